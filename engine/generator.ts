/**
 * Text generation on the GPU with a KV cache, for a changing batch of streams (continuous
 * batching): the Generator composes its parts in engine/generate/.
 *
 * - kv_slots.ts: each stream owns a KV-cache slot; the cache grows by doubling as streams
 *   arrive; decode rows are dense, so a finished stream's row is refilled by the last one.
 * - chunk_scheduler.ts: a step queues one chunk (the state remap, the prompts admitted since the
 *   last step prefilled in batches, `steps` decode steps for every row, sampling on the GPU) and
 *   reads every stream's tokens back at once; it can leave the next chunk running while it
 *   returns (`step`'s `ahead`).
 * - prefill_plans.ts: the training graph's forward pass planned for B prompts × a length bucket,
 *   with the KV writes and a gathered LM head over each prompt's last position.
 * - decode_plans.ts over graph/decode_step.ts: one decode step per batch bucket.
 * - gen_buffers.ts: the buffers the plans share, and how a plan is built and compiled.
 */

import { type ModelConfig, paramLayout } from "../model/config.ts";
import { type GpuContext, GpuError, isCpuAdapter } from "./device.ts";
import type { Op } from "./ops.ts";
import { LOGPROBS_MAX, PARAM_WORDS, STATE_SLOT, STATE_WORDS } from "./kernels/sample.ts";
import type { GeneratorOptions, SamplingParams, StepTiming, StreamOutput } from "./generate/gen_types.ts";
import { GenBuffers } from "./generate/gen_buffers.ts";
import { KvSlots } from "./generate/kv_slots.ts";
import { type PrefillPlan, PrefillPlans } from "./generate/prefill_plans.ts";
import { DecodePlans } from "./generate/decode_plans.ts";
import { ChunkScheduler } from "./generate/chunk_scheduler.ts";

export type {
  GeneratorOptions,
  SamplingParams,
  StepTiming,
  StreamOutput,
  TokenLogprobs,
} from "./generate/gen_types.ts";
export { isCpuAdapter };

/** What bench/generator_profile.ts times: the plans as they would run now, and their buffers. */
export interface ProfileAccess {
  ctx: GpuContext;
  buffers: GenBuffers;
  /** Rows being decoded, and streams admitted. */
  rows: number;
  streams: number;
  /** The prefill plan of B prompts of bucketed length Tb (built if need be). */
  prefill(B: number, Tb: number): Promise<PrefillPlan>;
  /** The decode step of the rows being decoded. */
  decode(): Promise<Op[]>;
}

/** Generates from one model on one GPU. */
export class Generator {
  readonly config: ModelConfig;
  readonly opts: Required<GeneratorOptions>;
  #buf: GenBuffers;
  #slots: KvSlots;
  #prefill: PrefillPlans;
  #decode: DecodePlans;
  #chunks: ChunkScheduler;

  private constructor(buf: GenBuffers) {
    this.#buf = buf;
    this.config = buf.config;
    this.opts = buf.opts;
    this.#slots = new KvSlots(buf.ctx, buf.config, buf.opts.maxStreams);
    this.#prefill = new PrefillPlans(buf, this.#slots);
    this.#decode = new DecodePlans(buf, this.#slots);
    this.#chunks = new ChunkScheduler(buf, this.#slots, this.#prefill, this.#decode);
  }

  /** Bytes of KV cache per stream slot (all layers, keys and values). */
  static slotBytes(config: ModelConfig): number {
    return 2 * config.n_layer * config.n_positions * config.n_embd * 4;
  }

  /** Uploads `params` (flat layout) and allocates the first cache slots. */
  static async create(
    ctx: GpuContext,
    config: ModelConfig,
    params: Float32Array,
    opts: GeneratorOptions,
  ): Promise<Generator> {
    const layout = paramLayout(config);
    if (params.length !== layout.totalSize) {
      throw new GpuError(
        "Cannot load parameters",
        `${params.length} floats, the model needs ${layout.totalSize}`,
      );
    }
    if (!(opts.maxStreams >= 1 && opts.chunk >= 1)) {
      throw new RangeError("Generator needs at least one stream and a chunk of 1");
    }
    if (config.n_positions * 4 + 256 * 20 > ctx.limits.maxComputeWorkgroupStorageSize) {
      throw new GpuError(
        "Generator",
        `n_positions ${config.n_positions} needs more workgroup memory than the device has`,
      );
    }
    if (opts.lmHead !== undefined && opts.lmHead !== "f32" && opts.lmHead !== "f16") {
      throw new RangeError(`LM head weights "${opts.lmHead}" must be "f32" or "f16"`);
    }
    // A layer's cache must fit one binding: that bounds the streams.
    const perLayerSlot = config.n_positions * config.n_embd * 4;
    const byBinding = Math.floor(ctx.limits.maxStorageBufferBindingSize / perLayerSlot) - 1;
    const maxStreams = Math.max(1, Math.min(opts.maxStreams, byBinding));
    const full = {
      maxStreams,
      chunk: opts.chunk,
      prefillTokens: opts.prefillTokens ?? 2048,
      cpuUniform: opts.cpuUniform ?? true,
      directSampler: opts.directSampler ?? !ctx.hasSubgroups,
      submitEvery: Math.max(1, Math.floor(opts.submitEvery ?? 4)),
      prefillPieces: Math.max(1, Math.floor(opts.prefillPieces ?? (isCpuAdapter(ctx) ? 1 : 6))),
      prerecord: opts.prerecord ?? true,
      lmHead: opts.lmHead ?? "f32",
      onCompile: opts.onCompile ?? (() => {}),
      readback: opts.readback ?? null,
      // The decode kernels' choices, every default here (bench/RESULTS.md, issue 38): the residual
      // reduces left to the next gemv in one-row steps (1.08x at one stream on the H200, every run
      // above the default's; no gain at 2 or 16 rows), the sampler's loops as they were.
      kernels: { residualRows: 1, writtenSampler: false, ...opts.kernels },
    };
    const g = new Generator(await GenBuffers.create(ctx, config, params, full));
    await g.#grow(Math.min(maxStreams, 4));
    return g;
  }

  /**
   * Gets ready for every request the engine can take, so none stalls later: compiles the decode
   * kernels of every batch bucket up to `rows` rows (1, 2, 4 …; all by default) and, with
   * `prefill` (default true), the kernels of every prefill shape a step can meet (prefillShapes).
   * With `reserve`, the KV cache first grows to `rows` streams (halving while the device is out of
   * memory), so a burst of streams later neither allocates and copies the cache nor rebinds the
   * plans. With `rehearse`, every prefill shape and decode bucket then runs once on throwaway
   * streams: a plan's first run pays for its staging buffers and the driver's first launch
   * of each kernel. Pipeline creation blocks the thread (about 85 ms a pipeline on an H200 with
   * an empty driver cache, 10 ms with a warm one), so this belongs at load. Returns the ms it took.
   */
  async warm(
    opts: { rows?: number; prefill?: boolean; reserve?: boolean; rehearse?: boolean } = {},
  ): Promise<number> {
    const t0 = performance.now(), top = Math.min(opts.rows ?? this.opts.maxStreams, this.opts.maxStreams);
    if (opts.reserve) await this.#reserve(top);
    await this.#decode.remap();
    for (let b = 1;; b *= 2) {
      await this.#decode.plan(Math.min(b, top));
      if (b >= top) break;
    }
    const prefill = opts.prefill ?? true;
    if (prefill) { for (const [B, Tb] of this.prefillShapes()) await this.#prefill.plan(B, Tb); }
    if (opts.rehearse && this.streams === 0) await this.#rehearse(top, prefill);
    return performance.now() - t0;
  }

  /** Grows the KV cache to `streams` slots, or to the most (a power of 2) the device has memory for. */
  async #reserve(streams: number): Promise<void> {
    for (let cap = streams; cap > this.#slots.cap; cap = Math.floor(cap / 2)) {
      try {
        await this.#grow(cap);
        return;
      } catch (e) {
        // Out of memory (or past maxBufferSize): a smaller cache, or growth by need.
        if (!(e instanceof GpuError)) throw e;
      }
    }
  }

  /** Runs each prefill shape (with `prefill`) and each decode bucket up to `top` rows once, on throwaway greedy streams. */
  async #rehearse(top: number, prefill: boolean): Promise<void> {
    const greedy: SamplingParams = { temperature: 0, top_k: 0, top_p: 1, seed: 0 };
    const run = async (prompts: number, len: number, steps: number) => {
      const hs: number[] = [];
      const prompt = new Uint32Array(Math.min(len, this.config.n_positions - 1));
      for (let i = 0; i < prompts; i++) hs.push(await this.admit(prompt, greedy, steps + 1));
      await this.step(0);
      if (steps > 0) await this.step(steps);
      for (const h of hs) this.release(h);
    };
    if (prefill) { for (const [B, Tb] of this.prefillShapes()) await run(B, Tb, 0); }
    for (let b = 1;; b *= 2) {
      await run(Math.min(b, top), 1, 1);
      if (b >= top) break;
    }
  }

  /**
   * Every prefill shape [prompts per batch (a power of 2), bucketed prompt length] a step can
   * meet: batches of up to PREFILL_ROWS prompts within the prefill token budget, or one prompt
   * of any length.
   */
  prefillShapes(): Array<[number, number]> {
    return this.#prefill.shapes();
  }

  /** Distinct kernels compiled so far. */
  get kernels(): number {
    return this.#buf.cache.size;
  }

  /** Streams admitted and not released (prefilled or pending). */
  get streams(): number {
    return this.#slots.streams;
  }

  /** Streams that can still be admitted. */
  get free(): number {
    return this.opts.maxStreams - this.streams;
  }

  /** Stream slots the KV cache holds now (it grows by need). */
  get capacity(): number {
    return this.#slots.cap;
  }

  /** Tokens stream `handle` may still be handed out (its maxTokens less those handed out; 0 if unknown). */
  remaining(handle: number): number {
    const known = this.#slots.rows.includes(handle) || this.#slots.pending.some((p) => p.slot === handle);
    return known ? this.#slots.budget[handle] : 0;
  }

  /** Where the last `step` spent its time. */
  get timing(): StepTiming {
    return this.#chunks.timing;
  }

  /** Grows the KV cache to `cap` stream slots; the plans bind the cache, so they are bound anew. */
  async #grow(cap: number): Promise<void> {
    if (cap <= this.#slots.cap) return;
    await this.#slots.grow(cap);
    this.#decode.clear();
    this.#prefill.unbind();
  }

  /**
   * Admits a stream on `prompt` (1 … n_positions−1 tokens): it is prefilled, and its first token
   * sampled, at the next `step`. `maxTokens`, when given, is the most tokens the stream is handed
   * out (the generator counts them: see `remaining` and StreamOutput.left), and it does not run
   * ahead past it. Returns its handle. Throws RangeError when no slot is free.
   */
  async admit(prompt: ArrayLike<number>, sampling: SamplingParams, maxTokens = Infinity): Promise<number> {
    const c = this.config, len = prompt.length;
    if (len < 1 || len >= c.n_positions) {
      throw new RangeError(`Prompt of ${len} tokens must have 1 to ${c.n_positions - 1} tokens`);
    }
    const tokens = new Uint32Array(len);
    for (let i = 0; i < len; i++) {
      const t = prompt[i];
      if (!(Number.isInteger(t) && t >= 0 && t < c.vocab_size)) {
        throw new RangeError(`Prompt token ${t} at ${i} is outside the vocabulary`);
      }
      tokens[i] = t;
    }
    const lp = sampling.logprobs;
    if (lp !== undefined && !(Number.isInteger(lp) && lp >= 0 && lp <= LOGPROBS_MAX)) {
      throw new RangeError(`Logprobs ${lp} must be 0 to ${LOGPROBS_MAX}`);
    }
    if (!(maxTokens >= 1)) throw new RangeError(`maxTokens ${maxTokens} must be at least 1`);
    if (this.free <= 0) throw new RangeError(`All ${this.opts.maxStreams} stream slots are in use`);
    await this.#chunks.flush(); // its steps are bound to the cache a growth replaces
    if (!this.#slots.hasFree) await this.#grow(Math.min(this.opts.maxStreams, this.#slots.cap * 2));
    const slot = this.#slots.take(maxTokens);
    const state = new Uint32Array(STATE_WORDS);
    state.set([tokens[len - 1], len - 1, sampling.seed >>> 0, 0]);
    state[STATE_SLOT] = slot;
    const params = new Uint32Array(PARAM_WORDS), pf = new Float32Array(params.buffer);
    pf[0] = sampling.temperature;
    params[1] = sampling.top_k >>> 0;
    pf[2] = sampling.top_p;
    params[3] = lp === undefined ? 0 : lp + 1;
    this.#slots.pending.push({ slot, prompt: tokens, state, params });
    return slot;
  }

  /**
   * Ends stream `handle`: its row is refilled by the last row and its slot freed. Tokens of a
   * chunk still running for it are dropped.
   */
  release(handle: number): void {
    if (this.#slots.release(handle)) this.#chunks.dropAhead();
  }

  /**
   * Prefills the streams admitted since the last step, runs `steps` decode steps for every stream,
   * and returns what each produced since the last step: a new stream's first token, then one
   * token per step, up to its maxTokens in all. `steps` + 1 (when prompts are pending) must not
   * exceed the chunk.
   *
   * `ahead` > 0 runs ahead: once the GPU has finished the work read back here, a further chunk of
   * up to `ahead` steps for the same streams is queued before this call returns, so the GPU keeps
   * decoding while the readback settles (Deno resolves a mapAsync about 10 ms after the GPU is
   * done) and while the caller handles the tokens; when the chunks were read through the canvas
   * path, that chunk is queued by `runAhead` instead, once the caller has handed the tokens out. The next call then returns that chunk's
   * tokens, without queueing its own `steps` unless prompts are pending. A stream released in
   * between just loses the tokens of the chunk that ran ahead for it. Only the first
   * `submitEvery` steps of that chunk are queued at once; the rest follow a piece at a time from
   * a timer while the readback settles and the caller handles the tokens, and whatever is left
   * when the generator is next used is queued then.
   */
  async step(steps: number, ahead = 0): Promise<Map<number, StreamOutput>> {
    const chunk = this.opts.chunk;
    if (!(Number.isInteger(steps) && steps >= 0 && steps + (this.#slots.pending.length ? 1 : 0) <= chunk)) {
      throw new RangeError(`Step of ${steps} decode steps exceeds the chunk of ${chunk} tokens`);
    }
    if (!(Number.isInteger(ahead) && ahead >= 0 && ahead <= chunk)) {
      throw new RangeError(`Running ahead ${ahead} steps must be 0 to the chunk of ${chunk} tokens`);
    }
    return await this.#chunks.step(this.#slots.pending.splice(0), steps, ahead);
  }

  /**
   * Queues the chunk of decode steps the last `step` was asked to run ahead, when that step read
   * its tokens through the canvas path: there the chunk is not encoded before `step` returns, so
   * the tokens are not held behind its encoding. Call it once the tokens are handed out; a chunk
   * still left is queued before the generator's next use anyway. Does nothing otherwise.
   */
  async runAhead(): Promise<void> {
    await this.#chunks.runAhead();
  }

  /**
   * For benchmarks (bench/generator_profile.ts): queues what was left to run ahead, then hands out
   * the plans as they would run now and their buffers, to be timed kernel by kernel.
   */
  async forProfiling(): Promise<ProfileAccess> {
    await this.#chunks.flush();
    const rows = this.#slots.rows.length;
    return {
      ctx: this.#buf.ctx,
      buffers: this.#buf,
      rows,
      streams: this.streams,
      prefill: (B, Tb) => this.#prefill.plan(B, Tb),
      decode: () => this.#decode.plan(this.#decode.bucket(rows)),
    };
  }

  /** Frees the GPU buffers. */
  destroy(): void {
    this.#chunks.dropAhead();
    this.#prefill.destroy();
    this.#buf.destroy();
    this.#slots.destroy();
  }
}
