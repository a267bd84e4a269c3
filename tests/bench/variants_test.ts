/**
 * bench/variants.ts: the `--variants` lists of the train and engine benchmarks (each variant's own
 * flags read before the command's), the order of each round, the summary against the first
 * variant, and issue38_compare reading the summary lines back. No GPU.
 */

import assert from "node:assert/strict";
import {
  baseArgs,
  parseRounds,
  parseVariants,
  planVariants,
  roundOrder,
  summarize,
  summaryLines,
  variantArgs,
} from "../../bench/variants.ts";
import { trainOptions } from "../../bench/train_bench.ts";
import { engineOptions } from "../../bench/generate_bench.ts";
import { logRuns, variantRows } from "../../bench/issue38_compare.ts";

Deno.test("--variants: names, flags, defaults and the errors that name what was wrong", () => {
  assert.deepEqual(parseVariants(["--steps", "3"]), [{ name: "default", args: [] }]);
  const vs = parseVariants(["--variants", "default; --attn-fills ;--colsum-unroll 32", "--steps", "3"]);
  assert.deepEqual(vs.map((v) => v.name), ["default", "--attn-fills", "--colsum-unroll 32"]);
  assert.deepEqual(vs[2].args, ["--colsum-unroll", "32"]);
  assert.deepEqual(parseVariants(["--variants", ";--ln-written"]).map((v) => v.name), [
    "default",
    "--ln-written",
  ]);
  assert.throws(() => parseVariants(["--variants"]), /needs a list/);
  assert.throws(() => parseVariants(["--variants", "default;--a;--a"]), /"--a" is named twice/);
  assert.throws(() => parseVariants(["--variants", "attn-fills"]), /must start with a flag/);
  assert.throws(() => parseVariants(["--variants", "--rounds 3"]), /may not set --variants or --rounds/);
  assert.equal(parseRounds([], 1), 1);
  assert.equal(parseRounds([], 3), 2);
  assert.equal(parseRounds(["--rounds", "4"], 3), 4);
  assert.throws(() => parseRounds(["--rounds", "0"], 3), /--rounds "0"/);
  assert.throws(() => parseRounds(["--rounds", "x"], 3), /--rounds "x"/);
});

Deno.test("--variants: a variant's flags win over the command's, and every round turns the order", () => {
  const args = [
    "--models",
    "gpt2-124M",
    "--variants",
    "default;--colsum-unroll 32",
    "--rounds",
    "2",
    "--colsum-unroll",
    "16",
  ];
  const base = baseArgs(args);
  assert.deepEqual(base, ["--models", "gpt2-124M", "--colsum-unroll", "16"]);
  const [plain, wide] = parseVariants(args);
  assert.equal(trainOptions(variantArgs(plain, base)).kernels?.columnSumUnroll, 16);
  assert.equal(trainOptions(variantArgs(wide, base)).kernels?.columnSumUnroll, 32);
  const fills = trainOptions(variantArgs(parseVariants(["--variants", "--attn-fills --ln-written"])[0], []));
  assert.equal(fills.kernels?.attentionFills, true);
  assert.equal(fills.kernels?.layernormWritten, true);
  assert.equal(trainOptions([]).kernels?.attentionFills, undefined);
  assert.throws(() => trainOptions(["--precision", "bf16"]), /Unknown --precision "bf16"/);

  const e = engineOptions(
    variantArgs({ name: "--residual-rows 1 --chunk 32", args: ["--residual-rows", "1", "--chunk", "32"] }, [
      "--chunk",
      "16",
    ]),
  );
  assert.equal(e.residualRows, 1);
  assert.equal(e.chunk, 32);
  assert.equal(e.ahead, 32, "the chunk queued ahead follows the variant's chunk");
  assert.equal(engineOptions([]).readback, "canvas");
  assert.equal(engineOptions(["--written-sampler"]).writtenSampler, true);
  assert.throws(() => engineOptions(["--readback", "poll"]), /--readback "poll" must be canvas or mapasync/);
  assert.throws(() => engineOptions(["--residual-rows", "-1"]), /--residual-rows "-1"/);
  assert.throws(() => engineOptions(["--lm-head", "bf16"]), /--lm-head "bf16"/);

  assert.deepEqual(roundOrder(["a", "b", "c"], 0), ["a", "b", "c"]);
  assert.deepEqual(roundOrder(["a", "b", "c"], 1), ["b", "c", "a"]);
  assert.deepEqual(roundOrder(["a", "b", "c"], 3), ["a", "b", "c"]);
});

Deno.test("--variants: a plan reads every variant's options up front, so a bad one fails before anything runs", () => {
  const plan = planVariants(
    ["--variants", "default;--residual-rows 2", "--rounds", "3", "--chunk", "8"],
    engineOptions,
  );
  assert.equal(plan.rounds, 3);
  assert.deepEqual(plan.variants.map((v) => [v.name, v.options.residualRows, v.options.chunk]), [
    ["default", 0, 8],
    ["--residual-rows 2", 2, 8],
  ]);
  assert.throws(
    () => planVariants(["--variants", "default;--readback poll"], engineOptions),
    /--readback "poll" must be canvas or mapasync/,
  );
  assert.equal(planVariants([], trainOptions).rounds, 1);
});

Deno.test("--variants: the summary's medians, ranges and ratios to the first variant", () => {
  const samples = [
    ...[200, 202, 198].map((value) => ({ variant: "default", key: "gpt2-124M", value })),
    ...[190, 193, 191].map((value) => ({ variant: "--attn-fills", key: "gpt2-124M", value })),
    ...[199, 210, 201].map((value) => ({ variant: "--ln-written", key: "gpt2-124M", value })),
    { variant: "default", key: "gpt2-124M layernorm", value: 4 },
    { variant: "--attn-fills", key: "gpt2-124M layernorm", value: 4 },
  ];
  const rows = summarize(samples, ["default", "--attn-fills", "--ln-written"], false);
  assert.deepEqual(rows.map((r) => [r.key, r.variant]), [
    ["gpt2-124M", "default"],
    ["gpt2-124M", "--attn-fills"],
    ["gpt2-124M", "--ln-written"],
    ["gpt2-124M layernorm", "default"],
    ["gpt2-124M layernorm", "--attn-fills"],
  ]);
  assert.deepEqual([rows[0].median, rows[0].min, rows[0].max, rows[0].ratio], [200, 198, 202, null]);
  assert.equal(rows[1].ratio, 191 / 200);
  assert.equal(rows[1].clear, true, "every fills run is below every default run");
  assert.equal(rows[2].clear, false, "ranges that overlap are not clear");
  assert.equal(rows[2].median, 201);
  const up = summarize(
    [
      { variant: "a", key: "batch 1", value: 10 },
      { variant: "a", key: "batch 1", value: 12 },
      { variant: "b", key: "batch 1", value: 13 },
    ],
    ["a", "b"],
    true,
  );
  assert.equal(up[0].median, 11, "an even count's median is the mean of the middle two");
  assert.equal(up[1].clear, false, "one run of b is not a range");
  const two = summarize(
    [
      { variant: "a", key: "batch 1", value: 10 },
      { variant: "a", key: "batch 1", value: 12 },
      { variant: "b", key: "batch 1", value: 13 },
      { variant: "b", key: "batch 1", value: 14 },
    ],
    ["a", "b"],
    true,
  );
  assert.equal(two[1].clear, true);

  // The summary's JSON lines are what issue38_compare reads back from a log.
  const lines = summaryLines(rows, "ms per step", false);
  assert.match(
    lines[2],
    /--attn-fills +191\.0 \(190\.0-193\.0, 3 runs\) +0\.955× the first, every run below/,
  );
  const log = `=== 2026-12-06T01:00:00Z deno task bench train --variants "default;--attn-fills"\n${
    lines.join("\n")
  }\n=== exit 0\n`;
  const back = variantRows(logRuns(log));
  assert.equal(back.length, rows.length);
  assert.equal(back[1].variant, "--attn-fills");
  assert.equal(back[1].median, 191);
  assert.equal(back[1].unit, "ms per step");
});
