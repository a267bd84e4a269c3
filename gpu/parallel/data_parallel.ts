/**
 * What a data-parallel rank needs beyond the communicators: `GradientReducer` sums a trainer's
 * flat gradients over the ranks bucket by bucket (through a `BucketExchange`, so successive
 * buckets pipeline over its lanes), and `RankControl` is a tiny fp32 communicator for the
 * decisions and numbers the ranks must share: stop or go at every step, the loss and timings at
 * log steps, weight checksums, distributed evaluation sums.
 */

import type { GpuContext } from "../device.ts";
import type { FlatBuffer } from "../flat.ts";
import { type CommDtype, createCommBuffer, RingComm } from "./allreduce.ts";
import { type Bucket, BucketExchange, type ReducePath } from "./exchange.ts";

/** Options of {@link GradientReducer}. */
export interface ReducerOptions {
  path?: ReducePath;
  /** Bytes per staging buffer of each lane (default 16 MiB: the best readback rate measured). */
  stagingBytes?: number;
  /** Maps in flight per lane (default 8). */
  inFlight?: number;
}

/** Time and bytes of the gradient exchanges since the last `take()`. */
export interface ReduceTiming {
  /** Steps reduced. */
  steps: number;
  /** Wall time of the exchanges, from the end of the backward pass on this GPU (so including a slower peer's lag). */
  ms: number;
  /** Gradient bytes sent per rank. */
  bytes: number;
}

/** Sums a trainer's gradients over the data-parallel ranks, in buckets of at most the lanes' capacity. */
export class GradientReducer {
  #exchange: BucketExchange;
  #ctx: GpuContext;
  #capacity: number;
  #elapsed = 0;
  #bytes = 0;
  #steps = 0;

  private constructor(ctx: GpuContext, exchange: BucketExchange, capacity: number) {
    this.#ctx = ctx;
    this.#exchange = exchange;
    this.#capacity = capacity;
  }

  /** A reducer over `comms` (this rank's lanes; an fp16/bf16 wire sends fp32 gradients packed). */
  static async create(
    ctx: GpuContext,
    comms: RingComm[],
    opts: ReducerOptions = {},
  ): Promise<GradientReducer> {
    const exchange = await BucketExchange.create(ctx, comms, {
      path: opts.path ?? "gpu",
      bufferDtype: "f32",
      stagingBytes: opts.stagingBytes ?? 16 << 20,
      inFlight: opts.inFlight ?? 8,
    });
    return new GradientReducer(ctx, exchange, comms[0].capacity);
  }

  /** The buckets of a flat array: each segment cut into pieces of at most the capacity, last first. */
  buckets(flat: FlatBuffer): Bucket[] {
    const out: Bucket[] = [];
    const cap = this.#capacity - (this.#capacity % 4);
    for (const seg of flat.segments) {
      for (let at = 0; at < seg.size; at += cap) {
        out.push({
          buffer: seg.buffer,
          offset: at * flat.bytesPerElement,
          count: Math.min(cap, seg.size - at),
        });
      }
    }
    return out.reverse();
  }

  /** Sums `grads` over the ranks in place (a `GradientReduce` for `Trainer.trainStepReduced`). */
  reduce = async (grads: FlatBuffer): Promise<void> => {
    // Time the exchange, not the backward pass still running on the GPU (the first readback would wait for it).
    await this.#ctx.device.queue.onSubmittedWorkDone();
    const t0 = performance.now();
    const runs = this.buckets(grads).map((b) => this.#exchange.run(b));
    const timings = await Promise.all(runs);
    for (const t of timings) this.#bytes += t.bytes;
    this.#elapsed += performance.now() - t0;
    this.#steps++;
  };

  /** Timing since the last call, then resets it. */
  take(): ReduceTiming {
    const t = { steps: this.#steps, ms: this.#elapsed, bytes: this.#bytes };
    this.#elapsed = this.#bytes = this.#steps = 0;
    return t;
  }

  destroy(): void {
    this.#exchange.destroy();
  }
}

/** Floats one `RankControl` exchange can carry per rank. */
export const CONTROL_WORDS = 16;

/** Creates the buffer of a job's control communicator. */
export function createControlBuffer(ranks: number): SharedArrayBuffer {
  return createCommBuffer({ ranks, capacity: CONTROL_WORDS * ranks, dtype: "f32", algorithm: "direct" });
}

/** Small collective decisions and numbers between the ranks of a job (fp32 sums, exact for small integers). */
export class RankControl {
  readonly rank: number;
  readonly size: number;
  #comm: RingComm;

  /** Opens rank `rank` of `sab`; a long timeout, since a peer may be writing a checkpoint meanwhile. */
  constructor(sab: SharedArrayBuffer, rank: number, timeoutMs = 3_600_000) {
    this.#comm = new RingComm(sab, rank, { timeoutMs });
    this.rank = rank;
    this.size = this.#comm.size;
  }

  /** Element-wise sum of `values` over the ranks (at most CONTROL_WORDS · ranks numbers). */
  async sum(values: number[]): Promise<number[]> {
    const data = Float32Array.from(values);
    await this.#comm.allreduceArray(data);
    return Array.from(data);
  }

  /** Every rank's `values` (at most CONTROL_WORDS numbers each, the same count on every rank), by rank. */
  async gather(values: number[]): Promise<number[][]> {
    const k = values.length;
    if (k > CONTROL_WORDS) throw new RangeError(`gather carries at most ${CONTROL_WORDS} numbers, got ${k}`);
    const all = new Array<number>(k * this.size).fill(0);
    values.forEach((v, i) => all[this.rank * k + i] = v);
    const sum = await this.sum(all);
    return Array.from({ length: this.size }, (_, r) => sum.slice(r * k, (r + 1) * k));
  }

  /** Fails the group: every peer's current or next exchange throws. */
  abort(reason: string): void {
    this.#comm.abort(reason);
  }
}

/** Splits a u32 into two 16-bit halves that fp32 carries exactly (for checksums through `RankControl`). */
export function splitU32(x: number): [number, number] {
  return [(x >>> 16) & 0xffff, x & 0xffff];
}

/** Joins what `splitU32` split. */
export function joinU32(hi: number, lo: number): number {
  return ((hi << 16) | lo) >>> 0;
}

/** The comm dtype of an `allreduce_dtype` job setting. */
export function wireDtype(setting: "fp32" | "fp16" | "bf16" | undefined): CommDtype {
  return setting === "fp16" ? "f16" : setting === "bf16" ? "bf16" : "f32";
}
