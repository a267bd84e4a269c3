/**
 * What generation can load, and loading it. Two kinds of model live under the data directory:
 * - the product's own checkpoints, `checkpoints/<job id>/iter_N/` (id "<job id>" for the newest,
 *   "<job id>/iter_N" for one), whose manifest holds the model config;
 * - Hugging Face GPT-2 directories, `models/<name>/` with `config.json` and `model.safetensors`
 *   (F32, F16 or BF16, widened to float32; names with or without `transformer.`), id "<name>".
 * Both store wte with the real 50257 rows; `importTensors` pads it back to the padded vocabulary.
 * A checkpoint written at tensor parallel size N > 1 (one shard file per rank) is served on one
 * GPU: its config is given the tp 1 vocabulary and its shards are merged in memory on load.
 * Resolving reads only small JSON files (HTTP thread); `loadWeights` reads the tensors (Worker),
 * and `loadWeightsAt` one rank's shard of them for a fine-tuning job at any tensor-parallel size.
 */

import { GPT2_VOCAB_SIZE, makeConfig, type ModelConfig } from "../model/config.ts";
import {
  importTensors,
  listCheckpoints,
  loadCheckpointWeights,
  mergedModel,
  readManifest,
} from "./checkpoint.ts";
import { InvalidJobError, ModelNotFoundError } from "../job/errors.ts";
import type { ModelSource } from "../protocol.ts";
import { readSafetensors } from "./safetensors.ts";
import { splitParams } from "../model/shard.ts";

/** A model as `GET /v1/models` lists it. */
export interface ModelInfo {
  id: string;
  kind: ModelSource["kind"];
  /** Unix seconds. */
  created: number;
  config: ModelConfig;
}

const NAME = /^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/;

async function exists(path: string): Promise<boolean> {
  try {
    await Deno.stat(path);
    return true;
  } catch {
    return false;
  }
}

/** The model config of a Hugging Face `config.json`; only GPT-2's vocabulary is accepted. */
async function hfModelConfig(dir: string, id: string): Promise<ModelConfig> {
  let raw: Record<string, unknown>;
  try {
    raw = JSON.parse(await Deno.readTextFile(`${dir}/config.json`));
  } catch (e) {
    throw new InvalidJobError("model", `Cannot load model "${id}": config.json: ${(e as Error).message}`);
  }
  const vocab = Number(raw.vocab_size ?? GPT2_VOCAB_SIZE);
  if (vocab !== GPT2_VOCAB_SIZE) {
    throw new InvalidJobError(
      "model",
      `Cannot load model "${id}": vocabulary ${vocab} does not match GPT-2's ${GPT2_VOCAB_SIZE}`,
    );
  }
  try {
    return makeConfig({
      n_layer: Number(raw.n_layer),
      n_head: Number(raw.n_head),
      n_embd: Number(raw.n_embd),
      n_positions: Number(raw.n_positions ?? raw.n_ctx),
    });
  } catch (e) {
    throw new InvalidJobError("model", `Cannot load model "${id}": ${(e as Error).message}`);
  }
}

/**
 * A cheap signature of what resolveModelSource(root, id) reads, from a few synchronous stats and no
 * file reads: the job's checkpoint folder (a committed checkpoint is renamed into it, a pruned one
 * removed, both change its modification time), the named checkpoint's folder, and the HF
 * directory's weights and config. Equal signatures mean the lookup would answer the same; null
 * for an id that names nothing resolvable.
 */
export function modelSourceStamp(root: string, id: string): string | null {
  const [first, name, ...rest] = id.split("/");
  if (!NAME.test(first) || rest.length > 0 || (name !== undefined && !/^iter_\d+$/.test(name))) return null;
  const sig = (path: string) => {
    try {
      const st = Deno.statSync(path);
      return `${st.ino ?? ""}:${st.size}:${st.mtime?.getTime() ?? ""}`;
    } catch {
      return "-";
    }
  };
  const job = `${root}/checkpoints/${first}`, dir = `${root}/models/${first}`;
  return [
    sig(job),
    name === undefined ? "" : sig(`${job}/${name}`),
    sig(`${dir}/model.safetensors`),
    sig(`${dir}/config.json`),
  ].join("|");
}

/**
 * Resolves a model id under data directory `root`. Throws ModelNotFoundError for an unknown id
 * and InvalidJobError("model") for one that exists but cannot be used.
 */
export async function resolveModelSource(root: string, id: string): Promise<ModelSource> {
  const [first, name, ...rest] = id.split("/");
  if (!NAME.test(first) || rest.length > 0 || (name !== undefined && !/^iter_\d+$/.test(name))) {
    throw new ModelNotFoundError(id);
  }
  const jobDir = `${root}/checkpoints/${first}`;
  const all = await listCheckpoints(jobDir);
  if (all.length > 0 || name !== undefined) {
    const found = name ? all.find((c) => c.name === name) : all.at(-1);
    if (!found) throw new ModelNotFoundError(id);
    const manifest = await readManifest(found.path);
    return {
      id: `${first}/${found.name}`,
      kind: "checkpoint",
      path: found.path,
      version: manifest.created_at,
      config: mergedModel(manifest),
    };
  }
  const dir = `${root}/models/${first}`;
  if (!(await exists(`${dir}/model.safetensors`))) throw new ModelNotFoundError(id);
  const stat = await Deno.stat(`${dir}/model.safetensors`);
  return {
    id: first,
    kind: "safetensors",
    path: dir,
    version: String(stat.mtime?.getTime() ?? 0),
    config: await hfModelConfig(dir, first),
  };
}

/** Every loadable model: each job's newest checkpoint ("<job id>"), each checkpoint, each HF directory. */
export async function listModelSources(root: string): Promise<ModelInfo[]> {
  const out: ModelInfo[] = [];
  const dirs = async (path: string) => {
    try {
      return (await Array.fromAsync(Deno.readDir(path))).filter((e) => e.isDirectory && NAME.test(e.name))
        .map((e) => e.name).sort();
    } catch {
      return [];
    }
  };
  for (const job of await dirs(`${root}/checkpoints`)) {
    const all = await listCheckpoints(`${root}/checkpoints/${job}`);
    for (const [i, c] of all.entries()) {
      const manifest = await readManifest(c.path).catch(() => null);
      if (!manifest) continue;
      const created = Math.floor(Date.parse(c.created_at) / 1000);
      const info = { kind: "checkpoint" as const, created, config: mergedModel(manifest) };
      if (i === all.length - 1) out.push({ id: job, ...info });
      out.push({ id: `${job}/${c.name}`, ...info });
    }
  }
  for (const name of await dirs(`${root}/models`)) {
    const dir = `${root}/models/${name}`;
    const stat = await Deno.stat(`${dir}/model.safetensors`).catch(() => null);
    const config = stat && await hfModelConfig(dir, name).catch(() => null);
    if (!stat || !config) continue;
    out.push({
      id: name,
      kind: "safetensors",
      created: Math.floor((stat.mtime?.getTime() ?? 0) / 1000),
      config,
    });
  }
  return out;
}

/** Reads a model's weights into the engine's flat layout (wte padded with zero rows), merging a checkpoint's tensor-parallel shards. */
export async function loadWeights(source: ModelSource): Promise<Float32Array> {
  if (source.kind === "checkpoint") return await loadCheckpointWeights(source.path, source.config);
  const file = await readSafetensors(`${source.path}/model.safetensors`);
  return importTensors(source.config, file.tensors, source.id);
}

/**
 * A model's weights as rank `rank` of a job at tensor-parallel size `tp` trains them: `model` is
 * that job's config (tensorParallelConfig for tp > 1, its padded vocabulary), the result is in
 * shardLayout(model, tp) with padded wte rows zero, whatever size a checkpoint was written at.
 */
export async function loadWeightsAt(
  source: ModelSource,
  model: ModelConfig,
  tp = 1,
  rank = 0,
): Promise<Float32Array> {
  if (source.kind === "checkpoint") {
    return await loadCheckpointWeights(source.path, model, { tensorParallel: tp, rank });
  }
  const file = await readSafetensors(`${source.path}/model.safetensors`);
  const full = importTensors(model, file.tensors, source.id);
  return tp > 1 ? splitParams(model, tp, full)[rank] : full;
}
