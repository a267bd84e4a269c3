/**
 * The graph builder: the one record every block of the graph (embedding, layer, head, optimizer)
 * reads while it emits its ops. `createBuilder` checks the shape, plans and allocates every buffer
 * up front (nothing is allocated later), and resolves the buffers, kernel choices and flags the
 * blocks share; the helpers below turn labels into buffers and views and defer an op into the
 * build's batch, so a block reads as a list of kernels, as llm.c's gpt2_forward does.
 */

import { ConfigError, type ParamLayout, validateSeqLen } from "../../model/config.ts";
import { createStorage, type GpuContext, isCpuAdapter } from "../device.ts";
import { type FlatBuffer, flatView } from "../flat.ts";
import {
  actPrefix,
  allocationOrder,
  LAYER_ACTS,
  type LayerActName,
  type ModelPlan,
  planModel,
  type PlannedBuffer,
  RECOMPUTED_ACTS,
  resLabel,
} from "../../model/plan.ts";
import { DROPOUT_SLOT_BYTES, dropoutSite } from "../../model/rng.ts";
import { type Op, type OpBatch, type OpKind, type Phase, PipelineCache, type View } from "../ops.ts";
import {
  type AttentionSpec,
  BACKWARD_Q_TILINGS,
  backwardKVSpec,
  type BackwardTiling,
  chooseAttentionSplit,
  chooseAttentionTiles,
  chooseBackwardTilings,
  chooseFlashForward,
  chooseSplitAttentionTiles,
  type FlashTiles,
  SCATTER_KV_TILINGS,
} from "../kernels/attention.ts";
import {
  chooseDqScoresTile,
  type DqScoresTile,
  scoresPathError,
  scoresScratchBytes,
} from "../kernels/attention_dq.ts";
import { ROW_BLOCK } from "../kernels/layernorm.ts";
import { MATMUL_TILE_RULES, type TileRule } from "../kernels/matmul.ts";
import { grid1d, type StorageDtype } from "../kernels/common.ts";
import type { BufferPool, GraphOptions, LayerActs, ModelShape, Step, Sync } from "./program.ts";

/** Rows [r0, r0 + n) of the LM head's input, the i-th chunk the head and its loss run over. */
export interface Chunk {
  i: number;
  r0: number;
  n: number;
}

/** The sizes of one rank's graph. */
export interface Dims {
  B: number;
  T: number;
  /** B·T rows of every activation. */
  BT: number;
  C: number;
  L: number;
  D: number;
  /** Padded vocabulary of the whole model. */
  Vp: number;
  /** This rank's attention heads (all H without tensor parallelism). */
  Hl: number;
  /** This rank's channels: Hl·D of attention, and 4·Cl MLP columns. */
  Cl: number;
  /** This rank's vocabulary rows of wte and columns of the logits. */
  Vl: number;
  /** Global id of this rank's first vocabulary row. */
  vlo: number;
}

/** The shared state of one build: the plan's buffers, the kernel choices and the batch of ops. */
export interface GraphBuilder {
  ctx: GpuContext;
  shape: ModelShape;
  opts: GraphOptions;
  plan: ModelPlan;
  layout: ParamLayout;
  dims: Dims;
  /** Tensor-parallel place (size 1 without); `on` when the program holds exchanges. */
  tp: { rank: number; size: number; on: boolean };
  /** Gradients, optimizer and backward planned (else forward and loss only). */
  train: boolean;
  microBatches: number;
  dataParallel: number;
  /** Gradient writers add (accumulation over micro-batches) rather than store. */
  accumulate: boolean;
  /** Layers per checkpointed group (0: every layer's activations are stored). */
  groupSize: number;
  nChunks: number;
  chunks: Chunk[];
  batch: OpBatch;
  /** The pipeline cache the batch compiles through (a later batch of the plan uses it too). */
  cache: PipelineCache;
  /** Every buffer of the plan, in allocation order. */
  buffers: GPUBuffer[];
  memoryBytes: number;
  /** CPU adapters: large matmuls read an operand as a uniform buffer (kernels/matmul_ubo.ts). */
  cpuUniform: boolean;
  /** Which tiled matmuls read their sizes from a uniform where they can (GraphOptions.kernels.uniformDims). */
  uniformDims: "weight-gradients" | "all" | "none";
  /** The sizes' uniforms made so far (dimsUniform), by their values. */
  dimsUniforms: Map<string, GPUBuffer>;
  /** CPU adapters: the kernels without barriers (kernels/matmul_direct.ts, direct attention). */
  cpuDirect: boolean;
  /** Weights and activations in f16 (precision "fp16"). */
  fp16: boolean;
  /** fp16: matmuls whose inputs are both f16 multiply in f16 per k-tile (see kernels/matmul.ts). */
  f16Math: boolean;
  params: FlatBuffer;
  /** fp16: the f16 copy of the weights the matmuls read. */
  params16: FlatBuffer | null;
  /** (B, T + 1) token ids: each row's inputs, and shifted by one its targets. */
  tokens: GPUBuffer;
  /** Logged scalars (STAT slots). */
  stats: GPUBuffer;
  control: GPUBuffer;
  dropUniform: GPUBuffer;
  optUniform: GPUBuffer;
  nSites: number;
  /** (B·T, C) residual stream at the input of each layer, and after the last (L + 1 entries). */
  res: GPUBuffer[];
  /** The shared LayerNorm output of a training plan (see plan.ts): ln1 and ln2 of every layer. */
  lnw: GPUBuffer | null;
  /** Per layer, its activations (B·T, ·). */
  acts: LayerActs[];
  /** (B·T, C) final LayerNorm output and its (B·T) statistics. */
  lnf: GPUBuffer;
  lnfs: GPUBuffer;
  /** (headRows, Vl) logits of one chunk (headRows = B·T in one chunk), overwritten by their gradient. */
  logits: GPUBuffer;
  /** (B·T) per-row losses. */
  losses: GPUBuffer;
  hiddenDropout: number;
  attnDropout: number;
  /** Tile rules the matmuls choose from (undefined: all of them). */
  tileRules: readonly TileRule[] | undefined;
  /** Split-K partial sums of the backward weight gradients (one matmul at a time, so shared). */
  matmulPart: GPUBuffer | null;
  attn: AttentionSpec;
  /**
   * The attention backward's dS scratch (B·Hl·T² f32 over the logits buffer, free once the LM
   * head's backward has run): the split dK/dV kernel writes dS there and dQ is a matmul over it
   * (kernels/attention_dq.ts) on `tile`. Null: the dQ kernel recomputes the scores.
   */
  dsScratch: { view: View; tile: DqScoresTile } | null;
  /** The FlashAttention-2 style forward's tiles where the device fits it. */
  flashFwd: FlashTiles | null;
  /** Tensor parallelism: the scratch of row-parallel partial sums (B·T, C). */
  partial: GPUBuffer | null;
  /** Each layer's forward steps, replayed in backward to recompute a checkpointed group. */
  layerSteps: Step[][];
  /** The plan's buffers by label. */
  byLabel: Map<string, GPUBuffer>;
  /** Buffers whose elements are f16 (everything else is f32 or u32). */
  f16Buffers: Set<GPUBuffer>;
}

/**
 * Multiply-adds from which a CPU adapter runs a matmul with kernels/matmul_ubo.ts: the LM head's
 * (the kernel compiles for about a second on llvmpipe, more than the smaller matmuls gain).
 */
export const CPU_MATMUL_MIN_MACS = 1 << 24;

/** Checks that every buffer of the plan fits the device; throws ConfigError naming the field. */
export function checkFits(ctx: GpuContext, shape: ModelShape): void {
  const { config: c, B, T } = shape;
  validateSeqLen(c, T);
  if (!Number.isInteger(B) || B <= 0) {
    throw new ConfigError("batch_size", `must be a positive integer, got ${B}`);
  }
  planModel(ctx.limits, shape);
  const D = c.n_embd / c.n_head;
  const tiles = chooseAttentionTiles({ T, D }, ctx.limits.maxComputeWorkgroupStorageSize);
  if (tiles.BKV < 8) {
    throw new ConfigError("n_embd", `head size ${D} needs more workgroup memory than the device has`);
  }
}

/**
 * Checks the shape and options, plans the model and allocates every buffer of the plan (freed
 * again when a check fails), then resolves what the blocks share into one builder.
 */
export async function createBuilder(
  ctx: GpuContext,
  shape: ModelShape,
  opts: GraphOptions,
): Promise<GraphBuilder> {
  checkFits(ctx, shape);
  const { tpRank, tpSize, micro, ranks } = checkOptions(opts);
  const { config: c, B, T } = shape;
  const C = c.n_embd, L = c.n_layer, H = c.n_head, D = C / H, Vp = c.padded_vocab_size, BT = B * T;
  // This rank's share: attention heads, MLP columns, vocabulary rows (global id of the first: vlo).
  const Vl = Vp / tpSize;
  const dims: Dims = { B, T, BT, C, L, D, Vp, Hl: H / tpSize, Cl: C / tpSize, Vl, vlo: tpRank * Vl };
  const train = opts.train ?? true;
  // The attention backward stores dS for its dQ (one product instead of three) by default where
  // the split kernels run (H200: the 124M step 209.5 -> 204.7 ms, 345M 566.8 -> 554.4).
  opts = { ...opts, attentionScores: opts.attentionScores ?? scoresByDefault(ctx, D) };
  const plan = planModel(ctx.limits, shape, {
    ...opts,
    train,
    sharedParams: !!opts.params,
    tensorParallel: tpSize,
  });
  const { layout, headRows } = plan, groupSize = plan.checkpointLayers;
  const nChunks = Math.ceil(BT / headRows);
  const cache = opts.cache ?? new PipelineCache(ctx), batch = cache.batch();
  // CPU adapters: every buffer can also be bound as a uniform buffer (see kernels/matmul_ubo.ts).
  const cpuUniform = isCpuAdapter(ctx) && opts.kernels?.cpuMatmul !== false;
  const cpuDirect = isCpuAdapter(ctx) && opts.kernels?.cpuDirect !== false;
  if (opts.hiddenOnly && train) {
    throw new RangeError("hiddenOnly plans a forward pass only: it needs train: false");
  }
  const { buffers, byLabel, f16Buffers, memoryBytes } = await allocate(ctx, plan, cpuUniform, opts.pool);
  const buf = (label: string): GPUBuffer => {
    const b = byLabel.get(label);
    if (!b) throw new Error(`Buffer "${label}" is not in the plan`);
    return b;
  };
  const fp16 = plan.precision === "fp16";
  if (fp16 && !ctx.hasF16) {
    for (const b of buffers) b.destroy();
    throw new ConfigError("precision", `"fp16" needs a GPU with shader-f16, which this adapter lacks`);
  }
  const lnw = plan.byLabel.has("lnw") ? buf("lnw") : null;
  const kernels = kernelChoices(ctx, opts, dims, plan, cpuDirect);
  return {
    ctx,
    shape,
    opts,
    plan,
    layout,
    dims,
    tp: { rank: tpRank, size: tpSize, on: tpSize > 1 },
    train,
    microBatches: micro,
    dataParallel: ranks,
    accumulate: micro > 1,
    groupSize,
    nChunks,
    chunks: Array.from({ length: nChunks }, (_, i) => {
      const r0 = i * headRows;
      return { i, r0, n: Math.min(headRows, BT - r0) };
    }),
    batch,
    cache,
    buffers,
    memoryBytes,
    cpuUniform,
    uniformDims: opts.kernels?.uniformDims ?? "weight-gradients",
    dimsUniforms: new Map(),
    cpuDirect,
    fp16,
    f16Math: fp16 && (opts.f16Math ?? true),
    params: opts.params
      ? {
        segments: [{ start: 0, size: layout.totalSize, buffer: opts.params }],
        totalSize: layout.totalSize,
        bytesPerElement: 4,
      }
      : flatOf(plan, buf, "params"),
    params16: fp16 ? { ...flatOf(plan, buf, "params16"), bytesPerElement: 2 } : null,
    tokens: buf("tokens"),
    stats: buf("stats"),
    control: buf("control"),
    dropUniform: buf("dropout"),
    optUniform: buf("optimizer"),
    nSites: dropoutSite.count(L),
    res: Array.from({ length: L + 1 }, (_, l) => buf(resLabel(groupSize, L, l))),
    lnw,
    acts: Array.from({ length: L }, (_, l) => layerActs(buf, lnw, actPrefix(groupSize, l))),
    lnf: buf("lnf"),
    lnfs: buf("lnfs"),
    logits: buf("logits"),
    losses: buf("losses"),
    hiddenDropout: shape.hiddenDropout,
    attnDropout: shape.attnDropout,
    matmulPart: plan.byLabel.has("matmul_part") ? buf("matmul_part") : null,
    ...kernels,
    dsScratch: scoresScratch(ctx, opts, train, kernels.attn, buf("logits")),
    partial: tpSize > 1 ? buf("partial") : null,
    layerSteps: [],
    byLabel,
    f16Buffers,
  };
}

/** The parallel options, checked: tensor-parallel place, micro-batches and data-parallel ranks. */
function checkOptions(opts: GraphOptions): { tpRank: number; tpSize: number; micro: number; ranks: number } {
  const tpSize = opts.tensorParallel?.size ?? 1, tpRank = opts.tensorParallel?.rank ?? 0;
  if (
    !Number.isInteger(tpSize) || tpSize < 1 || !Number.isInteger(tpRank) || tpRank < 0 || tpRank >= tpSize
  ) {
    throw new RangeError(
      `tensorParallel must be {rank, size} with 0 <= rank < size, got ${JSON.stringify(opts.tensorParallel)}`,
    );
  }
  const micro = opts.microBatches ?? 1, ranks = opts.dataParallel ?? 1;
  for (const [field, v] of [["microBatches", micro], ["dataParallel", ranks]] as const) {
    if (!Number.isInteger(v) || v < 1) throw new RangeError(`${field} must be a positive integer, got ${v}`);
  }
  return { tpRank, tpSize, micro, ranks };
}

/**
 * One layer's activations by name (labels `prefix + name`, see plan.ts); ln1 and ln2 are the
 * shared `lnw` where the plan recomputes them.
 */
function layerActs(buf: (label: string) => GPUBuffer, lnw: GPUBuffer | null, prefix: string): LayerActs {
  return Object.fromEntries(
    LAYER_ACTS.map((n) => [n, lnw && RECOMPUTED_ACTS.includes(n) ? lnw : buf(prefix + n)]),
  ) as Record<LayerActName, GPUBuffer>;
}

/** The matmul tile rules and the attention kernels' tiles for this device and options. */
function kernelChoices(
  ctx: GpuContext,
  opts: GraphOptions,
  dims: Dims,
  plan: ModelPlan,
  cpuDirect: boolean,
): Pick<GraphBuilder, "tileRules" | "attn" | "flashFwd"> {
  const ruleSet = opts.kernels?.tileRules ?? "all";
  return {
    tileRules: typeof ruleSet !== "string"
      ? ruleSet
      : ruleSet === "all"
      ? undefined
      : ruleSet === "none"
      ? []
      : MATMUL_TILE_RULES.filter((r) => (r.tile.splitK ?? 1) > 1),
    attn: attentionSpec(
      ctx,
      dims,
      plan.precision === "fp16",
      plan,
      cpuDirect,
      opts.kernels?.attentionBackwardTiles !== false,
      opts.kernels?.attentionUnroll,
      // Both measured faster in the training step on the H200 (bench/RESULTS.md, issue 38, fifth
      // session); they keep every value. The split kernels they change run on GPUs only.
      {
        writtenFills: opts.kernels?.attentionFills ?? true,
        scatterSums: opts.kernels?.attentionScatter ?? true,
      },
    ),
    // FlashAttention-2 style forward where the device fits it (measured 2.1× today's on an H200;
    // its fused backward measured slower, so the backward keeps today's kernels).
    flashFwd: opts.kernels?.flashAttention === false || cpuDirect
      ? null
      : chooseFlashForward({ T: dims.T, D: dims.D }, {
        maxWorkgroupBytes: ctx.limits.maxComputeWorkgroupStorageSize,
        maxThreads: ctx.limits.maxComputeInvocationsPerWorkgroup,
        subgroupMinSize: ctx.subgroupMinSize,
        maxBindingBytes: ctx.limits.maxStorageBufferBindingSize,
      }),
  };
}

/**
 * Every buffer of the plan, allocated up front in the order that packs the allocator's 256 MiB
 * blocks (allocationOrder); the blocks find them by label. Frees them all if one fails. A pool's
 * buffer is used where it has the label and is large enough; it stays the pool's (not in `buffers`).
 */
async function allocate(ctx: GpuContext, plan: ModelPlan, cpuUniform: boolean, pool?: BufferPool) {
  const buffers: GPUBuffer[] = [];
  const byLabel = new Map<string, GPUBuffer>();
  /** Buffers whose elements are f16 (everything else is f32 or u32). */
  const f16Buffers = new Set<GPUBuffer>();
  let memoryBytes = 0;
  try {
    for (const p of allocationOrder(plan.buffers).order) {
      const shared = pool?.byLabel.get(p.label);
      const b = shared && shared.size >= p.bytes ? shared : await allocateOne(ctx, p, cpuUniform);
      if (b !== shared) {
        buffers.push(b);
        memoryBytes += b.size;
      }
      byLabel.set(p.label, b);
      if (p.dtype === "f16") f16Buffers.add(b);
    }
  } catch (e) {
    for (const b of buffers) b.destroy();
    throw e;
  }
  return { buffers, byLabel, f16Buffers, memoryBytes };
}

function allocateOne(ctx: GpuContext, p: PlannedBuffer, cpuUniform: boolean): Promise<GPUBuffer> | GPUBuffer {
  return p.usage === "uniform"
    ? ctx.device.createBuffer({
      label: p.label,
      size: p.bytes,
      usage: GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST,
    })
    : createStorage(ctx, p.label, p.bytes, cpuUniform ? GPUBufferUsage.UNIFORM : 0);
}

/**
 * A pool for plans of several shapes that never run at the same time (generation's prefill
 * shapes): one buffer per label, as large as the largest of that label's planned sizes, so every
 * plan built with it (BuildOptions.pool) takes its buffers from it and allocates none of its own.
 * `shapes` are planned with `opts` (whose `train` must be false). Frees what it made if one fails.
 */
export async function createBufferPool(
  ctx: GpuContext,
  shapes: ModelShape[],
  opts: GraphOptions,
): Promise<BufferPool> {
  if (opts.train !== false) throw new RangeError("A buffer pool serves inference plans (train: false)");
  const cpuUniform = isCpuAdapter(ctx) && opts.kernels?.cpuMatmul !== false;
  const largest = new Map<string, PlannedBuffer>();
  for (const s of shapes) {
    checkFits(ctx, s);
    const plan = planModel(ctx.limits, s, {
      ...opts,
      sharedParams: !!opts.params,
      tensorParallel: opts.tensorParallel?.size ?? 1,
    });
    for (const p of plan.buffers) {
      const have = largest.get(p.label);
      if (!have || p.bytes > have.bytes) largest.set(p.label, p);
    }
  }
  const byLabel = new Map<string, GPUBuffer>();
  let bytes = 0;
  const destroy = () => {
    for (const b of byLabel.values()) b.destroy();
    byLabel.clear();
  };
  try {
    for (const p of allocationOrder([...largest.values()]).order) {
      const b = await allocateOne(ctx, p, cpuUniform);
      byLabel.set(p.label, b);
      bytes += b.size;
    }
  } catch (e) {
    destroy();
    throw e;
  }
  return { byLabel, bytes, destroy };
}

/** Whether a device stores the attention backward's dS by default: GPUs that run the split kernels. */
export function scoresByDefault(ctx: GpuContext, D: number): boolean {
  return !isCpuAdapter(ctx) && chooseAttentionSplit(D, ctx.hasSubgroups) > 1;
}

/**
 * The attention backward's dS scratch (see GraphBuilder.dsScratch): the start of the logits
 * buffer, where the plan sized it for them (PlanOptions.attentionScores) and the split dK/dV
 * kernel runs (not the CPU adapters' kernels), with the first dQ tiling the device fits.
 */
function scoresScratch(
  ctx: GpuContext,
  opts: GraphOptions,
  train: boolean,
  attn: AttentionSpec,
  logits: GPUBuffer,
): GraphBuilder["dsScratch"] {
  if (!train || !opts.attentionScores || scoresPathError(backwardKVSpec(attn)) !== null) return null;
  const tile = chooseDqScoresTile(attn.D, {
    maxWorkgroupBytes: ctx.limits.maxComputeWorkgroupStorageSize,
    maxThreads: ctx.limits.maxComputeInvocationsPerWorkgroup,
  }, opts.kernels?.dqScoresTiles);
  const size = scoresScratchBytes(attn);
  return tile && size <= logits.size ? { view: { buffer: logits, offset: 0, size }, tile } : null;
}

/** Backward tilings with their loops' unroll replaced, where one is given. */
function withUnroll<T extends { bwdKV?: BackwardTiling; bwdQ?: BackwardTiling }>(
  t: T,
  unroll?: 1 | 2 | 4,
): T {
  if (!unroll) return t;
  return {
    ...t,
    ...(t.bwdKV ? { bwdKV: { ...t.bwdKV, unroll } } : {}),
    ...(t.bwdQ ? { bwdQ: { ...t.bwdQ, unroll } } : {}),
  };
}

/** The attention kernels' spec for this rank's heads (tiles for the device, without dropout). */
function attentionSpec(
  ctx: GpuContext,
  dims: Dims,
  fp16: boolean,
  plan: ModelPlan,
  cpuDirect: boolean,
  ownBackwardTiles: boolean,
  unroll?: 1 | 2 | 4,
  { writtenFills, scatterSums }: Pick<AttentionSpec, "writtenFills" | "scatterSums"> = {},
): AttentionSpec {
  const { B, T, Hl, D } = dims;
  const split = chooseAttentionSplit(D, ctx.hasSubgroups);
  const wgBytes = ctx.limits.maxComputeWorkgroupStorageSize;
  return {
    B,
    T,
    H: Hl,
    D,
    split,
    dtype: fp16 ? "f16" : "f32",
    gradDtype: plan.byLabel.get("datty")?.dtype === "f16" ? "f16" : "f32",
    direct: cpuDirect,
    ...(writtenFills ? { writtenFills } : {}),
    ...(scatterSums ? { scatterSums } : {}),
    ...(split > 1 && !cpuDirect && ownBackwardTiles
      ? withUnroll(
        chooseBackwardTilings({ T, D }, {
          maxWorkgroupBytes: wgBytes,
          maxThreads: ctx.limits.maxComputeInvocationsPerWorkgroup,
          subgroupMinSize: ctx.subgroupMinSize,
        }, scatterSums ? { kv: SCATTER_KV_TILINGS, q: BACKWARD_Q_TILINGS } : undefined),
        unroll,
      )
      : {}),
    ...(split > 1
      ? chooseSplitAttentionTiles({ T, D }, wgBytes, split, ctx.limits.maxComputeInvocationsPerWorkgroup)
      : chooseAttentionTiles({ T, D }, wgBytes)),
  };
}

/** A flat array of the plan (one buffer per segment, labelled `label.i` when there are several). */
function flatOf(plan: ModelPlan, buf: (label: string) => GPUBuffer, label: string): FlatBuffer {
  const { segments, layout } = plan;
  return {
    segments: segments.map((r, i) => ({ ...r, buffer: buf(segments.length > 1 ? `${label}.${i}` : label) })),
    totalSize: layout.totalSize,
    bytesPerElement: 4,
  };
}

/** The plan's buffer of this label; throws when the plan has none. */
export function buf(g: GraphBuilder, label: string): GPUBuffer {
  const b = g.byLabel.get(label);
  if (!b) throw new Error(`Buffer "${label}" is not in the plan`);
  return b;
}

/** A flat f32 array of the plan (gradients, moments) by its label. */
export function flat(g: GraphBuilder, label: string): FlatBuffer {
  return flatOf(g.plan, (l) => buf(g, l), label);
}

/** Element type of a planned buffer. */
export function dtypeOf(g: GraphBuilder, b: GPUBuffer): StorageDtype {
  return g.f16Buffers.has(b) ? "f16" : "f32";
}

/** A whole buffer as a binding. */
export function whole(buffer: GPUBuffer): View {
  return { buffer };
}

/** A parameter tensor (f32 master copy) by name. */
export function param(g: GraphBuilder, name: string): View {
  const t = g.layout.byName.get(name);
  if (!t) throw new Error(`Unknown parameter "${name}"`);
  return flatView(g.params, t.offset, t.size);
}

/** A weight as the matmuls read it: the f16 copy with fp16, else the parameters. */
export function weight(g: GraphBuilder, name: string): View {
  if (!g.params16) return param(g, name);
  const t = g.layout.byName.get(name)!;
  return flatView(g.params16, t.offset, t.size);
}

/** Rows [r0, r0 + n) of a (B·T, width) activation. */
export function rowsView(g: GraphBuilder, buffer: GPUBuffer, r0: number, n: number, width: number): View {
  const bpe = dtypeOf(g, buffer) === "f16" ? 2 : 4;
  return { buffer, offset: r0 * width * bpe, size: n * width * bpe };
}

/** Defers one kernel into the build's batch (compiled together at the end of the build). */
export function op(
  g: GraphBuilder,
  phase: Phase,
  kind: OpKind,
  label: string,
  code: string,
  views: View[],
  grid: [number, number, number] | [number, number] | [number],
  o: { uniform?: GPUBuffer | View; flops?: number } = {},
): Op {
  return g.batch.defer(code, { label, phase, kind, views, grid, ...o });
}

/** The exchange summing `count` f32 of `buffer` over the tensor-parallel group. */
export function allreduce(label: string, buffer: GPUBuffer, count: number): Sync {
  return { sync: "allreduce", label, buffer, count };
}

/**
 * The uniform a matmul kernel reading its sizes binds at group 1 (MatmulKernel.dims): one 16-byte
 * buffer per distinct value, made and written once, outside the plan (GpuModel.uniforms), destroyed
 * with the model.
 */
export function dimsUniform(g: GraphBuilder, dims: readonly number[]): GPUBuffer {
  const key = dims.join(",");
  let b = g.dimsUniforms.get(key);
  if (!b) {
    b = g.ctx.device.createBuffer({
      label: `matmul_dims.${key}`,
      size: 16,
      usage: GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST,
    });
    g.ctx.device.queue.writeBuffer(b, 0, new Uint32Array(dims));
    g.dimsUniforms.set(key, b);
  }
  return b;
}

/** A dropout site's slot of the dropout uniform, which an op reading that site binds at group 1. */
export function dropSlot(g: GraphBuilder, site: number): View {
  return { buffer: g.dropUniform, offset: site * DROPOUT_SLOT_BYTES, size: 16 };
}

/** A dropout site's setting for a kernel (undefined when the probability is 0). */
export function drop(g: GraphBuilder, p: number, site: number): { site: number; nSites: number } | undefined {
  return p > 0 ? { site, nSites: g.nSites } : undefined;
}

/** One workgroup per row of the B·T rows. */
export function rowsGrid(g: GraphBuilder): [number, number, number] | [number, number] | [number] {
  return grid1d(g.dims.BT, g.ctx.limits.maxComputeWorkgroupsPerDimension);
}

/** 64-thread workgroups over `n4` vec4 elements. */
export function elemGrid(
  g: GraphBuilder,
  n4: number,
): [number, number, number] | [number, number] | [number] {
  return grid1d(Math.ceil(n4 / 64), g.ctx.limits.maxComputeWorkgroupsPerDimension);
}

/**
 * The training state: gradients, the AdamW moments (null for a distributed-optimizer rank) and the
 * backward scratch, each (B·T, ·) unless noted.
 */
export interface Backprop {
  grads: FlatBuffer;
  adamM: FlatBuffer | null;
  adamV: FlatBuffer | null;
  /** The moments are planned and the update is this model's (else the distributed optimizer's). */
  fullState: boolean;
  /** (B·T, C) gradient of the residual stream at the point backward has reached. */
  dres: GPUBuffer;
  /** (B·T, C) dres through a dropout mask. */
  dtmp: GPUBuffer;
  /** (B·T, C) gradient of a LayerNorm output. */
  dln: GPUBuffer;
  /** (B·T, Cl) gradient of the attention output. */
  datty: GPUBuffer;
  /** (B·T, 4·Cl) gradient of the MLP pre-activation. */
  d4: GPUBuffer;
  /** (B·T, 3·Cl) gradient of qkv. */
  dqkv: GPUBuffer;
  /** (B·T, Hl) rowwise dot of the attention output and its gradient. */
  delta: GPUBuffer;
  /** Column-sum partials of the bias and LayerNorm parameter gradients (blocks, ·). */
  part: GPUBuffer;
  /** Squared-gradient partials of the norm, NORM_GROUPS per segment (reused by the checksum). */
  normPart: GPUBuffer;
  /** Row blocks of the column sums. */
  blocks: number;
  /** Weight gradients are stored, or added with gradient accumulation. */
  dwEpilogue: "accumulate" | "store";
}

/** The training state of a training plan's builder. */
export function createBackprop(g: GraphBuilder): Backprop {
  const fullState = g.opts.optimizerState ?? true;
  return {
    grads: flat(g, "grads"),
    adamM: fullState ? flat(g, "adam.m") : null,
    adamV: fullState ? flat(g, "adam.v") : null,
    fullState,
    dres: buf(g, "dres"),
    dtmp: buf(g, "dtmp"),
    dln: buf(g, "dln"),
    datty: buf(g, "datty"),
    d4: buf(g, "d4c"),
    dqkv: buf(g, "dqkv"),
    delta: buf(g, "delta"),
    part: buf(g, "partials"),
    normPart: buf(g, "normPart"),
    blocks: Math.ceil(g.dims.BT / ROW_BLOCK),
    dwEpilogue: g.accumulate ? "accumulate" : "store",
  };
}

/** A parameter's gradient by name. */
export function gradView(g: GraphBuilder, t: Backprop, name: string): View {
  const p = g.layout.byName.get(name)!;
  return flatView(t.grads, p.offset, p.size);
}

/**
 * Loads in flight per thread of the column sums (PlanOptions kernels.columnSumUnroll): 32 on GPUs
 * (measured faster in the step on the H200, issue 38), 8 on CPU adapters, whose compiler takes long
 * over kernels written out. The same sums at any count.
 */
export function colsumUnroll(g: GraphBuilder): number {
  return g.opts.kernels?.columnSumUnroll ?? (isCpuAdapter(g.ctx) ? 8 : 32);
}

/** LayerNorm rows in registers (PlanOptions kernels.layernormWritten): on GPUs by default, as colsumUnroll. */
export function layernormWritten(g: GraphBuilder): boolean {
  return g.opts.kernels?.layernormWritten ?? !isCpuAdapter(g.ctx);
}
