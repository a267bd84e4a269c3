/**
 * Resharding a checkpoint: write a copy of it at another tensor-parallel size. Loading already
 * reshards in memory (loadCheckpoint at any tp), so this is only for a converted copy on disk,
 * e.g. the merged TP=1 folder that Hugging Face transformers loads from a TP=2 run. The copy is
 * written like a saved checkpoint: into a temporary folder beside the destination, every file
 * and the folder fsynced, then renamed into place; an existing destination is never replaced.
 *
 * Used by `deno task reshard SRC --tensor-parallel N --out DST` (scripts/reshard.ts) and by
 * `POST /checkpoints/reshard` (server/routes/checkpoints.ts), which writes `checkpoints/<name>/iter_N/`
 * under the data directory, where generation, `resume_from` and the model list find it.
 */

import { basename, dirname } from "node:path";
import { ConfigError, makeConfig } from "../model/config.ts";
import { tensorParallelConfig } from "../model/shard.ts";
import {
  CHECKPOINT_VERSION,
  type CheckpointManifest,
  fsyncPath,
  listCheckpoints,
  loadCheckpointRanks,
  readManifest,
  writeCheckpointFiles,
} from "./checkpoint.ts";

/** A resharding request that cannot be done: `status` for HTTP, `field` names the culprit. */
export class ReshardError extends Error {
  constructor(readonly status: 400 | 404 | 409, readonly field: string, message: string) {
    super(message);
    this.name = "ReshardError";
  }
}

/** What a resharding wrote. */
export interface ReshardResult {
  path: string;
  manifest: CheckpointManifest;
  from_tensor_parallel: number;
  tensor_parallel: number;
  /** File names in the new folder and its total size. */
  files: string[];
  bytes: number;
}

async function exists(path: string): Promise<boolean> {
  try {
    await Deno.lstat(path);
    return true;
  } catch (e) {
    if (e instanceof Deno.errors.NotFound) return false;
    throw e;
  }
}

/**
 * Writes checkpoint `src` resharded to `tensorParallel` ranks as the new folder `dst` (its parent
 * is created). `label` names the source in the copy's `resharded_from` (default `src`). Throws
 * ReshardError naming `checkpoint`, `tensor_parallel` or `destination`.
 */
export async function reshardCheckpoint(
  src: string,
  dst: string,
  tensorParallel: number,
  opts: { label?: string } = {},
): Promise<ReshardResult> {
  const label = opts.label ?? src;
  if (!(await exists(`${src}/manifest.json`))) {
    // A job's folder holds its checkpoints: name one of them.
    const inside = (await Array.fromAsync(Deno.readDir(src)).catch(() => []))
      .filter((e) => e.isDirectory && /^iter_\d+$/.test(e.name)).map((e) => e.name).sort();
    throw new ReshardError(
      404,
      "checkpoint",
      `Checkpoint "${label}" not found: no manifest.json in "${src}"` +
        (inside.length ? `; it holds checkpoints: give one of them, e.g. "${src}/${inside.at(-1)}"` : ""),
    );
  }
  let manifest: CheckpointManifest;
  try {
    manifest = await readManifest(src);
  } catch (e) {
    throw new ReshardError(400, "checkpoint", (e as Error).message);
  }
  let target;
  try {
    target = tensorParallelConfig(makeConfig(manifest.model), tensorParallel);
  } catch (e) {
    if (!(e instanceof ConfigError)) throw e;
    throw new ReshardError(
      400,
      e.field === "tensor_parallel" ? e.field : "checkpoint",
      `Cannot reshard "${label}" to tensor_parallel ${tensorParallel}: ${e.detail}`,
    );
  }
  if (await exists(dst)) {
    throw new ReshardError(409, "destination", `Cannot reshard to "${dst}": it already exists`);
  }
  const parent = dirname(dst);
  await Deno.mkdir(parent, { recursive: true });
  const tmp = `${parent}/.tmp-${basename(dst)}-${crypto.randomUUID().slice(0, 8)}`;
  await Deno.mkdir(tmp);
  try {
    let states;
    try {
      ({ states } = await loadCheckpointRanks(src, target, tensorParallel));
    } catch (e) {
      throw new ReshardError(400, "checkpoint", (e as Error).message);
    }
    const { parallel, vocab: _v, files: _f, tensors: _t, resharded_from: _r, ...base } = manifest;
    const written = await writeCheckpointFiles(
      tmp,
      {
        ...base,
        version: CHECKPOINT_VERSION,
        created_at: new Date().toISOString(),
        model: target,
        resharded_from: {
          checkpoint: label,
          tensor_parallel: parallel.tensor_parallel,
          created_at: manifest.created_at,
        },
      },
      states,
      parallel.data_parallel,
    );
    await fsyncPath(tmp);
    // rename() would replace an empty directory made meanwhile: check once more just before.
    if (await exists(dst)) {
      throw new ReshardError(409, "destination", `Cannot reshard to "${dst}": it already exists`);
    }
    await Deno.rename(tmp, dst);
    await fsyncPath(parent);
    const files: string[] = [];
    let bytes = 0;
    for await (const f of Deno.readDir(dst)) {
      files.push(f.name);
      bytes += (await Deno.stat(`${dst}/${f.name}`)).size;
    }
    return {
      path: dst,
      manifest: written,
      from_tensor_parallel: parallel.tensor_parallel,
      tensor_parallel: tensorParallel,
      files: files.sort(),
      bytes,
    };
  } catch (e) {
    await Deno.remove(tmp, { recursive: true }).catch(() => {});
    throw e;
  }
}

/** Names a resharded copy may take: a job-id-like folder name (so `resume_from` accepts it). */
export const RESHARD_NAME = /^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$/;

/** What `POST /checkpoints/reshard` asks. */
export interface ReshardRequest {
  /** "<job id>" (its newest checkpoint) or "<job id>/iter_N". */
  checkpoint: string;
  tensor_parallel: number;
  /** Folder under checkpoints/ for the copy (default "<job id>-tp<N>"). */
  name?: string;
}

/**
 * Reshards checkpoint `req.checkpoint` into `checkpointDir(name)/iter_N`. `checkpointDir` maps
 * an id to its folder under the data directory's `checkpoints/`; `isJob` says whether a name
 * belongs to a training job (whose folder a copy must not enter: pruning would remove it).
 * Returns the copy's id "<name>/iter_N" with the result.
 */
export async function reshardByName(
  checkpointDir: (id: string) => string,
  isJob: (id: string) => boolean,
  req: ReshardRequest,
): Promise<ReshardResult & { id: string; name: string; source: string }> {
  const [job, iter, ...rest] = req.checkpoint.split("/");
  if (!RESHARD_NAME.test(job) || rest.length > 0 || (iter !== undefined && !/^iter_\d+$/.test(iter))) {
    throw new ReshardError(
      400,
      "checkpoint",
      `Invalid checkpoint "${req.checkpoint}": expected "<job id>" or "<job id>/iter_0001000" (a checkpoint as GET /jobs/:id/checkpoints names it)`,
    );
  }
  const all = await listCheckpoints(checkpointDir(job));
  const found = iter ? all.find((c) => c.name === iter) : all.at(-1);
  if (!found) {
    throw new ReshardError(
      404,
      "checkpoint",
      `Checkpoint "${req.checkpoint}" not found: expected a job id with saved checkpoints or "<job id>/iter_0001000" (a checkpoint as GET /jobs/:id/checkpoints names it)`,
    );
  }
  const name = req.name ?? `${job}-tp${req.tensor_parallel}`;
  if (!RESHARD_NAME.test(name)) {
    throw new ReshardError(400, "name", `Invalid name "${name}": use 1-64 letters, digits, '-' or '_'`);
  }
  if (isJob(name)) {
    throw new ReshardError(
      409,
      "name",
      `Name "${name}" is a training job's id: choose another name for the resharded copy`,
    );
  }
  // A name holds copies of one run: another run's would mix with them (the newest of both answers for the name).
  const srcRun = (await readManifest(found.path).catch(() => null))?.job_id;
  for (const held of await listCheckpoints(checkpointDir(name))) {
    const run = (await readManifest(held.path).catch(() => null))?.job_id;
    if (run !== undefined && srcRun !== undefined && run !== srcRun) {
      throw new ReshardError(
        409,
        "name",
        `Name "${name}" holds copies of another run (job "${run}"): choose another name for this one's`,
      );
    }
  }
  const source = `${job}/${found.name}`;
  const dst = `${checkpointDir(name)}/${found.name}`;
  if (await exists(dst)) {
    throw new ReshardError(
      409,
      "name",
      `Checkpoint "${name}/${found.name}" already exists: choose another name`,
    );
  }
  let result: ReshardResult;
  try {
    result = await reshardCheckpoint(found.path, dst, req.tensor_parallel, { label: source });
  } catch (e) {
    if (e instanceof ReshardError && e.field === "destination") {
      throw new ReshardError(
        409,
        "name",
        `Checkpoint "${name}/${found.name}" already exists: choose another name`,
      );
    }
    throw e;
  }
  return { ...result, id: `${name}/${found.name}`, name, source };
}
