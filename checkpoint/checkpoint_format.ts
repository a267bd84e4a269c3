/**
 * What a checkpoint is on disk, shared by writing (checkpoint.ts) and loading
 * (checkpoint_load.ts): the manifest's format and records, shard file names, and the mapping
 * between the engine's flat parameter buffer and Hugging Face GPT-2 tensors. The layout itself is
 * described in checkpoint.ts.
 */

import { allTensorShapes, type ModelConfig, paramLayout } from "../model/config.ts";
import type { ControlState } from "../engine/kernels/adamw.ts";
// The shard specs are pure (no WebGPU): this module runs in the HTTP process too.
import { shardSlices, shardSpecs, type Slice, type SplitKind, type VocabSizes } from "../model/shard.ts";
import type { TrainConfig } from "../job/job.ts";
import type { FileDigest, NamedTensor } from "./safetensors.ts";

/** Identifies our manifests. */
export const CHECKPOINT_FORMAT = "gpt2-webgpu-checkpoint";
/** Version 2 added the layout, vocabulary and shard records (and TP=N shard files); 1 is still read. */
export const CHECKPOINT_VERSION = 2;
export const READABLE_VERSIONS = [1, 2];

/** Sampler position (data/ Sampler's `state`). */
export interface SamplerState {
  epoch: number;
  position: number;
}

/** One shard file's piece of a global tensor: the tensor it stores and the slices of the global one it holds. */
export interface ShardRecord {
  /** The tensor-parallel rank whose files hold it. */
  tp_rank: number;
  /** Shape of the tensor in the file. */
  shape: number[];
  /** Boxes of the global tensor, concatenated along the record's `axis` in the stored tensor. */
  slices: Slice[];
}

/** Where one parameter tensor is stored. Moments follow their weight's shards (TP=1: the flat layout). */
export interface TensorRecord {
  name: string;
  /** Shape of the whole tensor at this layout (wte: the padded vocabulary of its tp). */
  global_shape: number[];
  split: SplitKind;
  axis: number;
  /** Rows of wte outside every slice (TP=1: the padding) are zero. */
  shards: ShardRecord[];
}

/** The files of a checkpoint. */
export interface CheckpointFiles {
  hf_config: string;
  /** TP=1: the Hugging Face weights file (`model.safetensors`). */
  model?: string;
  /** TP=1: m and v in the flat layout (`optimizer.safetensors`). */
  optimizer?: string;
  /** TP>1: each rank's weights and `m.<name>`, `v.<name>` moments, in rank order. */
  shards?: Array<{ tp_rank: number; model: string; optimizer: string }>;
}

/** What `manifest.json` holds. */
export interface CheckpointManifest {
  format: typeof CHECKPOINT_FORMAT;
  version: number;
  job_id: string;
  name: string;
  /** Iterations done when saved; training resumes at this step. */
  iteration: number;
  created_at: string;
  /** The model at this layout: padded_vocab_size is the vocabulary padded for its tp. */
  model: ModelConfig;
  /** The parallel layout it was written at. */
  parallel: { tensor_parallel: number; data_parallel: number };
  vocab: VocabSizes;
  train: TrainConfig;
  /** Dropout is counter-based: (seed, step) is the whole RNG state. */
  rng: { seed: number; step: number };
  sampler: SamplerState;
  metrics: { loss: number | null; val_loss: number | null };
  /** The optimizer's control state (see CheckpointState.control). */
  control?: ControlState;
  files: CheckpointFiles;
  /**
   * Size and SHA-256 of every file but the manifest, by file name; verified on loading. Absent
   * in checkpoints written before it was added (they load unverified, as before).
   */
  checksums?: Record<string, FileDigest>;
  /** The chat template (Jinja, data/chat.ts), also in `tokenizer_config.json`; absent: none. */
  chat_template?: string;
  /** Set on a copy written by checkpoint/reshard.ts: what it was converted from. */
  resharded_from?: { checkpoint: string; tensor_parallel: number; created_at: string };
  /** Every parameter tensor's shards, in Hugging Face order. */
  tensors: TensorRecord[];
}

/**
 * The engine state a checkpoint stores: one rank's flat buffers in `shardLayout(model, tp)`,
 * which is `paramLayout(model)` at tp 1.
 */
export interface CheckpointState {
  step: number;
  params: Float32Array;
  m: Float32Array;
  v: Float32Array;
  /** Optimizer step, skipped-step counters and loss scaler (absent in older checkpoints: `step` optimizer steps). */
  control?: ControlState;
}

/** A checkpoint found on disk. */
export interface CheckpointInfo {
  name: string;
  path: string;
  iteration: number;
  created_at: string;
  bytes: number;
  metrics: CheckpointManifest["metrics"];
  /** The tensor-parallel size it was written at. */
  tensor_parallel: number;
}

/** Directory name of the checkpoint at `iteration`. */
export function checkpointName(iteration: number): string {
  return `iter_${String(iteration).padStart(7, "0")}`;
}

/** Splits a flat parameter buffer into Hugging Face tensors; wte keeps only the real vocabulary rows. */
export function exportTensors(config: ModelConfig, params: Float32Array): NamedTensor[] {
  const layout = paramLayout(config);
  if (params.length !== layout.totalSize) {
    throw new Error(
      `Cannot export parameters: ${params.length} floats do not match the layout's ${layout.totalSize}`,
    );
  }
  // Hugging Face order (wte, wpe, h.0 ... h.{L-1}, ln_f), not the decay-first buffer order.
  return allTensorShapes(config).map(([name]) => {
    const t = layout.byName.get(name)!;
    const shape = name === "wte.weight" ? [config.vocab_size, config.n_embd] : t.shape;
    const size = shape[0] * (shape[1] ?? 1);
    return { name, shape, data: params.subarray(t.offset, t.offset + size) };
  });
}

/**
 * Rebuilds the flat parameter buffer from Hugging Face tensors (names with or without the
 * `transformer.` prefix), padding wte back to `padded_vocab_size` with zero rows.
 */
export function importTensors(
  config: ModelConfig,
  tensors: Map<string, { shape: number[]; data: Float32Array }>,
  what = "checkpoint",
): Float32Array {
  const layout = paramLayout(config);
  const flat = new Float32Array(layout.totalSize);
  for (const t of layout.tensors) {
    const found = tensors.get(t.name) ?? tensors.get(`transformer.${t.name}`);
    if (!found) throw new Error(`Cannot load checkpoint "${what}": tensor "${t.name}" is missing`);
    const want = t.name === "wte.weight" ? [config.vocab_size, config.n_embd] : t.shape;
    if (t.name === "wte.weight" && found.shape[0] !== config.vocab_size) {
      throw new Error(
        `Cannot load checkpoint "${what}": vocabulary ${found.shape[0]} does not match ${config.vocab_size}`,
      );
    }
    if (found.shape.join(",") !== want.join(",")) {
      throw new Error(
        `Cannot load checkpoint "${what}": tensor "${t.name}" has shape [${found.shape}], expected [${want}]`,
      );
    }
    flat.set(found.data, t.offset); // wte's padded rows stay zero
  }
  return flat;
}

/** The manifest fields that do not depend on how the tensors are laid out in files. */
export type ManifestBase = Omit<CheckpointManifest, "parallel" | "vocab" | "files" | "tensors">;

/** File names of rank `rank`'s shards at tensor-parallel size `tp`, e.g. `model-tp00-of-02.safetensors`. */
export function shardFileNames(tp: number, rank: number): { model: string; optimizer: string } {
  const w = Math.max(2, String(tp - 1).length);
  const tag = `tp${String(rank).padStart(w, "0")}-of-${String(tp).padStart(w, "0")}`;
  return { model: `model-${tag}.safetensors`, optimizer: `optimizer-${tag}.safetensors` };
}

/** The shard records of every tensor of `model` at `tp`; at TP=1 wte is stored with its real rows only. */
export function tensorRecords(model: ModelConfig, tp: number): TensorRecord[] {
  return shardSpecs(model, tp).map((spec) => {
    const shards = Array.from({ length: tp }, (_, r) => ({
      tp_rank: r,
      shape: spec.shape,
      slices: shardSlices(spec, r),
    }));
    if (tp === 1 && spec.name === "wte.weight") {
      const real = [model.vocab_size, model.n_embd];
      shards[0] = { tp_rank: 0, shape: real, slices: [{ offset: [0, 0], shape: real }] };
    }
    return { name: spec.name, global_shape: spec.globalShape, split: spec.split, axis: spec.axis, shards };
  });
}
