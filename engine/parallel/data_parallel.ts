/**
 * What a data-parallel rank needs beyond the communicators: `GradientReducer` sums a trainer's
 * flat gradients over the ranks bucket by bucket (through a `BucketExchange`, so successive
 * buckets pipeline over its lanes), and `RankControl` is a tiny fp32 communicator for the
 * decisions and numbers the ranks must share: stop or go at every step, the loss and timings at
 * log steps, weight checksums, distributed evaluation sums.
 */

import { CONTROL_WORDS, createControlBuffer, wireDtype } from "./allreduce.ts";
import type { ParamLayout } from "../../model/config.ts";
import type { GpuContext } from "../device.ts";
import type { FlatBuffer } from "../flat.ts";
import { RingComm } from "./allreduce.ts";
import { type Bucket, BucketExchange, type ReducePath } from "./exchange.ts";

/** Options of {@link GradientReducer}. */
export interface ReducerOptions {
  path?: ReducePath;
  /** Bytes per staging buffer of each lane (default 16 MiB: the best readback rate measured). */
  stagingBytes?: number;
  /** Maps in flight per lane (default 8). */
  inFlight?: number;
  /**
   * Overlap the exchange with the backward pass (default true): the weight gradients of a stage of
   * layers travel while the layers below still compute (see `begin`).
   */
  overlap?: boolean;
  /** Gradient bytes per overlapped stage, at least one layer (default 160 MiB). */
  stageBytes?: number;
}

/** One step's overlapped exchange, driven by `Trainer.trainStepReduced` (see `GradientReducer.begin`). */
export interface StagedRun {
  /** The layer after whose backward each stage's gradients are final, descending. */
  readonly stageLayers: number[];
  /** Records into `enc` (the submission that ends with the stage's layers) the stage's copies to the host. */
  encode(enc: GPUCommandEncoder, stage: number): void;
  /** Waits until the stage's copies are readable (every mapAsync waits for all work queued). */
  mapped(stage: number): Promise<void>;
  /** Exchanges the stage (its sums queued on the GPU after whatever was submitted meanwhile). */
  exchange(stage: number): Promise<void>;
  /** After the whole backward pass: exchanges the remaining gradients (embeddings, 1-D tensors). */
  finish(): Promise<void>;
}

/** A stage of an overlapped step: its buckets, and where each lands in its MAP_READ staging buffer. */
interface Stage {
  buckets: Bucket[];
  at: number[];
  bytes: number;
  staging: GPUBuffer;
}

/** Time and bytes of the gradient exchanges since the last `take()`. */
export interface ReduceTiming {
  /** Steps reduced. */
  steps: number;
  /**
   * Wall time of the exchanges (host copies, waits for the peers, uploads; including a slower
   * peer's lag), whether or not the GPU computed meanwhile.
   */
  ms: number;
  /**
   * Wall time of the exchanges the step waited for with no backward work left to overlap: from
   * the submission of the last backward kernels to the summed gradients (so it also counts those
   * kernels). Without overlap, equal to `ms`.
   */
  exposedMs: number;
  /** Gradient bytes sent per rank. */
  bytes: number;
}

/** Sums a trainer's gradients over the data-parallel ranks, in buckets of at most the lanes' capacity. */
export class GradientReducer {
  #exchange: BucketExchange;
  #ctx: GpuContext;
  #capacity: number;
  #elapsed = 0;
  #exposed = 0;
  #bytes = 0;
  #steps = 0;
  /** Staging buffers of the two alternating stages of an overlapped step, grown by need. */
  #staging: (GPUBuffer | null)[] = [null, null];
  readonly overlap: boolean;
  readonly stageBytes: number;

  private constructor(ctx: GpuContext, exchange: BucketExchange, capacity: number, opts: ReducerOptions) {
    this.#ctx = ctx;
    this.#exchange = exchange;
    this.#capacity = capacity;
    this.overlap = opts.overlap ?? true;
    this.stageBytes = opts.stageBytes ?? 160 << 20;
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
    return new GradientReducer(ctx, exchange, comms[0].capacity, opts);
  }

  /** The buckets of a flat array: each segment cut into pieces of at most the capacity, last first. */
  buckets(flat: FlatBuffer): Bucket[] {
    return this.#bucketsOf(flat, 0, flat.totalSize).reverse();
  }

  /** Buckets of elements [from, to) of `flat`, cut at segment ends and at the capacity, in order. */
  #bucketsOf(flat: FlatBuffer, from: number, to: number): Bucket[] {
    const out: Bucket[] = [];
    const cap = this.#capacity - (this.#capacity % 4);
    for (const seg of flat.segments) {
      const a = Math.max(from, seg.start), b = Math.min(to, seg.start + seg.size);
      for (let at = a; at < b; at += cap) {
        out.push({
          buffer: seg.buffer,
          offset: (at - seg.start) * flat.bytesPerElement,
          count: Math.min(cap, b - at),
        });
      }
    }
    return out;
  }

  /**
   * Plans one overlapped step over `grads` (laid out as `layout`), or null when this reducer does
   * not overlap. Stages are runs of whole layers, top down, of at least `stageBytes` of 2-D weight
   * gradients each (a layer's four matrices are contiguous in the layout), the last one ending at
   * layer 0; the embeddings and the 1-D tensors, final only after the whole backward pass, go in
   * `finish`. Every rank plans the same stages, so their exchanges pair up.
   */
  begin(grads: FlatBuffer, layout: ParamLayout, layers: number): StagedRun | null {
    if (!this.overlap || layers < 1) return null;
    const first = (l: number) => layout.byName.get(`h.${l}.attn.c_attn.weight`)?.offset;
    const lo = first(0);
    if (lo === undefined) return null;
    const end = (l: number) => l + 1 < layers ? first(l + 1)! : layout.decayEnd;
    const ranges: { layer: number; from: number; to: number }[] = [];
    let top = layers - 1;
    for (let l = layers - 1; l >= 0; l--) {
      if ((end(top) - first(l)!) * grads.bytesPerElement >= this.stageBytes || l === 0) {
        ranges.push({ layer: l, from: first(l)!, to: end(top) });
        top = l - 1;
      }
    }
    const stages: Stage[] = ranges.map((r, i) => {
      const buckets = this.#bucketsOf(grads, r.from, r.to), at: number[] = [];
      let bytes = 0;
      for (const b of buckets) {
        at.push(bytes);
        bytes += Math.ceil(this.#wireBytes(b) / 8) * 8; // getMappedRange offsets are multiples of 8
      }
      return { buckets, at, bytes, staging: this.#stagingFor(i % 2, bytes) };
    });
    const rest = [
      ...this.#bucketsOf(grads, 0, lo),
      ...this.#bucketsOf(grads, layout.decayEnd, grads.totalSize),
    ].reverse();
    const exchange = this.#exchange;
    let lastSubmit = 0;
    const timed = async <T>(f: () => Promise<T>): Promise<T> => {
      const t0 = performance.now();
      try {
        return await f();
      } finally {
        this.#elapsed += performance.now() - t0;
      }
    };
    return {
      stageLayers: ranges.map((r) => r.layer),
      encode: (enc, i) => {
        const st = stages[i];
        st.buckets.forEach((b, j) => exchange.encodeRead(enc, b, st.staging, st.at[j]));
      },
      mapped: async (i) => {
        await stages[i].staging.mapAsync(GPUMapMode.READ, 0, stages[i].bytes);
        // The last backward kernels are submitted next: from here the step waits on the exchange.
        if (i === stages.length - 1) lastSubmit = performance.now();
      },
      exchange: (i) =>
        timed(async () => {
          const { buckets, at, bytes, staging } = stages[i];
          const range = staging.getMappedRange(0, bytes);
          try {
            // One copy out of the mapped range, into the shared slot (inside runFrom).
            const runs = buckets.map((b, j) =>
              exchange.runFrom(b, new Uint8Array(range, at[j], this.#wireBytes(b)))
            );
            for (const t of await Promise.all(runs)) this.#bytes += t.bytes;
          } finally {
            staging.unmap();
          }
        }),
      finish: async () => {
        await this.#ctx.device.queue.onSubmittedWorkDone();
        await timed(async () => {
          for (const t of await Promise.all(rest.map((b) => exchange.run(b)))) this.#bytes += t.bytes;
        });
        this.#exposed += performance.now() - lastSubmit;
        this.#steps++;
      },
    };
  }

  /** Bytes of a bucket on the wire. */
  #wireBytes(b: Bucket): number {
    return b.count * (this.#exchange.wireDtype === "f32" ? 4 : 2);
  }

  /** The staging buffer of set `set`, of at least `bytes`, grown by need. */
  #stagingFor(set: number, bytes: number): GPUBuffer {
    const have = this.#staging[set];
    if (have && have.size >= bytes) return have;
    have?.destroy();
    return this.#staging[set] = this.#ctx.device.createBuffer({
      label: `overlap staging ${set}`,
      size: Math.max(8, bytes),
      usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST,
    });
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
    this.#exposed += performance.now() - t0;
    this.#steps++;
  };

  /** Timing since the last call, then resets it. */
  take(): ReduceTiming {
    const t = { steps: this.#steps, ms: this.#elapsed, exposedMs: this.#exposed, bytes: this.#bytes };
    this.#elapsed =
      this.#exposed =
      this.#bytes =
      this.#steps =
        0;
    return t;
  }

  destroy(): void {
    this.#exchange.destroy();
    for (const b of this.#staging) b?.destroy();
  }
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

export { CONTROL_WORDS, createControlBuffer, wireDtype };
