/**
 * Whether the decode LM head over wte rounded to f16 (GeneratorOptions.lmHead "f16", issue 38)
 * decodes what the fp32 head does: a few prompts decoded greedily (temperature 0) for N tokens
 * with each head, all prompts as one batch; per prompt the first position where the greedy
 * tokens differ and the share of positions that agree before it; and the largest |logit
 * difference| of the first decode step (both heads see the same rows there: the prefill's head
 * reads wte in both runs). Weights: a checkpoint or Hugging Face model under the data directory
 * (`--load ID`, as `/v1/models` lists it), else fresh random weights of `--model`. On a CPU
 * adapter both runs use the GPUs' head kernels (kernels.cpuHead false), else the f16 head would
 * not run.
 *
 * With `--torch` (needs `--load`), transformers scores both decodes too (bench/torch_greedy.py on the
 * checkpoint as a Hugging Face folder): top-1 agreement per position, teacher-forced, of transformers
 * with our fp32 decode, of an f16-rounded head with the fp32 head, and transformers' own greedy
 * decode's first departure from each of ours. That is the evidence issue 38 asks for before f16
 * becomes the default.
 *
 *   deno run -A bench/lmhead_f16_probe.ts [--model gpt2-124M (gpt2-tiny on CPU adapters)]
 *                                          [--load ID [--root $GPT2_HOME or ./.gpt2] [--torch [--python python3]]]
 *                                          [--tokens 256] [--seed 1]
 */

import { encode } from "gpt-tokenizer/encoding/r50k_base";
import { type ModelConfig, presetConfig } from "../model/config.ts";
import { initParams } from "../model/init.ts";
import { describeDevice, type GpuContext, openDevice, readFloats } from "../engine/device.ts";
import { Generator, type GeneratorOptions, isCpuAdapter } from "../engine/generator.ts";
import { loadWeights, resolveModelSource } from "../checkpoint/model_source.ts";
import type { ModelSource } from "../protocol.ts";

function arg(name: string, def: string): string {
  const i = Deno.args.indexOf(`--${name}`);
  return i >= 0 && i + 1 < Deno.args.length ? Deno.args[i + 1] : def;
}

const PROMPTS = [
  "The quick brown fox jumps over the lazy dog. Then",
  "In 1905, Albert Einstein published",
  "def fibonacci(n):\n    ",
  "Once upon a time, in a small village by the sea, there lived",
];
const CHUNK = 32;

/** The greedy tokens of each prompt (up to `n`, within the context) and the first decode step's logits (prompts × Vp). */
async function decode(
  ctx: GpuContext,
  config: ModelConfig,
  params: Float32Array,
  prompts: number[][],
  n: number,
  opts: Partial<GeneratorOptions>,
): Promise<{ tokens: number[][]; logits: Float32Array }> {
  const gen = await Generator.create(ctx, config, params, {
    maxStreams: prompts.length,
    chunk: CHUNK,
    ...opts,
    kernels: isCpuAdapter(ctx) ? { cpuHead: false } : {},
  });
  const greedy = { temperature: 0, top_k: 0, top_p: 1, seed: 0 };
  const hs: number[] = [];
  for (const p of prompts) hs.push(await gen.admit(p, greedy, Math.min(n, config.n_positions - p.length)));
  const tokens = hs.map(() => [] as number[]);
  const take = (out: Awaited<ReturnType<Generator["step"]>>) => {
    hs.forEach((h, i) => tokens[i].push(...(out.get(h)?.tokens ?? [])));
    return [...out.values()].some((o) => o.left > 0);
  };
  take(await gen.step(0)); // the prefill's first tokens
  let more = take(await gen.step(1));
  // Row r of the logits is the r-th stream admitted (none has been released).
  const { buffers } = await gen.forProfiling();
  const logits = (await readFloats(ctx, buffers.acts.logits)).slice(
    0,
    prompts.length * config.padded_vocab_size,
  );
  while (more) more = take(await gen.step(CHUNK));
  for (const h of hs) gen.release(h);
  gen.destroy();
  return { tokens, logits };
}

const ctx = await openDevice();
console.log(describeDevice(ctx));
const load = Deno.args.includes("--load") ? arg("load", "") : null;
let config: ModelConfig, params: Float32Array, weights: string, source: ModelSource | null = null;
const torch = Deno.args.includes("--torch");
if (torch && !load) {
  throw new Error("--torch needs --load: transformers scores a saved model, not random weights");
}
if (load) {
  source = await resolveModelSource(arg("root", Deno.env.get("GPT2_HOME") || "./.gpt2"), load);
  config = source.config;
  params = await loadWeights(source);
  weights = `${source.kind} "${source.id}"`;
} else {
  const model = arg("model", isCpuAdapter(ctx) ? "gpt2-tiny" : "gpt2-124M"), seed = +arg("seed", "1");
  config = presetConfig(model);
  params = initParams(config, seed);
  weights = `${model}, random weights (seed ${seed})`;
}
const n = +arg("tokens", "256");
const prompts = PROMPTS.map((t) => encode(t).slice(0, config.n_positions - 1));
console.log(`${weights}: ${prompts.length} prompts, greedy, up to ${n} tokens each`);

const f32 = await decode(ctx, config, params, prompts, n, { lmHead: "f32" });
const f16 = await decode(ctx, config, params, prompts, n, { lmHead: "f16" });

let maxDiff = 0, maxLogit = 0;
for (let r = 0; r < prompts.length; r++) {
  for (let v = 0; v < config.vocab_size; v++) {
    const i = r * config.padded_vocab_size + v;
    maxDiff = Math.max(maxDiff, Math.abs(f16.logits[i] - f32.logits[i]));
    maxLogit = Math.max(maxLogit, Math.abs(f32.logits[i]));
  }
}
const perPrompt = prompts.map((_, i) => {
  const a = f32.tokens[i], b = f16.tokens[i];
  let d = 0;
  while (d < a.length && a[d] === b[d]) d++;
  return { prompt: i, tokens: a.length, first_divergence: d < a.length ? d : null, agree: d / a.length };
});
for (const p of perPrompt) {
  console.log(
    `  prompt ${p.prompt}: ${
      p.first_divergence === null
        ? `all ${p.tokens} greedy tokens agree`
        : `first divergence at token ${p.first_divergence}: ${
          (p.agree * 100).toFixed(1)
        }% of ${p.tokens} agree before it`
    }`,
  );
}
const agree = perPrompt.reduce((s, p) => s + p.agree, 0) / perPrompt.length;
console.log(
  `agreement before the first divergence, mean over prompts: ${
    (agree * 100).toFixed(1)
  }%; first decode step: ` +
    `max |logit f16 − f32| ${maxDiff.toExponential(3)} (max |logit| ${maxLogit.toFixed(3)})`,
);
const peer = torch && source ? await transformersScores(source, prompts, f32.tokens, f16.tokens) : null;
console.log(
  JSON.stringify({ probe: "lmhead_f16", weights, agree, max_logit_diff: maxDiff, prompts: perPrompt, peer }),
);
ctx.device.destroy();

/** bench/torch_greedy.py on the model as a Hugging Face folder (a checkpoint is merged into one first). */
async function transformersScores(
  src: ModelSource,
  prompts: number[][],
  t32: number[][],
  t16: number[][],
): Promise<Record<string, unknown>> {
  const tmp = await Deno.makeTempDir({ prefix: "lmhead_f16_" });
  try {
    let hf = src.path;
    if (src.kind === "checkpoint") {
      hf = `${tmp}/hf`;
      const out = await new Deno.Command(Deno.execPath(), {
        args: [
          "run",
          "-A",
          new URL("../scripts/reshard.ts", import.meta.url).pathname,
          src.path,
          "--tensor-parallel",
          "1",
          "--out",
          hf,
        ],
      }).output();
      if (!out.success) throw new Error(`reshard: ${new TextDecoder().decode(out.stderr)}`);
    }
    await Deno.writeTextFile(`${tmp}/tokens.json`, JSON.stringify({ prompts, f32: t32, f16: t16 }));
    const py = await new Deno.Command(arg("python", "python3"), {
      args: [
        new URL("torch_greedy.py", import.meta.url).pathname,
        "--model",
        hf,
        "--input",
        `${tmp}/tokens.json`,
      ],
    }).output();
    if (!py.success) throw new Error(`torch_greedy.py: ${new TextDecoder().decode(py.stderr)}`);
    const r = JSON.parse(new TextDecoder().decode(py.stdout).trim().split("\n").at(-1)!);
    const pct = (x: number) => `${(x * 100).toFixed(1)}%`;
    console.log(
      `transformers, teacher-forced top-1 per position: with our fp32 decode ${pct(r.hf_vs_ours_f32)}; ` +
        `f16-rounded head with the fp32 head ${pct(r.f16_vs_f32_head)}; with our f16 decode ${
          pct(r.hf16_vs_ours_f16)
        }`,
    );
    for (const [i, p] of (r.prompts as Record<string, number | null>[]).entries()) {
      console.log(
        `  prompt ${i}: transformers' greedy departs from ours (fp32) at ${
          p.hf_greedy_first_divergence_f32 ?? "never"
        }, (f16) at ${p.hf_greedy_first_divergence_f16 ?? "never"}`,
      );
    }
    return r;
  } finally {
    await Deno.remove(tmp, { recursive: true }).catch(() => {});
  }
}
