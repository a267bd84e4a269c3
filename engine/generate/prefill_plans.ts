/**
 * Prefill plans: the prompts admitted since the last step, cut into batches of up to PREFILL_ROWS
 * prompts within a token budget, each batch run as the training graph's forward pass planned for
 * B prompts × a length bucket (without gradients), with each layer's KV write after it and the LM
 * head only over each prompt's last position (graph/decode_step.ts's prefillTail), sampling each
 * prompt's first token on the GPU.
 */

import {
  buildModel,
  createBufferPool,
  destroyModel,
  type GpuModel,
  type GraphOptions,
} from "../graph/mod.ts";
import { type BufferPool } from "../graph/mod.ts";
import { encodeOps, type Op } from "../ops.ts";
import { SEL_WORDS } from "../kernels/decode.ts";
import { prefillTail } from "../graph/decode_step.ts";
import { type GenBuffers, PREFILL_ROWS } from "./gen_buffers.ts";
import type { KvSlots, Pending } from "./kv_slots.ts";

const BUCKETS = [32, 64, 128, 256, 512, 1024, 2048, 4096];

/** The prefill plan of one shape. */
export interface PrefillPlan {
  model: GpuModel;
  /** The forward pass up to the final LayerNorm (kept when the cache grows). */
  forward: Op[];
  /**
   * The forward pass with each layer's KV write after its last op (the layers share one set of
   * activation buffers), then the gathered LM head and the sampling: bound to the cache, so
   * rebuilt when it grows.
   */
  ops: Op[] | null;
}

/** The smallest power of 2 at least `n`. */
export function pow2(n: number): number {
  let b = 1;
  while (b < n) b *= 2;
  return b;
}

/** Every prefill shape's plan, built by need (or all at warm-up) and kept. */
export class PrefillPlans {
  #buf: GenBuffers;
  #slots: KvSlots;
  #plans = new Map<string, PrefillPlan>();
  /** The buffers every prefill plan shares (they run one after another in queue order). */
  #pool: BufferPool | null = null;

  constructor(buf: GenBuffers, slots: KvSlots) {
    this.#buf = buf;
    this.#slots = slots;
  }

  /**
   * Every prefill shape [prompts per batch (a power of 2), bucketed prompt length] a step can
   * meet: batches of up to PREFILL_ROWS prompts within the prefill token budget, or one prompt
   * of any length.
   */
  shapes(): Array<[number, number]> {
    const n = this.#buf.config.n_positions;
    const lens = [...new Set(Array.from({ length: n - 1 }, (_, i) => this.lenBucket(i + 1)))];
    const out: Array<[number, number]> = [];
    for (let B = 1; B <= PREFILL_ROWS; B *= 2) {
      for (const Tb of lens) if (B === 1 || B * Tb <= this.#buf.opts.prefillTokens) out.push([B, Tb]);
    }
    return out;
  }

  /** The length bucket of a prompt of `len` tokens. */
  lenBucket(len: number): number {
    const n = this.#buf.config.n_positions;
    return BUCKETS.find((b) => b >= len && b <= n) ?? n;
  }

  /** Splits prompts into prefill batches: at most PREFILL_ROWS, B·T within the token budget. */
  batches(pending: Pending[]): Pending[][] {
    const out: Pending[][] = [];
    let cur: Pending[] = [];
    const cost = (b: Pending[]) =>
      pow2(b.length) * this.lenBucket(Math.max(...b.map((p) => p.prompt.length)));
    for (const p of pending) {
      const next = [...cur, p];
      if (cur.length > 0 && (next.length > PREFILL_ROWS || cost(next) > this.#buf.opts.prefillTokens)) {
        out.push(cur);
        cur = [p];
      } else cur = next;
    }
    if (cur.length) out.push(cur);
    return out;
  }

  /** Writes one prefill batch's tokens and selection, and submits it. */
  async submit(batch: Pending[]): Promise<void> {
    const { ctx, opts, sel } = this.#buf;
    const B = pow2(batch.length);
    const Tb = this.lenBucket(Math.max(...batch.map((p) => p.prompt.length)));
    const plan = await this.plan(B, Tb);
    const tokens = new Uint32Array(B * (Tb + 1)), rows = new Uint32Array(PREFILL_ROWS * SEL_WORDS);
    for (let b = 0; b < B; b++) {
      const p = batch[b];
      if (!p) {
        // Padding prompt: no cache rows (length 0), samples into the spare state row.
        rows.set([0, 0, 0, opts.maxStreams], b * SEL_WORDS);
        continue;
      }
      const len = p.prompt.length;
      tokens.set(p.prompt, b * (Tb + 1));
      rows.set([b * Tb + len - 1, p.slot, len, this.#slots.rows.indexOf(p.slot)], b * SEL_WORDS);
    }
    const q = ctx.device.queue;
    q.writeBuffer(plan.model.tokens, 0, tokens);
    q.writeBuffer(sel, 0, rows);
    // In pieces (GeneratorOptions.prefillPieces), so the GPU starts while the rest is encoded.
    const ops = plan.ops!, per = Math.ceil(ops.length / Math.min(opts.prefillPieces, ops.length));
    for (let i = 0; i < ops.length; i += per) {
      const enc = ctx.device.createCommandEncoder();
      encodeOps(enc, ops.slice(i, i + per));
      q.submit([enc.finish()]);
    }
  }

  /**
   * The prefill of B prompts of (bucketed) length Tb. Every shape's plan is kept: their buffers
   * come from one pool sized for the largest, and the layers of a plan share one set of
   * activations (checkpointLayers 1 without training: only the residual stream is kept per
   * layer), so a plan costs its bind groups, not memory.
   */
  async plan(B: number, Tb: number): Promise<PrefillPlan> {
    const key = `${B}x${Tb}`, buf = this.#buf;
    let plan = this.#plans.get(key);
    if (!plan) {
      const opts: GraphOptions = {
        train: false,
        // Up to the final LayerNorm: prefillTail runs a gathered LM head over the last rows.
        hiddenOnly: true,
        checkpointLayers: 1,
        params: buf.params,
        kernels: { ...buf.opts.kernels, cpuMatmul: false },
        cache: buf.cache,
        onCompile: buf.opts.onCompile,
      };
      const shape = (B: number, T: number) => ({
        config: buf.config,
        B,
        T,
        attnDropout: 0,
        hiddenDropout: 0,
      });
      this.#pool ??= await createBufferPool(buf.ctx, this.shapes().map(([b, t]) => shape(b, t)), opts);
      const model = await buildModel(buf.ctx, shape(B, Tb), { ...opts, pool: this.#pool });
      plan = { model, forward: model.forward, ops: null };
      this.#plans.set(key, plan);
    }
    if (!plan.ops) {
      const model = plan.model;
      const { kv, rest } = await buf.inBatch(() =>
        prefillTail(buf, this.#slots, B, Tb, model.layers.map((l) => l.qkv), model.lnf)
      );
      plan.ops = withLayerOps(plan.forward, kv).concat(rest);
    }
    return plan;
  }

  /** The cache was replaced: the plans' tails are rebuilt on next use (pipelines stay compiled). */
  unbind(): void {
    for (const p of this.#plans.values()) p.ops = null;
  }

  destroy(): void {
    for (const { model } of this.#plans.values()) destroyModel(model);
    this.#pool?.destroy();
  }
}

/**
 * A forward pass's ops with `perLayer[l]` right after the last op of layer l (labelled "l{l}."),
 * while that layer's activations are still in the buffers the layers share.
 */
function withLayerOps(forward: Op[], perLayer: Op[]): Op[] {
  const last = perLayer.map((_, l) => forward.findLastIndex((o) => o.label.startsWith(`l${l}.`)));
  const missing = last.indexOf(-1);
  if (missing >= 0) throw new Error(`Prefill plan has no op of layer ${missing}`);
  const out: Op[] = [];
  forward.forEach((o, i) => {
    out.push(o);
    last.forEach((at, l) => at === i && out.push(perLayer[l]));
  });
  return out;
}
