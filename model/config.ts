/**
 * GPT-2 model configuration: presets, validation, the padded vocabulary, and the parameter layout.
 *
 * The layout is the single source of truth for where every parameter tensor lives in the flat
 * parameter buffer, shared by the GPU engine, the CPU reference and checkpoint import/export.
 * Weights of linear layers are stored [in, out] (Hugging Face's Conv1D layout), so a forward
 * matmul is out = inp @ W. Matrices come first and biases/LayerNorm parameters last, so AdamW's
 * decoupled weight decay applies to one contiguous prefix of the buffer.
 */

/** The GPT-2 BPE vocabulary size (r50k_base, `<|endoftext|>` = 50256). */
export const GPT2_VOCAB_SIZE = 50257;
/** The id of `<|endoftext|>`. */
export const EOT_TOKEN = 50256;
/** Vocabulary padding multiple (Megatron's make-vocab-size-divisible-by 128). */
export const VOCAB_MULTIPLE = 128;
/** Offsets of tensors in the flat buffers are aligned to this many elements: 256 bytes (WebGPU's binding offset alignment) in the f16 copy, 512 in fp32. */
export const TENSOR_ALIGN = 128;

/** Architecture of a GPT-2 model. */
export interface ModelConfig {
  /** Transformer blocks. */
  n_layer: number;
  /** Attention heads per block. */
  n_head: number;
  /** Width of the residual stream (C). */
  n_embd: number;
  /** Length of the position table: the longest sequence the model can see. */
  n_positions: number;
  /** Real vocabulary size (50257 for GPT-2): ids at or past it are never sampled nor trained on. */
  vocab_size: number;
  /** Vocabulary rounded up to a multiple of 128: rows of wte and columns of the logits. */
  padded_vocab_size: number;
}

/** Names of the built-in model presets. */
export const PRESET_NAMES = [
  "gpt2-tiny",
  "gpt2-small-test",
  "gpt2-124M",
  "gpt2-345M",
  "gpt2-774M",
  "gpt2-1558M",
] as const;
export type PresetName = typeof PRESET_NAMES[number];

/** Rounds `vocab` up to a multiple of `multiple`. */
export function padVocab(vocab: number, multiple = VOCAB_MULTIPLE): number {
  return Math.ceil(vocab / multiple) * multiple;
}

const PRESET_DIMS: Record<PresetName, [number, number, number, number]> = {
  // n_layer, n_head, n_embd, n_positions
  "gpt2-tiny": [2, 4, 64, 64],
  "gpt2-small-test": [4, 4, 128, 128],
  "gpt2-124M": [12, 12, 768, 1024],
  "gpt2-345M": [24, 16, 1024, 1024],
  "gpt2-774M": [36, 20, 1280, 1024],
  "gpt2-1558M": [48, 25, 1600, 1024],
};

/** Returns the configuration of a preset, or throws naming the unknown preset. */
export function presetConfig(name: string): ModelConfig {
  const dims = PRESET_DIMS[name as PresetName];
  if (!dims) {
    throw new ConfigError("model", `unknown preset "${name}": expected one of ${PRESET_NAMES.join(", ")}`);
  }
  const [n_layer, n_head, n_embd, n_positions] = dims;
  return makeConfig({ n_layer, n_head, n_embd, n_positions });
}

/** Builds a config from dimensions, filling in the GPT-2 vocabulary and its padding, then validates it. */
export function makeConfig(
  dims: Pick<ModelConfig, "n_layer" | "n_head" | "n_embd" | "n_positions"> & Partial<ModelConfig>,
): ModelConfig {
  const vocab_size = dims.vocab_size ?? GPT2_VOCAB_SIZE;
  const config: ModelConfig = {
    n_layer: dims.n_layer,
    n_head: dims.n_head,
    n_embd: dims.n_embd,
    n_positions: dims.n_positions,
    vocab_size,
    padded_vocab_size: dims.padded_vocab_size ?? padVocab(vocab_size),
  };
  validateConfig(config);
  return config;
}

/** A configuration field with an invalid value. `field` names it for the user. */
export class ConfigError extends Error {
  constructor(readonly field: string, readonly detail: string) {
    super(`Invalid model config: ${field}: ${detail}`);
    this.name = "ConfigError";
  }
}

function positiveInt(field: string, value: unknown): void {
  if (typeof value !== "number" || !Number.isInteger(value) || value <= 0) {
    throw new ConfigError(field, `must be a positive integer, got ${JSON.stringify(value)}`);
  }
}

/** Checks the architecture alone (device limits are checked by the engine when it plans buffers). */
export function validateConfig(c: ModelConfig): void {
  for (
    const f of ["n_layer", "n_head", "n_embd", "n_positions", "vocab_size", "padded_vocab_size"] as const
  ) {
    positiveInt(f, c[f]);
  }
  if (c.n_embd % c.n_head !== 0) {
    throw new ConfigError("n_embd", `${c.n_embd} is not divisible by n_head ${c.n_head}`);
  }
  const hd = c.n_embd / c.n_head;
  if (hd % 4 !== 0 || hd > 128) {
    throw new ConfigError(
      "n_embd",
      `head size n_embd/n_head = ${hd} must be a multiple of 4 and at most 128`,
    );
  }
  if (c.padded_vocab_size < c.vocab_size || c.padded_vocab_size % 4 !== 0) {
    throw new ConfigError(
      "padded_vocab_size",
      `${c.padded_vocab_size} must be a multiple of 4 and at least vocab_size ${c.vocab_size}`,
    );
  }
  if (c.vocab_size > 65536) {
    throw new ConfigError("vocab_size", `${c.vocab_size} exceeds the uint16 token range`);
  }
}

/** Checks a training/inference sequence length against the position table. */
export function validateSeqLen(c: ModelConfig, seqLen: number): void {
  positiveInt("seq_len", seqLen);
  if (seqLen > c.n_positions) {
    throw new ConfigError(
      "seq_len",
      `${seqLen} is past the position table of ${c.n_positions} (n_positions)`,
    );
  }
}

/** One parameter tensor in the flat buffer. Offsets and sizes are in floats. */
export interface TensorSpec {
  /** Hugging Face GPT-2 name (without the `transformer.` prefix), e.g. `h.0.attn.c_attn.weight`. */
  name: string;
  shape: number[];
  size: number;
  offset: number;
  /** Whether AdamW applies weight decay (2-D weights yes; biases and LayerNorm no). */
  decay: boolean;
}

/** Where each parameter tensor lives; `decayEnd` is the end of the weight-decayed prefix. */
export interface ParamLayout {
  tensors: TensorSpec[];
  byName: Map<string, TensorSpec>;
  /** Total floats including alignment padding. */
  totalSize: number;
  /** Floats [0, decayEnd) are decayed, [decayEnd, totalSize) are not. */
  decayEnd: number;
  /** Parameters counted without padding. */
  numParams: number;
}

/** Names and shapes of a layer's tensors in Hugging Face order. */
export function layerTensorShapes(c: ModelConfig, l: number): Array<[string, number[]]> {
  const C = c.n_embd, p = `h.${l}.`;
  return [
    [p + "ln_1.weight", [C]],
    [p + "ln_1.bias", [C]],
    [p + "attn.c_attn.weight", [C, 3 * C]],
    [p + "attn.c_attn.bias", [3 * C]],
    [p + "attn.c_proj.weight", [C, C]],
    [p + "attn.c_proj.bias", [C]],
    [p + "ln_2.weight", [C]],
    [p + "ln_2.bias", [C]],
    [p + "mlp.c_fc.weight", [C, 4 * C]],
    [p + "mlp.c_fc.bias", [4 * C]],
    [p + "mlp.c_proj.weight", [4 * C, C]],
    [p + "mlp.c_proj.bias", [C]],
  ];
}

/** All tensors in Hugging Face order: wte, wpe, h.0 … h.{L-1}, ln_f. */
export function allTensorShapes(c: ModelConfig): Array<[string, number[]]> {
  const out: Array<[string, number[]]> = [
    ["wte.weight", [c.padded_vocab_size, c.n_embd]],
    ["wpe.weight", [c.n_positions, c.n_embd]],
  ];
  for (let l = 0; l < c.n_layer; l++) out.push(...layerTensorShapes(c, l));
  out.push(["ln_f.weight", [c.n_embd]], ["ln_f.bias", [c.n_embd]]);
  return out;
}

/** Lays out every parameter tensor in one flat buffer: decayed (2-D) tensors first, then the rest. */
export function paramLayout(c: ModelConfig, align = TENSOR_ALIGN): ParamLayout {
  return layoutOf(allTensorShapes(c), align);
}

/**
 * The flat layout of named tensors given in Hugging Face order: 2-D (decayed) ones first, each
 * at an offset aligned to `align` elements. paramLayout() is this over the whole model; a
 * tensor-parallel rank's layout is this over its shard shapes (model/shard.ts).
 */
export function layoutOf(shapes: Array<[string, number[]]>, align = TENSOR_ALIGN): ParamLayout {
  const tensors: TensorSpec[] = [];
  let offset = 0, numParams = 0;
  const place = (name: string, shape: number[], decay: boolean) => {
    const size = shape.reduce((a, b) => a * b, 1);
    tensors.push({ name, shape, size, offset, decay });
    offset += Math.ceil(size / align) * align;
    numParams += size;
  };
  for (const [name, shape] of shapes) if (shape.length === 2) place(name, shape, true);
  const decayEnd = offset;
  for (const [name, shape] of shapes) if (shape.length !== 2) place(name, shape, false);
  return {
    tensors,
    byName: new Map(tensors.map((t) => [t.name, t])),
    totalSize: offset,
    decayEnd,
    numParams,
  };
}

/** Parameter count by formula: V·C + P·C + L·(12C² + 13C) + 2C (padded vocabulary). */
export function parameterCount(c: ModelConfig): number {
  const C = c.n_embd;
  return c.padded_vocab_size * C + c.n_positions * C + c.n_layer * (12 * C * C + 13 * C) + 2 * C;
}
