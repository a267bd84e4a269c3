/**
 * Checkpoints on disk. Each one is a directory `<job dir>/iter_0000100/`; one written at tensor
 * parallel size 1 (TP=1) holds:
 * - `model.safetensors`: weights under Hugging Face GPT-2 names and layout (Conv1D weights
 *   [in, out], `lm_head` tied and omitted, wte cut to the real 50257 rows, metadata format "pt"),
 * - `config.json`: a GPT2Config that `transformers` accepts, so `from_pretrained(dir)` loads it,
 * - `optimizer.safetensors`: AdamW's m and v in the engine's flat layout,
 * - `manifest.json`: the full model config (real and padded vocabulary), iteration, training
 *   config, RNG and sampler state: everything needed to resume bit for bit,
 * - `tokenizer_config.json` (a model with a chat template: SFT, or fine-tuned from one): GPT-2's
 *   tokenizer settings with the template as `chat_template`, as transformers stores it (the
 *   manifest's `chat_template` is the same text, which resharding carries over).
 * One written at TP=N holds one pair of shard files per tensor-parallel rank instead,
 * `model-tp00-of-02.safetensors` (that rank's weights under the same names, at their shard
 * shapes, wte with its V_pad/N rows) and `optimizer-tp00-of-02.safetensors` (`m.<name>` and
 * `v.<name>` at the same shapes), plus `config.json` and the manifest.
 *
 * Since version 2 the manifest records the layout it was written at (`parallel`: tp and dp), the
 * vocabulary sizes (real, padded to 128, padded to 128·tp, rows per rank) and, for every tensor,
 * its global shape and the slices of it each shard file holds (Megatron dist_checkpointing's
 * global offsets): loading at another tp is a lookup in the records (model/shard.ts cuts
 * the new shards), resharding in memory. Version 1 manifests (TP=1, no records) are read as
 * their TP=1 records; TP=1 files are the same bytes as before version 2.
 *
 * A checkpoint is written under a temporary name, every file and the directory fsynced, and then
 * renamed into place, so a crash or power loss never leaves a half-written directory that looks
 * complete: a checkpoint exists once its manifest does. The rename is the commit point: a caller's
 * `beforeCommit` may refuse it there (a host that lost the job's lease), and the temporary
 * folder is removed, as it is when writing fails. Older ones are pruned only after the new
 * one is durable, keeping the newest `keep`. A write that fails (a full disk: ENOSPC) is a
 * CheckpointWriteError naming the checkpoint, its path and the file.
 *
 * The manifest records each file's size and SHA-256 (`checksums`, since this field was added;
 * older checkpoints load without it): loading verifies them, so a truncated or corrupted file
 * is refused naming it, never used. loadUsableCheckpoint() tries a job's checkpoints newest
 * first and passes over the unusable ones, saying why.
 */

import {
  allTensorShapes,
  makeConfig,
  type ModelConfig,
  type ParamLayout,
  paramLayout,
  TENSOR_ALIGN,
} from "../model/config.ts";
import type { ControlState } from "../engine/kernels/adamw.ts";
// The shard specs are pure (no WebGPU), so they are imported directly rather than through
// engine/parallel/mod.ts: this module runs in the HTTP process too.
import {
  checkTensorParallel,
  cutShard,
  shardLayout,
  shardSlices,
  type ShardSpec,
  shardSpecs,
  type Slice,
  type SplitKind,
  tensorParallelConfig,
  type VocabSizes,
  vocabSizes,
  writeSlices,
} from "../model/shard.ts";
import type { TrainConfig } from "../model/job.ts";
import {
  decodeSafetensors,
  type FileDigest,
  type NamedTensor,
  type OpenForWrite,
  openForWrite,
  type SafetensorsFile,
  sha256Hex,
  writeChunks,
  writeSafetensors,
} from "./safetensors.ts";

/** Identifies our manifests. */
export const CHECKPOINT_FORMAT = "gpt2-webgpu-checkpoint";
/** Version 2 added the layout, vocabulary and shard records (and TP=N shard files); 1 is still read. */
export const CHECKPOINT_VERSION = 2;
const READABLE_VERSIONS = [1, 2];

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

/** A `config.json` that transformers' GPT2Config accepts. */
export function hfConfig(
  model: ModelConfig,
  train: Pick<TrainConfig, "attention_dropout" | "hidden_dropout">,
) {
  return {
    architectures: ["GPT2LMHeadModel"],
    model_type: "gpt2",
    vocab_size: model.vocab_size,
    n_positions: model.n_positions,
    n_ctx: model.n_positions,
    n_embd: model.n_embd,
    n_layer: model.n_layer,
    n_head: model.n_head,
    n_inner: null,
    activation_function: "gelu_new",
    resid_pdrop: train.hidden_dropout,
    embd_pdrop: train.hidden_dropout,
    attn_pdrop: train.attention_dropout,
    layer_norm_epsilon: 1e-5,
    initializer_range: 0.02,
    scale_attn_weights: true,
    use_cache: true,
    bos_token_id: 50256,
    eos_token_id: 50256,
    tie_word_embeddings: true,
    torch_dtype: "float32",
  };
}

/**
 * A `tokenizer_config.json` for GPT-2's tokenizer (transformers' GPT2Tokenizer, the files of the
 * `gpt2` hub model: `<|endoftext|>` as bos, eos and unk) carrying `chat_template`.
 */
export function tokenizerConfig(model: ModelConfig, chatTemplate: string) {
  return {
    tokenizer_class: "GPT2Tokenizer",
    model_max_length: model.n_positions,
    add_prefix_space: false,
    bos_token: "<|endoftext|>",
    eos_token: "<|endoftext|>",
    unk_token: "<|endoftext|>",
    chat_template: chatTemplate,
  };
}

/** The chat template of a model folder (a checkpoint or a Hugging Face one), from its `tokenizer_config.json`. */
export async function readChatTemplate(dir: string): Promise<string | undefined> {
  try {
    const t = JSON.parse(await Deno.readTextFile(`${dir}/tokenizer_config.json`)).chat_template;
    return typeof t === "string" && t ? t : undefined;
  } catch {
    return undefined;
  }
}

/** Everything `saveCheckpoint` writes besides the tensors. */
export interface CheckpointMeta {
  job_id: string;
  /** The model at the layout saved (at TP=N: padded_vocab_size a multiple of N, see tensorParallelConfig()). */
  model: ModelConfig;
  train: TrainConfig;
  sampler: SamplerState;
  metrics: CheckpointManifest["metrics"];
  /** The model's chat template, saved in `tokenizer_config.json` (absent: none). */
  chat_template?: string;
}

/** Options of saveCheckpoint(). */
export interface SaveOptions {
  /** Data-parallel size, recorded in the manifest (default 1); each state holds its TP rank's whole moments. */
  dataParallel?: number;
  /**
   * Asked once every file is written and durable, right before the commit (the rename into
   * place, and the moving aside of a same-named older one): throwing refuses the commit, and the
   * temporary folder is removed. Several hosts fence the files on the job's lease here.
   */
  beforeCommit?: (name: string, iteration: number) => Promise<void>;
  /**
   * Tests only: opens each file for writing instead of Deno.open, to make writes fail part-way
   * (a full disk) and check that nothing saved before is lost.
   */
  openFile?: OpenForWrite;
}

/** The reason of a failed write, ENOSPC and EDQUOT spelled out. */
function ioReason(e: unknown): string {
  const message = e instanceof Error ? e.message : String(e);
  const code = (e as { code?: unknown } | null)?.code;
  if (code === "ENOSPC" || /No space left on device|os error 28\b/.test(message)) {
    return "no space left on device (ENOSPC)";
  }
  if (code === "EDQUOT" || /Disk quota exceeded|os error 122\b/.test(message)) {
    return "disk quota exceeded (EDQUOT)";
  }
  return message;
}

/** A file of a checkpoint that could not be written (writeCheckpointFiles()); `cause` is the error. */
export class FileWriteError extends Error {
  constructor(readonly file: string, cause: unknown) {
    super(`Cannot write "${file}": ${ioReason(cause)}`, { cause });
    this.name = "FileWriteError";
  }
}

/**
 * A checkpoint that could not be written, e.g. on a full disk: `Cannot write checkpoint
 * "iter_0000200" to "<dir>/iter_0000200" (model.safetensors): no space left on device (ENOSPC)`.
 * Nothing of it was committed; the checkpoints saved before are untouched.
 */
export class CheckpointWriteError extends Error {
  /** The error's code (e.g. "ENOSPC"), when it had one. */
  readonly code: string | null;
  constructor(name: string, path: string, file: string | null, cause: unknown) {
    super(`Cannot write checkpoint "${name}" to "${path}"${file ? ` (${file})` : ""}: ${ioReason(cause)}`, {
      cause,
    });
    this.name = "CheckpointWriteError";
    const code = (cause as { code?: unknown } | null)?.code;
    this.code = typeof code === "string" ? code : ioReason(cause).includes("(ENOSPC)") ? "ENOSPC" : null;
  }
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

/** The manifest as JSON: pretty-printed, with one line per tensor record. */
function manifestText(manifest: CheckpointManifest): string {
  const { tensors, ...rest } = manifest;
  const head = JSON.stringify(rest, null, 2);
  const lines = tensors.map((t) => "    " + JSON.stringify(t)).join(",\n");
  return `${head.slice(0, -2)},\n  "tensors": [\n${lines}\n  ]\n}\n`;
}

function refuseNonFinite(states: CheckpointState[]): void {
  states.forEach((state, r) => {
    const bad = firstNonFinite(state.params);
    if (bad < 0) return;
    const of = states.length > 1 ? ` of tensor-parallel rank ${r}` : "";
    throw new Error(
      `Refusing to save checkpoint at iteration ${state.step}: parameter ${bad}${of} is ${state.params[bad]}`,
    );
  });
}

/**
 * Writes a checkpoint's files into the new, empty directory `dir`, each fsynced, the manifest
 * last; `states[r]` is tensor-parallel rank r's state in shardLayout(base.model, states.length).
 * The caller fsyncs and renames `dir`. Returns the manifest written. A failed write throws
 * FileWriteError naming the file; files written so far stay in `dir` for the caller to remove.
 */
export async function writeCheckpointFiles(
  dir: string,
  base: ManifestBase,
  states: CheckpointState[],
  dataParallel = 1,
  open: OpenForWrite = openForWrite,
): Promise<CheckpointManifest> {
  const tp = states.length, model = base.model;
  checkTensorParallel(model, tp);
  const layout = shardLayout(model, tp);
  for (const [r, st] of states.entries()) {
    for (const [what, a] of [["params", st.params], ["m", st.m], ["v", st.v]] as const) {
      if (a.length !== layout.totalSize) {
        throw new Error(
          `Cannot save checkpoint at iteration ${st.step}: ${what} of rank ${r} has ${a.length} floats, the layout ${layout.totalSize}`,
        );
      }
    }
    if (st.step !== states[0].step) {
      throw new Error(`Cannot save checkpoint: rank ${r} is at step ${st.step}, rank 0 at ${states[0].step}`);
    }
  }
  const step = String(states[0].step);
  const checksums: Record<string, FileDigest> = {};
  // Each file's size and hash go into the manifest; a failed write names its file.
  const put = async (file: string, write: (path: string) => Promise<FileDigest>) => {
    try {
      checksums[file] = await write(`${dir}/${file}`);
    } catch (e) {
      throw new FileWriteError(file, e);
    }
  };
  const putText = (file: string, text: string) =>
    put(file, (path) => writeChunks(path, [new TextEncoder().encode(text)], open));
  let files: CheckpointFiles;
  if (tp === 1) {
    const [state] = states;
    files = { model: "model.safetensors", optimizer: "optimizer.safetensors", hf_config: "config.json" };
    await put(
      files.model!,
      (path) => writeSafetensors(path, exportTensors(model, state.params), { format: "pt" }, open),
    );
    await put(files.optimizer!, (path) =>
      writeSafetensors(
        path,
        [
          { name: "m", shape: [state.m.length], data: state.m },
          { name: "v", shape: [state.v.length], data: state.v },
        ],
        { format: "pt", layout: "flat", align: String(TENSOR_ALIGN), step },
        open,
      ));
  } else {
    files = { hf_config: "config.json", shards: [] };
    const specs = shardSpecs(model, tp);
    for (const [r, state] of states.entries()) {
      const names = shardFileNames(tp, r);
      const meta = { format: "pt", tensor_parallel: String(tp), tp_rank: String(r) };
      // Hugging Face order in the files, as at TP=1.
      const named = (prefix: string, flat: Float32Array) =>
        specs.map(({ name }) => {
          const t = layout.byName.get(name)!;
          return { name: prefix + name, shape: t.shape, data: flat.subarray(t.offset, t.offset + t.size) };
        });
      await put(names.model, (path) => writeSafetensors(path, named("", state.params), meta, open));
      await put(names.optimizer, (path) =>
        writeSafetensors(
          path,
          [...named("m.", state.m), ...named("v.", state.v)],
          { ...meta, layout: "tensors", step },
          open,
        ));
      files.shards!.push({ tp_rank: r, ...names });
    }
  }
  await putText("config.json", JSON.stringify(hfConfig(model, base.train), null, 2) + "\n");
  if (base.chat_template) {
    await putText(
      "tokenizer_config.json",
      JSON.stringify(tokenizerConfig(model, base.chat_template), null, 2) + "\n",
    );
  }
  const { control, resharded_from, ...head } = base;
  const manifest: CheckpointManifest = {
    ...head,
    parallel: { tensor_parallel: tp, data_parallel: dataParallel },
    vocab: vocabSizes(model, tp),
    ...(control ? { control } : {}),
    files,
    checksums: { ...checksums },
    ...(resharded_from ? { resharded_from } : {}),
    tensors: tensorRecords(model, tp),
  };
  // The manifest goes last: a directory with a manifest is complete.
  await putText("manifest.json", manifestText(manifest));
  return manifest;
}

/**
 * Writes a checkpoint into `jobDir` under a temporary name, renames it into place, then keeps
 * only the newest `keep`. Returns its name and path. `state` is the whole model's state, or one
 * state per tensor-parallel rank (rank r's in shardLayout(meta.model, tp), tp = the array's
 * length), written as one pair of shard files per rank. A failed write (ENOSPC...) throws
 * CheckpointWriteError with the temporary folder removed and every older checkpoint in place.
 */
export async function saveCheckpoint(
  jobDir: string,
  meta: CheckpointMeta,
  state: CheckpointState | CheckpointState[],
  keep: number,
  opts: SaveOptions = {},
): Promise<{ name: string; path: string }> {
  const states = Array.isArray(state) ? state : [state];
  if (states.length === 0) throw new Error("Cannot save checkpoint: no rank states");
  refuseNonFinite(states);
  const step = states[0].step;
  const name = checkpointName(step);
  const path = `${jobDir}/${name}`;
  const failed = (file: string | null, e: unknown) => new CheckpointWriteError(name, path, file, e);
  const tmp = `${jobDir}/.tmp-${name}-${crypto.randomUUID().slice(0, 8)}`;
  try {
    await Deno.mkdir(jobDir, { recursive: true });
    await Deno.mkdir(tmp);
  } catch (e) {
    throw failed(null, e);
  }
  try {
    await writeCheckpointFiles(
      tmp,
      {
        format: CHECKPOINT_FORMAT,
        version: CHECKPOINT_VERSION,
        job_id: meta.job_id,
        name,
        iteration: step,
        created_at: new Date().toISOString(),
        model: meta.model,
        train: meta.train,
        rng: { seed: meta.train.seed, step },
        sampler: meta.sampler,
        metrics: meta.metrics,
        ...(meta.chat_template ? { chat_template: meta.chat_template } : {}),
        ...(states[0].control ? { control: states[0].control } : {}),
      },
      states,
      opts.dataParallel ?? 1,
      opts.openFile,
    );
    try {
      await fsyncPath(tmp);
    } catch (e) {
      throw failed(null, e);
    }
    await opts.beforeCommit?.(name, step);
  } catch (e) {
    // Nothing was committed: leave no half-written or refused folder behind.
    await Deno.remove(tmp, { recursive: true }).catch(() => {});
    throw e instanceof FileWriteError ? failed(e.file, e.cause) : e;
  }
  // A same-named checkpoint (a step saved again after a resume) is moved aside, not deleted, until
  // the new one is in place and durable; if the new one cannot be put in place, it goes back.
  let aside: string | null = `${jobDir}/.old-${name}-${crypto.randomUUID().slice(0, 8)}`;
  try {
    try {
      await Deno.rename(path, aside);
    } catch (e) {
      if (!(e instanceof Deno.errors.NotFound)) throw e;
      aside = null;
    }
    await Deno.rename(tmp, path);
  } catch (e) {
    if (aside) await Deno.rename(aside, path).catch(() => {});
    await Deno.remove(tmp, { recursive: true }).catch(() => {});
    throw failed(null, e);
  }
  try {
    await fsyncPath(jobDir);
  } catch (e) {
    throw failed(null, e);
  }
  // Pruning (and dropping the replaced one) only once the new checkpoint is durable.
  if (aside) await Deno.remove(aside, { recursive: true });
  await pruneCheckpoints(jobDir, keep);
  return { name, path };
}

/** Tensor alignment of the flat layout in checkpoints that do not record theirs. */
const LEGACY_TENSOR_ALIGN = 64;

/** Moves a flat array laid out with `fromAlign` into today's layout; a length that fits neither is returned as is (and refused by the caller). */
function moveLayout(model: ModelConfig, data: Float32Array, fromAlign: number): Float32Array {
  const from = paramLayout(model, fromAlign), to = paramLayout(model);
  if (data.length !== from.totalSize) return data;
  const out = new Float32Array(to.totalSize);
  for (const t of to.tensors) {
    const src = from.byName.get(t.name)!;
    out.set(data.subarray(src.offset, src.offset + src.size), t.offset);
  }
  return out;
}

/** Index of the first NaN or infinity in `a`, or -1. */
export function firstNonFinite(a: Float32Array): number {
  // x - x is 0 for every finite x and NaN for NaN and both infinities.
  for (let i = 0; i < a.length; i++) if (a[i] - a[i] !== 0) return i;
  return -1;
}

/** fsyncs a file or directory (a directory's fsync makes the renames inside it durable). */
export async function fsyncPath(path: string): Promise<void> {
  using f = await Deno.open(path, { read: true });
  await f.sync();
}

/**
 * Removes temporary (`.tmp-*`) and moved-aside (`.old-*`) directories left in `dir` by a process
 * that died while writing; run at server start, when no writer can be active. Returns their names.
 */
export async function removeStaleTemporaries(dir: string): Promise<string[]> {
  const removed: string[] = [];
  let entries: Deno.DirEntry[];
  try {
    entries = await Array.fromAsync(Deno.readDir(dir));
  } catch (e) {
    if (e instanceof Deno.errors.NotFound) return removed;
    throw e;
  }
  for (const e of entries) {
    if (!e.name.startsWith(".tmp-") && !e.name.startsWith(".old-")) continue;
    await Deno.remove(`${dir}/${e.name}`, { recursive: true });
    removed.push(e.name);
  }
  return removed;
}

/** removeStaleTemporaries() in every job's checkpoint directory under `root/checkpoints`. */
export async function removeStaleCheckpointTemporaries(root: string): Promise<string[]> {
  const removed: string[] = [];
  try {
    for await (const e of Deno.readDir(`${root}/checkpoints`)) {
      if (!e.isDirectory) continue;
      const found = await removeStaleTemporaries(`${root}/checkpoints/${e.name}`);
      removed.push(...found.map((n) => `checkpoints/${e.name}/${n}`));
    }
  } catch (e) {
    if (!(e instanceof Deno.errors.NotFound)) throw e;
  }
  return removed;
}

/** Complete checkpoints in `jobDir`, oldest first; temporary directories are skipped. */
export async function listCheckpoints(jobDir: string): Promise<CheckpointInfo[]> {
  const out: CheckpointInfo[] = [];
  let entries: Deno.DirEntry[];
  try {
    entries = await Array.fromAsync(Deno.readDir(jobDir));
  } catch (e) {
    if (e instanceof Deno.errors.NotFound) return [];
    throw e;
  }
  for (const e of entries) {
    if (!e.isDirectory || !e.name.startsWith("iter_")) continue;
    const path = `${jobDir}/${e.name}`;
    let manifest: CheckpointManifest;
    try {
      manifest = JSON.parse(await Deno.readTextFile(`${path}/manifest.json`));
    } catch {
      continue;
    }
    let bytes = 0;
    for await (const f of Deno.readDir(path)) {
      if (f.isFile) bytes += (await Deno.stat(`${path}/${f.name}`)).size;
    }
    out.push({
      name: e.name,
      path,
      iteration: manifest.iteration,
      created_at: manifest.created_at,
      bytes,
      metrics: manifest.metrics,
      tensor_parallel: manifest.parallel?.tensor_parallel ?? 1,
    });
  }
  return out.sort((a, b) => a.iteration - b.iteration);
}

/** Removes all but the newest `keep` checkpoints. */
export async function pruneCheckpoints(jobDir: string, keep: number): Promise<void> {
  const all = await listCheckpoints(jobDir);
  for (const c of all.slice(0, Math.max(0, all.length - Math.max(1, keep)))) {
    await Deno.remove(c.path, { recursive: true });
  }
}

/** Reads a checkpoint's manifest; a version 1 manifest is given its TP=1 layout, vocabulary and shard records. */
export async function readManifest(path: string): Promise<CheckpointManifest> {
  let manifest: CheckpointManifest;
  try {
    manifest = JSON.parse(await Deno.readTextFile(`${path}/manifest.json`));
  } catch (e) {
    throw new Error(`Cannot load checkpoint "${path}": ${(e as Error).message}`);
  }
  if (manifest.format !== CHECKPOINT_FORMAT || !READABLE_VERSIONS.includes(manifest.version)) {
    throw new Error(
      `Cannot load checkpoint "${path}": format "${manifest.format}" v${manifest.version} is not "${CHECKPOINT_FORMAT}" v${
        READABLE_VERSIONS.join(" or v")
      }`,
    );
  }
  const model = modelOf(manifest, path);
  if (manifest.version === 1) {
    return {
      ...manifest,
      parallel: { tensor_parallel: 1, data_parallel: 1 },
      vocab: vocabSizes(model, 1),
      tensors: tensorRecords(model, 1),
    };
  }
  const tp = manifest.parallel?.tensor_parallel;
  const bad = (what: string) => new Error(`Cannot load checkpoint "${path}": ${what}`);
  if (!Number.isInteger(tp) || tp < 1) {
    throw bad(`parallel.tensor_parallel ${JSON.stringify(tp)} is not a positive integer`);
  }
  if (!Array.isArray(manifest.tensors)) throw bad("the manifest has no tensor records");
  if (
    tp === 1 && (typeof manifest.files?.model !== "string" || typeof manifest.files?.optimizer !== "string")
  ) {
    throw bad("files.model and files.optimizer are missing");
  }
  if (
    tp > 1 && (manifest.files?.shards?.length !== tp || manifest.files.shards.some((f, r) => f.tp_rank !== r))
  ) {
    throw bad(`files.shards does not list one model and optimizer file for each of ${tp} ranks`);
  }
  return manifest;
}

/** The model config of a manifest (at the layout it was written at). */
function modelOf(manifest: CheckpointManifest, path: string): ModelConfig {
  try {
    return makeConfig(manifest.model);
  } catch (e) {
    throw new Error(`Cannot load checkpoint "${path}": ${(e as Error).message}`);
  }
}

/**
 * The model to serve a checkpoint with on one GPU: its config, with the vocabulary padded for
 * tp 1 when it was written at TP>1 (its shards are merged in memory, see loadCheckpointWeights()).
 */
export function mergedModel(manifest: CheckpointManifest): ModelConfig {
  const model = makeConfig(manifest.model);
  return (manifest.parallel?.tensor_parallel ?? 1) > 1 ? tensorParallelConfig(model, 1) : model;
}

function checkArchitecture(path: string, saved: ModelConfig, model: ModelConfig): void {
  for (const k of ["n_layer", "n_head", "n_embd", "n_positions", "vocab_size"] as const) {
    if (saved[k] !== model[k]) {
      throw new Error(`Cannot load checkpoint "${path}": ${k} ${saved[k]} does not match ${model[k]}`);
    }
  }
}

/** How to load: at which tensor-parallel size, as which rank. */
export interface LoadOptions {
  /** Tensor-parallel size to load at (default 1: the whole model). */
  tensorParallel?: number;
  /** The rank whose shard to return (default 0). */
  rank?: number;
}

/**
 * Loads a checkpoint for training with `model`: its manifest and rank `rank`'s engine state at
 * tensor-parallel size `tensorParallel`, in shardLayout(model, tensorParallel), whatever the
 * size it was written at: shards are merged and cut again in memory, AdamW moments with their
 * weights. `model` gives the padded vocabulary to load at (tensorParallelConfig(config, tp));
 * when it differs from the checkpoint's, wte rows past the real vocabulary are zero in the
 * weights and both moments, and real rows are kept bit for bit. Refuses a checkpoint whose
 * architecture differs. A TP=1 checkpoint loaded at tp 1 with its own padding is read as before
 * (moments in an older flat layout are moved into today's).
 */
export async function loadCheckpoint(
  path: string,
  model: ModelConfig,
  opts: LoadOptions = {},
): Promise<{ manifest: CheckpointManifest; state: CheckpointState }> {
  const { manifest, states } = await loadCheckpointRanks(path, model, opts.tensorParallel ?? 1, [
    opts.rank ?? 0,
  ]);
  return { manifest, state: states[0] };
}

/** A checkpoint loadUsableCheckpoint() passed over, and why. */
export interface UnusableCheckpoint {
  path: string;
  reason: string;
}

/**
 * Loads the first of `paths` (a job's checkpoints, newest first) that loads and verifies, as
 * loadCheckpoint() does: a truncated or corrupted one (or one that fails to load for any other
 * reason) is passed over for the next, and listed in `skipped` with the reason. Throws naming
 * every one and its reason when none is usable: a job never starts over silently.
 */
export async function loadUsableCheckpoint(
  paths: string[],
  model: ModelConfig,
  opts: LoadOptions = {},
): Promise<
  { path: string; manifest: CheckpointManifest; state: CheckpointState; skipped: UnusableCheckpoint[] }
> {
  if (paths.length === 0) throw new Error("Cannot resume: no checkpoint was given");
  const skipped: UnusableCheckpoint[] = [];
  for (const path of paths) {
    try {
      return { path, ...await loadCheckpoint(path, model, opts), skipped };
    } catch (e) {
      const reason = (e as Error).message || String(e);
      skipped.push({
        path,
        reason: reason.includes(path) ? reason : `Cannot load checkpoint "${path}": ${reason}`,
      });
    }
  }
  throw new Error(
    `Cannot resume: ${
      paths.length === 1 ? "its checkpoint is" : `none of its ${paths.length} checkpoints is`
    } usable: ${skipped.map((u) => u.reason).join("; ")}`,
  );
}

/**
 * loadCheckpoint() for several ranks at once, reading the files once: `states[i]` is rank
 * `ranks[i]`'s (default every rank, in order).
 */
export async function loadCheckpointRanks(
  path: string,
  model: ModelConfig,
  tensorParallel: number,
  ranks?: number[],
): Promise<{ manifest: CheckpointManifest; states: CheckpointState[] }> {
  const manifest = await readManifest(path);
  const saved = modelOf(manifest, path);
  checkArchitecture(path, saved, model);
  const tp = tensorParallel;
  checkTensorParallel(model, tp);
  const want = ranks ?? Array.from({ length: tp }, (_, r) => r);
  for (const r of want) {
    if (!Number.isInteger(r) || r < 0 || r >= tp) {
      throw new RangeError(`rank must be in [0, ${tp}), got "${r}"`);
    }
  }
  const from = manifest.parallel.tensor_parallel;
  if (from === 1 && tp === 1 && saved.padded_vocab_size === model.padded_vocab_size) {
    const whole = await loadWhole(path, manifest, model);
    return { manifest, states: want.map(() => whole) };
  }
  const globals = retarget(await readGlobals(path, manifest, saved, true), saved, model);
  const layout = shardLayout(model, tp), specs = shardSpecs(model, tp);
  const states = want.map((r) => ({
    step: manifest.iteration,
    params: packRank(globals.params, specs, layout, r),
    m: packRank(globals.m!, specs, layout, r),
    v: packRank(globals.v!, specs, layout, r),
    control: manifest.control,
  }));
  return { manifest, states };
}

/**
 * A checkpoint's weights alone (the optimizer files are not read): rank `rank`'s flat buffer at
 * `tensorParallel` (default: the whole model, as generation on one GPU wants, merging the shards
 * of a TP>1 checkpoint in memory). Padded wte rows are zero.
 */
export async function loadCheckpointWeights(
  path: string,
  model: ModelConfig,
  opts: LoadOptions = {},
): Promise<Float32Array> {
  const manifest = await readManifest(path);
  const saved = modelOf(manifest, path);
  checkArchitecture(path, saved, model);
  const tp = opts.tensorParallel ?? 1, rank = opts.rank ?? 0;
  checkTensorParallel(model, tp);
  if (manifest.parallel.tensor_parallel === 1 && tp === 1) {
    const weights = await readCheckpointFile(path, manifest, manifest.files.model!);
    return importTensors(model, weights.tensors, path);
  }
  const globals = retarget(await readGlobals(path, manifest, saved, false), saved, model);
  return packRank(globals.params, shardSpecs(model, tp), shardLayout(model, tp), rank);
}

/**
 * Reads one safetensors file of the checkpoint at `path`, verified against the size and SHA-256
 * its manifest records (checkpoints from before `checksums` only decode, which refuses a file
 * cut short of its tensors). Errors name the checkpoint and the file.
 */
async function readCheckpointFile(
  path: string,
  manifest: CheckpointManifest,
  file: string,
): Promise<SafetensorsFile> {
  const fail = (what: string) => new Error(`Cannot load checkpoint "${path}": ${what}`);
  let bytes: Uint8Array;
  try {
    bytes = await Deno.readFile(`${path}/${file}`);
  } catch (e) {
    throw fail(`cannot read "${file}": ${(e as Error).message}`);
  }
  const want = manifest.checksums?.[file];
  if (want) {
    if (bytes.length !== want.bytes) {
      throw fail(
        `"${file}" has ${bytes.length} bytes, its manifest records ${want.bytes} (truncated or overwritten)`,
      );
    }
    const got = sha256Hex(bytes);
    if (got !== want.sha256) {
      throw fail(`"${file}" is corrupted: its SHA-256 is ${got}, its manifest records ${want.sha256}`);
    }
  }
  try {
    return decodeSafetensors(bytes, file);
  } catch (e) {
    throw fail((e as Error).message.replace(/^Cannot read /, "cannot read "));
  }
}

/** A TP=1 checkpoint at its own layout, read exactly as before shards existed. */
async function loadWhole(
  path: string,
  manifest: CheckpointManifest,
  model: ModelConfig,
): Promise<CheckpointState> {
  const weights = await readCheckpointFile(path, manifest, manifest.files.model!);
  const params = importTensors(model, weights.tensors, path);
  const opt = await readCheckpointFile(path, manifest, manifest.files.optimizer!);
  // Moments are stored in the engine's flat layout; checkpoints from before 128-element alignment
  // (no "align" in the metadata) used 64 and are moved tensor by tensor into today's layout.
  const align = Number(opt.metadata.align ?? LEGACY_TENSOR_ALIGN);
  const relayout = (t: { shape: number[]; data: Float32Array } | undefined) =>
    t && align !== TENSOR_ALIGN ? { ...t, data: moveLayout(model, t.data, align) } : t;
  const m = relayout(opt.tensors.get("m")), v = relayout(opt.tensors.get("v"));
  if (!m || !v || m.data.length !== params.length || v.data.length !== params.length) {
    throw new Error(
      `Cannot load checkpoint "${path}": optimizer state does not match ${params.length} parameters`,
    );
  }
  return { step: manifest.iteration, params, m: m.data, v: v.data, control: manifest.control };
}

/** Whole tensors by name: weights, and AdamW's moments when read. */
interface Globals {
  params: Map<string, Float32Array>;
  m?: Map<string, Float32Array>;
  v?: Map<string, Float32Array>;
}

const sizeOf = (shape: number[]) => shape.reduce((a, b) => a * b, 1);

/**
 * Assembles every tensor of a checkpoint whole, at the layout it was written at, from its shard
 * records: each shard file is read once and its slices pasted into the global tensors. Slices
 * stored twice (replicated tensors, on every rank) are taken from the lowest rank.
 */
async function readGlobals(
  path: string,
  manifest: CheckpointManifest,
  saved: ModelConfig,
  moments: boolean,
): Promise<Globals> {
  const fail = (what: string) => new Error(`Cannot load checkpoint "${path}": ${what}`);
  const tp = manifest.parallel.tensor_parallel;
  const byName = new Map(manifest.tensors.map((t) => [t.name, t]));
  const records = allTensorShapes(saved).map(([name, shape]) => {
    const rec = byName.get(name);
    if (!rec) throw fail(`tensor "${name}" has no shard record`);
    if (rec.global_shape.join(",") !== shape.join(",")) {
      throw fail(`tensor "${name}" has global shape [${rec.global_shape}], expected [${shape}]`);
    }
    return rec;
  });
  const alloc = () => new Map(records.map((r) => [r.name, new Float32Array(sizeOf(r.global_shape))]));
  const out: Globals = { params: alloc() };
  const sharded = moments && tp > 1;
  if (sharded) [out.m, out.v] = [alloc(), alloc()];
  const seen = new Map(records.map((r) => [r.name, new Set<string>()]));
  const covered = new Map(records.map((r) => [r.name, 0]));
  for (let r = 0; r < tp; r++) {
    const files = tp === 1
      ? { model: manifest.files.model!, optimizer: manifest.files.optimizer! }
      : manifest.files.shards![r];
    const weights = await readCheckpointFile(path, manifest, files.model);
    const opt = sharded ? await readCheckpointFile(path, manifest, files.optimizer) : null;
    for (const rec of records) {
      for (const shard of rec.shards) {
        if (shard.tp_rank !== r) continue;
        const key = JSON.stringify(shard.slices);
        if (seen.get(rec.name)!.has(key)) continue;
        seen.get(rec.name)!.add(key);
        const paste = (
          into: Map<string, Float32Array>,
          file: typeof weights,
          name: string,
          fileName: string,
        ) => {
          const t = file.tensors.get(name) ??
            (name === rec.name ? file.tensors.get(`transformer.${name}`) : undefined);
          if (!t) throw fail(`tensor "${name}" is missing from "${fileName}"`);
          if (t.shape.join(",") !== shard.shape.join(",")) {
            throw fail(`tensor "${name}" in "${fileName}" has shape [${t.shape}], expected [${shard.shape}]`);
          }
          try {
            writeSlices(into.get(rec.name)!, rec.global_shape, t.data, shard.shape, shard.slices, rec.axis);
          } catch (e) {
            throw fail(`tensor "${name}" in "${fileName}": ${(e as Error).message}`);
          }
        };
        paste(out.params, weights, rec.name, files.model);
        if (opt) {
          paste(out.m!, opt, `m.${rec.name}`, files.optimizer);
          paste(out.v!, opt, `v.${rec.name}`, files.optimizer);
        }
        covered.set(rec.name, covered.get(rec.name)! + shard.slices.reduce((a, s) => a + sizeOf(s.shape), 0));
      }
    }
  }
  for (const rec of records) {
    const size = sizeOf(rec.global_shape), got = covered.get(rec.name)!;
    // Only wte may leave rows out: its padding, zero.
    const need = rec.name === "wte.weight" ? saved.vocab_size * saved.n_embd : size;
    if (got < need || got > size) {
      throw fail(`the shards of tensor "${rec.name}" cover ${got} of its ${size} values`);
    }
  }
  if (moments && tp === 1) {
    const opt = await readCheckpointFile(path, manifest, manifest.files.optimizer!);
    const layout = paramLayout(saved, Number(opt.metadata.align ?? LEGACY_TENSOR_ALIGN));
    for (const which of ["m", "v"] as const) {
      const flat = opt.tensors.get(which)?.data;
      if (!flat || flat.length !== layout.totalSize) {
        throw fail(`optimizer state does not match ${layout.totalSize} parameters`);
      }
      out[which] = new Map(layout.tensors.map((t) => [t.name, flat.subarray(t.offset, t.offset + t.size)]));
    }
  }
  return out;
}

/**
 * The global tensors for `model`'s padded vocabulary: when it differs from the checkpoint's, wte
 * (and its moments) keep the real rows bit for bit and every padded row is zero.
 */
function retarget(globals: Globals, saved: ModelConfig, model: ModelConfig): Globals {
  if (saved.padded_vocab_size === model.padded_vocab_size) return globals;
  const real = model.vocab_size * model.n_embd;
  const move = (map: Map<string, Float32Array> | undefined) => {
    if (!map) return map;
    const wte = new Float32Array(model.padded_vocab_size * model.n_embd);
    wte.set(map.get("wte.weight")!.subarray(0, real));
    return new Map(map).set("wte.weight", wte);
  };
  return { params: move(globals.params)!, m: move(globals.m), v: move(globals.v) };
}

/** Rank `rank`'s flat buffer (`layout`) cut from whole tensors. */
function packRank(
  globals: Map<string, Float32Array>,
  specs: ShardSpec[],
  layout: ParamLayout,
  rank: number,
): Float32Array {
  const out = new Float32Array(layout.totalSize);
  for (const spec of specs) {
    const g = globals.get(spec.name)!, t = layout.byName.get(spec.name)!;
    out.set(spec.tp === 1 ? g : cutShard(spec, rank, g), t.offset);
  }
  return out;
}
