/**
 * Turning a submitted training request into a complete job config: resolve the model (a preset
 * or explicit dimensions, always GPT-2's vocabulary padded to 128), fill the sequence length the
 * model allows, and reject what cannot work with a message that names the field — including a
 * model whose memory plan (model/plan.ts, the one the engine allocates) exceeds the GPU's memory.
 */

import { ConfigError, makeConfig, type ModelConfig, presetConfig, validateSeqLen } from "../model/config.ts";
import {
  DEFAULT_PLAN_LIMITS,
  type Estimate,
  estimateTraining,
  knownDeviceMemory,
} from "../model/memory_estimate.ts";
import type { PlanLimits } from "../model/plan.ts";
import { tensorParallelConfig } from "../model/shard.ts";
import { InvalidJobError } from "./errors.ts";
import type { EvalConfig, ModelDims, TrainConfig } from "./job.ts";
import type { ChoiceExample, ChoiceScoring } from "../model/multiple_choice.ts";

/**
 * A training request before defaults that depend on the model are filled in. `model` may be
 * omitted: it is the `init_from` source's, or "gpt2-tiny" without one.
 */
export type TrainRequest = Omit<TrainConfig, "seq_len" | "model"> & {
  seq_len?: number;
  model?: TrainConfig["model"];
};

/** The model a fine-tuning job starts from, as the server resolved `init_from`. */
export interface InitSource {
  id: string;
  config: ModelConfig;
}

/** Default model of a request that names none and starts from nothing. */
export const DEFAULT_MODEL = "gpt2-tiny";

/** The explicit dimensions of a model config. */
export function modelDims(c: ModelConfig): ModelDims {
  return { n_layer: c.n_layer, n_head: c.n_head, n_embd: c.n_embd, n_positions: c.n_positions };
}

/**
 * The model of a fine-tuning request: the source's dimensions when `model` is omitted, else the
 * request's, which must agree with the source's (a 400 naming "model" otherwise).
 */
export function initModel(asked: TrainConfig["model"] | undefined, source: InitSource): TrainConfig["model"] {
  if (asked === undefined) return modelDims(source.config);
  let want: ModelConfig;
  try {
    want = typeof asked === "string" ? presetConfig(asked) : makeConfig(asked);
  } catch (e) {
    if (e instanceof ConfigError) throw new InvalidJobError(e.field, e.message);
    throw e;
  }
  const name = typeof asked === "string" ? `"${asked}"` : "the model given";
  for (const k of ["n_layer", "n_head", "n_embd", "n_positions"] as const) {
    if (want[k] !== source.config[k]) {
      throw new InvalidJobError(
        "model",
        `Cannot fine-tune "model": ${name} has ${k} ${want[k]}, init_from "${source.id}" has ` +
          `${source.config[k]} (omit "model" to take the source's dimensions)`,
      );
    }
  }
  return asked;
}

/**
 * A training job's (and `GET /estimate`'s) default sequence length: the model's position table,
 * capped at this. The user-facing default of `seq_len` (README, the /train schema); small, so a
 * first job on any model fits and runs quickly. Not the evaluation window: see DEFAULT_EVAL_MAX_SEQ_LEN.
 */
export const DEFAULT_TRAIN_MAX_SEQ_LEN = 128;

/** The sequence length of a training request that gives none (`DEFAULT_TRAIN_MAX_SEQ_LEN` at most). */
export function defaultTrainSeqLen(model: Pick<ModelConfig, "n_positions">): number {
  return Math.min(model.n_positions, DEFAULT_TRAIN_MAX_SEQ_LEN);
}

/**
 * An evaluation's default window (`POST /evaluate`'s `seq_len`, README "Evaluation"): the model's
 * whole context, capped at GPT-2's 1024. Not training's default on purpose: perplexity is measured
 * over the context the model was built for, however short the runs that trained it.
 */
export const DEFAULT_EVAL_MAX_SEQ_LEN = 1024;

/** The window of an evaluation request that gives none (`DEFAULT_EVAL_MAX_SEQ_LEN` at most). */
export function defaultEvalSeqLen(model: Pick<ModelConfig, "n_positions">): number {
  return Math.min(model.n_positions, DEFAULT_EVAL_MAX_SEQ_LEN);
}

/** What a GPU reported about itself (see the Worker's "ready" message). */
export interface DeviceBudget {
  adapter: string | null;
  max_binding_bytes: number | null;
  max_buffer_bytes: number | null;
}

/**
 * Whether the engine stores the attention backward's dS on this device (engine/graph/builder.ts
 * scoresByDefault: a GPU, not a CPU adapter, with subgroups, and a head size the split kernels
 * take), so that its estimate counts the logits buffer at the size the engine allocates.
 */
export function storesScores(device: DeviceBudget | null, config: ModelConfig): boolean {
  const a = device?.adapter ?? "";
  const D = config.n_embd / config.n_head;
  return /\bsubgroups\b/.test(a) && !/llvmpipe|lavapipe|swiftshader|software/i.test(a) && (D / 4) % 2 === 0;
}

/** Resolves a job's model: a preset name or explicit dimensions. Throws ConfigError naming the field. */
export function resolveModel(config: Pick<TrainConfig, "model" | "seq_len">): ModelConfig {
  const model = typeof config.model === "string" ? presetConfig(config.model) : makeConfig(config.model);
  validateSeqLen(model, config.seq_len);
  return model;
}

/**
 * The model one rank of a job trains: `resolveModel`, with the vocabulary padded for the job's
 * tensor-parallel size (a multiple of 128·tp; the same as resolveModel's at tp 1).
 */
export function trainingModel(
  config: Pick<TrainConfig, "model" | "seq_len" | "tensor_parallel">,
): ModelConfig {
  const tp = config.tensor_parallel ?? 1;
  return tp > 1 ? tensorParallelConfig(resolveModel(config), tp) : resolveModel(config);
}

/** Layers per recomputed group of a config (0: no checkpointing). */
export function checkpointLayers(
  c: Pick<TrainConfig, "checkpoint_activations" | "checkpoint_num_layers">,
): number {
  return c.checkpoint_activations ? c.checkpoint_num_layers ?? 1 : 0;
}

function planLimits(device: DeviceBudget | null): PlanLimits {
  return {
    maxStorageBufferBindingSize: device?.max_binding_bytes ?? DEFAULT_PLAN_LIMITS.maxStorageBufferBindingSize,
    maxBufferSize: device?.max_buffer_bytes ?? DEFAULT_PLAN_LIMITS.maxBufferSize,
  };
}

/** What `GET /estimate` is asked. */
export interface EstimateQuery {
  model: TrainConfig["model"];
  batch_size: number;
  seq_len?: number;
  precision: "fp32" | "fp16";
  checkpoint_activations: boolean;
  checkpoint_num_layers: number;
  tensor_parallel: number;
  data_parallel: number;
  distributed_optimizer?: boolean;
}

/** The estimate of a query for a device (or the default limits), with the device's memory when known. */
export function estimateJob(
  q: EstimateQuery,
  device: DeviceBudget | null,
): Estimate & { seq_len: number; gpu_memory_bytes: number | null; fits: boolean | null } {
  try {
    const config = typeof q.model === "string" ? presetConfig(q.model) : makeConfig(q.model);
    const seq_len = q.seq_len ?? defaultTrainSeqLen(config);
    validateSeqLen(config, seq_len);
    const est = estimateTraining({
      config,
      batchSize: q.batch_size,
      seqLen: seq_len,
      precision: q.precision,
      checkpointLayers: checkpointLayers(q),
      tensorParallel: q.tensor_parallel,
      dataParallel: q.data_parallel,
      distributedOptimizer: q.distributed_optimizer ?? false,
      limits: planLimits(device),
      chunks: { attentionScores: storesScores(device, config) },
    });
    const memory = knownDeviceMemory(device?.adapter ?? null);
    return {
      ...est,
      seq_len,
      gpu_memory_bytes: memory,
      fits: memory === null ? null : est.bytes_per_gpu.total <= memory,
    };
  } catch (e) {
    if (e instanceof ConfigError) throw new InvalidJobError(e.field, e.message);
    throw e;
  }
}

/** The plan's GPU bytes for a complete config on `device` (default limits without one). */
export function estimateBytes(config: TrainConfig, device: DeviceBudget | null): number {
  const model = resolveModel(config);
  return estimateTraining({
    config: model,
    batchSize: config.batch_size,
    seqLen: config.seq_len,
    precision: config.precision ?? "fp32",
    checkpointLayers: checkpointLayers(config),
    dataParallel: config.data_parallel ?? 1,
    distributedOptimizer: (config.data_parallel ?? 1) > 1 && (config.distributed_optimizer ?? false),
    limits: planLimits(device),
    chunks: { attentionScores: storesScores(device, model) },
  }).bytes_per_gpu.total;
}

const gib = (n: number) => `${(n / 2 ** 30).toFixed(2)} GiB`;

/**
 * Completes and checks a request. With `device` (what its GPU reported), a model whose buffers
 * cannot be bound, or whose estimate exceeds the GPU's memory when that is known, is refused
 * naming the biggest part of the estimate.
 */
export function completeConfig(
  req: TrainRequest,
  device: DeviceBudget | null = null,
  source: InitSource | null = null,
): TrainConfig {
  if (req.init_from !== undefined && req.resume_from !== undefined) {
    throw new InvalidJobError(
      "init_from",
      "Cannot use init_from with resume_from: init_from starts a new run from weights only, " +
        "resume_from continues one with its optimizer and iteration",
    );
  }
  if (req.init_from !== undefined && !source) {
    throw new InvalidJobError("init_from", `Unknown model "${req.init_from}" in init_from`);
  }
  if (req.objective === "sft") {
    if (req.init_from === undefined) {
      throw new InvalidJobError(
        "init_from",
        'Objective "sft" fine-tunes a model: name it in init_from (a job id or a Hugging Face folder under models/)',
      );
    }
    if ((req.tensor_parallel ?? 1) > 1) {
      throw new InvalidJobError(
        "tensor_parallel",
        'Objective "sft" needs tensor_parallel 1 (a loss mask is not sharded yet)',
      );
    }
  }
  const model = source ? initModel(req.model, source) : req.model ?? DEFAULT_MODEL;
  let config: TrainConfig;
  try {
    const dims = typeof model === "string" ? presetConfig(model) : makeConfig(model);
    config = { ...req, model, seq_len: req.seq_len ?? defaultTrainSeqLen(dims) };
    const dp = config.data_parallel ?? 1;
    config.data_parallel = dp;
    config.global_batch_size ??= config.batch_size * dp;
    const tp = config.tensor_parallel ?? 1;
    config.tensor_parallel = tp;
    if (tp > 1) {
      trainingModel(config); // throws ConfigError naming tensor_parallel when tp cannot shard the model
      if (config.distributed_optimizer && dp > 1) {
        throw new InvalidJobError(
          "distributed_optimizer",
          "distributed_optimizer is not supported with tensor_parallel > 1 yet: use one of them",
        );
      }
    }
    for (const [i, t] of (config.eval_tasks ?? []).entries()) {
      if (tp > 1) {
        throw new InvalidJobError(
          "eval_tasks",
          "Cannot run eval_tasks with tensor_parallel > 1 yet: evaluate the checkpoints with POST /evaluate",
        );
      }
      if (t.stride !== undefined && t.stride > config.seq_len) {
        throw new InvalidJobError(
          `eval_tasks.${i}.stride`,
          `Cannot evaluate with stride ${t.stride} larger than seq_len ${config.seq_len}`,
        );
      }
    }
    if (config.global_batch_size % (config.batch_size * dp) !== 0) {
      throw new InvalidJobError(
        "global_batch_size",
        `global_batch_size ${config.global_batch_size} must be a multiple of batch_size × data_parallel = ` +
          `${config.batch_size * dp}`,
      );
    }
    resolveModel(config);
  } catch (e) {
    if (e instanceof ConfigError) throw new InvalidJobError(e.field, e.message);
    throw e;
  }
  if (config.precision === "fp16" && device?.adapter && !/shader-f16/.test(device.adapter)) {
    // The Worker's adapter line lists the device's features (see describeDevice()).
    throw new InvalidJobError(
      "precision",
      `Precision "fp16" needs a GPU with shader-f16: "${device.adapter}" has none`,
    );
  }
  if (device) checkFitsDevice(config, device);
  return config;
}

function checkFitsDevice(config: TrainConfig, device: DeviceBudget): void {
  let est: Estimate;
  try {
    const model = resolveModel(config);
    est = estimateTraining({
      config: model,
      batchSize: config.batch_size,
      seqLen: config.seq_len,
      precision: config.precision ?? "fp32",
      checkpointLayers: checkpointLayers(config),
      limits: planLimits(device),
      chunks: { attentionScores: storesScores(device, model) },
    });
  } catch (e) {
    if (e instanceof ConfigError) {
      throw new InvalidJobError(e.field, `Model does not fit the GPU: ${e.detail}`);
    }
    throw e;
  }
  const memory = knownDeviceMemory(device.adapter);
  if (memory === null || est.bytes_per_gpu.total <= memory) return;
  const { category, bytes } = est.biggest;
  const activation = category === "activations" || category === "logits";
  const hint = activation
    ? "lower batch_size or seq_len, or set checkpoint_activations"
    : config.precision === "fp16"
    ? "choose a smaller model"
    : 'choose a smaller model or precision "fp16"';
  throw new InvalidJobError(
    activation ? "batch_size" : "model",
    `Model does not fit the GPU: the estimate of ${gib(est.bytes_per_gpu.total)} exceeds the GPU's ` +
      `${gib(memory)}; the biggest part is ${category} (${gib(bytes)}): ${hint}`,
  );
}

/** A `POST /evaluate` request as the routes validated it. */
export interface EvaluateRequest {
  model: string;
  task: EvalConfig["task"];
  texts?: string[];
  dataset?: string;
  split: "train" | "valid" | "test";
  seq_len?: number;
  stride?: number;
  batch_size: number;
  strict: boolean;
  max_tokens?: number;
  examples?: ChoiceExample[];
  examples_file?: string;
  scoring?: ChoiceScoring;
}

/**
 * The job config of an evaluation: the model's dimensions, the window (`seq_len`, default
 * defaultEvalSeqLen: the model's context capped at 1024) and stride (default seq_len), and
 * `evaluate` with what to measure. The training fields are inert (no steps, no dropout). A
 * multiple-choice batch holds every ending of an example: `batch_size` rises to the most endings
 * an example has. Throws InvalidJobError naming seq_len or stride when they do not fit the model.
 */
export function completeEvalConfig(req: EvaluateRequest, source: InitSource): TrainConfig {
  const seq_len = req.seq_len ?? defaultEvalSeqLen(source.config);
  try {
    validateSeqLen(source.config, seq_len);
  } catch (e) {
    if (e instanceof ConfigError) {
      throw new InvalidJobError("seq_len", `Cannot evaluate "${source.id}": ${e.detail}`);
    }
    throw e;
  }
  const stride = req.stride ?? seq_len;
  if (stride > seq_len) {
    throw new InvalidJobError(
      "stride",
      `Cannot evaluate with stride ${stride} larger than seq_len ${seq_len}`,
    );
  }
  const evaluate: EvalConfig = {
    task: req.task,
    model: source.id,
    ...(req.texts ? { texts: req.texts } : { dataset: req.dataset, split: req.split }),
    stride,
    strict: req.strict,
    ...(req.max_tokens !== undefined ? { max_tokens: req.max_tokens } : {}),
  };
  let batch_size = req.batch_size;
  if (req.task === "multiple_choice") {
    delete evaluate.texts;
    delete evaluate.dataset;
    delete evaluate.split;
    if (req.examples_file !== undefined) evaluate.examples_file = req.examples_file;
    else evaluate.examples = req.examples ?? [];
    evaluate.scoring = req.scoring ?? "sum";
    for (const ex of evaluate.examples ?? []) batch_size = Math.max(batch_size, ex.endings.length);
  }
  return {
    model: modelDims(source.config),
    dataset: req.dataset ?? "",
    split: "949,50,1",
    train_iters: 0,
    batch_size,
    seq_len,
    lr: 0,
    min_lr: 0,
    lr_decay_style: "constant",
    warmup: 0,
    weight_decay: 0,
    clip_grad: 0,
    attention_dropout: 0,
    hidden_dropout: 0,
    seed: 0,
    log_interval: 1,
    eval_interval: 0,
    eval_iters: 1,
    save_interval: 0,
    keep_checkpoints: 1,
    data_parallel: 1,
    tensor_parallel: 1,
    global_batch_size: batch_size,
    evaluate,
  };
}
