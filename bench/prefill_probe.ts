/**
 * Where a prefill's time goes on this GPU: a Generator on random weights (`--model`, default
 * gpt2-124M) with every plan warmed, then per prefill shape the GPU time of each kernel
 * (timestamp queries, the second of two runs), summed by kernel across layers, beside the time
 * from `step` to the first token for a lone prompt of that length read back through the canvas
 * path (what a request waits for inside the Worker). Prints one line per figure and a `RESULT` line.
 *
 *   deno run -A bench/prefill_probe.ts [--model gpt2-124M] [--shapes 1x32,8x32,8x256,1x1024]
 */
import { openDevice } from "../engine/device.ts";
import { presetConfig } from "../model/config.ts";
import { initParams } from "../model/init.ts";
import { Generator } from "../engine/generator.ts";
import { createReadback } from "../engine/readback.ts";

const arg = (name: string, dflt: string) => {
  const i = Deno.args.indexOf(`--${name}`);
  return i >= 0 ? Deno.args[i + 1] : dflt;
};
const model = arg("model", "gpt2-124M");
const shapes = arg("shapes", "1x32,8x32,8x256,1x1024").split(",").map((s) => s.split("x").map(Number));
const ctx = await openDevice();
const config = presetConfig(model);
const readback = await createReadback(ctx);
const gen = await Generator.create(ctx, config, initParams(config, 1), {
  maxStreams: 64,
  chunk: 32,
  readback,
});
const warmMs = await gen.warm({ reserve: true, rehearse: true });
console.log(`${model}: warmed in ${warmMs.toFixed(0)} ms (${gen.kernels} kernels)`);
const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor((xs.length - 1) / 2)];
const result: Record<string, unknown> = { model, warm_ms: warmMs };
for (const [B, T] of shapes) {
  await gen.profilePrefill(B, T);
  const ops = await gen.profilePrefill(B, T);
  const total = ops.reduce((a, o) => a + o.ms, 0);
  const byKind = new Map<string, number>();
  for (const o of ops) {
    const k = o.label.replace(/^(prefill\.)?l\d+\./, "$1");
    byKind.set(k, (byKind.get(k) ?? 0) + o.ms);
  }
  const top = [...byKind].sort((a, b) => b[1] - a[1]).slice(0, 10);
  // A lone prompt of length T (B = 1 only): from step() to its first token, through the readback.
  const waits: number[] = [];
  if (B === 1) {
    for (let i = 0; i < 7; i++) {
      const h = await gen.admit(new Uint32Array(Math.min(T, config.n_positions - 1)).fill(464), {
        temperature: 0,
        top_k: 0,
        top_p: 1,
        seed: 0,
      }, 1);
      const t0 = performance.now();
      await gen.step(0);
      waits.push(performance.now() - t0);
      gen.release(h);
    }
  }
  console.log(
    `${B}x${T}: ${ops.length} kernels, GPU ${total.toFixed(2)} ms` +
      (waits.length ? `; step to first token ${median(waits).toFixed(2)} ms (median of 7)` : "") +
      `\n  ` + top.map(([k, ms]) => `${k} ${ms.toFixed(2)}`).join(", "),
  );
  result[`${B}x${T}`] = { kernels: ops.length, gpu_ms: total, step_ms: waits.length ? median(waits) : null };
}
console.log(`RESULT ${JSON.stringify(result)}`);
gen.destroy();
Deno.exit(0);
