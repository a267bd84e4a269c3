/**
 * What a submitted job is checked against before it is queued: the model it starts from, its
 * dataset and splits, its evaluation tasks, the checkpoint it resumes from, and the GPUs its ranks
 * need. Each refusal is an InvalidJobError naming the request's field.
 */

import { InvalidJobError, ModelNotFoundError } from "../../job/errors.ts";
import type { ModelSource } from "../../protocol.ts";
import { resolveModelSource } from "../../checkpoint/model_source.ts";
import { listCheckpoints, mergedModel, readManifest } from "../../checkpoint/checkpoint.ts";
import { resolveModel } from "../../job/job_config.ts";
import { DEFAULT_SPLIT, parseSplitWeights } from "../../data/split.ts";
import { isBuiltinName } from "../../data/builtin.ts";
import type { EvaluateRequest } from "../../job/job_config.ts";
import type { TrainConfig } from "../../job/job.ts";
import { getDataset } from "../../data/store.ts";
import { isChatDataset } from "../../data/chat_dataset.ts";
import { encode } from "gpt-tokenizer/encoding/r50k_base";
import { checkEvalData } from "./task_files.ts";

/** What the checks read: the data directory and the datasets (see RunnerOptions). */
export interface CheckContext {
  root: string;
  datasetExists: (id: string) => Promise<boolean>;
  splitTokens?: (id: string) => Promise<{ train: number; valid: number; test: number } | null>;
}

/** The dataset lookups of the checks over `root`'s prepared datasets and the built-ins (which have no counts until prepared). */
export function datasetLookups(root: string): Omit<CheckContext, "root"> {
  const info = (id: string) => getDataset(root, id).catch(() => undefined);
  return {
    datasetExists: async (id) => isBuiltinName(id) || (await info(id)) !== undefined,
    splitTokens: async (id) => isBuiltinName(id) ? null : (await info(id))?.splits ?? null,
  };
}

/** The error naming `id` unknown in `field`, as {@link modelSource} words it: the same for a model that is another user's. */
export function unknownModel(id: string, field: string): InvalidJobError {
  return new InvalidJobError(
    field,
    `Unknown model "${id}" in ${field}: expected a job id, "<job id>/iter_0001000" (a checkpoint as GET /jobs/:id/checkpoints names it) or a folder under models/ ` +
      "(see GET /v1/models)",
  );
}

/**
 * A model the server knows (see checkpoint/model_source.ts), for `field`: an unknown or unusable
 * one is an InvalidJobError naming that field.
 */
export async function modelSource(root: string, id: string, field: string): Promise<ModelSource> {
  try {
    return await resolveModelSource(root, id);
  } catch (e) {
    if (e instanceof ModelNotFoundError) throw unknownModel(id, field);
    if (e instanceof InvalidJobError) throw new InvalidJobError(field, e.message);
    throw e;
  }
}

/** The checkpoint `spec` ("<job id>" for its newest, or "<job id>/iter_N") names, as a path under `root`. */
export async function resolveResume(root: string, spec: string): Promise<string> {
  const [jobId, name, ...rest] = spec.split("/");
  if (
    !/^[A-Za-z0-9_-]+$/.test(jobId) || rest.length > 0 || (name !== undefined && !/^iter_\d+$/.test(name))
  ) {
    throw new InvalidJobError(
      "resume_from",
      `Invalid resume_from "${spec}": expected "<job id>" or "<job id>/iter_0001000" (a checkpoint as GET /jobs/:id/checkpoints names it)`,
    );
  }
  const all = await listCheckpoints(`${root}/checkpoints/${jobId}`);
  const found = name ? all.find((c) => c.name === name) : all.at(-1);
  if (!found) {
    // A job without checkpoints is answered as an unknown one (as another user's job is).
    const has = all.length > 0 ? `: job "${jobId}" has ${all.map((c) => c.name).join(", ")}` : "";
    throw new InvalidJobError("resume_from", `Unknown checkpoint "${spec}"${has}`);
  }
  return found.path;
}

/**
 * What a resumed run must agree with in its checkpoint: the same architecture, and iterations
 * left to train (refused at submission, not when the job fails after queueing).
 */
async function checkResume(root: string, config: TrainConfig): Promise<void> {
  const path = await resolveResume(root, config.resume_from!);
  const manifest = await readManifest(path).catch(() => null);
  if (!manifest) return; // an unreadable checkpoint is passed over at start, for an older one
  const saved = mergedModel(manifest), want = resolveModel(config);
  for (const k of ["n_layer", "n_head", "n_embd", "n_positions"] as const) {
    if (saved[k] !== want[k]) {
      throw new InvalidJobError(
        "model",
        `resume_from "${config.resume_from}" is a model with ${k} ${saved[k]}, this job's has ${want[k]}: ` +
          `resume with the checkpoint's model, or use init_from to fine-tune another`,
      );
    }
  }
  if (config.train_iters <= manifest.iteration) {
    throw new InvalidJobError(
      "train_iters",
      `train_iters ${config.train_iters} is not past resume_from "${config.resume_from}", saved at ` +
        `iteration ${manifest.iteration}: nothing would be trained`,
    );
  }
}

/** Checks a completed training config on a server with `trainers` GPUs that take training. */
export async function checkTrainConfig(
  ctx: CheckContext,
  config: TrainConfig,
  trainers: number,
): Promise<void> {
  const dp = config.data_parallel ?? 1, tp = config.tensor_parallel ?? 1;
  if (dp * tp > trainers) {
    const what = tp > 1 ? `data_parallel ${dp} × tensor_parallel ${tp}` : `data_parallel ${dp}`;
    throw new InvalidJobError(
      tp > 1 ? "tensor_parallel" : "data_parallel",
      `${what} needs ${dp * tp} GPU workers that take training; this server has ${trainers} ` +
        `(GPT2_GPUS, GPT2_GPU_ROLES)`,
    );
  }
  if (!(await ctx.datasetExists(config.dataset))) {
    throw new InvalidJobError("dataset", `Unknown dataset "${config.dataset}"`);
  }
  try {
    parseSplitWeights(config.split);
  } catch (e) {
    throw new InvalidJobError("split", (e as Error).message);
  }
  // A built-in is cut at the job's split; a prepared dataset keeps the split it was prepared with,
  // so another one (other than the default, which means "the dataset's own") is refused.
  if (!isBuiltinName(config.dataset) && config.split.replaceAll(" ", "") !== DEFAULT_SPLIT.join(",")) {
    const info = await getDataset(ctx.root, config.dataset).catch(() => undefined);
    const own = info?.options?.split;
    const ratios = (w: readonly number[]) => w.map((x) => x / (w[0] + w[1] + w[2]));
    const same = (a: readonly number[], b: readonly number[]) =>
      ratios(a).every((x, i) => Math.abs(x - ratios(b)[i]) < 1e-9);
    let ownWeights: [number, number, number] | null = null;
    try {
      ownWeights = parseSplitWeights((own ?? DEFAULT_SPLIT) as string | number[]);
    } catch { /* an unreadable record: refuse below */ }
    if (!ownWeights || !same(parseSplitWeights(config.split), ownWeights)) {
      throw new InvalidJobError(
        "split",
        `Dataset "${config.dataset}" keeps the split it was prepared with (${
          ownWeights?.join(",") ?? "unknown"
        }); ` +
          `split applies to the built-in datasets only: prepare it again (POST /datasets) with the split you want`,
      );
    }
  }
  const sft = config.objective === "sft";
  if (sft && !isChatDataset(await getDataset(ctx.root, config.dataset).catch(() => undefined))) {
    throw new InvalidJobError(
      "dataset",
      `Dataset "${config.dataset}" holds no conversations: objective "sft" needs a chat dataset ` +
        `(POST /datasets with "format": "chat")`,
    );
  }
  const splits = await ctx.splitTokens?.(config.dataset);
  for (const split of ["train", "valid", "test"] as const) {
    // A split weighted 0 is empty on purpose and simply not evaluated (not the training split);
    // SFT pads its packed rows.
    if (!splits || sft || (splits[split] === 0 && split !== "train") || splits[split] > config.seq_len) {
      continue;
    }
    throw new InvalidJobError(
      "seq_len",
      `The ${split} split of dataset "${config.dataset}" has ${splits[split]} tokens, ` +
        `fewer than one sequence of seq_len + 1 = ${config.seq_len + 1}`,
    );
  }
  for (const [i, t] of (config.eval_tasks ?? []).entries()) {
    await checkEvalData(ctx.root, t, `eval_tasks.${i}.`, ctx.datasetExists);
  }
  if (config.resume_from) await checkResume(ctx.root, config);
}

/** Checks an evaluation request's texts, examples file and dataset (its model is checked apart). */
export async function checkEvaluation(ctx: CheckContext, req: EvaluateRequest): Promise<void> {
  // Texts join with <|endoftext|>, so only a lone short text can be under the two tokens scoring needs.
  const [only] = req.texts ?? [];
  if (req.task === "perplexity" && req.texts?.length === 1 && only.length < 64) {
    if (encode(only, { disallowedSpecial: new Set() }).length < 2) {
      throw new InvalidJobError(
        "texts.0",
        `Cannot evaluate the perplexity of "${only}": it is one token, and scoring needs two`,
      );
    }
  }
  await checkEvalData(ctx.root, { examples_file: req.examples_file }, "", ctx.datasetExists);
  if (req.dataset !== undefined) {
    if (!(await ctx.datasetExists(req.dataset))) {
      throw new InvalidJobError("dataset", `Unknown dataset "${req.dataset}"`);
    }
    const tokens = (await ctx.splitTokens?.(req.dataset))?.[req.split];
    if (tokens !== undefined && tokens < 2) {
      throw new InvalidJobError(
        "split",
        `The ${req.split} split of dataset "${req.dataset}" has ${tokens} tokens: nothing to evaluate`,
      );
    }
  }
}
