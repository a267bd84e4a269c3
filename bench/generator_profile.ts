/**
 * The generator's plans timed on the GPU with timestamp queries, for the benchmarks
 * (prefill_probe.ts, decode_probe.ts, generate_bench.ts --profile): a prefill or a decode step
 * kernel by kernel, and a chunk of decode steps as one pass. They reach the plans through
 * Generator.forProfiling, which queues what was run ahead first.
 */

import { type GpuContext, GpuError, readBuffers } from "../engine/device.ts";
import { encodeOps, type Op, recordOps } from "../engine/ops.ts";
import { SEL_WORDS } from "../engine/kernels/decode.ts";
import { PREFILL_ROWS } from "../engine/generate/gen_buffers.ts";
import type { Generator } from "../engine/generator.ts";

/** Each op's GPU time in ms, in order: `ops` encoded with a timestamped pass each, after `before`. */
async function timeOps(
  ctx: GpuContext,
  ops: Op[],
  before: (enc: GPUCommandEncoder) => void = () => {},
  after: (enc: GPUCommandEncoder) => void = () => {},
): Promise<{ label: string; ms: number }[]> {
  const dev = ctx.device;
  const qs = dev.createQuerySet({ type: "timestamp", count: 2 * ops.length });
  const resolve = dev.createBuffer({
    size: 16 * ops.length,
    usage: GPUBufferUsage.QUERY_RESOLVE | GPUBufferUsage.COPY_SRC,
  });
  try {
    const enc = dev.createCommandEncoder();
    before(enc);
    encodeOps(enc, ops, qs);
    after(enc);
    enc.resolveQuerySet(qs, 0, 2 * ops.length, resolve, 0);
    dev.queue.submit([enc.finish()]);
    const [buf] = await readBuffers(ctx, [{ buffer: resolve, bytes: 16 * ops.length }]);
    const t = new BigUint64Array(buf);
    return ops.map((op, i) => ({ label: op.label, ms: Number(t[2 * i + 1] - t[2 * i]) / 1e6 }));
  } finally {
    qs.destroy();
    resolve.destroy();
  }
}

/**
 * Times the prefill of B prompts of bucketed length Tb (its plan built if need be) kernel by
 * kernel, on prompts of zeros, and returns each kernel's GPU time in ms in order. Needs timestamp
 * queries and no stream admitted (it writes the cache's first slots).
 */
export async function profilePrefill(
  gen: Generator,
  B: number,
  Tb: number,
): Promise<{ label: string; ms: number }[]> {
  const p = await gen.forProfiling(), dev = p.ctx.device;
  if (!p.ctx.hasTimestamps) throw new GpuError("profilePrefill", "the adapter has no timestamp queries");
  if (p.streams > 0) throw new RangeError("profilePrefill needs an idle generator");
  const plan = await p.prefill(B, Tb), ops = plan.ops!;
  const sel = new Uint32Array(PREFILL_ROWS * SEL_WORDS);
  for (let b = 0; b < B; b++) sel.set([b * Tb + Tb - 1, b, Tb, gen.opts.maxStreams], b * SEL_WORDS);
  dev.queue.writeBuffer(plan.model.tokens, 0, new Uint32Array(B * (Tb + 1)));
  dev.queue.writeBuffer(p.buffers.sel, 0, sel);
  return await timeOps(p.ctx, ops);
}

/**
 * Times one decode step of the rows now decoding, kernel by kernel (a timestamped pass per
 * kernel), and returns each kernel's GPU time in ms in order. The state is restored after it, so
 * the streams go on as if it had not run (the cache rows it wrote are written again by the next
 * step). Needs timestamp queries and at least one row.
 */
export async function profileDecode(gen: Generator): Promise<{ label: string; ms: number }[]> {
  const p = await gen.forProfiling(), { state, prevState } = p.buffers;
  if (!p.ctx.hasTimestamps) throw new GpuError("profileDecode", "the adapter has no timestamp queries");
  if (p.rows === 0) throw new RangeError("profileDecode needs a stream being decoded");
  return await timeOps(
    p.ctx,
    await p.decode(),
    (enc) => enc.copyBufferToBuffer(state, 0, prevState, 0, state.size),
    (enc) => enc.copyBufferToBuffer(prevState, 0, state, 0, state.size),
  );
}

/**
 * GPU time of `steps` decode steps of the rows now decoding, recorded in one compute pass with a
 * timestamp at its start and end (so the gaps between dispatches count), and the JS time spent
 * encoding them. Like profileDecode, the state is restored after it.
 */
export async function profileChunk(
  gen: Generator,
  steps: number,
): Promise<{ gpuMs: number; encodeMs: number; finishMs: number; submitMs: number }> {
  const p = await gen.forProfiling(), dev = p.ctx.device, { state, prevState } = p.buffers;
  if (!p.ctx.hasTimestamps) throw new GpuError("profileChunk", "the adapter has no timestamp queries");
  if (p.rows === 0) throw new RangeError("profileChunk needs a stream being decoded");
  const ops = await p.decode();
  const qs = dev.createQuerySet({ type: "timestamp", count: 2 });
  const resolve = dev.createBuffer({
    size: 16,
    usage: GPUBufferUsage.QUERY_RESOLVE | GPUBufferUsage.COPY_SRC,
  });
  try {
    const t0 = performance.now();
    const enc = dev.createCommandEncoder();
    enc.copyBufferToBuffer(state, 0, prevState, 0, state.size);
    const pass = enc.beginComputePass({
      timestampWrites: { querySet: qs, beginningOfPassWriteIndex: 0, endOfPassWriteIndex: 1 },
    });
    for (let i = 0; i < steps; i++) recordOps(pass, ops);
    pass.end();
    enc.copyBufferToBuffer(prevState, 0, state, 0, state.size);
    enc.resolveQuerySet(qs, 0, 2, resolve, 0);
    const t1 = performance.now();
    const cb = enc.finish();
    const t2 = performance.now();
    dev.queue.submit([cb]);
    const t3 = performance.now();
    const [buf] = await readBuffers(p.ctx, [{ buffer: resolve, bytes: 16 }]);
    const t = new BigUint64Array(buf);
    return { gpuMs: Number(t[1] - t[0]) / 1e6, encodeMs: t1 - t0, finishMs: t2 - t1, submitMs: t3 - t2 };
  } finally {
    qs.destroy();
    resolve.destroy();
  }
}
