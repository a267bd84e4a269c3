/**
 * The shapes a training job takes on the HTTP thread: its configuration (Megatron-style
 * arguments, already validated and defaulted by the routes), its status, its latest metrics and
 * the events streamed to clients. Kept apart from the store so routes, runner and Worker share
 * one vocabulary without importing SQLite.
 *
 * job/ is the job service's domain, pure and shared by every process: these shapes, the config's
 * defaults and checks (job_config.ts) and the caller-mistake errors (errors.ts). It reads model/
 * and nothing else (tests/e2e/layout_test.ts).
 */

import type { LrDecayStyle } from "../model/schedule.ts";
import type { ChoiceExample, ChoiceScoring } from "../model/multiple_choice.ts";

/** Explicit model dimensions (the vocabulary is always GPT-2's, padded to 128). */
export interface ModelDims {
  n_layer: number;
  n_head: number;
  n_embd: number;
  n_positions: number;
}

/** A training job's configuration, named after Megatron-LM's arguments. */
export interface TrainConfig {
  /** Preset name ("gpt2-tiny", ...) or explicit dimensions. */
  model: string | ModelDims;
  /** Dataset id (see `GET /datasets`). */
  dataset: string;
  /** Train/valid/test weights as Megatron writes them ("949,50,1"); a builtin dataset is split this way. */
  split: string;
  /** Total optimizer steps (a resumed job counts the steps already done). */
  train_iters: number;
  batch_size: number;
  seq_len: number;
  lr: number;
  min_lr: number;
  lr_decay_style: LrDecayStyle;
  /** Fraction of train_iters spent in linear warmup. */
  warmup: number;
  weight_decay: number;
  /** Global gradient-norm clip; 0 disables it. */
  clip_grad: number;
  attention_dropout: number;
  hidden_dropout: number;
  seed: number;
  /** Steps between loss readbacks and progress events. */
  log_interval: number;
  /** Steps between validation runs; 0 evaluates only at the end. */
  eval_interval: number;
  /** Batches per validation run. */
  eval_iters: number;
  /** Steps between checkpoints; 0 saves only at the end. */
  save_interval: number;
  /** Checkpoints kept per job (the newest). */
  keep_checkpoints: number;
  /** A checkpoint to start from: "<job id>" (its newest) or "<job id>/<checkpoint name>". */
  resume_from?: string;
  /**
   * Fine-tuning: a model the server knows to take the weights from ("<job id>", "<job id>/iter_N",
   * or a Hugging Face folder under models/). Weights only: fresh AdamW moments, iteration 0, this
   * job's schedule and dataset (Megatron's --finetune with --load; nanoGPT's init_from).
   */
  init_from?: string;
  /**
   * "lm" (absent: lm): the loss on every token. "sft": supervised fine-tuning on a chat dataset
   * (`format: "chat"`), with init_from: the loss on the assistant's tokens only, conversations
   * packed whole into rows and ones longer than seq_len cut at a turn boundary.
   */
  objective?: "lm" | "sft";
  /** Evaluation jobs (`POST /evaluate`): what to measure; absent on a training job. */
  evaluate?: EvalConfig;
  /** Training jobs: evaluations run on the current weights at every `eval_interval` (and at the end). */
  eval_tasks?: EvalTaskConfig[];
  /**
   * "fp32" (absent: fp32) or "fp16": f16 weights and activations, fp32 master weights and AdamW,
   * dynamic loss scaling (Megatron's --fp16).
   */
  precision?: "fp32" | "fp16";
  /** Recompute each group's activations in backward (Megatron's --checkpoint-activations). */
  checkpoint_activations?: boolean;
  /** Layers per recomputed group (Megatron's --checkpoint-num-layers; absent: 1). */
  checkpoint_num_layers?: number;
  /** Data-parallel ranks, one GPU Worker each (absent: 1). */
  data_parallel?: number;
  /**
   * Tensor-parallel ranks sharding every layer (Megatron's --tensor-model-parallel-size; absent:
   * 1). A job takes data_parallel × tensor_parallel GPU Workers.
   */
  tensor_parallel?: number;
  /**
   * Sequences per optimizer step over all ranks (Megatron's --global-batch-size; absent:
   * batch_size × data_parallel). Gradient accumulation steps = global / (batch_size × data_parallel).
   */
  global_batch_size?: number;
  /** Element type of the gradients on the wire between ranks (absent: fp32); sums are fp32. */
  allreduce_dtype?: "fp32" | "fp16" | "bf16";
  /**
   * Shard the AdamW moments over the data-parallel ranks (Megatron's --use-distributed-optimizer):
   * gradients reduced to their owner, weights broadcast back after the update.
   */
  distributed_optimizer?: boolean;
  /**
   * Exchange each stage of layers' gradients while the layers below still compute their backward
   * pass (Megatron's --overlap-grad-reduce; absent: true). Not with the distributed optimizer.
   */
  overlap_grad_reduce?: boolean;
}

/** What an evaluation job measures (`POST /evaluate`), with every default filled. */
export interface EvalConfig {
  /**
   * "perplexity": sliding windows over a text stream; "cloze": LAMBADA-style last-word prediction;
   * "multiple_choice": the best-scored of several endings (HellaSwag, PIQA, ARC).
   */
  task: EvalTask;
  /** The model evaluated, as the server knows it (see `init_from`). */
  model: string;
  /** Texts given in the request (perplexity: one stream, joined by <|endoftext|>; cloze: one line each). */
  texts?: string[];
  /** Or a dataset's split (perplexity only). */
  dataset?: string;
  split?: "train" | "valid" | "test";
  /** Perplexity: tokens a window advances by (≤ seq_len; seq_len is the non-overlapping evaluation). */
  stride: number;
  /** Cloze: Megatron's --strict-lambada (the whole last word is the target, tokenized on its own). */
  strict: boolean;
  /** Perplexity: score at most this many tokens of the stream (absent: all of it). */
  max_tokens?: number;
  /** Multiple choice: the examples, or the name of a JSONL file of them (data/tasks.ts). */
  examples?: ChoiceExample[];
  examples_file?: string;
  /** Multiple choice: how `accuracy` ranks endings (absent: "sum"). */
  scoring?: ChoiceScoring;
}

/**
 * An evaluation during training (`eval_tasks` of `POST /train`): a name (unique in the job), the
 * task and its data as `POST /evaluate` takes them, run in the training plan's window and batch.
 */
export type EvalTaskConfig = Omit<EvalConfig, "model" | "stride"> & { name: string; stride?: number };

/** The evaluation tasks. */
export type EvalTask = "perplexity" | "cloze" | "multiple_choice";

/** What an evaluation job found (stored in its metrics as `evaluation`). */
export interface EvalResult {
  task: EvalTask;
  model: string;
  /** Mean loss (nats per scored token; cloze: per last word) and its exponential. */
  loss: number;
  perplexity: number;
  /** Tokens scored. */
  tokens: number;
  /** Perplexity: Megatron's word perplexity, the token perplexity adjusted by tokens per word. */
  word_perplexity?: number;
  words?: number;
  /** Perplexity: lm-evaluation-harness's byte perplexity and bits per byte. */
  byte_perplexity?: number;
  bits_per_byte?: number;
  bytes?: number;
  /** Perplexity: windows run and the stride. */
  windows?: number;
  stride?: number;
  seq_len: number;
  /**
   * Cloze: share of examples whose greedy continuation is the whole last word, and how many.
   * Multiple choice: share of examples whose right ending scores best (see model/multiple_choice.ts).
   */
  accuracy?: number;
  examples?: number;
  correct?: number;
  /** Multiple choice: accuracy with each ending's log-probability per byte (lm-evaluation-harness's acc_norm). */
  accuracy_norm?: number;
  correct_norm?: number;
  /** Multiple choice: endings scored, and how `accuracy` ranked them. */
  endings?: number;
  scoring?: ChoiceScoring;
  /** Scored tokens per second on the GPU (forward passes and readbacks). */
  tokens_per_s: number;
  /** Multiple choice: endings scored per second. */
  endings_per_s?: number;
  elapsed_s: number;
}

/** Micro-batches each rank accumulates per optimizer step. */
export function accumulationSteps(c: TrainConfig): number {
  const dp = c.data_parallel ?? 1;
  return (c.global_batch_size ?? c.batch_size * dp) / (c.batch_size * dp);
}

/** Lifecycle of a job. `interrupted` means the server died while it ran; it resumes on its own. */
export type JobStatus = "queued" | "running" | "succeeded" | "failed" | "cancelled" | "interrupted";

/** Statuses after which a job never changes again. */
export const FINISHED_STATUSES: readonly JobStatus[] = ["succeeded", "failed", "cancelled"];

/** Milliseconds per step spent in each phase (Megatron's timers). */
export interface PhaseTimes {
  forward_ms: number | null;
  backward_ms: number | null;
  allreduce_ms: number;
  optimizer_ms: number | null;
  /** Time to draw one batch from the sampler. */
  batch_generator_ms: number;
  /** Time spent loading the dataset splits (once per job run). */
  data_loader_ms: number;
  /** Wall time per step, averaged over the last log interval. */
  step_ms: number;
}

/** One data-parallel rank's numbers over the last log interval. */
export interface RankTimes {
  rank: number;
  step_ms: number;
  /** Wall time per step spent waiting for the gradient allreduce. */
  allreduce_ms: number;
  /** Gradient bytes per second through this rank's allreduce while it ran. */
  allreduce_gb_per_s: number | null;
  /**
   * Wall time per step of the allreduce with no backward work left under it (from the last
   * backward submission to the summed gradients; equal to allreduce_ms without overlap).
   */
  allreduce_exposed_ms?: number;
  /** Share of the allreduce time hidden under the backward pass: 1 − exposed / allreduce, in [0, 1]. */
  allreduce_hidden?: number;
  /** Tensor-parallel jobs: wall time per step in the activation and loss exchanges, and the activation allreduces per step. */
  tp_exchange_ms?: number;
  tp_allreduces?: number;
}

/** The newest numbers a job has reported. */
export interface JobMetrics {
  loss: number | null;
  grad_norm: number | null;
  lr: number | null;
  tokens_per_s: number | null;
  val_loss: number | null;
  val_perplexity: number | null;
  test_loss: number | null;
  test_perplexity: number | null;
  /** Tokens the newest validation and test losses averaged over. */
  val_tokens: number | null;
  test_tokens: number | null;
  /** Steps skipped for a non-finite loss or gradient norm. */
  skipped_steps: number | null;
  /** Dynamic loss scale (1 in fp32). */
  loss_scale: number | null;
  timings: PhaseTimes | null;
  /** GPU bytes the job's buffers take (measured from the allocation). */
  gpu_memory_bytes: number | null;
  /** GPU bytes the memory plan estimated when the job was submitted (see GET /estimate). */
  gpu_memory_estimate_bytes: number | null;
  /** Data-parallel jobs: the GPUs of its ranks (rank order) and each rank's latest timings. */
  gpus?: number[];
  ranks?: RankTimes[] | null;
  /** Evaluation jobs: the result once finished. */
  evaluation?: EvalResult | null;
}

/** A job as the API shows it. */
export interface Job {
  id: string;
  status: JobStatus;
  /** The GPU whose queue holds the job. */
  gpu: number;
  config: TrainConfig;
  created_at: string;
  started_at: string | null;
  finished_at: string | null;
  /** Iterations done. */
  iteration: number;
  metrics: JobMetrics;
  error: string | null;
  cancel_requested: boolean;
  /** Times the job was restarted from its own checkpoint after an interruption. */
  resumes: number;
  /** The checkpoint the current run started from, if any. */
  resumed_from: string | null;
  /** Name of the newest checkpoint. */
  last_checkpoint: string | null;
  /** The user who made it (absent: made with no user, by the bootstrap token or before users existed). */
  owner?: string;
}

/**
 * Kinds of server-sent events. `compile`: kernel compilation before the first step (pipelines
 * done of total, the adapter, whether it is a first run there; see worker/compile_report.ts).
 * `evaluation`: an evaluation job's result (its progress comes as `progress` events of kind
 * "evaluate"). `eval_task`: one of a training job's `eval_tasks` at an iteration (its name, task,
 * figures, or the error that stopped it). `shutdown` is live only (never stored): the server is stopping, and the stream ends; the job
 * resumes when the server is back.
 */
export type JobEventType =
  | "progress"
  | "compile"
  | "log"
  | "checkpoint"
  | "evaluation"
  | "eval_task"
  | "done"
  | "shutdown";

/** One stored event; `id` increases across all jobs and is the SSE id. */
export interface JobEvent {
  id: number;
  job_id: string;
  type: JobEventType;
  data: Record<string, unknown>;
  at: string;
}

/** One row of the metrics history. */
export interface MetricPoint {
  iteration: number;
  /** "train" for training loss, "valid" or "test" for evaluations, `eval:<name>` for an eval task's loss. */
  split: "train" | "valid" | "test" | `eval:${string}`;
  loss: number;
  perplexity: number | null;
  lr: number | null;
  tokens_per_s: number | null;
  at: string;
}

/** Metrics of a job that has reported nothing yet. */
export function emptyMetrics(): JobMetrics {
  return {
    loss: null,
    grad_norm: null,
    lr: null,
    tokens_per_s: null,
    val_loss: null,
    val_perplexity: null,
    test_loss: null,
    test_perplexity: null,
    val_tokens: null,
    test_tokens: null,
    skipped_steps: null,
    loss_scale: null,
    timings: null,
    gpu_memory_bytes: null,
    gpu_memory_estimate_bytes: null,
  };
}
