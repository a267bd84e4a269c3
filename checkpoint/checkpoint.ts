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
 *
 * This module writes, lists and prunes checkpoints; the manifest's records and the Hugging Face
 * tensor mapping are in checkpoint_format.ts, loading in checkpoint_load.ts (both re-exported here).
 */

import { type ModelConfig, TENSOR_ALIGN } from "../model/config.ts";
// The shard specs are pure (no WebGPU), so they are imported directly rather than through
// engine/parallel/mod.ts: this module runs in the HTTP process too.
import { checkTensorParallel, shardLayout, shardSpecs, vocabSizes } from "../model/shard.ts";
import type { TrainConfig } from "../job/job.ts";
import {
  type FileDigest,
  type OpenForWrite,
  openForWrite,
  writeChunks,
  writeSafetensors,
} from "./safetensors.ts";
import {
  CHECKPOINT_FORMAT,
  CHECKPOINT_VERSION,
  type CheckpointFiles,
  type CheckpointInfo,
  type CheckpointManifest,
  checkpointName,
  type CheckpointState,
  exportTensors,
  type ManifestBase,
  type SamplerState,
  shardFileNames,
  tensorRecords,
} from "./checkpoint_format.ts";

export {
  CHECKPOINT_FORMAT,
  CHECKPOINT_VERSION,
  type CheckpointFiles,
  type CheckpointInfo,
  type CheckpointManifest,
  checkpointName,
  type CheckpointState,
  exportTensors,
  importTensors,
  type ManifestBase,
  type SamplerState,
  shardFileNames,
  type ShardRecord,
  type TensorRecord,
  tensorRecords,
} from "./checkpoint_format.ts";
export {
  loadCheckpoint,
  loadCheckpointRanks,
  loadCheckpointWeights,
  type LoadOptions,
  loadUsableCheckpoint,
  mergedModel,
  readManifest,
  type UnusableCheckpoint,
} from "./checkpoint_load.ts";

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
 * `gpt2` hub model: `<|endoftext|>` as bos, eos and unk, and registered as the special token 50256
 * so that the text `<|endoftext|>` a chat template writes encodes as that one token, as ours does)
 * carrying `chat_template`.
 */
export function tokenizerConfig(model: ModelConfig, chatTemplate: string) {
  return {
    tokenizer_class: "GPT2Tokenizer",
    model_max_length: model.n_positions,
    add_prefix_space: false,
    added_tokens_decoder: {
      "50256": {
        content: "<|endoftext|>",
        lstrip: false,
        normalized: true,
        rstrip: false,
        single_word: false,
        special: true,
      },
    },
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
