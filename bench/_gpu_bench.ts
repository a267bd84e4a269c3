/**
 * Kernel timing for the benchmarks: each repetition of a list of ops runs in its own compute pass
 * between two timestamp queries, after untimed warmup repetitions in the same submission, and the
 * result is the median (and min) over repetitions — robust to the odd slow run and to submission
 * overhead, unlike the wall clock over a batch. Where the adapter lacks timestamp queries, each
 * repetition is its own submission timed by the wall clock up to onSubmittedWorkDone (which
 * includes the submission's overhead, so small kernels read slower).
 */

import type { GpuContext } from "../gpu/device.ts";
import type { Op } from "../gpu/ops.ts";

/** Times of one measured kernel sequence, in ms. */
export interface Timing {
  median_ms: number;
  min_ms: number;
  mean_ms: number;
  reps: number;
}

/** How many repetitions to time: enough for `targetMs` of GPU time, within [minReps, maxReps]. */
export interface RepPolicy {
  minReps: number;
  maxReps: number;
  targetMs: number;
  warmup: number;
}

function stats(samples: number[]): Timing {
  const s = [...samples].sort((a, b) => a - b);
  const mid = s.length >> 1;
  const median = s.length % 2 ? s[mid] : (s[mid - 1] + s[mid]) / 2;
  return {
    median_ms: median,
    min_ms: s[0],
    mean_ms: s.reduce((a, b) => a + b, 0) / s.length,
    reps: s.length,
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
  #maxReps: number;
  #qs?: GPUQuerySet;
  #resolve?: GPUBuffer;

  constructor(ctx: GpuContext, maxReps = 400) {
    this.#ctx = ctx;
    this.#maxReps = maxReps;
    this.method = ctx.hasTimestamps ? "timestamp" : "wallclock";
    if (ctx.hasTimestamps) {
      this.#qs = ctx.device.createQuerySet({ type: "timestamp", count: 2 * maxReps });
      this.#resolve = ctx.device.createBuffer({
        size: 16 * maxReps,
        usage: GPUBufferUsage.QUERY_RESOLVE | GPUBufferUsage.COPY_SRC,
      });
    }
  }

  /** Per-repetition times (ms) of `ops` run `reps` times, after `warmup` untimed runs. */
  async samples(ops: Op[], reps: number, warmup = 2): Promise<number[]> {
    const { device } = this.#ctx;
    reps = Math.max(1, Math.min(reps, this.#maxReps));
    if (!this.#qs || !this.#resolve) {
      const out: number[] = [];
      for (let r = -warmup; r < reps; r++) {
        const enc = device.createCommandEncoder();
        const pass = enc.beginComputePass();
        record(pass, ops);
        pass.end();
        const t0 = performance.now();
        device.queue.submit([enc.finish()]);
        await device.queue.onSubmittedWorkDone();
        if (r >= 0) out.push(performance.now() - t0);
      }
      return out;
    }
    const enc = device.createCommandEncoder();
    if (warmup > 0) {
      const pass = enc.beginComputePass();
      for (let w = 0; w < warmup; w++) record(pass, ops);
      pass.end();
    }
    for (let r = 0; r < reps; r++) {
      const pass = enc.beginComputePass({
        timestampWrites: {
          querySet: this.#qs,
          beginningOfPassWriteIndex: 2 * r,
          endOfPassWriteIndex: 2 * r + 1,
        },
      });
      record(pass, ops);
      pass.end();
    }
    const bytes = 16 * reps;
    const staging = device.createBuffer({
      size: bytes,
      usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST,
    });
    enc.resolveQuerySet(this.#qs, 0, 2 * reps, this.#resolve, 0);
    enc.copyBufferToBuffer(this.#resolve, 0, staging, 0, bytes);
    device.queue.submit([enc.finish()]);
    await staging.mapAsync(GPUMapMode.READ);
    const t = new BigUint64Array(staging.getMappedRange().slice(0));
    staging.unmap();
    staging.destroy();
    const out: number[] = [];
    for (let r = 0; r < reps; r++) out.push(Number(t[2 * r + 1] - t[2 * r]) / 1e6);
    return out;
  }

  /** Times `ops` `reps` times after `warmup` runs. */
  async time(ops: Op[], reps: number, warmup = 2): Promise<Timing> {
    return stats(await this.samples(ops, reps, warmup));
  }

  /**
   * Probes with a few runs, then times as many as fill `targetMs` (within the policy's bounds);
   * the probe's runs count as warmup.
   */
  async timeAdaptive(ops: Op[], p: RepPolicy): Promise<Timing> {
    const probe = await this.samples(ops, 3, p.warmup);
    const est = Math.max(1e-3, stats(probe).median_ms);
    const reps = Math.max(p.minReps, Math.min(p.maxReps, Math.ceil(p.targetMs / est)));
    return stats(await this.samples(ops, reps, 1));
  }

  destroy(): void {
    this.#qs?.destroy();
    this.#resolve?.destroy();
  }
}
