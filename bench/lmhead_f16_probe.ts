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
 *   deno run -A bench/lmhead_f16_probe.ts [--model gpt2-124M (gpt2-tiny on CPU adapters)]
 *                                          [--load ID [--root $GPT2_HOME or ./.gpt2]] [--tokens 256] [--seed 1]
 */

import { encode } from "gpt-tokenizer/encoding/r50k_base";
import { type ModelConfig, presetConfig } from "../model/config.ts";
import { initParams } from "../model/init.ts";
import { describeDevice, type GpuContext, openDevice, readFloats } from "../engine/device.ts";
import { Generator, type GeneratorOptions, isCpuAdapter } from "../engine/generator.ts";
import { loadWeights, resolveModelSource } from "../checkpoint/model_source.ts";

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
let config: ModelConfig, params: Float32Array, weights: string;
if (load) {
  const source = await resolveModelSource(arg("root", Deno.env.get("GPT2_HOME") || "./.gpt2"), load);
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
console.log(
  JSON.stringify({ probe: "lmhead_f16", weights, agree, max_logit_diff: maxDiff, prompts: perPrompt }),
);
ctx.device.destroy();
