/**
 * The generator's GPU buffers apart from the KV cache (kv_slots.ts), and how its plans are built
 * over them: the parameters, each row's state and sampling, the tokens and logprobs a chunk
 * writes, the prefill's selection, the decode activations (sized for every row at once), on CPU
 * adapters the weights copied for their kernels, and with `lmHead` "f16" wte rounded to f16 for
 * the decode LM head. Every plan's ops are deferred into one batch and compiled together
 * (`inBatch`).
 */

import { type ModelConfig, paramLayout } from "../../model/config.ts";
import { createStorage, type GpuContext, isCpuAdapter } from "../device.ts";
import { makeOp, type Op, type OpBatch, type OpKind, PipelineCache, type View } from "../ops.ts";
import { REMAP_WORDS, SEL_WORDS } from "../kernels/decode.ts";
import { LP_WORDS, PARAM_WORDS, STATE_WORDS } from "../kernels/sample.ts";
import {
  GEMV_MAX_ROWS,
  GEMV_TRANSPOSED_COLUMNS,
  GEMV_TRANSPOSED_ROWS,
  gemvKSplit,
  gemvUboBlocks,
  gemvUboColumns,
  gemvUboLayerRows,
  packF16,
} from "../kernels/gemv.ts";
import type { DecodeActs, UboHead, UboLayers } from "../graph/decode_step.ts";
import type { GeneratorOptions } from "./gen_types.ts";

/** Prompts per prefill batch at most (the gathered LM head serves up to GEMV_MAX_ROWS rows). */
export const PREFILL_ROWS = GEMV_MAX_ROWS;

type Alloc = (label: string, bytes: number, extraUsage?: number) => Promise<GPUBuffer>;

/** One generator's buffers and plan building (all fields read-only after `create`). */
export class GenBuffers {
  readonly ctx: GpuContext;
  readonly config: ModelConfig;
  readonly opts: Required<GeneratorOptions>;
  readonly cache: PipelineCache;
  /** A CPU adapter (llvmpipe, lavapipe, SwiftShader): kernels without barriers where it matters. */
  readonly cpu: boolean;
  /** The LM head runs CPU adapters' kernels (a CPU adapter, unless `kernels.cpuHead` is false). */
  readonly cpuHead: boolean;
  params!: GPUBuffer;
  /** Each row's state (STATE_WORDS), the copy the state remap reads, and the remap's table. */
  state!: GPUBuffer;
  prevState!: GPUBuffer;
  table!: GPUBuffer;
  sampling!: GPUBuffer;
  out!: GPUBuffer;
  lp!: GPUBuffer;
  sel!: GPUBuffer;
  acts!: DecodeActs;
  /** CPU adapters: wte transposed ([C, Vp]) for the LM head of small batches (see gemvTransposedWgsl). */
  wteT: GPUBuffer | null = null;
  /** With `lmHead` "f16" (not on CPU adapters' head kernels): wte in f16, packed two to a u32 (packF16). */
  wte16: GPUBuffer | null = null;
  /**
   * CPU adapters: wte in uniform blocks for the decode LM head (gemvUboWgsl), each dispatch's
   * first block (one u32 per uniform offset alignment), and the blocks bound per dispatch.
   */
  ubo: UboHead | null = null;
  /** CPU adapters: the layers' weights in uniform slices (gemvUboLayerWgsl) by weight name. */
  uboW: UboLayers | null = null;
  #buffers: GPUBuffer[] = [];
  #layout: ReturnType<typeof paramLayout> | null = null;
  /** The plan being built: its ops are deferred into it and compiled together (see inBatch). */
  #batch: OpBatch | null = null;
  /** The build in progress: builds run one at a time. */
  #building: Promise<unknown> = Promise.resolve();

  private constructor(ctx: GpuContext, config: ModelConfig, opts: Required<GeneratorOptions>) {
    this.ctx = ctx;
    this.config = config;
    this.opts = opts;
    this.cache = new PipelineCache(ctx);
    this.cpu = isCpuAdapter(ctx);
    this.cpuHead = this.cpu && opts.kernels.cpuHead !== false;
  }

  /** Uploads `params` (flat layout, checked by the caller) and allocates every buffer but the KV cache. */
  static async create(
    ctx: GpuContext,
    config: ModelConfig,
    params: Float32Array,
    opts: Required<GeneratorOptions>,
  ): Promise<GenBuffers> {
    const g = new GenBuffers(ctx, config, opts);
    const alloc: Alloc = async (label, bytes, extraUsage = 0) => {
      const b = await createStorage(ctx, label, bytes, extraUsage);
      g.#buffers.push(b);
      return b;
    };
    g.params = await alloc("gen.params", params.byteLength);
    ctx.device.queue.writeBuffer(
      g.params,
      0,
      params.buffer as ArrayBuffer,
      params.byteOffset,
      params.byteLength,
    );
    const rows = opts.maxStreams + 1;
    g.state = await alloc("gen.state", rows * STATE_WORDS * 4);
    g.prevState = await alloc("gen.prev_state", rows * STATE_WORDS * 4);
    g.table = await alloc("gen.remap", rows * REMAP_WORDS * 4);
    g.sampling = await alloc("gen.sampling", rows * PARAM_WORDS * 4);
    g.out = await alloc("gen.out", rows * opts.chunk * 4);
    g.lp = await alloc("gen.lp", rows * opts.chunk * LP_WORDS * 4);
    g.sel = await alloc("gen.sel", PREFILL_ROWS * SEL_WORDS * 4);
    if (g.cpu) await g.#cpuWeights(params, alloc);
    if (opts.lmHead === "f16" && !g.cpuHead) {
      const wte = paramLayout(config).byName.get("wte.weight")!;
      const half = packF16(params, wte.offset, wte.size);
      g.wte16 = await alloc("gen.wte16", half.byteLength);
      ctx.device.queue.writeBuffer(g.wte16, 0, half);
    }
    await g.#allocActs(alloc);
    return g;
  }

  /**
   * CPU adapters: for the LM head's CPU kernels wte transposed, and (with cpuUniform) wte in
   * uniform blocks; with cpuUniform the layers' weights in uniform slices.
   */
  async #cpuWeights(params: Float32Array, alloc: Alloc): Promise<void> {
    const { ctx, config } = this, layout = paramLayout(config);
    const C = config.n_embd, Vp = config.padded_vocab_size;
    if (!(C * GEMV_TRANSPOSED_ROWS <= 8192 && Vp % GEMV_TRANSPOSED_COLUMNS === 0)) return;
    if (this.cpuHead) await this.#cpuHeadWeights(params, layout, alloc);
    if (this.opts.cpuUniform) this.uboW = await uboLayerWeights(ctx, config, params, layout, alloc);
  }

  /** wte transposed (gemvTransposedWgsl) and, with cpuUniform, in uniform blocks (gemvUboWgsl). */
  async #cpuHeadWeights(
    params: Float32Array,
    layout: ReturnType<typeof paramLayout>,
    alloc: Alloc,
  ): Promise<void> {
    const { ctx, config } = this, C = config.n_embd, Vp = config.padded_vocab_size;
    const wte = layout.byName.get("wte.weight")!, t = new Float32Array(C * Vp);
    for (let v = 0; v < Vp; v++) {
      const row = wte.offset + v * C;
      for (let k = 0; k < C; k++) t[k * Vp + v] = params[row + k];
    }
    this.wteT = await alloc("gen.wte_t", t.byteLength);
    ctx.device.queue.writeBuffer(this.wteT, 0, t);
    // At most 8 blocks per dispatch: each is one more case of the kernel's switch to compile.
    const BC = gemvUboColumns(C), NB = Math.min(8, ctx.device.limits.maxUniformBuffersPerShaderStage - 2);
    const uniform = this.opts.cpuUniform;
    if (uniform && BC > 0 && NB >= 1) {
      const blocks = gemvUboBlocks(params, wte.offset, Vp, C, BC), count = Math.ceil(Vp / BC);
      const align = ctx.device.limits.minUniformBufferOffsetAlignment, dispatches = Math.ceil(count / NB);
      const base = new Uint32Array((dispatches * align) / 4);
      for (let d = 0; d < dispatches; d++) base[(d * align) / 4] = d * NB;
      const wb = await alloc("gen.wte_ubo", blocks.byteLength, GPUBufferUsage.UNIFORM);
      const bb = await alloc("gen.lm_base", base.byteLength, GPUBufferUsage.UNIFORM);
      ctx.device.queue.writeBuffer(wb, 0, blocks);
      ctx.device.queue.writeBuffer(bb, 0, base);
      this.ubo = { blocks: wb, base: bb, align, BC, NB, count };
    }
  }

  /** The decode activations, one row per stream (and the spare row), and the LM head's logits. */
  async #allocActs(alloc: Alloc): Promise<void> {
    const C = this.config.n_embd, Vp = this.config.padded_vocab_size, rows = this.opts.maxStreams + 1;
    const f = (label: string, n: number, extraUsage = 0) => alloc(label, Math.max(16, n * 4), extraUsage);
    // The layers' inputs are bound as uniform ranges where their weights are (gemvUboLayerWgsl),
    // the LM head's input where wte is (gemvUboWgsl).
    const layerIn = this.uboW ? GPUBufferUsage.UNIFORM : 0;
    const shapes = [[3 * C, C], [C, C], [4 * C, C], [C, 4 * C]];
    const R = this.opts.maxStreams; // the largest decode bucket
    this.acts = {
      x: await f("gen.x", rows * C, layerIn),
      x2: await f("gen.x2", rows * C, layerIn),
      ln: await f("gen.ln", rows * C, this.ubo ? GPUBufferUsage.UNIFORM : 0),
      stats: await f("gen.stats", rows * 2),
      y: await f("gen.y", rows * C, layerIn),
      fch: await f("gen.fch", rows * 4 * C),
      fcg: await f("gen.fcg", rows * 4 * C, layerIn),
      logits: await f("gen.logits", Math.max(rows, PREFILL_ROWS) * Vp),
      part: await f(
        "gen.part",
        Math.max(
          ...[...Array(R).keys()].flatMap((m) =>
            shapes.map(([n, k]) => gemvKSplit(n, k, m + 1) * (m + 1) * n)
          ),
        ),
      ),
      fcPart: await f(
        "gen.fc_part",
        Math.max(...[...Array(R).keys()].map((m) => gemvKSplit(4 * C, C, m + 1) * (m + 1) * 4 * C)),
      ),
      // Only decode buckets of up to kernels.residualRows rows use it (residualFused).
      qkvPart: await f(
        "gen.qkv_part",
        Math.max(
          0,
          ...[...Array(Math.min(R, this.opts.kernels.residualRows ?? 0)).keys()].map((m) =>
            gemvKSplit(3 * C, C, m + 1) * (m + 1) * 3 * C
          ),
        ),
      ),
    };
  }

  /** One op of the plan being built (deferred into its batch), or compiled now outside a build. */
  async op(
    kind: OpKind,
    label: string,
    code: string,
    views: View[],
    grid: [number, number, number] | [number, number] | [number],
  ): Promise<Op> {
    if (this.#batch) return this.#batch.defer(code, { label, phase: "forward", kind, views, grid });
    return makeOp(this.ctx, await this.cache.get(label, code), {
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
  async inBatch<T>(build: () => Promise<T>, keep?: (out: T) => void): Promise<T> {
    const before = this.#building;
    let done!: () => void;
    this.#building = new Promise<void>((r) => done = r);
    await before;
    try {
      const batch = this.cache.batch();
      this.#batch = batch;
      let out: T;
      try {
        out = await build();
      } finally {
        this.#batch = null;
      }
      // CPU adapters: each new pipeline dispatched once on scratch buffers, since llvmpipe compiles
      // at the first dispatch (the first token waited minutes for it through OpenGL).
      await batch.compile(this.opts.onCompile, this.cpu ? "scratch" : false);
      keep?.(out);
      return out;
    } finally {
      done();
    }
  }

  /** The parameter tensor `name` in the parameter buffer. */
  P(name: string): View {
    this.#layout ??= paramLayout(this.config);
    const t = this.#layout.byName.get(name)!;
    return { buffer: this.params, offset: t.offset * 4, size: t.size * 4 };
  }

  destroy(): void {
    for (const b of this.#buffers) b.destroy();
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
  alloc: Alloc,
): Promise<UboLayers | null> {
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
