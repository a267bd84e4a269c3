/**
 * Checkpoints on disk. Each one is a directory `<job dir>/iter_0000100/` holding:
 * - `model.safetensors`: weights under Hugging Face GPT-2 names and layout (Conv1D weights
 *   [in, out], `lm_head` tied and omitted, wte cut to the real 50257 rows, metadata format "pt"),
 * - `config.json`: a GPT2Config that `transformers` accepts, so `from_pretrained(dir)` loads it,
 * - `optimizer.safetensors`: AdamW's m and v in the engine's flat layout,
 * - `manifest.json`: the full model config (real and padded vocabulary), iteration, training
 *   config, RNG and sampler state: everything needed to resume bit for bit.
 * A checkpoint is written under a temporary name, every file and the directory fsynced, and then
 * renamed into place, so a crash or power loss never leaves a half-written directory that looks
 * complete: a checkpoint exists once its manifest does. Older ones are pruned only after the new
 * one is durable, keeping the newest `keep`.
 */

import { allTensorShapes, makeConfig, type ModelConfig, paramLayout, TENSOR_ALIGN } from "../gpu/config.ts";
import type { ControlState } from "../gpu/kernels/adamw.ts";
import type { TrainConfig } from "./types.ts";
import { type NamedTensor, readSafetensors, writeSafetensors } from "./safetensors.ts";

/** Identifies our manifests. */
export const CHECKPOINT_FORMAT = "gpt2-webgpu-checkpoint";
export const CHECKPOINT_VERSION = 1;

/** Sampler position (data/ Sampler's `state`). */
export interface SamplerState {
  epoch: number;
  position: number;
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
  model: ModelConfig;
  train: TrainConfig;
  /** Dropout is counter-based: (seed, step) is the whole RNG state. */
  rng: { seed: number; step: number };
  sampler: SamplerState;
  metrics: { loss: number | null; val_loss: number | null };
  /** The optimizer's control state (see CheckpointState.control). */
  control?: ControlState;
  files: { model: string; optimizer: string; hf_config: string };
}

/** The engine state a checkpoint stores (flat layout of `paramLayout(model)`). */
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

/** Everything `saveCheckpoint` writes besides the tensors. */
export interface CheckpointMeta {
  job_id: string;
  model: ModelConfig;
  train: TrainConfig;
  sampler: SamplerState;
  metrics: CheckpointManifest["metrics"];
}

/**
 * Writes a checkpoint into `jobDir` under a temporary name, renames it into place, then keeps
 * only the newest `keep`. Returns its name and path.
 */
export async function saveCheckpoint(
  jobDir: string,
  meta: CheckpointMeta,
  state: CheckpointState,
  keep: number,
): Promise<{ name: string; path: string }> {
  const bad = firstNonFinite(state.params);
  if (bad >= 0) {
    throw new Error(
      `Refusing to save checkpoint at iteration ${state.step}: parameter ${bad} is ${state.params[bad]}`,
    );
  }
  await Deno.mkdir(jobDir, { recursive: true });
  const name = checkpointName(state.step);
  const tmp = `${jobDir}/.tmp-${name}-${crypto.randomUUID().slice(0, 8)}`;
  await Deno.mkdir(tmp);
  const manifest: CheckpointManifest = {
    format: CHECKPOINT_FORMAT,
    version: CHECKPOINT_VERSION,
    job_id: meta.job_id,
    name,
    iteration: state.step,
    created_at: new Date().toISOString(),
    model: meta.model,
    train: meta.train,
    rng: { seed: meta.train.seed, step: state.step },
    sampler: meta.sampler,
    metrics: meta.metrics,
    ...(state.control ? { control: state.control } : {}),
    files: { model: "model.safetensors", optimizer: "optimizer.safetensors", hf_config: "config.json" },
  };
  await writeSafetensors(`${tmp}/model.safetensors`, exportTensors(meta.model, state.params), {
    format: "pt",
  });
  await writeSafetensors(`${tmp}/optimizer.safetensors`, [
    { name: "m", shape: [state.m.length], data: state.m },
    { name: "v", shape: [state.v.length], data: state.v },
  ], { format: "pt", layout: "flat", align: String(TENSOR_ALIGN), step: String(state.step) });
  await Deno.writeTextFile(
    `${tmp}/config.json`,
    JSON.stringify(hfConfig(meta.model, meta.train), null, 2) + "\n",
  );
  await fsyncPath(`${tmp}/config.json`);
  // The manifest goes last: a directory with a manifest is complete.
  await Deno.writeTextFile(`${tmp}/manifest.json`, JSON.stringify(manifest, null, 2) + "\n");
  await fsyncPath(`${tmp}/manifest.json`);
  await fsyncPath(tmp);
  const path = `${jobDir}/${name}`;
  // A same-named checkpoint (a step saved again after a resume) is moved aside, not deleted, until
  // the new one is in place and durable.
  let aside: string | null = `${jobDir}/.old-${name}-${crypto.randomUUID().slice(0, 8)}`;
  try {
    await Deno.rename(path, aside);
  } catch (e) {
    if (!(e instanceof Deno.errors.NotFound)) throw e;
    aside = null;
  }
  await Deno.rename(tmp, path);
  await fsyncPath(jobDir);
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

/** Reads a checkpoint's manifest. */
export async function readManifest(path: string): Promise<CheckpointManifest> {
  let manifest: CheckpointManifest;
  try {
    manifest = JSON.parse(await Deno.readTextFile(`${path}/manifest.json`));
  } catch (e) {
    throw new Error(`Cannot load checkpoint "${path}": ${(e as Error).message}`);
  }
  if (manifest.format !== CHECKPOINT_FORMAT || manifest.version !== CHECKPOINT_VERSION) {
    throw new Error(
      `Cannot load checkpoint "${path}": format "${manifest.format}" v${manifest.version} is not "${CHECKPOINT_FORMAT}" v${CHECKPOINT_VERSION}`,
    );
  }
  return manifest;
}

/**
 * Loads a checkpoint for training with `model`: its manifest and the engine state. Refuses a
 * checkpoint whose architecture differs.
 */
export async function loadCheckpoint(
  path: string,
  model: ModelConfig,
): Promise<{ manifest: CheckpointManifest; state: CheckpointState }> {
  const manifest = await readManifest(path);
  const saved = makeConfig(manifest.model);
  for (
    const k of ["n_layer", "n_head", "n_embd", "n_positions", "vocab_size", "padded_vocab_size"] as const
  ) {
    if (saved[k] !== model[k]) {
      throw new Error(`Cannot load checkpoint "${path}": ${k} ${saved[k]} does not match ${model[k]}`);
    }
  }
  const weights = await readSafetensors(`${path}/${manifest.files.model}`);
  const params = importTensors(model, weights.tensors, path);
  const opt = await readSafetensors(`${path}/${manifest.files.optimizer}`);
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
  return {
    manifest,
    state: { step: manifest.iteration, params, m: m.data, v: v.data, control: manifest.control },
  };
}
