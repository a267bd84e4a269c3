/**
 * Where a prefill's time goes on this GPU: a Generator on random weights (`--model`, default
 * gpt2-124M) with every plan warmed, then per prefill shape the GPU time of each kernel
 * (timestamp queries, the second of two runs), summed by kernel across layers, beside the time
 * from `step` to the first token for a lone prompt of that length read back through the canvas
 * path (what a request waits for inside the Worker), with the prefill in 1-12 submissions; the
 * time wgpu takes to record, finish and submit 4 decode steps; and a lone stream's decoding speed
 * with its next chunk recorded ahead or not. Prints one line per figure and a `RESULT` line.
 *
 *   deno run -A bench/prefill_probe.ts [--model gpt2-124M] [--shapes 1x32,8x32,8x256,1x1024]
 */
import { openDevice } from "../engine/device.ts";
import { presetConfig } from "../model/config.ts";
import { initParams } from "../model/init.ts";
import { Generator } from "../engine/generator.ts";
import { profileChunk, profilePrefill } from "./generator_profile.ts";
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
  await profilePrefill(gen, B, T);
  const ops = await profilePrefill(gen, B, T);
  const total = ops.reduce((a, o) => a + o.ms, 0);
  const byKind = new Map<string, number>();
  for (const o of ops) {
    const k = o.label.replace(/^(prefill\.)?l\d+\./, "$1");
    byKind.set(k, (byKind.get(k) ?? 0) + o.ms);
  }
  const top = [...byKind].sort((a, b) => b[1] - a[1]).slice(0, 10);
  // A lone prompt of length T (B = 1 only): from step() to its first token, through the readback,
  // as serving runs it (a first chunk of 4 steps run ahead, queued by runAhead after the tokens),
  // with the prefill cut into 1, 3, 6 or 12 submissions (GeneratorOptions.prefillPieces).
  const waits: number[] = [];
  const lines: string[] = [];
  if (B === 1) {
    for (const pieces of [1, 3, 6, 12]) {
      gen.opts.prefillPieces = pieces;
      const step: number[] = [], enc: number[] = [], wait: number[] = [], later: number[] = [];
      for (let i = 0; i < 9; i++) {
        const h = await gen.admit(new Uint32Array(Math.min(T, config.n_positions - 1)).fill(464), {
          temperature: 0,
          top_k: 0,
          top_p: 1,
          seed: 0,
        }, 64);
        const t0 = performance.now();
        await gen.step(0, 4);
        const t1 = performance.now();
        await gen.runAhead();
        later.push(performance.now() - t1);
        step.push(t1 - t0);
        enc.push(gen.timing.encodeMs);
        wait.push(gen.timing.waitMs);
        gen.release(h);
        await ctx.device.queue.onSubmittedWorkDone();
      }
      if (pieces === 1) waits.push(...step);
      lines.push(
        `  prefill in ${pieces} piece(s): step to first token ${median(step).toFixed(2)} ms (encode ` +
          `${median(enc).toFixed(2)}, wait ${median(wait).toFixed(2)}), then 4 steps run ahead queued in ` +
          `${median(later).toFixed(2)} ms (medians of 9)`,
      );
      result[`${B}x${T}_pieces${pieces}`] = {
        step_ms: median(step),
        encode_ms: median(enc),
        wait_ms: median(wait),
      };
    }
    gen.opts.prefillPieces = 1;
  }
  console.log(
    `${B}x${T}: ${ops.length} kernels, GPU ${total.toFixed(2)} ms` +
      (waits.length ? `; step to first token ${median(waits).toFixed(2)} ms (median of 7)` : "") +
      `\n  ` + top.map(([k, ms]) => `${k} ${ms.toFixed(2)}`).join(", "),
  );
  for (const l of lines) console.log(l);
  result[`${B}x${T}`] = { kernels: ops.length, gpu_ms: total, step_ms: waits.length ? median(waits) : null };
}
// Encoding decode steps at batch 1 (JS time: recording, finish, submit; the GPU's beside it).
{
  const h = await gen.admit(
    new Uint32Array(32).fill(464),
    { temperature: 0, top_k: 0, top_p: 1, seed: 0 },
    1000,
  );
  await gen.step(0);
  for (let i = 0; i < 4; i++) {
    const c = await profileChunk(gen, 4);
    console.log(
      `4 decode steps at batch 1: recorded in ${c.encodeMs.toFixed(2)} ms, finished in ${
        c.finishMs.toFixed(2)
      }, ` +
        `submitted in ${c.submitMs.toFixed(2)}; GPU ${c.gpuMs.toFixed(2)} ms`,
    );
    result.decode4 = c;
  }
  gen.release(h);
}
// A lone stream decoding as serving drives it (step, then runAhead once the tokens are out), its
// next chunk recorded while the GPU runs the last or not (GeneratorOptions.prerecord), alternating.
for (const prerecord of [false, true, false, true]) {
  gen.opts.prerecord = prerecord;
  const sampling = { temperature: 0.8, top_k: 40, top_p: 1, seed: 1 };
  const h = await gen.admit(new Uint32Array(32).fill(464), sampling, 1 + 4 + 32 * 9);
  const run = async (ahead: number) => {
    const n = (await gen.step(0, ahead)).get(h)?.tokens.length ?? 0;
    await gen.runAhead();
    return n;
  };
  await run(4);
  await run(32);
  const t0 = performance.now();
  let n = 0;
  for (let i = 0; i < 8; i++) n += await run(32);
  const ms = performance.now() - t0;
  gen.release(h);
  await ctx.device.queue.onSubmittedWorkDone();
  console.log(
    `a lone stream, chunks of 32, next chunk ${prerecord ? "recorded ahead" : "encoded after the read"}: ` +
      `${n} tokens in ${ms.toFixed(1)} ms, ${(n / ms * 1000).toFixed(0)} tokens/s`,
  );
  result[`lone_${prerecord ? "prerecorded" : "encoded"}_tok_s`] = n / ms * 1000;
}
console.log(`RESULT ${JSON.stringify(result)}`);
gen.destroy();
Deno.exit(0);
