/**
 * Who holds which KV-cache slot. Each stream owns a slot of the cache; the cache grows by doubling
 * up to `maxStreams` slots as streams arrive (slot 0 is scratch, written by padding rows). A stream
 * admitted waits as pending until the next chunk prefills it; from then on it is a decode row.
 * Rows are dense: row r's slot is in its state, so a finished stream's row is refilled by the last
 * one and the batch shrinks. Each slot's epoch is bumped when a stream takes or leaves it, so a
 * chunk still running tells a stream released since by it.
 */

import type { ModelConfig } from "../../model/config.ts";
import { createStorage, type GpuContext } from "../device.ts";
import { PARAM_WORDS } from "../kernels/sample.ts";
import type { KvCache } from "../graph/decode_step.ts";

/** A stream admitted and not prefilled yet. */
export interface Pending {
  slot: number;
  prompt: Uint32Array;
  /** Its first state (STATE_WORDS) and sampling parameters (PARAM_WORDS). */
  state: Uint32Array;
  params: Uint32Array;
}

/** The KV cache, its slots, and the streams' rows. */
export class KvSlots implements KvCache {
  kc: GPUBuffer[] = [];
  vc: GPUBuffer[] = [];
  /** Slots the cache holds for streams (slot 0, scratch, not counted). */
  cap = 0;
  /** Row → slot of the streams being decoded. */
  rows: number[] = [];
  /** Each row's source row in the GPU's state as the last queued chunk left it (−1: admitted since). */
  src: number[] = [];
  /** Streams admitted since the last step. */
  pending: Pending[] = [];
  /** Per slot, bumped when a stream takes or leaves it (chunks still running tell their streams by it). */
  readonly epochs: Uint32Array;
  /**
   * Per slot, tokens its stream may still be handed out: its maxTokens less those handed out (the
   * one count of maxTokens; Infinity without it).
   */
  readonly budget: Float64Array;
  /** Per slot, tokens queued on the GPU for its stream and not read back yet. */
  readonly queued: Float64Array;
  /** CPU copy of the rows' sampling parameters (the GPU's are rewritten before every chunk). */
  readonly paramsCpu: Uint32Array<ArrayBuffer>;
  #free: number[] = [];
  #ctx: GpuContext;
  #config: ModelConfig;

  constructor(ctx: GpuContext, config: ModelConfig, maxStreams: number) {
    this.#ctx = ctx;
    this.#config = config;
    // One row more than the streams: padding prefill prompts sample into it.
    this.epochs = new Uint32Array(maxStreams + 1);
    this.budget = new Float64Array(maxStreams + 1);
    this.queued = new Float64Array(maxStreams + 1);
    this.paramsCpu = new Uint32Array((maxStreams + 1) * PARAM_WORDS);
  }

  /** Streams admitted and not released (prefilled or pending). */
  get streams(): number {
    return this.rows.length + this.pending.length;
  }

  /** Whether a slot is free without growing the cache. */
  get hasFree(): boolean {
    return this.#free.length > 0;
  }

  /** Grows the KV cache to `cap` stream slots (plus scratch), keeping what is cached. */
  async grow(cap: number): Promise<void> {
    if (cap <= this.cap) return;
    const c = this.#config, bytes = (cap + 1) * c.n_positions * c.n_embd * 4;
    const kc: GPUBuffer[] = [], vc: GPUBuffer[] = [];
    try {
      for (let l = 0; l < c.n_layer; l++) {
        kc.push(await createStorage(this.#ctx, `gen.k${l}`, bytes));
        vc.push(await createStorage(this.#ctx, `gen.v${l}`, bytes));
      }
    } catch (e) {
      for (const b of [...kc, ...vc]) b.destroy();
      throw e;
    }
    if (this.kc.length) {
      // Slots are outermost in the layout: the old cache is a prefix of the new one.
      const enc = this.#ctx.device.createCommandEncoder();
      for (let l = 0; l < c.n_layer; l++) {
        enc.copyBufferToBuffer(this.kc[l], 0, kc[l], 0, this.kc[l].size);
        enc.copyBufferToBuffer(this.vc[l], 0, vc[l], 0, this.vc[l].size);
      }
      this.#ctx.device.queue.submit([enc.finish()]);
      for (const b of [...this.kc, ...this.vc]) b.destroy();
    }
    this.kc = kc;
    this.vc = vc;
    for (let s = cap; s > this.cap; s--) this.#free.push(s);
    this.#free.sort((a, b) => b - a); // lowest slot first off the end
    this.cap = cap;
  }

  /**
   * Takes the lowest free slot (one must be free) for a stream that may be asked for `maxTokens`;
   * the caller queues it in `pending`.
   */
  take(maxTokens: number): number {
    const slot = this.#free.pop()!;
    this.epochs[slot]++;
    this.budget[slot] = maxTokens;
    this.queued[slot] = 0;
    return slot;
  }

  /** Tokens slot `slot`'s stream may still be asked for beyond what the queued chunks produce. */
  left(slot: number): number {
    return this.budget[slot] - this.queued[slot];
  }

  /** Streams taken from `pending` become the last rows, to be prefilled by the next chunk. */
  adopt(pending: Pending[]): void {
    for (const p of pending) {
      this.paramsCpu.set(p.params, this.rows.length * PARAM_WORDS);
      this.rows.push(p.slot);
      this.src.push(-1);
    }
  }

  /**
   * Frees stream `handle`'s slot: a pending one leaves the queue, a row is refilled by the last
   * row. Returns whether a row left and none is left.
   */
  release(handle: number): boolean {
    const p = this.pending.findIndex((x) => x.slot === handle);
    if (p >= 0) {
      this.pending.splice(p, 1);
      this.epochs[handle]++;
      this.#free.push(handle);
      return false;
    }
    const r = this.rows.indexOf(handle);
    if (r < 0) return false;
    const last = this.rows.length - 1;
    if (r !== last) {
      this.rows[r] = this.rows[last];
      this.src[r] = this.src[last];
      this.paramsCpu.copyWithin(r * PARAM_WORDS, last * PARAM_WORDS, (last + 1) * PARAM_WORDS);
    }
    this.rows.pop();
    this.src.pop();
    this.epochs[handle]++;
    this.#free.push(handle);
    return this.rows.length === 0;
  }

  destroy(): void {
    for (const b of [...this.kc, ...this.vc]) b.destroy();
  }
}
