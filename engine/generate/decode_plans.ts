/**
 * The decode plans, one per batch bucket (1, 2, 4 … rows, graph/decode_step.ts), and the state
 * remap that starts every chunk: built once, compiled together, and bound anew when the KV cache
 * grows.
 */

import type { Op } from "../ops.ts";
import { stateRemapWgsl } from "../kernels/decode.ts";
import { decodeStep } from "../graph/decode_step.ts";
import type { GenBuffers } from "./gen_buffers.ts";
import type { KvSlots } from "./kv_slots.ts";

/** Decode plans by rows, and the state remap. */
export class DecodePlans {
  #buf: GenBuffers;
  #slots: KvSlots;
  #plans = new Map<number, Op[]>();
  #remap: Op | null = null;

  constructor(buf: GenBuffers, slots: KvSlots) {
    this.#buf = buf;
    this.#slots = slots;
  }

  /** The decode bucket of `rows` rows: the next power of 2, at most maxStreams. */
  bucket(rows: number): number {
    let b = 1;
    while (b < rows) b *= 2;
    return Math.min(b, this.#buf.opts.maxStreams);
  }

  /** One decode step for S rows, built (and compiled) on first use. */
  async plan(S: number): Promise<Op[]> {
    // Listed once compiled, so a step never meets a plan still being built.
    return this.#plans.get(S) ??
      await this.#buf.inBatch(
        async () => this.#plans.get(S) ?? await decodeStep(this.#buf, this.#slots, S),
        (ops) => this.#plans.set(S, ops),
      );
  }

  /** The plan for S rows if it is built, else undefined. */
  built(S: number): Op[] | undefined {
    return this.#plans.get(S);
  }

  /** The state remap that starts every chunk (see stateRemapWgsl), built once. */
  async remap(): Promise<Op> {
    const b = this.#buf;
    this.#remap ??= await b.inBatch(() =>
      b.op("elementwise", "dec.remap", stateRemapWgsl(), [
        { buffer: b.prevState },
        { buffer: b.table },
        { buffer: b.state },
      ], [Math.ceil((b.opts.maxStreams + 1) / 64)])
    );
    return this.#remap;
  }

  /** The state remap if it is built. */
  get builtRemap(): Op | null {
    return this.#remap;
  }

  /** The cache was replaced: plans bind it, so they are rebuilt on next use (pipelines stay compiled). */
  clear(): void {
    this.#plans.clear();
  }
}
