/**
 * The exchanges of a tensor-parallel rank (the `Sync` steps of a GPU model's program, see
 * engine/graph/), over the fp32 communicators of its tensor-parallel group:
 *  - "allreduce": activation partial sums (row-parallel outputs, the vocabulary-parallel
 *    embedding, the input gradients of column-parallel matmuls) read back, summed, written
 *    back on every rank, through a `BucketExchange`;
 *  - "vocab_ce": the loss's per-row statistics gathered from every rank and combined into the
 *    global log-sum-exp and target logit (the logits themselves never travel);
 *  - "norm": the ranks' squared-gradient partials added into the global norm's square.
 * Every rank combines the same numbers in the same order, so all hold the same bits. Also moves
 * whole rank states to rank 0 for checkpoints (`gather`).
 */

import { type GpuContext, readBuffer } from "../device.ts";
import type { Sync } from "../graph/mod.ts";
import type { RingComm } from "./allreduce.ts";
import { BucketExchange, type ReducePath } from "./exchange.ts";
import { combineCeStats } from "./tensor_parallel_kernels.ts";

/** Time spent in exchanges, by kind, since the last `take()`. */
export interface TensorParallelTiming {
  allreduces: number;
  allreduceMs: number;
  allreduceBytes: number;
  otherMs: number;
}

/** One tensor-parallel rank's side of its group's exchanges. */
export class TensorParallelExchange {
  readonly rank: number;
  readonly size: number;
  #ctx: GpuContext;
  #comm: RingComm;
  #x: BucketExchange;
  #t: TensorParallelTiming = { allreduces: 0, allreduceMs: 0, allreduceBytes: 0, otherMs: 0 };

  /** Elements per activation bucket. */
  #actCapacity: number;

  private constructor(ctx: GpuContext, comms: RingComm[], x: BucketExchange, actCapacity: number) {
    this.#ctx = ctx;
    this.#actCapacity = actCapacity;
    this.#comm = comms[0];
    this.#x = x;
    this.rank = comms[0].rank;
    this.size = comms[0].size;
  }

  /**
   * An exchange over `comms`, this rank's lanes of its tensor-parallel group: the first fp32 (row
   * statistics, norms, gathers), the others for the activations, fp32 or 16-bit on the wire (an
   * fp16 job's activations travel as fp16 and are summed in fp32). One lane serves both.
   */
  static async create(
    ctx: GpuContext,
    comms: RingComm[],
    opts: { path?: ReducePath; stagingBytes?: number; inFlight?: number } = {},
  ): Promise<TensorParallelExchange> {
    if (comms[0]?.dtype !== "f32") throw new RangeError("A tensor-parallel group's first lane carries fp32");
    const acts = comms.length > 1 ? comms.slice(1) : comms;
    const x = await BucketExchange.create(ctx, acts, {
      path: opts.path ?? "host",
      bufferDtype: "f32",
      stagingBytes: opts.stagingBytes ?? 16 << 20,
      inFlight: opts.inFlight ?? 8,
    });
    return new TensorParallelExchange(ctx, comms, x, acts[0].capacity);
  }

  /** Runs one exchange of the program (Trainer's `tensorParallel.exchange`). */
  exchange = async (s: Sync): Promise<void> => {
    const t0 = performance.now();
    switch (s.sync) {
      case "allreduce": {
        const cap = this.#actCapacity - (this.#actCapacity % 4), runs = [];
        for (let at = 0; at < s.count; at += cap) {
          runs.push(this.#x.run({ buffer: s.buffer, offset: at * 4, count: Math.min(cap, s.count - at) }));
        }
        await Promise.all(runs);
        this.#t.allreduces++;
        this.#t.allreduceBytes += s.count * 4;
        this.#t.allreduceMs += performance.now() - t0;
        return;
      }
      case "vocab_ce": {
        const local = new Float32Array(await readBuffer(this.#ctx, s.stats, 0, s.rows * 16));
        const all = await this.gatherAll(local);
        const out = new Float32Array(s.rows * 4);
        combineCeStats(all, s.rows, out);
        this.#ctx.device.queue.writeBuffer(s.stats, 0, out);
        break;
      }
      case "norm": {
        let sumsq = 0;
        for (const x of new Float32Array(await readBuffer(this.#ctx, s.parts, 0, s.count * 4))) sumsq += x;
        const all = await this.gatherAll(Float32Array.of(sumsq));
        let total = 0;
        for (const [x] of all) total = Math.fround(total + x);
        this.#ctx.device.queue.writeBuffer(s.total, 0, new Float32Array([total, 0, 0, 0]));
        break;
      }
    }
    this.#t.otherMs += performance.now() - t0;
  };

  /**
   * Every rank's `data` (the same length on every rank), in rank order, through the
   * communicator: each rank writes its piece into a zeroed slot and the slots are summed.
   */
  async gatherAll(data: Float32Array): Promise<Float32Array[]> {
    const n = this.size, comm = this.#comm, chunk = Math.floor(comm.capacity / n);
    const out = Array.from({ length: n }, () => new Float32Array(data.length));
    for (let at = 0; at < data.length || (at === 0 && data.length === 0); at += chunk) {
      const len = Math.min(chunk, data.length - at);
      const slot = (await comm.acquire()) as Float32Array;
      slot.fill(0, 0, n * len);
      slot.set(data.subarray(at, at + len), this.rank * len);
      await comm.allreduce(n * len);
      for (let r = 0; r < n; r++) out[r].set(slot.subarray(r * len, (r + 1) * len), at);
      if (data.length === 0) break;
    }
    return out;
  }

  /** Exchange time since the last call, then resets it. */
  take(): TensorParallelTiming {
    const t = this.#t;
    this.#t = { allreduces: 0, allreduceMs: 0, allreduceBytes: 0, otherMs: 0 };
    return t;
  }

  destroy(): void {
    this.#x.destroy();
  }
}
