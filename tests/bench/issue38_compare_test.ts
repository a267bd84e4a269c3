/**
 * bench/issue38_compare.ts reads issue38_next.sh's logs: commands split at their `===` lines,
 * each option named by the flags that tell it from the default run, the engine benchmark's decode
 * rates and the train benchmark's ms per step picked out, a default run twice kept twice.
 */

import assert from "node:assert/strict";
import { decodeRates, logRuns, stepTimes } from "../../bench/issue38_compare.ts";

const decodeLog =
  `=== 2026-12-06T01:00:00Z deno task bench generate engine --models gpt2-124M --batches 1,16 --repeat 5 --profile --torch
Task bench deno run -A bench/mod.ts 'generate'
{"scenario":"engine","model":"gpt2-124M","batch":1,"decode_tokens_per_s":1100,"decode_tokens_per_s_min":1080,"decode_tokens_per_s_max":1110}
{"model":"gpt2-124M","dtype":"bf16","batch":1,"tokens_per_s":1039}
=== exit 0
=== 2026-12-06T01:01:00Z deno task bench generate engine --models gpt2-124M --batches 1,16 --repeat 5 --residual-rows 1 --profile
{"scenario":"engine","model":"gpt2-124M","batch":1,"decode_tokens_per_s":1180,"decode_tokens_per_s_min":1150,"decode_tokens_per_s_max":1190}
=== exit 124
=== 2026-12-06T01:02:00Z deno task bench generate engine --models gpt2-124M --batches 1,16 --repeat 5
{"scenario":"engine","model":"gpt2-124M","batch":16,"decode_tokens_per_s":12000,"decode_tokens_per_s_min":11900,"decode_tokens_per_s_max":12100}
=== exit 0
`;

const variantLog =
  `=== 2026-12-06T01:03:00Z deno task bench train --models gpt2-124M --rounds 2 --variants default;--attn-scatter
gpt2-124M  batch 8 seq 1024 fp32: 199.0 ms/step, 41161 tokens/s, loss 8.463
{"variant_summary":{"variant":"default","key":"gpt2-124M","runs":2,"median":199,"min":198,"max":200,"ratio":null,"clear":false,"unit":"ms per step"}}
=== exit 0
`;

const trainLog =
  `=== 2026-12-06T01:00:00Z deno task bench train --models gpt2-124M,gpt2-345M --batch 8 --seq 1024 --steps 10
gpt2-124M  batch 8 seq 1024 fp32: 199.3 ms/step, 41099 tokens/s, loss 8.463
gpt2-345M  batch 8 seq 1024 fp32: 545.4 ms/step, 15021 tokens/s, loss 9.811
=== exit 0
=== 2026-12-06T01:01:00Z deno task bench train --models gpt2-124M,gpt2-345M --batch 8 --seq 1024 --steps 10 --attn-fills
gpt2-124M  batch 8 seq 1024 fp32: 197.0 ms/step, 41591 tokens/s, loss 8.463
=== exit 0
`;

Deno.test("issue38_compare reads the decode rates and steps of issue38_next.sh's logs by option", () => {
  const runs = logRuns(decodeLog);
  assert.equal(runs.length, 3);
  assert.equal(runs[1].lines.length, 1, "a command's output lines, without the === lines");
  const rates = decodeRates(runs);
  assert.deepEqual([...rates.keys()], ["default", "--residual-rows 1", "default #2"]);
  assert.deepEqual(rates.get("default")!.get(1), { median: 1100, min: 1080, max: 1110 });
  assert.equal(rates.get("--residual-rows 1")!.get(1)!.median, 1180);
  assert.equal(rates.get("default #2")!.get(16)!.median, 12000);
  assert.equal(rates.get("default")!.size, 1, "the peer's JSON line is not a decode rate of ours");
  assert.equal(stepTimes(logRuns(variantLog)).size, 0, "a --variants command is read by variantRows alone");
  const steps = stepTimes(logRuns(trainLog));
  assert.deepEqual([...steps.keys()], ["default", "--attn-fills"]);
  assert.equal(steps.get("default")!.get("gpt2-345M"), 545.4);
  assert.equal(steps.get("--attn-fills")!.get("gpt2-124M"), 197.0);
});
