/**
 * Tensor-parallel shard specs, Megatron style: for a model and a tensor-parallel size `tp`, how
 * each parameter splits across the `tp` ranks of a group, and functions that cut a whole tensor
 * into a rank's shard and merge the shards back, bit for bit. Pure: no WebGPU, no files.
 *
 * - Column-parallel (split output columns, bias split alike): `mlp.c_fc`. Its weight is stored
 *   [in, out] (Hugging Face Conv1D), so a rank holds a block of columns.
 * - Column-parallel by heads: `attn.c_attn` is [C, 3C] with the q, k and v blocks side by side;
 *   rank r takes heads [r·H/tp, (r+1)·H/tp) of each, i.e. the matching column slice of q, of k
 *   and of v, concatenated (q_r | k_r | v_r) into a [C, 3C/tp] tensor; the bias likewise.
 * - Row-parallel (split input rows): `attn.c_proj` and `mlp.c_proj` weights; their biases are
 *   whole on every rank (added once, after the allreduce).
 * - Vocabulary-parallel: each rank holds V_pad/tp consecutive rows of `wte` (tied LM head).
 * - Replicated: LayerNorms, `wpe`, the row-parallel biases.
 *
 * The padded vocabulary is a multiple of 128·tp (50304 at tp 1, 50432 at tp 2, 50688 at tp 4),
 * so every rank's share of rows is a multiple of 128. Rows at or past the real vocabulary are
 * padding: zero, never sampled and never part of a softmax (see `vocabShard`).
 *
 * A shard is described by slices: boxes {offset, shape} of the global tensor, concatenated along
 * the split axis in the rank's tensor; one box except for c_attn (three). Checkpoints record the
 * same slices (checkpoint/checkpoint.ts), so loading at another tp is a lookup.
 */

import {
  allTensorShapes,
  ConfigError,
  layoutOf,
  makeConfig,
  type ModelConfig,
  padVocab,
  type ParamLayout,
  paramLayout,
  TENSOR_ALIGN,
  VOCAB_MULTIPLE,
} from "./config.ts";

/** How a tensor splits across tensor-parallel ranks. */
export type SplitKind = "replicated" | "column" | "qkv" | "row" | "vocab";

/** A box of a global tensor: `offset` and `shape` have one entry per dimension. */
export interface Slice {
  offset: number[];
  shape: number[];
}

/** How one parameter tensor is sharded at one tensor-parallel size. */
export interface ShardSpec {
  /** Hugging Face GPT-2 name, e.g. `h.0.attn.c_attn.weight`. */
  name: string;
  split: SplitKind;
  /** The dimension it is cut along (0 for replicated tensors, which are not cut). */
  axis: number;
  /** Shape of the whole tensor (wte: [padded_vocab_size, C] of this layout). */
  globalShape: number[];
  /** Shape each rank holds (the same on every rank). */
  shape: number[];
  /** Tensor-parallel size. */
  tp: number;
}

/** The vocabulary sizes of one layout, as checkpoints record them. */
export interface VocabSizes {
  /** Real vocabulary (50257): ids at or past it are never sampled nor normalised over. */
  vocab_size: number;
  /** Padded to a multiple of 128, as at tp 1 (50304). */
  padded_vocab_size: number;
  /** wte rows of this layout: padded to a multiple of 128·tp (50432 at tp 2). */
  tensor_parallel_vocab_size: number;
  /** wte rows each rank holds (tensor_parallel_vocab_size / tp). */
  rank_vocab_size: number;
  tensor_parallel: number;
}

/** The vocabulary padded for `tp` ranks: a multiple of 128·tp (Megatron's make-vocab-size-divisible-by × tp). */
export function tensorParallelVocab(vocabSize: number, tp: number): number {
  return padVocab(vocabSize, VOCAB_MULTIPLE * tp);
}

/**
 * Checks that `tp` can shard `config`: a positive integer dividing n_head (whole heads per rank),
 * 4·n_embd (the MLP) and the padded vocabulary. Throws ConfigError naming `tensor_parallel`.
 */
export function checkTensorParallel(config: ModelConfig, tp: number): void {
  checkHeads(config, tp);
  if (config.padded_vocab_size % tp !== 0) {
    throw new ConfigError(
      "tensor_parallel",
      `${tp} does not divide padded_vocab_size ${config.padded_vocab_size} (use tensorParallelConfig())`,
    );
  }
}

/** checkTensorParallel() without the vocabulary, which tensorParallelConfig() pads to fit. */
function checkHeads(config: ModelConfig, tp: number): void {
  if (typeof tp !== "number" || !Number.isInteger(tp) || tp < 1) {
    throw new ConfigError("tensor_parallel", `must be a positive integer, got ${JSON.stringify(tp)}`);
  }
  if (config.n_head % tp !== 0) {
    throw new ConfigError(
      "tensor_parallel",
      `${tp} does not divide n_head ${config.n_head}: each rank must hold whole attention heads`,
    );
  }
  if ((4 * config.n_embd) % tp !== 0) {
    throw new ConfigError("tensor_parallel", `${tp} does not divide 4·n_embd ${4 * config.n_embd}`);
  }
}

/**
 * `config` with the padded vocabulary of `tp` ranks (a multiple of 128·tp); at tp 1 the padding
 * of makeConfig() (50304). Throws ConfigError naming `tensor_parallel` when `tp` cannot shard it.
 */
export function tensorParallelConfig(config: ModelConfig, tp: number): ModelConfig {
  checkHeads(config, tp);
  return makeConfig({ ...config, padded_vocab_size: tensorParallelVocab(config.vocab_size, tp) });
}

/** The vocabulary sizes of `config` sharded over `tp` ranks. */
export function vocabSizes(config: ModelConfig, tp: number): VocabSizes {
  checkTensorParallel(config, tp);
  return {
    vocab_size: config.vocab_size,
    padded_vocab_size: padVocab(config.vocab_size),
    tensor_parallel_vocab_size: config.padded_vocab_size,
    rank_vocab_size: config.padded_vocab_size / tp,
    tensor_parallel: tp,
  };
}

/**
 * The wte rows of rank `rank`: global rows [start, start + rows), of which the first `real` are
 * real vocabulary (the vocabulary-parallel softmax and sampling use only those; `real` may be 0).
 */
export function vocabShard(
  config: ModelConfig,
  tp: number,
  rank: number,
): { start: number; rows: number; real: number } {
  checkRank(tp, rank);
  checkTensorParallel(config, tp);
  const rows = config.padded_vocab_size / tp, start = rank * rows;
  return { start, rows, real: Math.max(0, Math.min(rows, config.vocab_size - start)) };
}

/** How `name` splits; `dims` is its number of dimensions (weights 2, biases 1). */
function splitOf(name: string, dims: number): { split: SplitKind; axis: number } {
  if (name === "wte.weight") return { split: "vocab", axis: 0 };
  if (/\.attn\.c_attn\.(weight|bias)$/.test(name)) return { split: "qkv", axis: dims - 1 };
  if (/\.mlp\.c_fc\.(weight|bias)$/.test(name)) return { split: "column", axis: dims - 1 };
  if (/\.(attn|mlp)\.c_proj\.weight$/.test(name)) return { split: "row", axis: 0 };
  return { split: "replicated", axis: 0 };
}

/** The shard spec of every parameter of `config` at `tp`, in Hugging Face order (wte, wpe, h.0 …, ln_f). */
export function shardSpecs(config: ModelConfig, tp: number): ShardSpec[] {
  checkTensorParallel(config, tp);
  return allTensorShapes(config).map(([name, globalShape]) => {
    const { split, axis } = splitOf(name, globalShape.length);
    const shape = [...globalShape];
    if (split !== "replicated") shape[axis] /= tp;
    return { name, split, axis, globalShape, shape, tp };
  });
}

function checkRank(tp: number, rank: number): void {
  if (!Number.isInteger(rank) || rank < 0 || rank >= tp) {
    throw new RangeError(`rank must be in [0, ${tp}), got "${rank}"`);
  }
}

/** The boxes of the global tensor that rank `rank` holds, in the order its tensor concatenates them along `spec.axis`. */
export function shardSlices(spec: ShardSpec, rank: number): Slice[] {
  checkRank(spec.tp, rank);
  const zero = spec.globalShape.map(() => 0);
  if (spec.split === "replicated") return [{ offset: zero, shape: [...spec.globalShape] }];
  // A qkv shard holds three boxes (its heads of q, of k and of v), any other one box.
  const n = spec.split === "qkv" ? spec.shape[spec.axis] / 3 : spec.shape[spec.axis];
  const box = (start: number): Slice => {
    const offset = [...zero], shape = [...spec.globalShape];
    offset[spec.axis] = start;
    shape[spec.axis] = n;
    return { offset, shape };
  };
  if (spec.split !== "qkv") return [box(rank * n)];
  const third = spec.globalShape[spec.axis] / 3;
  return [0, 1, 2].map((k) => box(k * third + rank * n));
}

const sizeOf = (shape: number[]) => shape.reduce((a, b) => a * b, 1);

/** Rows and columns of a 1-D or 2-D shape seen as a matrix (1-D: one row). */
function matrix(shape: number[]): [number, number] {
  if (shape.length === 1) return [1, shape[0]];
  if (shape.length === 2) return [shape[0], shape[1]];
  throw new RangeError(`Only 1-D and 2-D tensors are sharded, got shape [${shape}]`);
}

/**
 * Copies box `box` (shape of src's rank) between a tensor of shape `aShape` at `aOffset` and one
 * of shape `bShape` at `bOffset`; `toB` picks the direction.
 */
function copyBox(
  a: Float32Array,
  aShape: number[],
  aOffset: number[],
  b: Float32Array,
  bShape: number[],
  bOffset: number[],
  box: number[],
  toB: boolean,
): void {
  const [, aCols] = matrix(aShape), [, bCols] = matrix(bShape), [rows, cols] = matrix(box);
  const [ar, ac] = aOffset.length === 1 ? [0, aOffset[0]] : aOffset;
  const [br, bc] = bOffset.length === 1 ? [0, bOffset[0]] : bOffset;
  for (let r = 0; r < rows; r++) {
    const ai = (ar + r) * aCols + ac, bi = (br + r) * bCols + bc;
    if (toB) b.set(a.subarray(ai, ai + cols), bi);
    else a.set(b.subarray(bi, bi + cols), ai);
  }
}

/**
 * Copies `slices` of `global` (shape `globalShape`) into a new tensor of shape `shape`, one after
 * another along `axis`: a rank's shard as `shardSlices()` or a checkpoint's records describe it.
 */
export function readSlices(
  global: Float32Array,
  globalShape: number[],
  slices: Slice[],
  axis: number,
  shape: number[],
): Float32Array {
  checkLength("Cannot read slices", global, globalShape);
  const out = new Float32Array(sizeOf(shape));
  const at = slicePlaces(slices, axis, shape, globalShape);
  slices.forEach((s, i) => copyBox(global, globalShape, s.offset, out, shape, at[i], s.shape, true));
  return out;
}

/** The inverse of readSlices(): pastes `local` (shape `shape`) into its `slices` of `global`. */
export function writeSlices(
  global: Float32Array,
  globalShape: number[],
  local: Float32Array,
  shape: number[],
  slices: Slice[],
  axis: number,
): void {
  checkLength("Cannot write slices", global, globalShape);
  checkLength("Cannot write slices", local, shape);
  const at = slicePlaces(slices, axis, shape, globalShape);
  slices.forEach((s, i) => copyBox(global, globalShape, s.offset, local, shape, at[i], s.shape, false));
}

/**
 * Where each slice starts in the tensor that concatenates them along `axis`; throws when a slice
 * is outside the global tensor or the slices do not fill `shape` exactly.
 */
function slicePlaces(slices: Slice[], axis: number, shape: number[], globalShape: number[]): number[][] {
  let at = 0;
  const out = slices.map((s) => {
    if (
      s.shape.length !== shape.length || s.offset.length !== shape.length ||
      globalShape.length !== shape.length ||
      s.offset.some((o, d) => !Number.isInteger(o) || o < 0 || o + s.shape[d] > globalShape[d])
    ) {
      throw new RangeError(
        `Slice at [${s.offset}] of shape [${s.shape}] is outside a tensor of shape [${globalShape}]`,
      );
    }
    s.shape.forEach((n, d) => {
      if (d !== axis && n !== shape[d]) {
        throw new RangeError(`Slice shape [${s.shape}] does not match [${shape}] outside axis ${axis}`);
      }
    });
    const o = shape.map(() => 0);
    o[axis] = at;
    at += s.shape[axis];
    return o;
  });
  if (at !== shape[axis]) {
    throw new RangeError(`Slices fill ${at} of ${shape[axis]} along axis ${axis} of shape [${shape}]`);
  }
  return out;
}

function checkLength(what: string, data: Float32Array, shape: number[]): void {
  if (data.length !== sizeOf(shape)) {
    throw new RangeError(
      `${what}: ${data.length} values do not fill shape [${shape}] (${sizeOf(shape)} values)`,
    );
  }
}

/** Rank `rank`'s shard (shape `spec.shape`) of the whole tensor `global` (shape `spec.globalShape`). */
export function cutShard(spec: ShardSpec, rank: number, global: Float32Array): Float32Array {
  checkLength(`Cannot cut "${spec.name}"`, global, spec.globalShape);
  const slices = shardSlices(spec, rank);
  if (spec.split === "replicated") return global.slice();
  return readSlices(global, spec.globalShape, slices, spec.axis, spec.shape);
}

/**
 * The whole tensor from every rank's shard (`shards[r]` of rank r). Replicated tensors are taken
 * from rank 0 (every rank holds the same values).
 */
export function mergeShards(spec: ShardSpec, shards: Float32Array[]): Float32Array {
  if (shards.length !== spec.tp) {
    throw new RangeError(`Cannot merge "${spec.name}": ${shards.length} shards for tp ${spec.tp}`);
  }
  shards.forEach((s, r) => checkLength(`Cannot merge "${spec.name}" rank ${r}`, s, spec.shape));
  if (spec.split === "replicated") return shards[0].slice();
  const out = new Float32Array(sizeOf(spec.globalShape));
  for (let r = 0; r < spec.tp; r++) {
    writeSlices(out, spec.globalShape, shards[r], spec.shape, shardSlices(spec, r), spec.axis);
  }
  return out;
}

/**
 * The flat layout of one rank's parameters (and gradients and AdamW moments) at `tp`: paramLayout()
 * over the shard shapes, the same on every rank. At tp 1 it is paramLayout(config).
 */
export function shardLayout(config: ModelConfig, tp: number, align = TENSOR_ALIGN): ParamLayout {
  return layoutOf(shardSpecs(config, tp).map((s) => [s.name, s.shape]), align);
}

/** Cuts a whole flat buffer (paramLayout(config)) into `tp` rank buffers (shardLayout(config, tp)). */
export function splitParams(config: ModelConfig, tp: number, flat: Float32Array): Float32Array[] {
  const full = paramLayout(config), local = shardLayout(config, tp);
  if (flat.length !== full.totalSize) {
    throw new RangeError(`Cannot split parameters: ${flat.length} floats, the layout has ${full.totalSize}`);
  }
  const out = Array.from({ length: tp }, () => new Float32Array(local.totalSize));
  for (const spec of shardSpecs(config, tp)) {
    const f = full.byName.get(spec.name)!, l = local.byName.get(spec.name)!;
    const global = flat.subarray(f.offset, f.offset + f.size);
    for (let r = 0; r < tp; r++) out[r].set(tp === 1 ? global : cutShard(spec, r, global), l.offset);
  }
  return out;
}

/** Merges `tp` rank buffers (shardLayout(config, tp)) into one whole flat buffer (paramLayout(config)). */
export function mergeParams(config: ModelConfig, tp: number, ranks: Float32Array[]): Float32Array {
  const full = paramLayout(config), local = shardLayout(config, tp);
  if (ranks.length !== tp || ranks.some((r) => r.length !== local.totalSize)) {
    throw new RangeError(
      `Cannot merge parameters: expected ${tp} buffers of ${local.totalSize} floats, got [${
        ranks.map((r) => r.length)
      }]`,
    );
  }
  const out = new Float32Array(full.totalSize);
  for (const spec of shardSpecs(config, tp)) {
    const f = full.byName.get(spec.name)!, l = local.byName.get(spec.name)!;
    const shards = ranks.map((r) => r.subarray(l.offset, l.offset + l.size));
    out.set(tp === 1 ? shards[0] : mergeShards(spec, shards), f.offset);
  }
  return out;
}
