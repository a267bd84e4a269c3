/**
 * Messages between the HTTP process (the runner) and a GPU Worker. The Worker owns its device and
 * never sees the store: it receives a fully resolved job and reports progress, evaluations,
 * checkpoints and the outcome. Every message is plain JSON, since it may cross a process
 * boundary (HTTP process -> GPU host -> Worker thread). Cancel and stop reach a running job as
 * shared Int32 flags that the GPU host sets for the Worker and the training loop polls between
 * steps, so they work even while the loop does not yield to the event loop. The one question the
 * Worker asks is `commit_check`, before committing a checkpoint: it waits (awaiting, so its event
 * loop runs) for `commit_answer`, which its host delivers at once rather than behind the job.
 */

import type { EvalResult, PhaseTimes, RankTimes, TrainConfig } from "./job/job.ts";
import type { ModelConfig } from "./model/config.ts";

/** Index in the shared flags: non-zero asks the running job to stop and end "cancelled". */
export const CANCEL_FLAG = 0;
/** Index in the shared flags: non-zero asks the running job to save a checkpoint at its current step and end "interrupted" (server shutdown). */
export const STOP_FLAG = 1;
/**
 * Index in the shared flags: messages posted to the Worker thread since `init` (the port adds one
 * before each). The Worker compares it with the messages it has taken in, to know whether one is
 * on its way (serving waits for it, through a timer, only then: see worker/serving.ts).
 */
export const SENT_COUNT = 2;
/** Int32 slots in the shared flags buffer. */
export const FLAG_COUNT = 3;
/**
 * How long a Worker waits for the answer to a `commit_check` before it gives the checkpoint up
 * (not committed, the job stopped): a host that cannot say it holds the lease does not write.
 */
export const COMMIT_CHECK_MS = 30_000;

/** A job handed to a Worker. */
export interface WorkerJob {
  id: string;
  config: TrainConfig;
  /** Data directory (datasets live under it). */
  root: string;
  /** Directory holding this job's checkpoints. */
  checkpoint_dir: string;
  /** Checkpoint directory to start from (its own after a crash, or `resume_from`), or null. */
  resume_path: string | null;
  /**
   * The job's own checkpoints, newest first (the first is `resume_path`), when it has several: one
   * that fails to load or verify (truncated, corrupted) is passed over for the next older one,
   * with a warning naming it and why; none usable fails the job. Absent: `resume_path` alone.
   */
  resume_candidates?: string[];
  /**
   * The model whose weights a fine-tuning job starts from (`init_from`, used only when there is no
   * `resume_path`), or the model an evaluation job measures.
   */
  init_source?: ModelSource;
  /**
   * Parallel jobs: this Worker's global rank of `size` (data_parallel × tensor_parallel, tensor
   * parallel fastest), and an id of this run of the job (fresh communicators per run).
   */
  parallel?: { rank: number; size: number; run: string };
}

/** The shared buffers of one data-parallel run, the same objects for all its ranks (made by the GPU port). */
export interface JobComm {
  /** Gradient lanes of this rank's data-parallel group (empty when dp is 1; see engine/parallel/allreduce.ts). */
  grads: SharedArrayBuffer[];
  /** The small control communicator (see engine/parallel/data_parallel.ts). */
  control: SharedArrayBuffer;
  /** fp32 weight lanes of the distributed optimizer (its broadcasts and moment gathers). */
  weights?: SharedArrayBuffer[];
  /** fp32 lanes of this rank's tensor-parallel group (activation exchanges). */
  tp?: SharedArrayBuffer[];
}

/** Where a generation model's weights are: one of our checkpoints or a Hugging Face GPT-2 directory. */
export interface ModelSource {
  /** The id clients use ("job_x", "job_x/iter_0000100", or a directory name under models/). */
  id: string;
  kind: "checkpoint" | "safetensors";
  /** Directory holding `model.safetensors`. */
  path: string;
  /** Changes when the weights on disk change (checkpoint creation time, file mtime). */
  version: string;
  config: ModelConfig;
}

/** A generation handed to a Worker: the prompt already tokenized and cut to fit the context. */
export interface WorkerGeneration {
  id: string;
  model: ModelSource;
  /** 1 ... n_positions - max_tokens token ids. */
  prompt: number[];
  max_tokens: number;
  temperature: number;
  top_k: number;
  top_p: number;
  seed: number;
  /** Stop at `<|endoftext|>` (not returned). */
  stop_at_eos: boolean;
  /** Log-probabilities per token: null for none, else how many top ones (0 … 5). */
  logprobs?: number | null;
  /** Data directory: the Worker records there which kernels it compiled (worker/compile_report.ts). */
  root?: string;
  /**
   * Where the request's time to its first token goes (wall-clock ms since the epoch, `epochMs()`):
   * when the HTTP process handed it to the GPU host, when the GPU host passed it to the Worker,
   * and when the Worker's thread took it in. Each hop stamps its own; the Worker reports them
   * back in `gen_started`.
   */
  sent_at?: number;
  relayed_at?: number;
  received_at?: number;
  /**
   * A rehearsal of the request path (the server's start-up warm-up): the Worker answers it from
   * the prompt, as a generation's messages would come, without a model or the GPU; nothing is counted.
   */
  rehearsal?: boolean;
}

/** Wall-clock ms since the epoch with sub-millisecond precision, comparable between processes and threads. */
export function epochMs(): number {
  return performance.timeOrigin + performance.now();
}

/**
 * A request's path to its first token, stamped by each hop (epochMs): `sent_at` by the HTTP
 * process, `relayed_at` by the GPU host, `received_at` when the Worker's thread took it in,
 * `admitted_at` when its prefill began, and `first_at` (in the first `gen_tokens`) when its first
 * token was posted.
 */
export interface GenerationStamps {
  sent_at?: number;
  relayed_at?: number;
  received_at?: number;
  admitted_at?: number;
}

/** Log-probabilities of one generated token: its own and the top ones as [id, logprob], best first. */
export interface WorkerLogprobs {
  logprob: number;
  top: [number, number][];
}

/**
 * Runner → GPU port. `cancel` and `stop` raise the shared flags of the Worker (the port does it,
 * since the Worker's own event loop is busy while it trains); `shutdown` destroys the Worker's
 * generators, trainer and device and ends the Worker.
 */
export type ToWorker =
  | { type: "init"; gpu: number }
  | { type: "train"; job: WorkerJob }
  | { type: "generate"; request: WorkerGeneration }
  | { type: "generate_cancel"; id: string }
  /**
   * The answer to the Worker's `commit_check` number `request`: whether the checkpoint of job
   * `id` may be committed (this host still holds the job's lease), and if not, why.
   */
  | { type: "commit_answer"; id: string; request: number; held: boolean; reason: string | null }
  | { type: "cancel" }
  | { type: "stop" }
  | { type: "shutdown" };

/** What the Worker thread itself receives: `init` carries the shared flags (FLAG_COUNT Int32s). */
export type ToWorkerThread =
  | Exclude<ToWorker, { type: "init" | "cancel" | "stop" | "train" }>
  /** `comm`: the run's shared communicators when the job is data-parallel. */
  | { type: "train"; job: WorkerJob; comm?: JobComm }
  /** `probe_bytes`: hold a buffer this large until `probe_done`, so the host can see which GPU's memory grew. */
  | { type: "init"; gpu: number; flags: SharedArrayBuffer; probe_bytes?: number }
  | { type: "probe_done" };

/** Worker → HTTP thread, for generations: accepted onto the GPU, new tokens, finished. */
export type FromWorkerGeneration =
  | { type: "gen_started"; id: string; load_ms: number; stamps?: GenerationStamps }
  /** `first_at`: on a request's first tokens, when the Worker posted them (epochMs). */
  | { type: "gen_tokens"; id: string; tokens: number[]; logprobs?: WorkerLogprobs[]; first_at?: number }
  | {
    type: "gen_done";
    id: string;
    reason: "length" | "eos" | "cancelled" | "error";
    error: string | null;
    completion_tokens: number;
  };

/** Worker → HTTP thread. */
export type FromWorker =
  | FromWorkerGeneration
  | {
    type: "ready";
    gpu: number;
    adapter: string;
    max_buffer_bytes: number;
    max_binding_bytes: number;
    /** The PCI bus the Worker landed on, when the GPU host could tell (nvidia-smi). */
    pci_bus?: string | null;
  }
  /** The Worker destroyed its device and is ending (answer to `shutdown`). */
  | { type: "closed"; gpu: number }
  | { type: "unavailable"; gpu: number; error: string }
  | { type: "started"; id: string; iteration: number; resumed_from: string | null; gpu_memory_bytes: number }
  | {
    type: "progress";
    id: string;
    iteration: number;
    /** Null when the logged step was skipped for a non-finite loss or gradient. */
    loss: number | null;
    grad_norm: number | null;
    lr: number;
    tokens_per_s: number;
    timings: PhaseTimes;
    gpu_memory_bytes: number;
    /** Steps whose update was skipped for a non-finite loss or gradient, in this job so far. */
    skipped_steps: number;
    /** Dynamic loss scale of the next step (1 in fp32). */
    loss_scale: number;
    /** Data-parallel jobs: each rank's step and allreduce times over the log interval. */
    ranks?: RankTimes[];
  }
  | {
    type: "eval";
    id: string;
    iteration: number;
    split: "valid" | "test";
    loss: number;
    perplexity: number;
    /** Tokens whose loss was averaged. */
    tokens: number;
  }
  /**
   * An evaluation job's progress (`done` of `total` windows or examples, `tokens` scored so far),
   * and once finished its `result`.
   */
  | {
    type: "evaluation";
    id: string;
    done: number;
    total: number;
    tokens: number;
    tokens_per_s: number;
    result?: EvalResult;
  }
  /**
   * One of a training job's `eval_tasks` at `iteration`: its result, or the error that stopped it
   * (the training goes on); with neither, a sign of life while it runs (`done` of `total`).
   */
  | {
    type: "eval_task";
    id: string;
    iteration: number;
    name: string;
    task: EvalResult["task"];
    result?: EvalResult;
    error?: string;
    done?: number;
    total?: number;
  }
  | { type: "log"; id: string; level: "info" | "warn"; message: string }
  /**
   * Kernel compilation of a training job (`id`), or of a generation model (`id` null, `model` its
   * id), throttled by the Worker (worker/compile_report.ts).
   */
  | ({ type: "compile"; id: string | null; model?: string } & CompileReport)
  | { type: "checkpoint"; id: string; iteration: number; name: string; path: string }
  /**
   * Before committing a checkpoint (the rename of its finished temporary folder into place), the
   * Worker asks whether its host still holds job `id`'s lease; the runner answers `commit_answer`
   * with the same `request` after reading the lease from the database. See {@link COMMIT_CHECK_MS}.
   */
  | { type: "commit_check"; id: string; request: number; iteration: number; name: string }
  | {
    type: "done";
    id: string;
    /** "interrupted": stopped by a shutdown after saving a checkpoint at `iteration`; it resumes there. */
    status: "succeeded" | "failed" | "cancelled" | "interrupted";
    iteration: number;
    error: string | null;
  };

/** HTTP process → GPU host: one JSON line on the host's stdin per message. */
export interface ToHost {
  gpu: number;
  msg: ToWorker;
}

/** GPU host → HTTP process: one JSON line on the host's stdout per message. */
export type FromHost =
  | { gpu: number; msg: FromWorker }
  /** The Worker thread of `gpu` died (uncaught error); the host starts a new one on the next `init`. */
  | { gpu: number; error: string };

/** What the runner needs of a GPU's Worker (a local Worker thread, one inside the GPU host, or a test double). */
export interface WorkerPort {
  postMessage(msg: ToWorker): void;
  onmessage: ((e: MessageEvent<FromWorker>) => void) | null;
  onerror: ((e: ErrorEvent) => void) | null;
  terminate(): void;
}

/** Creates the port that drives GPU `gpu`. */
export type SpawnWorker = (gpu: number) => WorkerPort;

/** What a Worker reports of one build's compilation (see `FromWorker` "compile"). */
export interface CompileReport {
  /** Pipelines compiled so far, of `total`. */
  done: number;
  total: number;
  /** The kernel that first used the newest pipeline. */
  label: string;
  /** Compile time so far in ms (the pipelines' own times, summed). */
  ms: number;
  /** The adapter's name (e.g. "llvmpipe (LLVM 15.0.6, 256 bits)"). */
  adapter: string;
  /** No build of this kind completed on this adapter before (per the marker); null when unknown. */
  first_run: boolean | null;
  /** The driver's shader cache is disabled (MESA_SHADER_CACHE_DISABLE), so every run compiles in full. */
  cache_disabled: boolean;
}

/**
 * A log line for a compile report, after `who` when given: "job_x: compiling kernels 12/41 on
 * llvmpipe (…), 8.3 s so far (first run on this adapter; cached afterwards)".
 */
export function compileLine(r: CompileReport, who?: string): string {
  const cache = r.cache_disabled
    ? "the driver's shader cache is disabled: MESA_SHADER_CACHE_DISABLE"
    : r.first_run === true
    ? "first run on this adapter; cached afterwards"
    : r.first_run === false
    ? "compiled before on this adapter: the driver's cache should make it quick"
    : null;
  const what = r.done >= r.total
    ? `compiled ${r.total} kernel${r.total === 1 ? "" : "s"} on ${r.adapter} in ${(r.ms / 1000).toFixed(1)} s`
    : `compiling kernels ${r.done}/${r.total} on ${r.adapter}, ${(r.ms / 1000).toFixed(1)} s so far`;
  return `${who ? `${who}: ` : ""}${what}${cache ? ` (${cache})` : ""}`;
}
