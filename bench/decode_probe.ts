/**
 * Where a chunk of decode steps spends its wall-clock time (issue 13): the readback's floor with
 * nothing queued, whether a readback blocks the JS thread, the GPU time of a chunk recorded in
 * one pass (gaps between dispatches included) against the JS time to encode it, and timed
 * `step(chunk)` calls at several submission sizes.
 *
 *   deno run -A bench/decode_probe.ts [--model gpt2-124M] [--batches 1,16] [--chunk 32] [--every 1,4,32]
 */

import { presetConfig } from "../model/config.ts";
import { describeDevice, openDevice, readBuffer } from "../engine/device.ts";
import { Generator } from "../engine/generator.ts";
import { profileChunk } from "./generator_profile.ts";
import { initParams } from "../model/init.ts";

function arg(name: string, def: string): string {
  const i = Deno.args.indexOf(`--${name}`);
  return i >= 0 && i + 1 < Deno.args.length ? Deno.args[i + 1] : def;
}
const nums = (s: string) => s.split(",").map(Number);
const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor((xs.length - 1) / 2)];
const f = (x: number) => x.toFixed(2);

const ctx = await openDevice();
console.log(describeDevice(ctx));
const model = arg("model", "gpt2-124M"), chunk = +arg("chunk", "32");
const config = presetConfig(model);
const small = ctx.device.createBuffer({ size: 16, usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC });
const floor: number[] = [];
for (let i = 0; i < 10; i++) {
  const t0 = performance.now();
  await readBuffer(ctx, small);
  floor.push(performance.now() - t0);
}
console.log(
  `readback of 16 bytes, nothing queued: median ${f(median(floor))} ms, min ${f(Math.min(...floor))}`,
);

for (const every of nums(arg("every", "1,4,32"))) {
  const gen = await Generator.create(ctx, config, initParams(config, 1), {
    maxStreams: 64,
    chunk,
    submitEvery: every,
  });
  for (const B of nums(arg("batches", "1,16"))) {
    const hs = [];
    for (let i = 0; i < B; i++) {
      hs.push(await gen.admit([1, 2, 3, 4, 5, 6, 7, 8], { temperature: 0.8, top_k: 40, top_p: 1, seed: i }));
    }
    await gen.step(0);
    await gen.step(chunk); // warm: compiles the plan
    const enc: number[] = [], wait: number[] = [], tot: number[] = [];
    for (let r = 0; r < 5; r++) {
      const t0 = performance.now();
      await gen.step(chunk);
      tot.push(performance.now() - t0);
      enc.push(gen.timing.encodeMs);
      wait.push(gen.timing.waitMs);
    }
    // Does a readback block the JS thread? Count timer ticks during one.
    let ticks = 0;
    const id = setInterval(() => ticks++, 1);
    const t0 = performance.now();
    await gen.step(chunk);
    const during = performance.now() - t0;
    clearInterval(id);
    const p = await profileChunk(gen, chunk);
    // Running ahead: each call returns the chunk queued by the call before and queues the next.
    await gen.step(chunk, chunk);
    const calls: string[] = [];
    const a0 = performance.now();
    for (let r = 0; r < 6; r++) {
      const t = performance.now();
      await gen.step(chunk, chunk);
      const g = gen.timing;
      calls.push(`${f(performance.now() - t)} (enc ${f(g.encodeMs)} map ${f(g.mapMs)} wait ${f(g.waitMs)})`);
    }
    const aheadMs = (performance.now() - a0) / 6;
    await gen.step(0);
    console.log(
      `${model} batch ${B} chunk ${chunk} submitEvery ${every}: step ${f(median(tot))} ms ` +
        `(${f(median(tot) / chunk)} ms/token; encode ${f(median(enc))}, wait ${f(median(wait))}); ` +
        `one-pass GPU time ${f(p.gpuMs)} ms (${f(p.gpuMs / chunk)}/step), its encoding ${
          f(p.encodeMs)
        } ms; ` +
        `1 ms timer ticks during a ${f(during)} ms step: ${ticks}`,
    );
    console.log(
      `  running ahead: ${f(aheadMs)} ms per call (${f(aheadMs / chunk)} ms/token): ${calls.join(", ")}`,
    );
    for (const h of hs) gen.release(h);
  }
  gen.destroy();
}
Deno.exit(0);
