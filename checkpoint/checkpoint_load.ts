/**
 * Loading checkpoints (the layout is described in checkpoint.ts): the manifest read and checked,
 * every file verified against its recorded size and SHA-256, and the engine state rebuilt at any
 * tensor-parallel size and padded vocabulary, shards merged and cut again in memory.
 */

import {
  allTensorShapes,
  makeConfig,
  type ModelConfig,
  type ParamLayout,
  paramLayout,
  TENSOR_ALIGN,
} from "../model/config.ts";
// The shard specs are pure (no WebGPU): this module runs in the HTTP process too.
import {
  checkTensorParallel,
  cutShard,
  shardLayout,
  type ShardSpec,
  shardSpecs,
  tensorParallelConfig,
  vocabSizes,
  writeSlices,
} from "../model/shard.ts";
import { decodeSafetensors, type SafetensorsFile, sha256Hex } from "./safetensors.ts";
import {
  CHECKPOINT_FORMAT,
  type CheckpointManifest,
  type CheckpointState,
  importTensors,
  READABLE_VERSIONS,
  tensorRecords,
} from "./checkpoint_format.ts";

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
      paths.length === 1 ? "its checkpoint is not" : `none of its ${paths.length} checkpoints is`
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
