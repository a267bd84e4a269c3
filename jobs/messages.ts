/**
 * Messages between the HTTP thread (the runner) and a GPU Worker. The Worker owns its device and
 * never sees the store: it receives a fully resolved job and reports progress, evaluations,
 * checkpoints and the outcome. Cancellation is a shared Int32 flag the training loop polls
 * between steps, so it works even while the loop does not yield to the event loop.
 */

import type { PhaseTimes, TrainConfig } from "./types.ts";
import type { ModelConfig } from "../gpu/config.ts";

/** Index in the shared cancel flag: non-zero asks the running job to stop. */
export const CANCEL_FLAG = 0;

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
}

/** Log-probabilities of one generated token: its own and the top ones as [id, logprob], best first. */
export interface WorkerLogprobs {
  logprob: number;
  top: [number, number][];
}

/** HTTP thread → Worker. */
export type ToWorker =
  | { type: "init"; gpu: number; cancel: SharedArrayBuffer }
  | { type: "train"; job: WorkerJob }
  | { type: "generate"; request: WorkerGeneration }
  | { type: "generate_cancel"; id: string }
  | { type: "shutdown" };

/** Worker → HTTP thread, for generations: accepted onto the GPU, new tokens, finished. */
export type FromWorkerGeneration =
  | { type: "gen_started"; id: string; load_ms: number }
  | { type: "gen_tokens"; id: string; tokens: number[]; logprobs?: WorkerLogprobs[] }
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
  | { type: "ready"; gpu: number; adapter: string; max_buffer_bytes: number; max_binding_bytes: number }
  | { type: "unavailable"; gpu: number; error: string }
  | { type: "started"; id: string; iteration: number; resumed_from: string | null; gpu_memory_bytes: number }
  | {
    type: "progress";
    id: string;
    iteration: number;
    loss: number;
    grad_norm: number;
    lr: number;
    tokens_per_s: number;
    timings: PhaseTimes;
    gpu_memory_bytes: number;
  }
  | { type: "eval"; id: string; iteration: number; split: "valid" | "test"; loss: number; perplexity: number }
  | { type: "log"; id: string; level: "info" | "warn"; message: string }
  | { type: "checkpoint"; id: string; iteration: number; name: string; path: string }
  | {
    type: "done";
    id: string;
    status: "succeeded" | "failed" | "cancelled";
    iteration: number;
    error: string | null;
  };
