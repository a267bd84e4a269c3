/**
 * What compiling on first use costs a fresh engine: opens the device, creates a Generator on
 * random weights (`--model`, default gpt2-124M), warms only the one-stream decode bucket (as the
 * service did at load before it warmed everything: worker/serving.ts), then times the first
 * request (a 12-token prompt: its prefill shape compiled on demand, prefill, first chunk) and a
 * second one at the same shape; then the warm-up of every bucket and prefill shape, and a
 * request at a new shape after it. Prints one line per figure and a `RESULT` JSON line.
 */
import { openDevice } from "../engine/device.ts";
import { presetConfig } from "../model/config.ts";
import { initParams } from "../model/init.ts";
import { Generator } from "../engine/generator.ts";

const arg = (name: string, dflt: string) => {
  const i = Deno.args.indexOf(`--${name}`);
  return i >= 0 ? Deno.args[i + 1] : dflt;
};
const model = arg("model", "gpt2-124M");
const ctx = await openDevice();
const config = presetConfig(model);
let pipelines = 0;
const t0 = performance.now();
const gen = await Generator.create(ctx, config, initParams(config, 1), {
  maxStreams: 64,
  chunk: 16,
  onCompile: (p) => {
    pipelines++;
    if (p.ms > 1000) console.log(`  slow: ${p.label} ${p.ms.toFixed(0)} ms`);
  },
});
const created = performance.now() - t0;
const w1 = await gen.warm({ rows: 1, prefill: false });
const loadPipes = pipelines;
const sampling = { temperature: 0.8, top_k: 40, top_p: 1, seed: 1 };
async function request(prompt: number[], streams = 1): Promise<number> {
  const t = performance.now();
  const hs = [];
  for (let i = 0; i < streams; i++) hs.push(await gen.admit(prompt, sampling, 32));
  const out = await gen.step(4);
  const ms = performance.now() - t;
  if (![...out.values()].every((o) => o.tokens.length > 0)) throw new Error("No token came back");
  for (const h of hs) gen.release(h);
  return ms;
}
const prompt = Array.from({ length: 12 }, (_, i) => 464 + i);
const p0 = pipelines;
const first = await request(prompt);
const firstPipes = pipelines - p0;
const second = await request(prompt);
const w = performance.now();
await gen.warm();
const warmAll = performance.now() - w;
const restPipes = pipelines - p0 - firstPipes;
const p1 = pipelines;
const newShape = await request(
  Array.from({ length: Math.min(200, config.n_positions - 1) }, (_, i) => 464 + (i % 50)),
  4,
);
const result = {
  model,
  adapter: ctx.adapterInfo.description,
  create_ms: created,
  warm_bucket1_ms: w1,
  load_pipelines: loadPipes,
  first_request_ms: first,
  first_request_pipelines: firstPipes,
  second_request_ms: second,
  warm_all_ms: warmAll,
  warm_all_pipelines: restPipes,
  shapes: gen.prefillShapes().length,
  new_shape_after_warm_ms: newShape,
  new_shape_pipelines: pipelines - p1,
};
for (const [k, v] of Object.entries(result)) console.log(`${k}: ${typeof v === "number" ? v.toFixed(1) : v}`);
console.log(`RESULT ${JSON.stringify(result)}`);
Deno.exit(0);
