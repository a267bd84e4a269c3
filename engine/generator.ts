/**
 * Text generation on the GPU with a KV cache, for a changing batch of streams (continuous
 * batching).
 *
 * Each stream owns a KV-cache slot; the cache grows by doubling up to `maxStreams` slots as
 * streams arrive (slot 0 is scratch, written by padding rows). Decode rows are dense: row r's slot
 * is in its state, so a finished stream's row is refilled by the last one and the batch shrinks.
 * A step runs, in one go: the prompts admitted since the last step, prefilled in batches (the
 * training graph planned for B prompts × a length bucket, without gradients; the LM head only on
 * each prompt's last position), each sampling its first token on the GPU; then `steps` decode
 * steps for every row, sampling on the GPU and feeding the token back through the state buffer.
 * One readback returns every stream's tokens (and logprobs when asked). The GPU's state is
 * authoritative: each chunk starts with a remap kernel that moves rows, writes new rows' state
 * and resets the rest, so the CPU never has to read the state back before queueing more work,
 * and a step can leave the next chunk running on the GPU while it returns (`step`'s `ahead`).
 */

import { type ModelConfig, paramLayout } from "../model/config.ts";
import {
  checkDevice,
  createStorage,
  type GpuContext,
  GpuError,
  isCpuAdapter,
  readBuffers,
  stagingFor,
} from "./device.ts";
import {
  type BufferPool,
  buildModel,
  createBufferPool,
  destroyModel,
  type GpuModel,
  type GraphOptions,
} from "./graph/mod.ts";
import type { Readback } from "./readback.ts";
import {
  type CompileListener,
  encodeOps,
  makeOp,
  type Op,
  type OpBatch,
  type OpKind,
  PipelineCache,
  recordOps,
  type View,
} from "./ops.ts";
import { chooseTile, matmulBindings, matmulGrid, type MatmulSpec, matmulWgsl } from "./kernels/matmul.ts";
import { layernormForwardWgsl } from "./kernels/layernorm.ts";
import {
  attentionDecodeWgsl,
  type DecodeSpec,
  embedDecodeWgsl,
  kvWriteWgsl,
  REMAP_NEW,
  REMAP_WORDS,
  SEL_WORDS,
  stateRemapWgsl,
} from "./kernels/decode.ts";
import {
  LOGPROBS_MAX,
  LP_WORDS,
  PARAM_WORDS,
  sampleWgsl,
  STATE_SLOT,
  STATE_WORDS,
} from "./kernels/sample.ts";
import {
  chooseKSplit,
  GEMV_MAX_ROWS,
  GEMV_TRANSPOSED_COLUMNS,
  GEMV_TRANSPOSED_ROWS,
  type GemvEpilogue,
  gemvPartialWgsl,
  gemvReduceBindings,
  gemvReduceWgsl,
  gemvRowGroups,
  type GemvSpec,
  gemvTColumns,
  gemvTransposedWgsl,
  gemvTWgsl,
  gemvUboBlocks,
  gemvUboColumns,
  gemvUboLayerRows,
  gemvUboLayerWgsl,
  type GemvUboSpec,
  gemvUboWgsl,
} from "./kernels/gemv.ts";
import { grid1d, UNIFORM_BINDING_BYTES } from "./kernels/common.ts";

/**
 * How to pick tokens. temperature 0 is greedy; top_k 0 and top_p 1 disable those filters.
 * `logprobs` (0 … LOGPROBS_MAX) asks for the chosen token's log-probability and that many top ones.
 */
export interface SamplingParams {
  temperature: number;
  top_k: number;
  top_p: number;
  seed: number;
  logprobs?: number;
}

/** Generator sizing. */
export interface GeneratorOptions {
  /** Most streams decoded together (KV-cache slots, allocated by need). */
  maxStreams: number;
  /** Most tokens a stream gets per `step`. */
  chunk: number;
  /** Prompt tokens (padded) per prefill batch; a longer prompt runs alone. Default 2048. */
  prefillTokens?: number;
  /**
   * CPU adapters: read the decode weights through uniform buffers (gemvUboWgsl, gemvUboLayerWgsl;
   * default true). false keeps the storage-buffer kernels that GPUs run (tests cover both).
   */
  cpuUniform?: boolean;
  /**
   * CPU adapters: sample with the one-invocation kernel, which has no barriers (sampleDirectWgsl).
   * Default: where the adapter has no subgroups, i.e. Mesa's OpenGL llvmpipe, which compiles the
   * workgroup kernel's barriers for minutes (the direct one in about 20 s); Mesa's Vulkan lavapipe
   * compiles the workgroup kernel in about a second.
   */
  directSampler?: boolean;
  /**
   * Decode steps per queue submission within a step (default 4): the GPU starts on the first
   * steps while the rest are still being encoded.
   */
  submitEvery?: number;
  /**
   * Queue submissions a prefill batch is cut into: with more than one, the GPU starts on the first
   * layers while the later ones are still being encoded. Default 6 on GPUs (H200, 124M, a lone
   * 32-token prompt: 3.38 ms from step to its first token in one submission, 2.68 in 6), 1 on CPU
   * adapters (lavapipe runs each submission as it comes: 21 ms in one, 36 in 6).
   */
  prefillPieces?: number;
  /**
   * Record a lone stream's next chunk while the GPU still runs the one being read, and only submit
   * it once the tokens are handed out (`runAhead`), so the GPU does not idle through its encoding:
   * wgpu's `finish` of 4 decode steps took 1.2-2.3 ms of the H200 host's CPU, `submit` 0.1. Only
   * when the chunk being read is at least as long (its GPU time covers the recording). Default true.
   */
  prerecord?: boolean;
  /** Hears of each kernel compiled, with the total of the plan being built (see OpBatch.compile). */
  onCompile?: CompileListener;
  /**
   * Reads the chunks of a lone stream back through this reader's canvas path where it serves their
   * size (engine/readback.ts: well under a millisecond for a chunk's few KB, against mapAsync's 10 ms
   * floor); null or absent, or several streams: mapAsync.
   */
  readback?: Readback | null;
  /**
   * Kernel choices of the prefill plans (see BuildOptions.kernels), for tests and benchmarks:
   * e.g. the GPUs' tiled kernels on a CPU adapter, or other matmul tile rules.
   */
  kernels?: { tileRules?: NonNullable<GraphOptions["kernels"]>["tileRules"]; cpuDirect?: boolean };
}

/** Where the last `step` spent its time (wall-clock ms on the JS thread). */
export interface StepTiming {
  /** Encoding and submitting the decode steps (the prefill excluded). */
  encodeMs: number;
  /** From the last submission until the readback arrived. */
  waitMs: number;
  /** Of which issuing the readback's mapAsync (it blocks until the GPU has run all queued work). */
  mapMs: number;
  /** Decode steps run. */
  steps: number;
  /**
   * Whether the readback waited for the GPU on this thread (the canvas path): the event loop did
   * not run meanwhile, so messages from other threads have not been taken in.
   */
  blocked: boolean;
}

/** Log-probabilities of one generated token (natural log, the model's raw distribution). */
export interface TokenLogprobs {
  logprob: number;
  /** The most likely tokens, best first. */
  top: { id: number; logprob: number }[];
}

/** What one stream produced in a step. */
export interface StreamOutput {
  tokens: number[];
  /** One entry per token when the stream asked for logprobs, else null. */
  logprobs: TokenLogprobs[] | null;
}

const BUCKETS = [32, 64, 128, 256, 512, 1024, 2048, 4096];
/** Prompts per prefill batch at most (the gathered LM head serves up to GEMV_MAX_ROWS rows). */
const PREFILL_ROWS = GEMV_MAX_ROWS;

interface Pending {
  slot: number;
  prompt: Uint32Array;
  state: Uint32Array;
  params: Uint32Array;
}

/** A chunk queued on the GPU whose results are not read yet. */
interface Chunk {
  /** What it produced: the rows' state, their tokens, and their logprobs when any row asked. */
  staging: GPUBuffer;
  /** Byte offsets of those three in `staging`. */
  offsets: number[];
  /** The streams of its rows, with their epoch: a stream released since has a newer one. */
  rows: { slot: number; epoch: number }[];
  /** Each row's logprobs + 1 (0: none). */
  nlp: number[];
  wantLp: boolean;
  /** Decode steps it ran. */
  steps: number;
  /** Read back through `GeneratorOptions.readback`'s canvas path (staging is a COPY_SRC buffer). */
  fast: boolean;
}

/** What a chunk reads back, and how (see #chunkOutput). */
interface ChunkOutput {
  staged: ReturnType<typeof stagingFor>;
  nlp: number[];
  wantLp: boolean;
  fast: boolean;
}

/** A chunk of decode steps recorded ahead, to be submitted while the rows are as they were. */
interface Recorded {
  commands: GPUCommandBuffer;
  rows: number[];
  src: number[];
  steps: number;
  out: ChunkOutput;
}

interface PrefillPlan {
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

export { isCpuAdapter };

/** Generates from one model on one GPU. */
export class Generator {
  readonly config: ModelConfig;
  readonly opts: Required<GeneratorOptions>;
  #ctx: GpuContext;
  #cache: PipelineCache;
  /** The plan being built: its ops are deferred into it and compiled together (see #inBatch). */
  #batch: OpBatch | null = null;
  /** The build in progress: builds run one at a time. */
  #building: Promise<unknown> = Promise.resolve();
  #layout: ReturnType<typeof paramLayout> | null = null;
  /** A CPU adapter (llvmpipe, lavapipe, SwiftShader): kernels without barriers where it matters. */
  #cpu: boolean;
  #params: GPUBuffer;
  /** CPU adapters: wte transposed ([C, Vp]) for the LM head of small batches (see gemvTransposedWgsl). */
  #wteT: GPUBuffer | null = null;
  /**
   * CPU adapters: wte in uniform blocks for the decode LM head (gemvUboWgsl), each dispatch's
   * first block (one u32 per uniform offset alignment), and the blocks bound per dispatch.
   */
  #ubo: { blocks: GPUBuffer; base: GPUBuffer; align: number; BC: number; NB: number; count: number } | null =
    null;
  /**
   * CPU adapters: the layers' weights in uniform slices (gemvUboLayerWgsl) by weight name: the
   * slices' and the LayerNorm's ranges in `buffer`, and rows per slice.
   */
  #uboW: {
    buffer: GPUBuffer;
    byWeight: Map<string, { R: number; slices: View[]; ln: View | null }>;
  } | null = null;
  #state: GPUBuffer;
  #sampling: GPUBuffer;
  #out: GPUBuffer;
  #lp: GPUBuffer;
  #sel: GPUBuffer;
  #acts: Record<string, GPUBuffer> = {};
  #kc: GPUBuffer[] = [];
  #vc: GPUBuffer[] = [];
  /** Slots the cache holds for streams (slot 0, scratch, not counted). */
  #cap = 0;
  #buffers: GPUBuffer[] = [];
  #decode = new Map<number, Op[]>();
  /** Where the last `step` spent its time. */
  timing: StepTiming = { encodeMs: 0, waitMs: 0, mapMs: 0, steps: 0, blocked: false };
  #prefills = new Map<string, PrefillPlan>();
  /** The buffers every prefill plan shares (they run one after another in queue order). */
  #prefillPool: BufferPool | null = null;
  /** Row → slot of the streams being decoded. */
  #rows: number[] = [];
  #free: number[] = [];
  #pending: Pending[] = [];
  /** Each row's source row in the GPU's state as the last queued chunk left it (−1: admitted since). */
  #src: number[] = [];
  /** Per slot, bumped when a stream takes or leaves it (chunks still running tell their streams by it). */
  #epochs: Uint32Array;
  /** Per slot, tokens its stream may still be asked for beyond what the queued chunks produce. */
  #left: Float64Array;
  /** Chunks queued and not read back, oldest first. */
  #inflight: Chunk[] = [];
  /**
   * The rest of a chunk run ahead (its later steps and its copy into the staging buffer), queued
   * a piece at a time from a timer (`#schedule`), the remainder by `#flush` when the generator is
   * next used, so a step returns soon after its readback (see `step`).
   */
  #rest: (() => boolean) | null = null;
  /**
   * The chunk a step read through the canvas path is to run ahead (its `ahead` and whether it
   * admitted), queued by `runAhead` once the caller has handed out the tokens, or before anything
   * else is queued or read.
   */
  #later: { ahead: number; admitted: boolean } | null = null;
  /** That chunk, recorded while the GPU ran the one being read (GeneratorOptions.prerecord). */
  #recorded: Recorded | null = null;
  #timer: ReturnType<typeof setTimeout> | null = null;
  /** The state remap at each chunk's start, its table, and the copy of the state it reads. */
  #remap: Op | null = null;
  #table: GPUBuffer;
  #prevState: GPUBuffer;
  /** CPU copy of the sampling rows (the GPU's are rewritten before every chunk). */
  #paramsCpu: Uint32Array<ArrayBuffer>;

  private constructor(
    ctx: GpuContext,
    config: ModelConfig,
    opts: Required<GeneratorOptions>,
    bufs: Record<"params" | "state" | "prevState" | "table" | "sampling" | "out" | "lp" | "sel", GPUBuffer>,
  ) {
    this.#ctx = ctx;
    this.config = config;
    this.opts = opts;
    this.#cache = new PipelineCache(ctx);
    this.#cpu = isCpuAdapter(ctx);
    this.#params = bufs.params;
    this.#state = bufs.state;
    this.#sampling = bufs.sampling;
    this.#out = bufs.out;
    this.#lp = bufs.lp;
    this.#sel = bufs.sel;
    this.#prevState = bufs.prevState;
    this.#table = bufs.table;
    // One row more than the streams: padding prefill prompts sample into it.
    this.#epochs = new Uint32Array(opts.maxStreams + 1);
    this.#left = new Float64Array(opts.maxStreams + 1);
    this.#paramsCpu = new Uint32Array((opts.maxStreams + 1) * PARAM_WORDS);
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
      onCompile: opts.onCompile ?? (() => {}),
      readback: opts.readback ?? null,
      kernels: opts.kernels ?? {},
    };
    const buffers: GPUBuffer[] = [];
    const alloc = async (label: string, bytes: number, extraUsage = 0) => {
      const b = await createStorage(ctx, label, bytes, extraUsage);
      buffers.push(b);
      return b;
    };
    const p = await alloc("gen.params", params.byteLength);
    ctx.device.queue.writeBuffer(p, 0, params.buffer as ArrayBuffer, params.byteOffset, params.byteLength);
    const rows = maxStreams + 1;
    const g = new Generator(ctx, config, full, {
      params: p,
      state: await alloc("gen.state", rows * STATE_WORDS * 4),
      prevState: await alloc("gen.prev_state", rows * STATE_WORDS * 4),
      table: await alloc("gen.remap", rows * REMAP_WORDS * 4),
      sampling: await alloc("gen.sampling", rows * PARAM_WORDS * 4),
      out: await alloc("gen.out", rows * opts.chunk * 4),
      lp: await alloc("gen.lp", rows * opts.chunk * LP_WORDS * 4),
      sel: await alloc("gen.sel", PREFILL_ROWS * SEL_WORDS * 4),
    });
    g.#buffers = buffers;
    const C = config.n_embd, Vp = config.padded_vocab_size;
    if (g.#cpu && C * GEMV_TRANSPOSED_ROWS <= 8192 && Vp % GEMV_TRANSPOSED_COLUMNS === 0) {
      const wte = layout.byName.get("wte.weight")!, t = new Float32Array(C * Vp);
      for (let v = 0; v < Vp; v++) {
        const row = wte.offset + v * C;
        for (let k = 0; k < C; k++) t[k * Vp + v] = params[row + k];
      }
      g.#wteT = await alloc("gen.wte_t", t.byteLength);
      ctx.device.queue.writeBuffer(g.#wteT, 0, t);
      // At most 8 blocks per dispatch: each is one more case of the kernel's switch to compile.
      const BC = gemvUboColumns(C), NB = Math.min(8, ctx.device.limits.maxUniformBuffersPerShaderStage - 2);
      const uniform = opts.cpuUniform !== false;
      if (uniform && BC > 0 && NB >= 1) {
        const wte = layout.byName.get("wte.weight")!;
        const blocks = gemvUboBlocks(params, wte.offset, Vp, C, BC), count = Math.ceil(Vp / BC);
        const align = ctx.device.limits.minUniformBufferOffsetAlignment, dispatches = Math.ceil(count / NB);
        const base = new Uint32Array((dispatches * align) / 4);
        for (let d = 0; d < dispatches; d++) base[(d * align) / 4] = d * NB;
        const wb = await alloc("gen.wte_ubo", blocks.byteLength, GPUBufferUsage.UNIFORM);
        const bb = await alloc("gen.lm_base", base.byteLength, GPUBufferUsage.UNIFORM);
        ctx.device.queue.writeBuffer(wb, 0, blocks);
        ctx.device.queue.writeBuffer(bb, 0, base);
        g.#ubo = { blocks: wb, base: bb, align, BC, NB, count };
      }
      if (uniform) g.#uboW = await uboLayerWeights(ctx, config, params, layout, alloc);
    }
    const f = (label: string, n: number, extraUsage = 0) => alloc(label, Math.max(16, n * 4), extraUsage);
    // The layers' inputs are bound as uniform ranges where their weights are (gemvUboLayerWgsl),
    // the LM head's input where wte is (gemvUboWgsl).
    const layerIn = g.#uboW ? GPUBufferUsage.UNIFORM : 0;
    const shapes = [[3 * C, C], [C, C], [4 * C, C], [C, 4 * C]];
    const R = maxStreams; // the largest decode bucket
    g.#acts = {
      x: await f("gen.x", rows * C, layerIn),
      x2: await f("gen.x2", rows * C, layerIn),
      ln: await f("gen.ln", rows * C, g.#ubo ? GPUBufferUsage.UNIFORM : 0),
      stats: await f("gen.stats", rows * 2),
      qkv: await f("gen.qkv", rows * 3 * C),
      y: await f("gen.y", rows * C, layerIn),
      fch: await f("gen.fch", rows * 4 * C),
      fcg: await f("gen.fcg", rows * 4 * C, layerIn),
      logits: await f("gen.logits", Math.max(rows, PREFILL_ROWS) * Vp),
      part: await f(
        "gen.part",
        Math.max(
          ...[...Array(R).keys()].flatMap((m) =>
            shapes.map(([n, k]) => chooseKSplit(n, k, 264, m + 1) * (m + 1) * n)
          ),
        ),
      ),
    };
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
    await this.#remapOp();
    for (let b = 1;; b *= 2) {
      await this.#decodePlan(Math.min(b, top));
      if (b >= top) break;
    }
    const prefill = opts.prefill ?? true;
    if (prefill) { for (const [B, Tb] of this.prefillShapes()) await this.#prefillPlan(B, Tb); }
    if (opts.rehearse && this.streams === 0) await this.#rehearse(top, prefill);
    return performance.now() - t0;
  }

  /** Grows the KV cache to `streams` slots, or to the most (a power of 2) the device has memory for. */
  async #reserve(streams: number): Promise<void> {
    for (let cap = streams; cap > this.#cap; cap = Math.floor(cap / 2)) {
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

  /** The state remap that starts every chunk (see stateRemapWgsl), built once. */
  async #remapOp(): Promise<Op> {
    this.#remap ??= await this.#inBatch(() =>
      this.#op("elementwise", "dec.remap", stateRemapWgsl(), [
        { buffer: this.#prevState },
        { buffer: this.#table },
        { buffer: this.#state },
      ], [Math.ceil((this.opts.maxStreams + 1) / 64)])
    );
    return this.#remap;
  }

  /**
   * Every prefill shape [prompts per batch (a power of 2), bucketed prompt length] a step can
   * meet: batches of up to PREFILL_ROWS prompts within the prefill token budget, or one prompt
   * of any length.
   */
  prefillShapes(): Array<[number, number]> {
    const n = this.config.n_positions;
    const lens = [...new Set(Array.from({ length: n - 1 }, (_, i) => this.#lenBucket(i + 1)))];
    const out: Array<[number, number]> = [];
    for (let B = 1; B <= PREFILL_ROWS; B *= 2) {
      for (const Tb of lens) if (B === 1 || B * Tb <= this.opts.prefillTokens) out.push([B, Tb]);
    }
    return out;
  }

  /** Distinct kernels compiled so far. */
  get kernels(): number {
    return this.#cache.size;
  }

  /** Streams admitted and not released (prefilled or pending). */
  get streams(): number {
    return this.#rows.length + this.#pending.length;
  }

  /** Streams that can still be admitted. */
  get free(): number {
    return this.opts.maxStreams - this.streams;
  }

  /** Stream slots the KV cache holds now (it grows by need). */
  get capacity(): number {
    return this.#cap;
  }

  /** Grows the KV cache to `cap` stream slots (plus scratch), keeping what is cached. */
  async #grow(cap: number): Promise<void> {
    if (cap <= this.#cap) return;
    const c = this.config, bytes = (cap + 1) * c.n_positions * c.n_embd * 4;
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
    if (this.#kc.length) {
      // Slots are outermost in the layout: the old cache is a prefix of the new one.
      const enc = this.#ctx.device.createCommandEncoder();
      for (let l = 0; l < c.n_layer; l++) {
        enc.copyBufferToBuffer(this.#kc[l], 0, kc[l], 0, this.#kc[l].size);
        enc.copyBufferToBuffer(this.#vc[l], 0, vc[l], 0, this.#vc[l].size);
      }
      this.#ctx.device.queue.submit([enc.finish()]);
      for (const b of [...this.#kc, ...this.#vc]) b.destroy();
    }
    this.#kc = kc;
    this.#vc = vc;
    for (let s = cap; s > this.#cap; s--) this.#free.push(s);
    this.#free.sort((a, b) => b - a); // lowest slot first off the end
    this.#cap = cap;
    // Plans bind the cache: rebuild their bindings on next use (pipelines stay compiled).
    this.#decode.clear();
    for (const p of this.#prefills.values()) p.ops = null;
  }

  /**
   * Admits a stream on `prompt` (1 … n_positions−1 tokens): it is prefilled, and its first token
   * sampled, at the next `step`. `maxTokens`, when given, is the most tokens the stream will be
   * asked for: the generator does not run ahead past it. Returns its handle. Throws RangeError
   * when no slot is free.
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
    await this.#flush(); // its steps are bound to the cache a growth replaces
    if (this.#free.length === 0) await this.#grow(Math.min(this.opts.maxStreams, this.#cap * 2));
    const slot = this.#free.pop()!;
    const state = new Uint32Array(STATE_WORDS);
    state.set([tokens[len - 1], len - 1, sampling.seed >>> 0, 0]);
    state[STATE_SLOT] = slot;
    const params = new Uint32Array(PARAM_WORDS), pf = new Float32Array(params.buffer);
    pf[0] = sampling.temperature;
    params[1] = sampling.top_k >>> 0;
    pf[2] = sampling.top_p;
    params[3] = lp === undefined ? 0 : lp + 1;
    this.#epochs[slot]++;
    this.#left[slot] = maxTokens;
    this.#pending.push({ slot, prompt: tokens, state, params });
    return slot;
  }

  /**
   * Ends stream `handle`: its row is refilled by the last row and its slot freed. Tokens of a
   * chunk still running for it are dropped.
   */
  release(handle: number): void {
    const p = this.#pending.findIndex((x) => x.slot === handle);
    if (p >= 0) {
      this.#pending.splice(p, 1);
      this.#epochs[handle]++;
      this.#free.push(handle);
      return;
    }
    const r = this.#rows.indexOf(handle);
    if (r < 0) return;
    const last = this.#rows.length - 1;
    if (r !== last) {
      this.#rows[r] = this.#rows[last];
      this.#src[r] = this.#src[last];
      this.#paramsCpu.copyWithin(r * PARAM_WORDS, last * PARAM_WORDS, (last + 1) * PARAM_WORDS);
    }
    this.#rows.pop();
    this.#src.pop();
    this.#epochs[handle]++;
    this.#free.push(handle);
    if (this.#rows.length === 0) this.#dropAhead();
  }

  /**
   * No stream is left: the rest of a chunk run ahead is not queued, and the chunks still queued
   * are not read (their staging buffers go once the GPU is done with them).
   */
  #dropAhead(): void {
    this.#later = null;
    this.#recorded?.out.staged.buffer.destroy();
    this.#recorded = null;
    this.#takeRest();
    for (const c of this.#inflight.splice(0)) c.staging.destroy();
  }

  /**
   * Prefills the streams admitted since the last step, runs `steps` decode steps for every stream,
   * and returns what each produced since the last step: a new stream's first token, then one
   * token per step. `steps` + 1 (when prompts are pending) must not exceed the chunk.
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
    if (!(Number.isInteger(steps) && steps >= 0 && steps + (this.#pending.length ? 1 : 0) <= chunk)) {
      throw new RangeError(`Step of ${steps} decode steps exceeds the chunk of ${chunk} tokens`);
    }
    if (!(Number.isInteger(ahead) && ahead >= 0 && ahead <= chunk)) {
      throw new RangeError(`Running ahead ${ahead} steps must be 0 to the chunk of ${chunk} tokens`);
    }
    const pending = this.#pending.splice(0);
    await this.#flush();
    for (const p of pending) {
      this.#paramsCpu.set(p.params, this.#rows.length * PARAM_WORDS);
      this.#rows.push(p.slot);
      this.#src.push(-1);
    }
    const t0 = performance.now();
    if (this.#rows.length > 0 && (pending.length > 0 || this.#inflight.length === 0)) {
      await this.#submitChunk(pending, steps);
    }
    const t1 = performance.now();
    const chunks = this.#inflight.splice(0);
    const admitted = pending.length > 0;
    if (chunks.length > 0 && chunks.every((c) => c.fast)) {
      return await this.#stepFast(chunks, ahead, t0, t1, admitted);
    }
    // The first mapAsync blocks until the GPU has run everything queued; the rest find it done.
    const maps = chunks.map((c) => c.fast ? null : c.staging.mapAsync(GPUMapMode.READ));
    const t2 = performance.now();
    if (ahead > 0 && this.#rows.length > 0) {
      const n = Math.min(ahead, Math.max(0, ...this.#rows.map((slot) => this.#left[slot])));
      if (n > 0) await this.#submitChunk([], n, true, admitted);
    }
    const t3 = performance.now();
    const res = new Map<number, StreamOutput>();
    try {
      await Promise.all(maps);
      checkDevice(this.#ctx);
      for (const c of chunks) {
        this.#collect(
          c,
          c.fast ? await this.opts.readback!.read(c.staging) : c.staging.getMappedRange(),
          res,
        );
      }
    } finally {
      for (const c of chunks) c.staging.destroy();
    }
    this.timing = {
      encodeMs: t1 - t0 + (t3 - t2),
      waitMs: performance.now() - t3 + (t2 - t1),
      mapMs: t2 - t1,
      steps: chunks.reduce((a, c) => a + c.steps, 0),
      blocked: chunks.some((c) => c.fast),
    };
    return res;
  }

  /**
   * The end of `step` when its chunks are read through the canvas path, which waits for the GPU on
   * this thread: the chunks are read first and the chunk run ahead is left for `runAhead`, so
   * nothing queued behind the copy delays the read and its encoding does not delay the tokens.
   */
  async #stepFast(
    chunks: Chunk[],
    ahead: number,
    t0: number,
    t1: number,
    admitted: boolean,
  ): Promise<Map<number, StreamOutput>> {
    const res = new Map<number, StreamOutput>();
    const bufs: ArrayBuffer[] = [];
    // The next chunk of a lone stream, recorded while the GPU runs these (GeneratorOptions.prerecord).
    const n = ahead > 0 && !admitted && this.#rows.length > 0 ? this.#aheadSteps(ahead) : 0;
    if (this.opts.prerecord && n > 0 && chunks.reduce((a, c) => a + c.steps, 0) >= n) {
      this.#recorded = this.#record(n);
    }
    const tr = performance.now();
    try {
      for (const c of chunks) bufs.push(await this.opts.readback!.read(c.staging));
    } finally {
      for (const c of chunks) c.staging.destroy();
    }
    const t2 = performance.now();
    // The chunk run ahead is queued by runAhead, once the caller has handed these tokens out.
    if (ahead > 0 && this.#rows.length > 0) this.#later = { ahead, admitted };
    chunks.forEach((c, i) => this.#collect(c, bufs[i], res));
    this.timing = {
      encodeMs: t1 - t0 + (tr - t1),
      waitMs: t2 - tr,
      mapMs: 0,
      steps: chunks.reduce((a, c) => a + c.steps, 0),
      blocked: true,
    };
    return res;
  }

  /**
   * Queues one chunk: the state remap (rows moved, new rows' state, padding rows and the spare row
   * reset), the pending prompts' prefill, `steps` decode steps, and the copy of what the chunk
   * produced into its own staging buffer for a later readback.
   */
  async #submitChunk(pending: Pending[], steps: number, defer = false, afterAdmit = false): Promise<void> {
    const R = this.#rows.length, Rb = this.#bucket(R);
    const dev = this.#ctx.device, q = dev.queue;
    this.#writeRemap(pending);
    const remap = await this.#remapOp();
    const enc = dev.createCommandEncoder();
    enc.copyBufferToBuffer(this.#state, 0, this.#prevState, 0, this.#state.size);
    encodeOps(enc, [remap]);
    q.submit([enc.finish()]);
    this.#src = this.#rows.map((_, r) => r);
    for (const batch of this.#batches(pending)) await this.#submitPrefill(batch);
    const ops = steps > 0 ? await this.#decodePlan(Rb) : [], every = this.opts.submitEvery;
    const out = this.#chunkOutput(R === 1 || pending.length > 0 || afterAdmit);
    let next = 0;
    /** Queues the next `submitEvery` steps in one submission, or the copy once all are; true when done. */
    const piece = (): boolean => {
      const e = dev.createCommandEncoder();
      const done = next >= steps;
      if (done) out.staged.copy(e);
      for (const end = Math.min(steps, next + every); next < end; next++) encodeOps(e, ops);
      q.submit([e.finish()]);
      return done;
    };
    if (defer) {
      piece();
      this.#rest = piece;
      this.#schedule();
    } else while (!piece());
    this.#book(steps, pending, out);
  }

  /**
   * Writes the state remap's table for the rows as they stand (each from its source row, or a new
   * stream's state from `pending`; padding rows and the spare row reset) and the rows' sampling.
   */
  #writeRemap(pending: Pending[]): void {
    const R = this.#rows.length, Rb = this.#bucket(R), N = this.opts.maxStreams + 1;
    const fresh = new Map(pending.map((p) => [p.slot, p.state]));
    const table = new Uint32Array(N * REMAP_WORDS);
    for (let j = 0; j < N; j++) {
      const e = j * REMAP_WORDS;
      if (j < R && this.#src[j] >= 0) table[e] = this.#src[j];
      else if (j < R) {
        table[e] = REMAP_NEW;
        table.set(fresh.get(this.#rows[j])!, e + STATE_WORDS);
      } // Padding rows and the spare row: greedy, in the scratch slot at position 0.
      else if (j < Rb || j === N - 1) table[e] = REMAP_NEW;
      else table[e] = j;
    }
    this.#paramsCpu.fill(0, R * PARAM_WORDS, Rb * PARAM_WORDS);
    const q = this.#ctx.device.queue;
    q.writeBuffer(this.#table, 0, table);
    q.writeBuffer(this.#sampling, 0, this.#paramsCpu);
  }

  /** What a chunk over the rows as they stand reads back (their state, tokens, logprobs if any asked), and how. */
  #chunkOutput(urgent: boolean): ChunkOutput {
    const R = this.#rows.length, chunk = this.opts.chunk;
    const nlp = this.#rows.map((_, r) => this.#paramsCpu[r * PARAM_WORDS + 3]);
    const wantLp = nlp.some((n) => n > 0);
    const ranges = [
      { buffer: this.#state, bytes: R * STATE_WORDS * 4 },
      { buffer: this.#out, bytes: R * chunk * 4 },
      ...(wantLp ? [{ buffer: this.#lp, bytes: R * chunk * LP_WORDS * 4 }] : []),
    ];
    // Through the canvas: a lone stream's chunks, the chunk that carries admitted prompts' first
    // tokens (requests wait on them) and the short one run ahead of it (so that requests arriving
    // next are not held behind a mapAsync). Otherwise mapAsync, whose chunk run ahead keeps the GPU
    // busier (H200, 124M, 16 streams over HTTP: 2,389 tokens/s with every chunk read through the
    // canvas, 7,338 with mapAsync).
    const fast = urgent && this.opts.readback?.pathFor(ranges.reduce((a, r) => a + r.bytes, 0)) === "canvas";
    const staged = stagingFor(
      this.#ctx,
      ranges,
      fast ? GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST : undefined,
    );
    return { staged, nlp, wantLp, fast };
  }

  /** Books a chunk just queued: the tokens its rows may still be asked for, and the chunk to read. */
  #book(steps: number, pending: Pending[], out: ChunkOutput): void {
    const isNew = new Set(pending.map((p) => p.slot));
    for (const slot of this.#rows) this.#left[slot] -= steps + (isNew.has(slot) ? 1 : 0);
    this.#inflight.push({
      staging: out.staged.buffer,
      offsets: out.staged.offsets,
      rows: this.#rows.map((slot) => ({ slot, epoch: this.#epochs[slot] })),
      nlp: out.nlp,
      wantLp: out.wantLp,
      steps,
      fast: out.fast,
    });
  }

  /**
   * Records (and finishes, without submitting) a chunk of `steps` decode steps for the rows as they
   * stand, with its state remap and its copy for the readback; null when its plans are not built.
   */
  #record(steps: number): Recorded | null {
    const R = this.#rows.length, ops = this.#decode.get(this.#bucket(R));
    if (R === 0 || steps < 1 || !ops || !this.#remap) return null;
    const out = this.#chunkOutput(R === 1);
    const enc = this.#ctx.device.createCommandEncoder();
    enc.copyBufferToBuffer(this.#state, 0, this.#prevState, 0, this.#state.size);
    encodeOps(enc, [this.#remap]);
    for (let i = 0; i < steps; i++) encodeOps(enc, ops);
    out.staged.copy(enc);
    return { commands: enc.finish(), rows: [...this.#rows], src: [...this.#src], steps, out };
  }

  /**
   * Queues one more piece of the chunk run ahead from a timer, so the pieces go to the GPU while
   * `step` awaits its readback and while the caller handles the tokens.
   */
  #schedule(): void {
    this.#timer = setTimeout(() => {
      this.#timer = null;
      if (this.#rest?.()) this.#rest = null;
      else if (this.#rest) this.#schedule();
    }, 0);
  }

  /** The rest of the chunk run ahead, taken from the timer (null when none is left). */
  #takeRest(): (() => boolean) | null {
    if (this.#timer !== null) clearTimeout(this.#timer);
    this.#timer = null;
    const rest = this.#rest;
    this.#rest = null;
    return rest;
  }

  /**
   * Queues the chunk run ahead that the last step left for later (see `runAhead`) and what is left
   * of one queued a piece at a time, if any (before anything else is queued or read).
   */
  async #flush(): Promise<void> {
    await this.#queueLater();
    const rest = this.#takeRest();
    if (rest) { while (!rest()); }
  }

  /** Queues the chunk the last step read through the canvas path is to run ahead, if any. */
  async #queueLater(): Promise<void> {
    const later = this.#later, rec = this.#recorded;
    this.#later = null;
    this.#recorded = null;
    if (!later || this.#rows.length === 0) {
      rec?.out.staged.buffer.destroy();
      return;
    }
    const n = this.#aheadSteps(later.ahead);
    const same = (a: number[], b: number[]) => a.length === b.length && a.every((x, i) => x === b[i]);
    if (rec && rec.steps === n && same(rec.rows, this.#rows) && same(rec.src, this.#src)) {
      // Recorded while the GPU ran the last chunk: only its table and the submission are left.
      this.#writeRemap([]);
      this.#ctx.device.queue.submit([rec.commands]);
      this.#src = this.#rows.map((_, r) => r);
      this.#book(n, [], rec.out);
      return;
    }
    rec?.out.staged.buffer.destroy();
    if (n > 0) await this.#submitChunk([], n, true, later.admitted);
  }

  /** Steps a chunk run ahead gets: `ahead`, but no further than any row may still be asked for. */
  #aheadSteps(ahead: number): number {
    return Math.min(ahead, Math.max(0, ...this.#rows.map((slot) => this.#left[slot])));
  }

  /**
   * Queues the chunk of decode steps the last `step` was asked to run ahead, when that step read
   * its tokens through the canvas path: there the chunk is not encoded before `step` returns, so
   * the tokens are not held behind its encoding. Call it once the tokens are handed out; a chunk
   * still left is queued before the generator's next use anyway. Does nothing otherwise.
   */
  async runAhead(): Promise<void> {
    await this.#queueLater();
  }

  /** Adds what chunk `c` produced (its staging buffer mapped as `buf`) to `res`, for streams still running. */
  #collect(c: Chunk, buf: ArrayBuffer, res: Map<number, StreamOutput>): void {
    const chunk = this.opts.chunk, R = c.rows.length;
    const [stateAt, outAt, lpAt] = c.offsets;
    const state = new Uint32Array(buf, stateAt, R * STATE_WORDS);
    const out = new Uint32Array(buf, outAt, R * chunk);
    const lpf = c.wantLp ? new Float32Array(buf, lpAt, R * chunk * LP_WORDS) : null;
    const lpu = c.wantLp ? new Uint32Array(buf, lpAt, R * chunk * LP_WORDS) : null;
    for (let r = 0; r < R; r++) {
      const { slot, epoch } = c.rows[r];
      if (this.#epochs[slot] !== epoch) continue; // released since
      const n = Math.min(state[r * STATE_WORDS + 3], chunk);
      const tokens = Array.from(out.subarray(r * chunk, r * chunk + n));
      const nlp = c.nlp[r];
      let logprobs: TokenLogprobs[] | null = null;
      if (nlp > 0 && lpf && lpu) {
        logprobs = [];
        for (let i = 0; i < n; i++) {
          const o = (r * chunk + i) * LP_WORDS;
          const top = [];
          for (let k = 0; k < nlp - 1; k++) top.push({ id: lpu[o + 2 + 2 * k], logprob: lpf[o + 3 + 2 * k] });
          logprobs.push({ logprob: lpf[o], top });
        }
      }
      const have = res.get(slot);
      if (!have) res.set(slot, { tokens, logprobs });
      else {
        have.tokens.push(...tokens);
        if (logprobs) have.logprobs = [...(have.logprobs ?? []), ...logprobs];
      }
    }
  }

  /** Frees the GPU buffers. */
  destroy(): void {
    this.#dropAhead();
    for (const { model } of this.#prefills.values()) destroyModel(model);
    this.#prefillPool?.destroy();
    for (const b of [...this.#buffers, ...this.#kc, ...this.#vc]) b.destroy();
  }

  #bucket(rows: number): number {
    let b = 1;
    while (b < rows) b *= 2;
    return Math.min(b, this.opts.maxStreams);
  }

  /** Splits prompts into prefill batches: at most PREFILL_ROWS, B·T within the token budget. */
  #batches(pending: Pending[]): Pending[][] {
    const out: Pending[][] = [];
    let cur: Pending[] = [];
    const cost = (b: Pending[]) =>
      this.#pow2(b.length) * this.#lenBucket(Math.max(...b.map((p) => p.prompt.length)));
    for (const p of pending) {
      const next = [...cur, p];
      if (cur.length > 0 && (next.length > PREFILL_ROWS || cost(next) > this.opts.prefillTokens)) {
        out.push(cur);
        cur = [p];
      } else cur = next;
    }
    if (cur.length) out.push(cur);
    return out;
  }

  #pow2(n: number): number {
    let b = 1;
    while (b < n) b *= 2;
    return b;
  }

  #lenBucket(len: number): number {
    const n = this.config.n_positions;
    return BUCKETS.find((b) => b >= len && b <= n) ?? n;
  }

  /** Writes one prefill batch's tokens and selection, and submits it. */
  async #submitPrefill(batch: Pending[]): Promise<void> {
    const B = this.#pow2(batch.length);
    const Tb = this.#lenBucket(Math.max(...batch.map((p) => p.prompt.length)));
    const plan = await this.#prefillPlan(B, Tb);
    const tokens = new Uint32Array(B * (Tb + 1)), sel = new Uint32Array(PREFILL_ROWS * SEL_WORDS);
    for (let b = 0; b < B; b++) {
      const p = batch[b];
      if (!p) {
        // Padding prompt: no cache rows (length 0), samples into the spare state row.
        sel.set([0, 0, 0, this.opts.maxStreams], b * SEL_WORDS);
        continue;
      }
      const len = p.prompt.length;
      tokens.set(p.prompt, b * (Tb + 1));
      sel.set([b * Tb + len - 1, p.slot, len, this.#rows.indexOf(p.slot)], b * SEL_WORDS);
    }
    const q = this.#ctx.device.queue;
    q.writeBuffer(plan.model.tokens, 0, tokens);
    q.writeBuffer(this.#sel, 0, sel);
    // In pieces (GeneratorOptions.prefillPieces), so the GPU starts while the rest is encoded.
    const ops = plan.ops!, per = Math.ceil(ops.length / Math.min(this.opts.prefillPieces, ops.length));
    for (let i = 0; i < ops.length; i += per) {
      const enc = this.#ctx.device.createCommandEncoder();
      encodeOps(enc, ops.slice(i, i + per));
      q.submit([enc.finish()]);
    }
  }

  async #op(
    kind: OpKind,
    label: string,
    code: string,
    views: View[],
    grid: [number, number, number] | [number, number] | [number],
  ): Promise<Op> {
    if (this.#batch) return this.#batch.defer(code, { label, phase: "forward", kind, views, grid });
    return makeOp(this.#ctx, await this.#cache.get(label, code), {
      label,
      phase: "forward",
      kind,
      views,
      grid,
    });
  }

  /**
   * Builds one plan with its ops deferred into one batch, then compiles them together, reporting
   * progress against the plan's total. Builds run one at a time (a warm-up may overlap a step).
   */
  async #inBatch<T>(build: () => Promise<T>, keep?: (out: T) => void): Promise<T> {
    const before = this.#building;
    let done!: () => void;
    this.#building = new Promise<void>((r) => done = r);
    await before;
    try {
      const batch = this.#cache.batch();
      this.#batch = batch;
      let out: T;
      try {
        out = await build();
      } finally {
        this.#batch = null;
      }
      // CPU adapters: each new pipeline dispatched once on scratch buffers, since llvmpipe compiles
      // at the first dispatch (the first token waited minutes for it through OpenGL).
      await batch.compile(this.opts.onCompile, this.#cpu ? "scratch" : false);
      keep?.(out);
      return out;
    } finally {
      done();
    }
  }

  #P(name: string): View {
    this.#layout ??= paramLayout(this.config);
    const t = this.#layout.byName.get(name)!;
    return { buffer: this.#params, offset: t.offset * 4, size: t.size * 4 };
  }

  /** The LM head over `M` rows of `x` (gathered through sel for a prefill) into the logits. */
  async #lmHead(label: string, M: number, x: GPUBuffer, gather: boolean): Promise<Op> {
    const c = this.config, Vp = c.padded_vocab_size, C = c.n_embd;
    const V = (buffer: GPUBuffer): View => ({ buffer });
    if (this.#wteT && M <= GEMV_TRANSPOSED_ROWS) {
      const s = { M, N: Vp, K: C, gather: gather ? { selStride: SEL_WORDS } : undefined };
      return await this.#op(
        "matmul_fwd",
        label,
        gemvTransposedWgsl(s),
        [V(x), V(this.#wteT), V(this.#acts.logits), ...(gather ? [V(this.#sel)] : [])],
        [Math.ceil(Vp / GEMV_TRANSPOSED_COLUMNS / 64)],
      );
    }
    if (M <= GEMV_MAX_ROWS || this.#cpu) {
      const s = {
        M,
        N: Vp,
        K: C,
        gather: gather ? { selStride: SEL_WORDS } : undefined,
        perThread: this.#cpu,
      };
      return await this.#op(
        "matmul_fwd",
        label,
        gemvTWgsl(s),
        [V(x), this.#P("wte.weight"), V(this.#acts.logits), ...(gather ? [V(this.#sel)] : [])],
        [Math.ceil(Vp / gemvTColumns(s))],
      );
    }
    const s: MatmulSpec = { M, N: Vp, K: C, transA: false, transB: true, bias: false, epilogue: "store" };
    const tile = chooseTile(s, this.#ctx.limits.maxComputeInvocationsPerWorkgroup);
    const views: Record<string, View> = { A: V(x), B: this.#P("wte.weight"), out: V(this.#acts.logits) };
    return await this.#op(
      "matmul_fwd",
      label,
      matmulWgsl(s, tile),
      matmulBindings(s).map((n) => views[n]),
      matmulGrid(s, tile),
    );
  }

  /** The decode LM head through uniform blocks of wte (CPU adapters, see gemvUboWgsl): one op per NB blocks. */
  async #lmHeadUbo(label: string, M: number, x: GPUBuffer): Promise<Op[]> {
    const u = this.#ubo!, C = this.config.n_embd, blockBytes = C * u.BC * 4;
    const s: GemvUboSpec = { M, N: this.config.padded_vocab_size, K: C, BC: u.BC, NB: u.NB };
    const code = gemvUboWgsl(s), ops: Op[] = [];
    for (let d = 0; d * u.NB < u.count; d++) {
      const blocks = [...Array(u.NB).keys()].map((b) => ({
        buffer: u.blocks,
        offset: Math.min(d * u.NB + b, u.count - 1) * blockBytes,
        size: blockBytes,
      }));
      ops.push(
        await this.#op("matmul_fwd", label, code, [
          { buffer: x, offset: 0, size: M * C * 4 },
          { buffer: u.base, offset: d * u.align, size: 16 },
          { buffer: this.#acts.logits },
          ...blocks,
        ], [u.NB]),
      );
    }
    return ops;
  }

  /**
   * The prefill of B prompts of (bucketed) length Tb. Every shape's plan is kept: their buffers
   * come from one pool sized for the largest (#prefillPool), and the layers of a plan share one
   * set of activations (checkpointLayers 1 without training: only the residual stream is kept
   * per layer), so a plan costs its bind groups, not memory.
   */
  async #prefillPlan(B: number, Tb: number): Promise<PrefillPlan> {
    const key = `${B}x${Tb}`;
    let plan = this.#prefills.get(key);
    if (!plan) {
      const opts: GraphOptions = {
        train: false,
        // Up to the final LayerNorm: #prefillTail runs a gathered LM head over the last rows.
        hiddenOnly: true,
        checkpointLayers: 1,
        params: this.#params,
        kernels: { ...this.opts.kernels, cpuMatmul: false },
        cache: this.#cache,
        onCompile: this.opts.onCompile,
      };
      const shape = (B: number, T: number) => ({
        config: this.config,
        B,
        T,
        attnDropout: 0,
        hiddenDropout: 0,
      });
      this.#prefillPool ??= await createBufferPool(
        this.#ctx,
        this.prefillShapes().map(([b, t]) => shape(b, t)),
        opts,
      );
      const model = await buildModel(this.#ctx, shape(B, Tb), { ...opts, pool: this.#prefillPool });
      plan = { model, forward: model.forward, ops: null };
      this.#prefills.set(key, plan);
    }
    if (!plan.ops) {
      const { kv, rest } = await this.#inBatch(() => this.#prefillTail(plan!.model, B, Tb));
      plan.ops = withLayerOps(plan.forward, kv).concat(rest);
    }
    return plan;
  }

  /** A prefill's KV writes into the cache (one per layer), its gathered LM head and its sampling. */
  async #prefillTail(model: GpuModel, B: number, Tb: number): Promise<{ kv: Op[]; rest: Op[] }> {
    const c = this.config, ctx = this.#ctx, kv: Op[] = [], ops: Op[] = [];
    const spec: DecodeSpec = { S: B, H: c.n_head, D: c.n_embd / c.n_head, Tmax: c.n_positions };
    const kvGrid = grid1d(
      Math.ceil((B * Tb * c.n_embd) / 4 / 64),
      ctx.limits.maxComputeWorkgroupsPerDimension,
    );
    for (let l = 0; l < c.n_layer; l++) {
      kv.push(
        await this.#op("attention_fwd", `prefill.l${l}.kv`, kvWriteWgsl(spec, { prefill: { B, Tb } }), [
          { buffer: this.#sel },
          { buffer: model.layers[l].qkv },
          { buffer: this.#kc[l] },
          { buffer: this.#vc[l] },
        ], kvGrid),
      );
    }
    ops.push(await this.#lmHead("prefill.lm_head", B, model.lnf, true));
    const sample = sampleWgsl({
      V: c.vocab_size,
      Vp: c.padded_vocab_size,
      streams: B,
      chunk: this.opts.chunk,
      rows: "prefill",
      maxPos: c.n_positions - 1,
      serialReductions: this.#cpu,
      direct: this.#cpu && this.opts.directSampler,
    });
    ops.push(
      await this.#op("elementwise", "prefill.sample", sample, [
        { buffer: this.#acts.logits },
        { buffer: this.#state },
        { buffer: this.#sampling },
        { buffer: this.#out },
        { buffer: this.#lp },
        { buffer: this.#sel },
      ], [B]),
    );
    return { kv, rest: ops };
  }

  /**
   * For benchmarks: times the prefill of B prompts of bucketed length Tb (its plan built if need
   * be) kernel by kernel, on prompts of zeros, and returns each kernel's GPU time in ms in order.
   * Needs timestamp queries and no stream admitted (it writes the cache's first slots).
   */
  async profilePrefill(B: number, Tb: number): Promise<{ label: string; ms: number }[]> {
    const dev = this.#ctx.device;
    if (!this.#ctx.hasTimestamps) {
      throw new GpuError("profilePrefill", "the adapter has no timestamp queries");
    }
    if (this.streams > 0) throw new RangeError("profilePrefill needs an idle generator");
    await this.#flush();
    const plan = await this.#prefillPlan(B, Tb), ops = plan.ops!;
    const sel = new Uint32Array(PREFILL_ROWS * SEL_WORDS);
    for (let b = 0; b < B; b++) sel.set([b * Tb + Tb - 1, b, Tb, this.opts.maxStreams], b * SEL_WORDS);
    dev.queue.writeBuffer(plan.model.tokens, 0, new Uint32Array(B * (Tb + 1)));
    dev.queue.writeBuffer(this.#sel, 0, sel);
    const qs = dev.createQuerySet({ type: "timestamp", count: 2 * ops.length });
    const resolve = dev.createBuffer({
      size: 16 * ops.length,
      usage: GPUBufferUsage.QUERY_RESOLVE | GPUBufferUsage.COPY_SRC,
    });
    try {
      const enc = dev.createCommandEncoder();
      encodeOps(enc, ops, qs);
      enc.resolveQuerySet(qs, 0, 2 * ops.length, resolve, 0);
      dev.queue.submit([enc.finish()]);
      const [buf] = await readBuffers(this.#ctx, [{ buffer: resolve, bytes: 16 * ops.length }]);
      const t = new BigUint64Array(buf);
      return ops.map((op, i) => ({ label: op.label, ms: Number(t[2 * i + 1] - t[2 * i]) / 1e6 }));
    } finally {
      qs.destroy();
      resolve.destroy();
    }
  }

  /**
   * For benchmarks: times one decode step of the rows now decoding, kernel by kernel (a
   * timestamped pass per kernel), and returns each kernel's GPU time in ms in order. The state is
   * restored after it, so the streams go on as if it had not run (the cache rows it wrote are
   * written again by the next step). Needs timestamp queries and at least one row.
   */
  async profileDecode(): Promise<{ label: string; ms: number }[]> {
    await this.#flush();
    const R = this.#rows.length, dev = this.#ctx.device;
    if (!this.#ctx.hasTimestamps) throw new GpuError("profileDecode", "the adapter has no timestamp queries");
    if (R === 0) throw new RangeError("profileDecode needs a stream being decoded");
    const ops = await this.#decodePlan(this.#bucket(R));
    const qs = dev.createQuerySet({ type: "timestamp", count: 2 * ops.length });
    const resolve = dev.createBuffer({
      size: 16 * ops.length,
      usage: GPUBufferUsage.QUERY_RESOLVE | GPUBufferUsage.COPY_SRC,
    });
    try {
      const enc = dev.createCommandEncoder();
      enc.copyBufferToBuffer(this.#state, 0, this.#prevState, 0, this.#state.size);
      encodeOps(enc, ops, qs);
      enc.copyBufferToBuffer(this.#prevState, 0, this.#state, 0, this.#state.size);
      enc.resolveQuerySet(qs, 0, 2 * ops.length, resolve, 0);
      dev.queue.submit([enc.finish()]);
      const [buf] = await readBuffers(this.#ctx, [{ buffer: resolve, bytes: 16 * ops.length }]);
      const t = new BigUint64Array(buf);
      return ops.map((op, i) => ({ label: op.label, ms: Number(t[2 * i + 1] - t[2 * i]) / 1e6 }));
    } finally {
      qs.destroy();
      resolve.destroy();
    }
  }

  /**
   * For benchmarks: GPU time of `steps` decode steps of the rows now decoding, recorded in one
   * compute pass with a timestamp at its start and end (so the gaps between dispatches count),
   * and the JS time spent encoding them. Like profileDecode, the state is restored after it.
   */
  async profileChunk(
    steps: number,
  ): Promise<{ gpuMs: number; encodeMs: number; finishMs: number; submitMs: number }> {
    await this.#flush();
    const R = this.#rows.length, dev = this.#ctx.device;
    if (!this.#ctx.hasTimestamps) throw new GpuError("profileChunk", "the adapter has no timestamp queries");
    if (R === 0) throw new RangeError("profileChunk needs a stream being decoded");
    const ops = await this.#decodePlan(this.#bucket(R));
    const qs = dev.createQuerySet({ type: "timestamp", count: 2 });
    const resolve = dev.createBuffer({
      size: 16,
      usage: GPUBufferUsage.QUERY_RESOLVE | GPUBufferUsage.COPY_SRC,
    });
    try {
      const t0 = performance.now();
      const enc = dev.createCommandEncoder();
      enc.copyBufferToBuffer(this.#state, 0, this.#prevState, 0, this.#state.size);
      const pass = enc.beginComputePass({
        timestampWrites: { querySet: qs, beginningOfPassWriteIndex: 0, endOfPassWriteIndex: 1 },
      });
      for (let i = 0; i < steps; i++) recordOps(pass, ops);
      pass.end();
      enc.copyBufferToBuffer(this.#prevState, 0, this.#state, 0, this.#state.size);
      enc.resolveQuerySet(qs, 0, 2, resolve, 0);
      const t1 = performance.now();
      const cb = enc.finish();
      const t2 = performance.now();
      dev.queue.submit([cb]);
      const t3 = performance.now();
      const [buf] = await readBuffers(this.#ctx, [{ buffer: resolve, bytes: 16 }]);
      const t = new BigUint64Array(buf);
      return { gpuMs: Number(t[1] - t[0]) / 1e6, encodeMs: t1 - t0, finishMs: t2 - t1, submitMs: t3 - t2 };
    } finally {
      qs.destroy();
      resolve.destroy();
    }
  }

  /** One decode step for S rows: embed, 12 layers of gemv/matmul and attention, LM head, sample. */
  async #decodePlan(S: number): Promise<Op[]> {
    // Listed once compiled, so a step never meets a plan still being built.
    return this.#decode.get(S) ??
      await this.#inBatch(() => this.#buildDecodePlan(S), (ops) => this.#decode.set(S, ops));
  }

  async #buildDecodePlan(S: number): Promise<Op[]> {
    const have = this.#decode.get(S);
    if (have) return have;
    const c = this.config, a = this.#acts;
    const C = c.n_embd, H = c.n_head, D = C / H, L = c.n_layer;
    const spec: DecodeSpec = { S, H, D, Tmax: c.n_positions };
    const V = (buffer: GPUBuffer): View => ({ buffer });
    const P = (n: string) => this.#P(n);
    const op = this.#op.bind(this);
    const base = { transA: false, transB: false, bias: true } as const;
    const C4g = Math.ceil((S * C) / 4 / 64);
    const lnOp = (src: GPUBuffer, w: string, b: string, label: string) =>
      op("layernorm", label, layernormForwardWgsl(C), [V(src), P(w), P(b), V(a.ln), V(a.stats)], [S]);
    /**
     * One linear layer of weight `weight`: on GPUs the skinny gemv (row groups of 8 beyond 8 rows),
     * on CPU adapters the uniform-slice gemv where its weight was copied (gemvUboLayerWgsl); then the
     * reduce kernel. `fuse.ln` names the LayerNorm before it (views.A is then its raw input,
     * normalised in the prologue), `fuse.kv` the layer whose KV cache the qkv output feeds.
     */
    const lin = async (
      label: string,
      s: MatmulSpec,
      weight: string,
      views: Record<string, View>,
      fuse: { ln?: [string, string]; kv?: number } = {},
    ): Promise<Op[]> => {
      const u = this.#uboW?.byWeight.get(weight);
      const ubo = u !== undefined && s.M * s.K * 4 <= UNIFORM_BINDING_BYTES;
      const g: GemvSpec = {
        M: s.M,
        N: s.N,
        K: s.K,
        bias: s.bias,
        epilogue: s.epilogue as GemvEpilogue,
        KS: ubo ? 1 : chooseKSplit(s.N, s.K, 264, s.M),
        ln: !!fuse.ln,
        kv: fuse.kv !== undefined ? { H, D, Tmax: c.n_positions } : undefined,
        // Staging pays from 8 rows (H200: 1.3-1.7x at 16 and 64 rows, 0.75x at one row).
        staged: !this.#cpu && s.M >= 8,
      };
      const all: Record<string, View> = { ...views, B: P(weight), part: V(a.part) };
      if (fuse.kv !== undefined) {
        Object.assign(all, { state: V(this.#state), kc: V(this.#kc[fuse.kv]), vc: V(this.#vc[fuse.kv]) });
      }
      const partial = ubo
        ? await op(
          "matmul_fwd",
          label + ".gemv",
          gemvUboLayerWgsl({ M: s.M, N: s.N, K: s.K, R: u.R, ln: !!fuse.ln }),
          [
            { buffer: views.A.buffer, offset: 0, size: s.M * s.K * 4 },
            V(a.part),
            ...(fuse.ln && u.ln ? [u.ln] : []),
            ...u.slices,
          ],
          [Math.ceil(s.N / 4 / 64)],
        )
        : await op(
          "matmul_fwd",
          label + ".gemv",
          gemvPartialWgsl(g),
          [all.A, all.B, all.part, ...(fuse.ln ? [P(fuse.ln[0]), P(fuse.ln[1])] : [])],
          [Math.ceil(s.N / 128), g.KS, gemvRowGroups(s.M)],
        );
      return [
        partial,
        await op("matmul_fwd", label + ".sum", gemvReduceWgsl(g), gemvReduceBindings(g).map((n) => all[n]), [
          Math.ceil((s.M * s.N) / 4 / 64),
        ]),
      ];
    };
    const ops: Op[] = [];
    ops.push(
      await op("embedding", "dec.embed", embedDecodeWgsl(spec), [
        V(this.#state),
        P("wte.weight"),
        P("wpe.weight"),
        V(a.x),
      ], [C4g]),
    );
    for (let l = 0; l < L; l++) {
      const p = `h.${l}.`;
      ops.push(
        ...await lin(
          `dec.l${l}.qkv`,
          { ...base, M: S, N: 3 * C, K: C, epilogue: "store" },
          p + "attn.c_attn.weight",
          {
            A: V(a.x),
            bias: P(p + "attn.c_attn.bias"),
            out: V(a.qkv),
          },
          { ln: [p + "ln_1.weight", p + "ln_1.bias"], kv: l },
        ),
      );
      ops.push(
        await op("attention_fwd", `dec.l${l}.attn`, attentionDecodeWgsl(spec), [
          V(this.#state),
          V(a.qkv),
          V(this.#kc[l]),
          V(this.#vc[l]),
          V(a.y),
        ], [S, H]),
      );
      ops.push(
        ...await lin(
          `dec.l${l}.proj`,
          { ...base, M: S, N: C, K: C, epilogue: "residual" },
          p + "attn.c_proj.weight",
          {
            A: V(a.y),
            bias: P(p + "attn.c_proj.bias"),
            res: V(a.x),
            out: V(a.x2),
          },
        ),
      );
      ops.push(
        ...await lin(
          `dec.l${l}.fc`,
          { ...base, M: S, N: 4 * C, K: C, epilogue: "gelu" },
          p + "mlp.c_fc.weight",
          {
            A: V(a.x2),
            bias: P(p + "mlp.c_fc.bias"),
            out: V(a.fch),
            out2: V(a.fcg),
          },
          { ln: [p + "ln_2.weight", p + "ln_2.bias"] },
        ),
      );
      ops.push(
        ...await lin(
          `dec.l${l}.fcproj`,
          { ...base, M: S, N: C, K: 4 * C, epilogue: "residual" },
          p + "mlp.c_proj.weight",
          {
            A: V(a.fcg),
            bias: P(p + "mlp.c_proj.bias"),
            res: V(a.x2),
            out: V(a.x),
          },
        ),
      );
    }
    ops.push(await lnOp(a.x, "ln_f.weight", "ln_f.bias", "dec.lnf"));
    if (this.#ubo && S * C * 4 <= UNIFORM_BINDING_BYTES) {
      ops.push(...await this.#lmHeadUbo("dec.lm_head", S, a.ln));
    } else ops.push(await this.#lmHead("dec.lm_head", S, a.ln, false));
    const sample = sampleWgsl({
      V: c.vocab_size,
      Vp: c.padded_vocab_size,
      streams: S,
      chunk: this.opts.chunk,
      rows: "stream",
      maxPos: c.n_positions - 1,
      serialReductions: this.#cpu,
      direct: this.#cpu && this.opts.directSampler,
    });
    ops.push(
      await op("elementwise", "dec.sample", sample, [
        V(a.logits),
        V(this.#state),
        V(this.#sampling),
        V(this.#out),
        V(this.#lp),
      ], [S]),
    );
    return ops;
  }
}

/**
 * CPU adapters: every layer weight [K, N] copied into uniform slices of R rows (and each
 * LayerNorm's weight and bias beside the matrix it feeds) at the device's uniform offset
 * alignment, for gemvUboLayerWgsl; null when some weight needs more slices than a dispatch binds.
 */
async function uboLayerWeights(
  ctx: GpuContext,
  config: ModelConfig,
  params: Float32Array,
  layout: ReturnType<typeof paramLayout>,
  alloc: (label: string, bytes: number, extraUsage?: number) => Promise<GPUBuffer>,
): Promise<
  { buffer: GPUBuffer; byWeight: Map<string, { R: number; slices: View[]; ln: View | null }> } | null
> {
  const C = config.n_embd, align = ctx.device.limits.minUniformBufferOffsetAlignment;
  const maxBindings = ctx.device.limits.maxUniformBuffersPerShaderStage;
  // Every layer matrix [K, N] and the LayerNorm before it, and where (in floats, each at an
  // aligned offset) its slices of R rows and that LayerNorm's weight and bias go.
  type Slice = { at: number; row0: number; rows: number };
  const mats: {
    weight: string;
    K: number;
    N: number;
    R: number;
    slices: Slice[];
    ln: string | null;
    lnAt: number;
  }[] = [];
  let end = 0;
  const place = (floats: number) => {
    const start = end;
    end += Math.ceil((floats * 4) / align) * (align / 4);
    return start;
  };
  for (let l = 0; l < config.n_layer; l++) {
    const p = `h.${l}.`;
    for (
      const [weight, K, N, ln] of [
        [p + "attn.c_attn.weight", C, 3 * C, p + "ln_1"],
        [p + "attn.c_proj.weight", C, C, null],
        [p + "mlp.c_fc.weight", C, 4 * C, p + "ln_2"],
        [p + "mlp.c_proj.weight", 4 * C, C, null],
      ] as const
    ) {
      const R = gemvUboLayerRows(N), S = R > 0 ? Math.ceil(K / R) : Infinity;
      if (S + 1 + (ln ? 1 : 0) > maxBindings) return null;
      const slices: Slice[] = [];
      for (let row0 = 0; row0 < K; row0 += R) {
        const rows = Math.min(R, K - row0);
        slices.push({ at: place(rows * N), row0, rows });
      }
      mats.push({ weight, K, N, R, slices, ln, lnAt: ln ? place(2 * K) : 0 });
    }
  }
  const data = new Float32Array(end);
  const tensor = (name: string) => {
    const t = layout.byName.get(name)!;
    return params.subarray(t.offset, t.offset + t.size);
  };
  for (const m of mats) {
    const w = tensor(m.weight);
    for (const sl of m.slices) data.set(w.subarray(sl.row0 * m.N, (sl.row0 + sl.rows) * m.N), sl.at);
    if (m.ln) {
      data.set(tensor(m.ln + ".weight"), m.lnAt);
      data.set(tensor(m.ln + ".bias"), m.lnAt + m.K);
    }
  }
  const buffer = await alloc("gen.w_ubo", data.byteLength, GPUBufferUsage.UNIFORM);
  ctx.device.queue.writeBuffer(buffer, 0, data);
  const byWeight = new Map(mats.map((m) => [m.weight, {
    R: m.R,
    slices: m.slices.map((sl) => ({ buffer, offset: sl.at * 4, size: sl.rows * m.N * 4 })),
    ln: m.ln ? { buffer, offset: m.lnAt * 4, size: 2 * m.K * 4 } : null,
  }]));
  return { buffer, byWeight };
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
