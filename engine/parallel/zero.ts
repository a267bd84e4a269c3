/**
 * The distributed optimizer (Megatron's --use-distributed-optimizer, ZeRO stage 1): each
 * data-parallel rank keeps the AdamW moments of its own share of the flat parameters only.
 *
 * The flat array is cut into buckets (at most one communicator slot each, aligned to 64
 * elements so every piece binds at a legal offset) and the buckets are dealt out in flat order,
 * a contiguous run per rank of about equal size. One step after the backward passes:
 *  1. each bucket's gradients are summed over the ranks and written back on its owner only
 *     (a reduction to the owner: every rank reads its bucket back, only one uploads);
 *  2. the owner's squared gradient norm of its buckets is read back, the ranks' sums added in
 *     rank order on every rank (the same bits everywhere), and the GPU's step control (loss
 *     scaling, skip on inf/nan, clipping) runs on that global norm;
 *  3. AdamW updates the owned buckets against the owned moments;
 *  4. each bucket's new weights are broadcast from its owner (fp32, whatever the gradient wire)
 *     and the fp16 weight copy, if any, is refreshed.
 * Moments travel whole only for checkpoints (`exportMoments`, `loadMoments`).
 */

import { createStorage, type GpuContext, readBuffer, readBuffers } from "../device.ts";
import type { FlatBuffer } from "../flat.ts";
import type { ParamLayout } from "../../model/config.ts";
import { encodeOps, makeOp, type Op, PipelineCache, type View } from "../ops.ts";
import { adamwWgsl, gradNormPartialWgsl, NORM_GROUPS, stepControlWgsl } from "../kernels/adamw.ts";
import type { RingComm } from "./allreduce.ts";
import { BucketExchange, type ReducePath } from "./exchange.ts";
import type { RankControl } from "./data_parallel.ts";
import type { ReduceTiming } from "./data_parallel.ts";

/** One bucket of the flat array: `count` elements at element `offset` of segment `segment`, owned by rank `owner`. */
export interface ZeroBucket {
  segment: number;
  /** Element offset within the segment. */
  offset: number;
  /** Element offset in the whole flat array. */
  start: number;
  count: number;
  owner: number;
}

/**
 * Cuts segments of the given sizes into buckets of at most `capacity` elements (a multiple of
 * 64; at least 8 per rank when the array is large enough, for balance) and deals them out.
 */
export function zeroBuckets(segmentSizes: number[], ranks: number, capacity: number): ZeroBucket[] {
  const total = segmentSizes.reduce((a, b) => a + b, 0);
  const align = 64;
  let size = Math.min(capacity, Math.ceil(total / (8 * ranks)));
  size = Math.max(align, Math.floor(size / align) * align);
  if (size > capacity) throw new RangeError(`Bucket capacity ${capacity} is below ${align} elements`);
  const out: ZeroBucket[] = [];
  let start = 0;
  segmentSizes.forEach((n, segment) => {
    for (let offset = 0; offset < n; offset += size) {
      const count = Math.min(size, n - offset);
      const owner = Math.min(ranks - 1, Math.floor(((start + count / 2) * ranks) / total));
      out.push({ segment, offset, start, count, owner });
      start += count;
    }
  });
  return out;
}

/** What the distributed optimizer drives: a trainer's buffers (see GpuModel). */
export interface ZeroModel {
  layout: ParamLayout;
  params: FlatBuffer;
  grads: FlatBuffer;
  control: GPUBuffer;
  stats: GPUBuffer;
  optUniform: GPUBuffer;
  /** Refreshes the fp16 weight copy from the parameters (empty in fp32). */
  castWeights: Op[];
  /** Slots of the loss and the gradient norm in `stats`. */
  lossSlot: number;
  normSlot: number;
}

/** Options of {@link DistributedOptimizer.create}. */
export interface ZeroOptions {
  rank: number;
  size: number;
  /** Gradient lanes (any wire dtype). */
  gradComms: RingComm[];
  /** Weight lanes (fp32). */
  paramComms: RingComm[];
  control: RankControl;
  path?: ReducePath;
  stagingBytes?: number;
  inFlight?: number;
}

/** One data-parallel rank's share of AdamW and the exchanges around it. */
export class DistributedOptimizer {
  readonly buckets: ZeroBucket[];
  readonly rank: number;
  #ctx: GpuContext;
  #model: ZeroModel;
  #control: RankControl;
  #grads: BucketExchange;
  #weights: BucketExchange;
  #paramComm: RingComm;
  /** Moments of each owned bucket, by bucket index. */
  #m = new Map<number, GPUBuffer>();
  #v = new Map<number, GPUBuffer>();
  #normParts: GPUBuffer;
  #normTotal: GPUBuffer;
  #normOps: Op[] = [];
  #updateOps: Op[] = [];
  #elapsed = 0;
  #bytes = 0;
  #steps = 0;

  private constructor(
    ctx: GpuContext,
    model: ZeroModel,
    o: ZeroOptions,
    x: BucketExchange,
    w: BucketExchange,
  ) {
    this.#ctx = ctx;
    this.#model = model;
    this.rank = o.rank;
    this.#control = o.control;
    this.#grads = x;
    this.#weights = w;
    this.#paramComm = o.paramComms[0];
    this.buckets = zeroBuckets(
      model.params.segments.map((s) => s.size),
      o.size,
      Math.min(o.gradComms[0].capacity, o.paramComms[0].capacity),
    );
    const owned = this.buckets.filter((b) => b.owner === o.rank).length;
    this.#normParts = ctx.device.createBuffer({
      label: "zero norm partials",
      size: Math.max(1, owned) * NORM_GROUPS * 4,
      usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC,
    });
    this.#normTotal = ctx.device.createBuffer({
      label: "zero norm",
      size: 16,
      usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST,
    });
  }

  /** Allocates this rank's moments and builds its update kernels. */
  static async create(ctx: GpuContext, model: ZeroModel, o: ZeroOptions): Promise<DistributedOptimizer> {
    const common = { stagingBytes: o.stagingBytes ?? 16 << 20, inFlight: o.inFlight ?? 8 };
    const grads = await BucketExchange.create(ctx, o.gradComms, {
      ...common,
      path: o.path ?? "gpu",
      bufferDtype: "f32",
    });
    const weights = await BucketExchange.create(ctx, o.paramComms, { ...common, path: "host" });
    const z = new DistributedOptimizer(ctx, model, o, grads, weights);
    await z.#build();
    return z;
  }

  async #build(): Promise<void> {
    const ctx = this.#ctx, m = this.#model, cache = new PipelineCache(ctx);
    const view = (flat: FlatBuffer, b: ZeroBucket): View => ({
      buffer: flat.segments[b.segment].buffer,
      offset: b.offset * 4,
      size: b.count * 4,
    });
    const op = async (
      label: string,
      code: string,
      views: View[],
      grid: [number] | [number, number],
      uniform?: GPUBuffer,
    ) =>
      makeOp(ctx, await cache.get(label, code), {
        label,
        phase: "optimizer",
        kind: "optimizer",
        views,
        grid,
        uniform,
      });
    let k = 0;
    const maxWg = ctx.limits.maxComputeWorkgroupsPerDimension;
    for (const [i, b] of this.buckets.entries()) {
      if (b.owner !== this.rank) continue;
      const n4 = b.count / 4;
      this.#m.set(i, await createStorage(ctx, `zero m ${i}`, b.count * 4));
      this.#v.set(i, await createStorage(ctx, `zero v ${i}`, b.count * 4));
      this.#normOps.push(
        await op(`zero grad_norm.${i}`, gradNormPartialWgsl(n4), [
          view(m.grads, b),
          { buffer: this.#normParts, offset: k * NORM_GROUPS * 4, size: NORM_GROUPS * 4 },
        ], [NORM_GROUPS]),
      );
      const decayEnd4 = Math.min(Math.max(m.layout.decayEnd - b.start, 0), b.count) / 4;
      const wg = Math.ceil(n4 / 256);
      this.#updateOps.push(
        await op(
          `zero adamw.${i}`,
          adamwWgsl(n4, decayEnd4),
          [view(m.params, b), view(m.grads, b), { buffer: this.#m.get(i)! }, { buffer: this.#v.get(i)! }, {
            buffer: m.control,
          }],
          wg > maxWg ? [maxWg, Math.ceil(wg / maxWg)] : [wg],
          m.optUniform,
        ),
      );
      k++;
    }
    this.#updateOps.unshift(
      await op(
        "zero step_control",
        stepControlWgsl(1, m.lossSlot, m.normSlot),
        [{ buffer: this.#normTotal }, { buffer: m.stats }, { buffer: m.control }],
        [1],
        m.optUniform,
      ),
    );
  }

  /** Elements whose moments this rank keeps. */
  get ownedElements(): number {
    return this.buckets.filter((b) => b.owner === this.rank).reduce((a, b) => a + b.count, 0);
  }

  /** Bytes of GPU memory this rank's moments take. */
  get momentBytes(): number {
    return 8 * this.ownedElements;
  }

  /**
   * The whole update after the backward passes (a `GradientReduce` for `Trainer.trainStepReduced`,
   * whose own update list is then empty): reduce to owners, global norm, AdamW on owned buckets,
   * broadcast of the weights.
   */
  step = async (grads: FlatBuffer): Promise<void> => {
    const q = this.#ctx.device.queue;
    await q.onSubmittedWorkDone();
    const t0 = performance.now();
    const bucket = (flat: FlatBuffer, b: ZeroBucket) => ({
      buffer: flat.segments[b.segment].buffer,
      offset: b.offset * 4,
      count: b.count,
    });
    const reduced = this.buckets.map((b) =>
      this.#grads.run({ ...bucket(grads, b), writeBack: b.owner === this.rank })
    );
    for (const t of await Promise.all(reduced)) this.#bytes += t.bytes;
    let enc = this.#ctx.device.createCommandEncoder();
    encodeOps(enc, this.#normOps);
    q.submit([enc.finish()]);
    const [parts, stats] = await readBuffers(this.#ctx, [
      { buffer: this.#normParts },
      { buffer: this.#model.stats, bytes: 16 },
    ]);
    let sumsq = 0;
    if (this.#normOps.length > 0) { for (const x of new Float32Array(parts)) sumsq += x; }
    const lossOk = Number.isFinite(new Float32Array(stats)[this.#model.lossSlot]) ? 1 : 0;
    const all = await this.#control.gather([sumsq, lossOk]);
    // fp32 sum in rank order: the same value on every rank; a non-finite loss anywhere skips the step everywhere.
    let total = 0;
    for (const [x] of all) total = Math.fround(total + x);
    if (all.some(([, ok]) => ok === 0)) total = NaN;
    q.writeBuffer(this.#normTotal, 0, new Float32Array([total, 0, 0, 0]));
    enc = this.#ctx.device.createCommandEncoder();
    encodeOps(enc, this.#updateOps);
    q.submit([enc.finish()]);
    const sent = this.buckets.map((b) =>
      this.#weights.run({ ...bucket(this.#model.params, b), source: b.owner === this.rank })
    );
    for (const t of await Promise.all(sent)) this.#bytes += t.bytes;
    if (this.#model.castWeights.length) {
      enc = this.#ctx.device.createCommandEncoder();
      encodeOps(enc, this.#model.castWeights);
      q.submit([enc.finish()]);
    }
    this.#elapsed += performance.now() - t0;
    this.#steps++;
  };

  /** Exchange time and bytes since the last call, then resets them. */
  take(): ReduceTiming {
    // Nothing overlaps the backward pass here: all of it is exposed.
    const t = { steps: this.#steps, ms: this.#elapsed, exposedMs: this.#elapsed, bytes: this.#bytes };
    this.#elapsed = this.#bytes = this.#steps = 0;
    return t;
  }

  /** Writes this rank's share of whole-model moments (from a checkpoint). */
  loadMoments(m: Float32Array, v: Float32Array): void {
    const q = this.#ctx.device.queue;
    for (const [i, b] of this.buckets.entries()) {
      if (b.owner !== this.rank) continue;
      q.writeBuffer(this.#m.get(i)!, 0, m.subarray(b.start, b.start + b.count) as Float32Array<ArrayBuffer>);
      q.writeBuffer(this.#v.get(i)!, 0, v.subarray(b.start, b.start + b.count) as Float32Array<ArrayBuffer>);
    }
  }

  /**
   * The whole moments, assembled on rank 0 (every rank must call it; others get null), bucket by
   * bucket through the weight communicator.
   */
  async exportMoments(total: number): Promise<{ m: Float32Array; v: Float32Array } | null> {
    const comm = this.#paramComm;
    const lead = this.rank === 0;
    const m = lead ? new Float32Array(total) : null, v = lead ? new Float32Array(total) : null;
    for (const [which, out] of [[this.#m, m], [this.#v, v]] as const) {
      for (const [i, b] of this.buckets.entries()) {
        const slot = (await comm.acquire()) as Float32Array;
        if (b.owner === this.rank) slot.set(new Float32Array(await readBuffer(this.#ctx, which.get(i)!)));
        else slot.fill(0, 0, b.count);
        await comm.allreduce(b.count);
        out?.set(slot.subarray(0, b.count), b.start);
      }
    }
    return lead ? { m: m!, v: v! } : null;
  }

  destroy(): void {
    this.#grads.destroy();
    this.#weights.destroy();
    for (const b of [...this.#m.values(), ...this.#v.values()]) b.destroy();
    this.#normParts.destroy();
    this.#normTotal.destroy();
  }
}
