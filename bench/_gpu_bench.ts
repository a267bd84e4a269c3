/**
 * GPU helpers for the benchmarks. Kernel timing: a measurement is several batches, each one
 * compute pass of back-to-back repetitions between two timestamp queries (after untimed warmup
 * repetitions in the same submission); a repetition's time is its batch's over its count, and the
 * result is the median and min over batches. Whole batches make the figure independent of where a
 * driver records a pass's first timestamp (a top-of-pipe write may land before the previous pass
 * drains) and include the barriers between dependent dispatches that a training step also pays.
 * Where the adapter lacks timestamp queries, each batch is its own submission timed by the wall
 * clock up to onSubmittedWorkDone (submission overhead then shows in small kernels).
 * Correctness: an on-GPU max |a − b| / max |b| of two outputs.
 */

import { type GpuContext, readBuffer } from "../engine/device.ts";
import { type StorageDtype, treeReduce } from "../engine/kernels/common.ts";
import { makeOp, type Op, PipelineCache, type View } from "../engine/ops.ts";

/** Time of one repetition of a measured kernel sequence, in ms, over batches of repetitions. */
export interface Timing {
  median_ms: number;
  min_ms: number;
  mean_ms: number;
  /** Repetitions timed, in `batches` batches. */
  reps: number;
  batches: number;
}

/** How many repetitions to time: enough for `targetMs` of GPU time, within [minReps, maxReps]. */
export interface RepPolicy {
  minReps: number;
  maxReps: number;
  targetMs: number;
  warmup: number;
}

function stats(samples: number[], perBatch: number): Timing {
  const s = [...samples].sort((a, b) => a - b);
  const mid = s.length >> 1;
  const median = s.length % 2 ? s[mid] : (s[mid - 1] + s[mid]) / 2;
  return {
    median_ms: median,
    min_ms: s[0],
    mean_ms: s.reduce((a, b) => a + b, 0) / s.length,
    reps: s.length * perBatch,
    batches: s.length,
  };
}

function record(pass: GPUComputePassEncoder, ops: Op[]): void {
  for (const op of ops) {
    pass.setPipeline(op.pipeline);
    for (let g = 0; g < op.bindGroups.length; g++) pass.setBindGroup(g, op.bindGroups[g]);
    pass.dispatchWorkgroups(op.grid[0], op.grid[1], op.grid[2]);
  }
}

/** Times op sequences on one device; reuses one query set. */
export class GpuTimer {
  readonly method: "timestamp" | "wallclock";
  #ctx: GpuContext;
  #maxBatches: number;
  #qs?: GPUQuerySet;
  #resolve?: GPUBuffer;

  constructor(ctx: GpuContext, maxBatches = 64) {
    this.#ctx = ctx;
    this.#maxBatches = maxBatches;
    this.method = ctx.hasTimestamps ? "timestamp" : "wallclock";
    if (ctx.hasTimestamps) {
      this.#qs = ctx.device.createQuerySet({ type: "timestamp", count: 2 * maxBatches });
      this.#resolve = ctx.device.createBuffer({
        size: 16 * maxBatches,
        usage: GPUBufferUsage.QUERY_RESOLVE | GPUBufferUsage.COPY_SRC,
      });
    }
  }

  /**
   * Per-repetition times (ms), one per batch: `batches` batches of `perBatch` runs of `ops`, after
   * `warmup` untimed runs.
   */
  async samples(ops: Op[], batches: number, perBatch: number, warmup = 2): Promise<number[]> {
    const { device } = this.#ctx;
    batches = Math.max(1, Math.min(batches, this.#maxBatches));
    perBatch = Math.max(1, perBatch);
    if (!this.#qs || !this.#resolve) {
      const out: number[] = [];
      for (let r = warmup > 0 ? -1 : 0; r < batches; r++) {
        const enc = device.createCommandEncoder();
        const pass = enc.beginComputePass();
        for (let k = 0; k < (r < 0 ? warmup : perBatch); k++) record(pass, ops);
        pass.end();
        const t0 = performance.now();
        device.queue.submit([enc.finish()]);
        await device.queue.onSubmittedWorkDone();
        if (r >= 0) out.push((performance.now() - t0) / perBatch);
      }
      return out;
    }
    const enc = device.createCommandEncoder();
    if (warmup > 0) {
      const pass = enc.beginComputePass();
      for (let w = 0; w < warmup; w++) record(pass, ops);
      pass.end();
    }
    for (let r = 0; r < batches; r++) {
      const pass = enc.beginComputePass({
        timestampWrites: {
          querySet: this.#qs,
          beginningOfPassWriteIndex: 2 * r,
          endOfPassWriteIndex: 2 * r + 1,
        },
      });
      for (let k = 0; k < perBatch; k++) record(pass, ops);
      pass.end();
    }
    const bytes = 16 * batches;
    const staging = device.createBuffer({
      size: bytes,
      usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST,
    });
    enc.resolveQuerySet(this.#qs, 0, 2 * batches, this.#resolve, 0);
    enc.copyBufferToBuffer(this.#resolve, 0, staging, 0, bytes);
    device.queue.submit([enc.finish()]);
    await staging.mapAsync(GPUMapMode.READ);
    const t = new BigUint64Array(staging.getMappedRange().slice(0));
    staging.unmap();
    staging.destroy();
    const out: number[] = [];
    for (let r = 0; r < batches; r++) out.push(Number(t[2 * r + 1] - t[2 * r]) / 1e6 / perBatch);
    return out;
  }

  /** Times about `reps` runs of `ops`, in up to 10 batches, after `warmup` runs. */
  async time(ops: Op[], reps: number, warmup = 2): Promise<Timing> {
    const batches = Math.min(10, Math.max(1, reps));
    const perBatch = Math.ceil(reps / batches);
    return stats(await this.samples(ops, batches, perBatch, warmup), perBatch);
  }

  /**
   * Probes with one short batch, then times enough runs to fill `targetMs` (within the policy's
   * bounds) in up to 10 batches; the probe counts as warmup.
   */
  async timeAdaptive(ops: Op[], p: RepPolicy): Promise<Timing> {
    const probe = await this.samples(ops, 1, 3, p.warmup);
    const est = Math.max(1e-3, probe[0]);
    const reps = Math.max(p.minReps, Math.min(p.maxReps, Math.ceil(p.targetMs / est)));
    return await this.time(ops, reps, 0);
  }

  destroy(): void {
    this.#qs?.destroy();
    this.#resolve?.destroy();
  }
}

/** max |a - b| and max |b| over n4 vec4s, as two u32-ordered floats (atomicMax on positive bits). */
export function maxDiffWgsl(n4: number, dtype: StorageDtype): string {
  const t = dtype === "f16" ? "vec4<f16>" : "vec4<f32>";
  return `${dtype === "f16" ? "enable f16;\n" : ""}
@group(0) @binding(0) var<storage, read> a: array<${t}>;
@group(0) @binding(1) var<storage, read> b: array<${t}>;
@group(0) @binding(2) var<storage, read_write> res: array<atomic<u32>, 2>;
var<workgroup> sd: array<f32, 256>;
var<workgroup> sr: array<f32, 256>;
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
  var d = 0.0;
  var r = 0.0;
  for (var i = (wg.x + wg.y * nwg.x) * 256u + tid; i < ${n4}u; i = i + nwg.x * nwg.y * 256u) {
    let x = vec4<f32>(a[i]);
    let y = vec4<f32>(b[i]);
    let e = abs(x - y);
    let m = abs(y);
    // NaN in the output counts as a difference of 1e30.
    let bad = any(x != x);
    d = max(d, select(max(max(e.x, e.y), max(e.z, e.w)), 1e30, bad));
    r = max(r, max(max(m.x, m.y), max(m.z, m.w)));
  }
  sd[tid] = d;
  sr[tid] = r;
  workgroupBarrier();
  ${treeReduce("sd", 256, "max")}
  ${treeReduce("sr", 256, "max")}
  if (tid == 0u) {
    atomicMax(&res[0], bitcast<u32>(sd[0]));
    atomicMax(&res[1], bitcast<u32>(sr[0]));
  }
}`;
}

/** Compares GPU outputs on the GPU: max |a − b| / max |b| over the first n4 vec4s of two views. */
export class GpuDiff {
  #ctx: GpuContext;
  #cache: PipelineCache;
  #buf: GPUBuffer;
  constructor(ctx: GpuContext, cache: PipelineCache) {
    this.#ctx = ctx;
    this.#cache = cache;
    this.#buf = ctx.device.createBuffer({
      size: 16,
      usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST,
    });
  }
  /** Relative difference of `a` against the reference `b` (NaN in `a` counts as 1e30). */
  async rel(a: View, b: View, n4: number, dtype: StorageDtype = "f32"): Promise<number> {
    const { device } = this.#ctx;
    const pipeline = await this.#cache.get(`maxdiff.${n4}.${dtype}`, maxDiffWgsl(n4, dtype));
    device.queue.writeBuffer(this.#buf, 0, new Uint32Array(4));
    const op = makeOp(this.#ctx, pipeline, {
      label: "maxdiff",
      phase: "forward",
      kind: "reduce",
      views: [a, b, { buffer: this.#buf, offset: 0, size: 8 }],
      grid: [Math.min(1024, Math.ceil(n4 / 256))],
    });
    const enc = device.createCommandEncoder();
    const pass = enc.beginComputePass();
    record(pass, [op]);
    pass.end();
    device.queue.submit([enc.finish()]);
    const r = new Float32Array(await readBuffer(this.#ctx, this.#buf, 0, 8));
    return r[1] > 0 ? r[0] / r[1] : r[0];
  }
  destroy(): void {
    this.#buf.destroy();
  }
}
