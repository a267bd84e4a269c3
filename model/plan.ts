/**
 * The memory plan of a model on one GPU: every buffer the engine allocates, as {label, bytes,
 * dtype, category}. It is the single source of truth: `buildModel` allocates exactly this list
 * (by label, never computing a size itself), the estimator (model/memory_estimate.ts) sums it, and the fit
 * check at `POST /train` reads the estimate, so the three cannot drift apart.
 *
 * Pure: it needs the device's binding and buffer limits (for segments and LM head chunks), not a
 * device, so the HTTP process can plan for a GPU it never touches.
 */

import { ConfigError, type ModelConfig, type ParamLayout, paramLayout } from "./config.ts";
import { planSegments, type SegmentRange } from "./segments.ts";
import { DROPOUT_SLOT_BYTES, dropoutSite } from "./rng.ts";
import { shardLayout, shardSpecs } from "./shard.ts";
import {
  CONTROL_BYTES,
  lnBiasPartialOffset,
  NORM_GROUPS,
  OPT_UNIFORM_BYTES,
  ROW_BLOCK,
} from "./buffer_layout.ts";

/** Element types of planned buffers. */
export type DType = "f32" | "f16" | "u32";

/** Bytes per element of each dtype. */
export const DTYPE_BYTES: Record<DType, number> = { f32: 4, f16: 2, u32: 4 };

/** What a buffer is for, as the estimator reports it. */
export type Category = "weights" | "gradients" | "optimizer" | "activations" | "logits" | "workspace";

/** Categories in report order. */
export const CATEGORIES: readonly Category[] = [
  "weights",
  "gradients",
  "optimizer",
  "activations",
  "logits",
  "workspace",
];

/** One planned buffer. `bytes` is what the allocation takes (rounded as createStorage rounds). */
export interface PlannedBuffer {
  label: string;
  bytes: number;
  dtype: DType;
  category: Category;
  /** Storage buffer (the default) or uniform. */
  usage: "storage" | "uniform";
}

/** Device limits the plan depends on. */
export interface PlanLimits {
  maxStorageBufferBindingSize: number;
  maxBufferSize: number;
}

/** Rows of the LM head chunks are a multiple of this (so row offsets stay 256-byte aligned). */
export const HEAD_ROW_MULTIPLE = 64;
/** Default cap on one chunk of logits, in bytes. */
export const HEAD_CHUNK_BYTES = 512 * 2 ** 20;

/** How the big arrays are cut to fit the device's bindings (all optional, for tests and benchmarks). */
export interface ChunkOptions {
  /** Cap on a segment of the flat arrays (below the device's binding and buffer limits). */
  maxSegmentBytes?: number;
  /** Rows of one LM head chunk (a multiple of 64); default: logits of at most HEAD_CHUNK_BYTES. */
  headChunkRows?: number;
}

/** What is planned besides the shape. */
export interface PlanOptions extends ChunkOptions {
  /** Gradients, optimizer state and backward scratch (default true). */
  train?: boolean;
  /** The parameters live in a buffer owned elsewhere (not planned). */
  sharedParams?: boolean;
  /**
   * Activation checkpointing: layers per group whose activations are recomputed in backward from
   * the group's input; 0 or absent stores every layer's activations.
   */
  checkpointLayers?: number;
  /** Arithmetic of weights and activations (default fp32). */
  precision?: Precision;
  /**
   * AdamW moments in the plan (default true). False for a rank of the distributed optimizer,
   * which keeps only its shard of them (engine/parallel/zero.ts) and runs the update itself.
   */
  optimizerState?: boolean;
  /**
   * Tensor-parallel size: the plan of one of `tensorParallel` ranks (its parameter shard, its
   * heads' and MLP columns' activations, its vocabulary columns of the logits). The config's
   * padded vocabulary must divide by it (tensorParallelConfig). Default 1.
   */
  tensorParallel?: number;
  /**
   * A forward pass that stops at the final LayerNorm (generation's prefill, which runs its own
   * gathered LM head): no logits or losses are planned. Needs `train: false`.
   */
  hiddenOnly?: boolean;
  /**
   * SFT's loss mask: the tokens buffer holds, after the B·(T + 1) token ids, B·T per-target loss
   * weights (f32 bits; see kernels/cross_entropy.ts). Default false.
   */
  lossMask?: boolean;
  /**
   * A training plan's logits buffer also holds the attention backward's dS (B·(H/tp)·T² f32,
   * written by the dK/dV kernel for a dQ matmul to read once the LM head's backward is done with
   * the logits; engine/kernels/attention_dq.ts): it is sized to fit them where they take at most
   * SCORES_MAX_BYTES and the device's binding limit (see scoresFloats). Default false here;
   * the engine's buildGraph turns it on for GPUs that run the split kernels (scoresByDefault).
   */
  attentionScores?: boolean;
}

/** Most bytes of dS a plan's logits buffer grows to hold (PlanOptions.attentionScores). */
export const SCORES_MAX_BYTES = 2 ** 30;

/**
 * f32 elements of the attention backward's dS that a plan's logits buffer holds
 * (PlanOptions.attentionScores): B·(H/tp)·T² for a training plan with the option, where they fit
 * SCORES_MAX_BYTES and the binding limit; else 0.
 */
export function scoresFloats(
  limits: PlanLimits,
  shape: { config: ModelConfig; B: number; T: number },
  o: PlanOptions,
): number {
  if (!o.attentionScores || !(o.train ?? true)) return 0;
  const n = shape.B * (shape.config.n_head / (o.tensorParallel ?? 1)) * shape.T ** 2;
  return n * 4 <= Math.min(SCORES_MAX_BYTES, limits.maxStorageBufferBindingSize) ? n : 0;
}

/** Training precisions. */
export type Precision = "fp32" | "fp16";

/** The full plan. */
export interface ModelPlan {
  config: ModelConfig;
  B: number;
  T: number;
  layout: ParamLayout;
  segments: SegmentRange[];
  /** Rows of one LM head chunk (B·T when the head runs in one piece). */
  headRows: number;
  /** Layers per checkpoint group (0: no checkpointing). */
  checkpointLayers: number;
  precision: Precision;
  buffers: PlannedBuffer[];
  byLabel: Map<string, PlannedBuffer>;
  totalBytes: number;
}

/** Most floats of the split-K scratch of the backward matmuls (64 MiB; less for small models: 8 slices of the MLP's weight gradient). */
export const MATMUL_PART_FLOATS = 16 << 20;

/** A range of the flat arrays inside one segment (element offsets within the segment). */
export interface NormRange {
  segment: number;
  offset: number;
  size: number;
}

/**
 * The flat ranges whose squared gradients tensor-parallel rank `rank` adds to the global norm:
 * everything on rank 0, only the sharded tensors on the others (a replicated tensor's gradient is
 * the same on every rank, so it counts once). Each range lies in one segment.
 */
export function normRanges(
  config: ModelConfig,
  layout: ParamLayout,
  segments: SegmentRange[],
  tp: number,
  rank: number,
): NormRange[] {
  const split = new Map(shardSpecs(config, tp).map((s) => [s.name, s.split]));
  const tensors = [...layout.tensors].sort((a, b) => a.offset - b.offset);
  const out: NormRange[] = [];
  tensors.forEach((t, i) => {
    if (rank !== 0 && split.get(t.name) === "replicated") return;
    const end = i + 1 < tensors.length ? tensors[i + 1].offset : layout.totalSize;
    const segment = segments.findIndex((s) => t.offset >= s.start && t.offset < s.start + s.size);
    const last = out.at(-1), offset = t.offset - segments[segment].start;
    if (last && last.segment === segment && last.offset + last.size === offset) last.size += end - t.offset;
    else out.push({ segment, offset, size: end - t.offset });
  });
  return out;
}

/** The flat arrays' segments: at most the binding limit and the buffer limit. */
export function flatSegments(limits: PlanLimits, layout: ParamLayout, o: ChunkOptions = {}): SegmentRange[] {
  const cap = Math.min(
    limits.maxStorageBufferBindingSize,
    limits.maxBufferSize,
    o.maxSegmentBytes ?? Infinity,
  );
  return planSegments(layout, cap);
}

/** Rows per LM head chunk for `rows` rows; one chunk (all rows) when they fit. */
export function headChunkRows(
  limits: PlanLimits,
  c: ModelConfig,
  rows: number,
  o: ChunkOptions = {},
): number {
  if (o.headChunkRows !== undefined) {
    if (o.headChunkRows <= 0 || o.headChunkRows % HEAD_ROW_MULTIPLE !== 0) {
      throw new RangeError(
        `headChunkRows ${o.headChunkRows} must be a positive multiple of ${HEAD_ROW_MULTIPLE}`,
      );
    }
    return Math.min(rows, o.headChunkRows);
  }
  const rowBytes = c.padded_vocab_size * 4;
  const maxRows = Math.floor(Math.min(limits.maxStorageBufferBindingSize, HEAD_CHUNK_BYTES) / rowBytes);
  if (rows <= maxRows) return rows;
  const n = Math.ceil(rows / maxRows);
  return Math.ceil(rows / n / HEAD_ROW_MULTIPLE) * HEAD_ROW_MULTIPLE;
}

/** Names of one layer's activation buffers (see engine/graph/ for what each holds). */
export const LAYER_ACTS = ["ln1", "ln1s", "qkv", "atty", "lse", "res2", "ln2", "ln2s", "fch"] as const;
export type LayerActName = typeof LAYER_ACTS[number];

/** Layer activations a training plan does not store (recomputed from their LayerNorm's input and statistics). */
export const RECOMPUTED_ACTS: readonly LayerActName[] = ["ln1", "ln2"];

/**
 * Label prefix of layer l's activations: its own (`l3.`) without checkpointing, or the working set
 * of its place in the group (`w1.`), shared by every group, with it.
 */
export function actPrefix(checkpointLayers: number, l: number): string {
  return checkpointLayers > 0 ? `w${l % checkpointLayers}.` : `l${l}.`;
}

/**
 * Label of the residual stream entering layer l (l = L: entering ln_f). With checkpointing only the
 * inputs of groups and res[L] are kept (`res{l}`); the others live in the working set (`wres{j}`).
 */
export function resLabel(checkpointLayers: number, L: number, l: number): string {
  const k = checkpointLayers;
  return k === 0 || l % k === 0 || l === L ? `res${l}` : `wres${l % k}`;
}

/**
 * Element type of a layer activation: with fp16 the matmul and attention inputs and outputs are
 * f16; the residual stream (res2) and the LayerNorm and softmax statistics stay f32.
 */
export function actDtype(name: LayerActName, half: boolean): DType {
  return half && !["res2", "ln1s", "ln2s", "lse"].includes(name) ? "f16" : "f32";
}

/** Plans every buffer of a model for batch B and sequence length T. */
export function planModel(
  limits: PlanLimits,
  shape: { config: ModelConfig; B: number; T: number },
  o: PlanOptions = {},
): ModelPlan {
  const { config: c, B, T } = shape;
  const L = c.n_layer, Vp = c.padded_vocab_size, BT = B * T;
  const train = o.train ?? true;
  const k = Math.min(o.checkpointLayers ?? 0, L);
  const half = o.precision === "fp16";
  const tp = o.tensorParallel ?? 1;
  const layout = tp > 1 ? shardLayout(c, tp) : paramLayout(c);
  const segments = flatSegments(limits, layout, o);
  // One rank's vocabulary columns of the logits.
  const Vl = Vp / tp;
  const headRows = train ? headChunkRows(limits, { ...c, padded_vocab_size: Vl }, BT, o) : BT;
  const p: PlanParts = {
    c,
    B,
    T,
    BT,
    train,
    k,
    half,
    act: half ? "f16" : "f32",
    tp,
    layout,
    segments,
    Vl,
    headRows,
    scores: scoresFloats(limits, shape, o),
    o,
    buffers: [],
  };
  addStateBuffers(p);
  addActivationBuffers(p);
  addWorkspaceBuffers(p);
  const { buffers } = p;
  checkBindingLimit(buffers, limits);
  return {
    config: c,
    B,
    T,
    layout,
    segments,
    headRows,
    checkpointLayers: k,
    precision: half ? "fp16" : "fp32",
    buffers,
    byLabel: new Map(buffers.map((b) => [b.label, b])),
    totalBytes: buffers.reduce((a, b) => a + b.bytes, 0),
  };
}

/** A plan being built by planModel: its shape and options, and the buffers so far, in order. */
interface PlanParts {
  c: ModelConfig;
  B: number;
  T: number;
  BT: number;
  train: boolean;
  /** Checkpointed layers (0: every layer's activations kept). */
  k: number;
  half: boolean;
  /** Element type of the f16-able activations and gradients. */
  act: DType;
  tp: number;
  layout: ParamLayout;
  segments: SegmentRange[];
  /** One rank's vocabulary columns of the logits. */
  Vl: number;
  headRows: number;
  /** f32 elements of dS the logits buffer also holds (scoresFloats). */
  scores: number;
  o: PlanOptions;
  buffers: PlannedBuffer[];
}

/** Adds a storage buffer of `elems` elements (16-byte aligned, at least 16 bytes). */
function addBuffer(p: PlanParts, label: string, elems: number, dtype: DType, category: Category): void {
  const bytes = Math.max(16, Math.ceil((Math.max(1, elems) * DTYPE_BYTES[dtype]) / 16) * 16);
  p.buffers.push({ label, bytes, dtype, category, usage: "storage" });
}

/** Adds a flat parameter-sized buffer: one per segment (`label.i`) when the layout is split. */
function addFlat(p: PlanParts, label: string, category: Category, dtype: DType = "f32"): void {
  for (const [i, s] of p.segments.entries()) {
    addBuffer(p, p.segments.length > 1 ? `${label}.${i}` : label, s.size, dtype, category);
  }
}

/** The weights, the token ids, and the small statistics and uniform buffers. */
function addStateBuffers(p: PlanParts): void {
  const { B, T, BT, half, o } = p;
  // fp16: the kernels read an f16 copy of the weights; the fp32 master copy is optimizer state.
  if (!o.sharedParams) addFlat(p, "params", half ? "optimizer" : "weights");
  if (half) addFlat(p, "params16", "weights", "f16");
  addBuffer(p, "tokens", B * (T + 1) + (o.lossMask ? BT : 0), "u32", "workspace");
  addBuffer(p, "stats", 64, "f32", "workspace");
  p.buffers.push(
    {
      label: "dropout",
      bytes: dropoutSite.count(p.c.n_layer) * DROPOUT_SLOT_BYTES,
      dtype: "u32",
      category: "workspace",
      usage: "uniform",
    },
    { label: "optimizer", bytes: OPT_UNIFORM_BYTES, dtype: "u32", category: "workspace", usage: "uniform" },
  );
  addBuffer(p, "control", CONTROL_BYTES / 4, "u32", "workspace");
}

/** The residual stream, each layer's stored activations, the final LayerNorm and the logits. */
function addActivationBuffers(p: PlanParts): void {
  const { c, B, T, BT, k, half, act, tp, train, o } = p;
  const C = c.n_embd, L = c.n_layer, H = c.n_head;
  const sizes: Record<LayerActName, number> = {
    ln1: BT * C,
    ln1s: BT * 2,
    qkv: (BT * 3 * C) / tp,
    atty: (BT * C) / tp,
    lse: (B * H * T) / tp,
    res2: BT * C,
    ln2: BT * C,
    ln2s: BT * 2,
    fch: (BT * 4 * C) / tp,
  };
  const seen = new Set<string>();
  for (let l = 0; l <= L; l++) {
    const r = resLabel(k, L, l);
    if (!seen.has(r)) addBuffer(p, r, BT * C, "f32", "activations");
    seen.add(r);
  }
  // Training keeps no LayerNorm outputs: the matmul reading one recomputes it from the stored
  // input and statistics into one shared buffer (in forward right before, in backward before the
  // weight gradient), which costs two LayerNorm passes per layer and saves 2·B·T·C per layer.
  for (let l = 0; l < (k > 0 ? k : L); l++) {
    for (const name of LAYER_ACTS) {
      if (train && RECOMPUTED_ACTS.includes(name)) continue;
      addBuffer(p, actPrefix(k, l) + name, sizes[name], actDtype(name, half), "activations");
    }
  }
  if (train) addBuffer(p, "lnw", BT * C, act, "activations");
  addBuffer(p, "lnf", BT * C, act, "activations");
  addBuffer(p, "lnfs", BT * 2, "f32", "activations");
  addBuffer(p, "logits", o.hiddenOnly ? 1 : Math.max(p.headRows * p.Vl, p.scores), "f32", "logits");
  addBuffer(p, "losses", o.hiddenOnly ? 1 : BT, "f32", "logits");
  if (!o.hiddenOnly && p.headRows < BT) {
    // The LM head's chunks: each chunk's first row in its own slot, bound by its loss kernels.
    p.buffers.push({
      label: "ceRows",
      bytes: Math.ceil(BT / p.headRows) * CE_ROWS_SLOT_BYTES,
      dtype: "u32",
      category: "workspace",
      usage: "uniform",
    });
  }
}

/**
 * Bytes per LM-head chunk in the "ceRows" uniform: chunk i's first row (u32) at i · this, where its
 * loss kernel binds it (uniform offsets align to 256 bytes at most), so one pipeline serves every chunk.
 */
export const CE_ROWS_SLOT_BYTES = 256;

/** Training's gradients, optimizer state and backward workspace; split-K partials; tensor-parallel buffers. */
function addWorkspaceBuffers(p: PlanParts): void {
  const { c, B, T, BT, act, tp, train, o, segments } = p;
  const C = c.n_embd, H = c.n_head;
  if (train) {
    addFlat(p, "grads", "gradients");
    if (o.optimizerState ?? true) {
      addFlat(p, "adam.m", "optimizer");
      addFlat(p, "adam.v", "optimizer");
    }
    // fp16: the gradients that feed f16 matmuls and attention are f16 (loss scaling keeps them in
    // range); the residual stream's gradient and the LayerNorm inputs stay f32.
    for (const name of ["dres", "dtmp", "dln"]) addBuffer(p, name, BT * C, "f32", "workspace");
    addBuffer(p, "datty", (BT * C) / tp, act, "workspace");
    addBuffer(p, "d4c", (BT * 4 * C) / tp, act, "workspace");
    addBuffer(p, "dqkv", (BT * 3 * C) / tp, act, "workspace");
    addBuffer(p, "delta", (B * H * T) / tp, "f32", "workspace");
    const blocks = Math.ceil(BT / ROW_BLOCK);
    addBuffer(p, "partials", Math.max(blocks * 4 * C, 2 * lnBiasPartialOffset(C, BT)), "f32", "workspace");
    addBuffer(p, "normPart", NORM_GROUPS * segments.length, "f32", "workspace");
    // Split-K partial sums of the weight-gradient matmuls (those needing more do without split-K).
    addBuffer(p, "matmul_part", Math.min(MATMUL_PART_FLOATS, (8 * 4 * C * C) / tp), "f32", "workspace");
  } else if (o.hiddenOnly) {
    // Split-K partial sums of the forward matmuls of few rows (generation's prefill: with 32 rows,
    // K = 3072 ran 24 blocks of 32×32; split in 4 slices it ran 5x faster on an H200).
    addBuffer(p, "matmul_part", Math.min(MATMUL_PART_FLOATS, (4 * 4 * C * C) / tp), "f32", "workspace");
  }
  if (tp > 1) {
    // Row-parallel outputs (and the embedding) before their allreduce; the loss's row statistics.
    addBuffer(p, "partial", BT * C, "f32", "workspace");
    addBuffer(p, "ceStats", p.headRows * 4, "f32", "workspace");
    if (train) {
      addBuffer(p, "normTotal", 4, "f32", "workspace");
      const parts = NORM_GROUPS * normRanges(c, p.layout, segments, tp, 1).length;
      addBuffer(p, "tpNormParts", parts, "f32", "workspace");
    }
  }
}

/** Refuses a plan with a buffer over the device's storage binding limit, naming the setting to lower. */
function checkBindingLimit(buffers: PlannedBuffer[], limits: PlanLimits): void {
  const bind = limits.maxStorageBufferBindingSize;
  for (const b of buffers) {
    if (b.bytes > bind) {
      throw new ConfigError(
        "batch_size",
        `buffer "${b.label}" of ${b.bytes} bytes exceeds the device's storage binding limit of ${bind} bytes: ` +
          `lower batch_size or seq_len`,
      );
    }
  }
}

/**
 * Block size of the driver-side allocator under Deno's WebGPU (Vulkan), as measured on an H200
 * (bench/alloc_probe.ts): a buffer of at most this many bytes is sub-allocated from a block of
 * this size (a new whole block when none has room; see allocatorWaste for the order blocks are
 * tried in), a bigger one gets an allocation of its own. nvidia-smi counts every block whole.
 */
export const ALLOCATOR_BLOCK_BYTES = 256 * 2 ** 20;

/**
 * What a sub-allocation takes of its block in the model: its bytes rounded up to this (Vulkan's
 * buffer alignment is at most this on the GPUs we target), so a bin packed to the byte still fits.
 */
export const ALLOCATOR_ALIGN_BYTES = 256;

/** Bytes a buffer of `bytes` occupies in a block. */
function footprint(bytes: number): number {
  return Math.ceil(bytes / ALLOCATOR_ALIGN_BYTES) * ALLOCATOR_ALIGN_BYTES;
}

/** An allocation order and what the allocator wastes under it. */
export interface AllocationOrder<B extends { bytes: number } = PlannedBuffer> {
  /** Every buffer once: those bigger than a block first (plan order), then the bins one after another. */
  order: B[];
  /** The buffers of at most a block, first-fit-decreasing into bins of at most `blockBytes`. */
  bins: B[][];
  /** Σ over bins of (block − bytes of its buffers): allocatorWaste() of `order`. */
  wasteBytes: number;
}

/**
 * The order in which to allocate `buffers` (storage and uniform alike: both live in the
 * allocator's blocks) so the small ones pack its blocks tightly: buffers bigger than a block first
 * (each its own allocation, no waste), then the others packed first-fit-decreasing into bins of at
 * most `blockBytes` and emitted bin after bin. Allocated in that order, the allocator puts each
 * bin in a block of its own whichever order it tries its blocks in: a buffer that went to a later
 * bin did not fit the earlier bins when it was placed, and they only filled up since. Pure.
 */
export function allocationOrder<B extends { bytes: number }>(
  buffers: readonly B[],
  blockBytes: number = ALLOCATOR_BLOCK_BYTES,
): AllocationOrder<B> {
  const big = buffers.filter((b) => b.bytes > blockBytes);
  // Stable: equal sizes keep plan order.
  const small = buffers.filter((b) => b.bytes <= blockBytes)
    .map((b, i) => ({ b, i }))
    .sort((x, y) => footprint(y.b.bytes) - footprint(x.b.bytes) || x.i - y.i)
    .map((x) => x.b);
  const bins: B[][] = [], fill: number[] = [];
  for (const b of small) {
    const f = Math.min(footprint(b.bytes), blockBytes);
    let i = fill.findIndex((used) => used + f <= blockBytes);
    if (i < 0) {
      i = bins.length;
      bins.push([]);
      fill.push(0);
    }
    bins[i].push(b);
    fill[i] += f;
  }
  const order = [...big, ...bins.flat()];
  return { order, bins, wasteBytes: allocatorWaste(order.map((b) => b.bytes), blockBytes) };
}

/**
 * Bytes the allocator wastes when buffers of `sizes` are allocated in that order and kept: the
 * ones of at most `blockBytes` are placed in the newest block with room (blocks are tried newest
 * first, as gpu-allocator scans them; a new block when none has room) and every block counts
 * whole; bigger ones are their own allocation (no waste). The result is the blocks' bytes less the
 * bytes of the buffers in them (alignment included).
 *
 * Newest-first rather than first fit because it reproduces what nvidia-smi measured for the
 * plans of gpt2-345M at 8×1024 in plan order (bench/alloc_probe.ts, H200): fp16 +0.387 GiB
 * modelled against +0.38 measured, checkpointed +0.214 against +0.21, fp32 +1.23 against +0.98;
 * first fit would say +0.23 for fp32. Under allocationOrder() both scans give the same blocks.
 */
export function allocatorWaste(sizes: readonly number[], blockBytes: number = ALLOCATOR_BLOCK_BYTES): number {
  const fill: number[] = [];
  let small = 0;
  for (const s of sizes) {
    if (s > blockBytes) continue;
    const f = Math.min(footprint(s), blockBytes);
    let i = fill.length - 1;
    while (i >= 0 && fill[i] + f > blockBytes) i--;
    if (i < 0) fill.push(f);
    else fill[i] += f;
    small += s;
  }
  return fill.length * blockBytes - small;
}
