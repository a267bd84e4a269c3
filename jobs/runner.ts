/**
 * The job runner: the HTTP thread's side of training. It owns one Worker per GPU (each Worker
 * opens its own device, since mapAsync and onSubmittedWorkDone block the JS thread), feeds each
 * GPU's FIFO queue from the store, turns Worker messages into stored metrics and events, and
 * fans events out to live subscribers (the SSE routes). On start it marks jobs a dead server left
 * running as interrupted; they go to the head of their queue and resume from their newest
 * checkpoint.
 */

import { isFinished, type JobStore } from "./store.ts";
import { InvalidJobError, JobConflictError, JobNotFoundError } from "./errors.ts";
import {
  CANCEL_FLAG,
  type FromWorker,
  type FromWorkerGeneration,
  type ToWorker,
  type WorkerJob,
} from "./messages.ts";
import { type CheckpointInfo, listCheckpoints } from "./checkpoint.ts";
import type { Job, JobEvent, JobEventType } from "./types.ts";
import { completeConfig, type DeviceBudget, type TrainRequest } from "./model.ts";

/** What the runner needs of a Worker (a real `Worker`, or a test double). */
export interface WorkerPort {
  postMessage(msg: ToWorker): void;
  onmessage: ((e: MessageEvent<FromWorker>) => void) | null;
  onerror: ((e: ErrorEvent) => void) | null;
  terminate(): void;
}

/** Creates the Worker that drives GPU `gpu`. */
export type SpawnWorker = (gpu: number) => WorkerPort;

/** Spawns the real GPU Worker (jobs/gpu_worker.ts). */
export const spawnGpuWorker: SpawnWorker = () =>
  new Worker(new URL("./gpu_worker.ts", import.meta.url).href, { type: "module" }) as unknown as WorkerPort;

/** What one GPU slot is doing. */
export interface GpuState {
  index: number;
  state: "starting" | "idle" | "busy" | "unavailable";
  adapter: string | null;
  error: string | null;
  job: string | null;
  queued: number;
  max_buffer_bytes: number | null;
}

interface Slot {
  index: number;
  worker: WorkerPort;
  cancel: Int32Array;
  state: GpuState["state"];
  adapter: string | null;
  error: string | null;
  job: string | null;
  maxBuffer: number | null;
  maxBinding: number | null;
}

/** Options of {@link JobRunner}. */
export interface RunnerOptions {
  /** Data directory: datasets and `checkpoints/<job id>/`. */
  root: string;
  /** Number of GPUs (one Worker each). */
  gpus: number;
  spawn: SpawnWorker;
  /** Whether a dataset id can be trained on (prepared, or a builtin prepared on first use). */
  datasetExists: (id: string) => Promise<boolean>;
}

type Listener = (e: JobEvent) => void;

/** What a GPU Worker reports about generations, plus its crash (every generation on it is lost). */
export type GenerationReport = FromWorkerGeneration | { type: "gen_crash"; error: string };

/** Schedules jobs onto GPU Workers and records what they report. */
export class JobRunner {
  #store: JobStore;
  #opts: RunnerOptions;
  #slots: Slot[] = [];
  #listeners = new Map<string, Set<Listener>>();
  #stopped = false;
  #generation: ((gpu: number, msg: GenerationReport) => void) | null = null;

  constructor(store: JobStore, opts: RunnerOptions) {
    this.#store = store;
    this.#opts = opts;
  }

  /** The store the runner records into. */
  get store(): JobStore {
    return this.#store;
  }

  /** Recovers interrupted jobs and starts one Worker per GPU. */
  start(): void {
    // Jobs left on GPUs this server does not have (fewer GPUs than last time) move to the others.
    this.#store.requeueBeyond(this.#opts.gpus);
    for (const job of this.#store.markInterrupted()) {
      const cancelled = job.cancel_requested;
      this.#emit(job.id, "log", {
        level: "warn",
        message: `Server restarted while job "${job.id}" was running at iteration ${job.iteration}: ` +
          (cancelled ? "it was being cancelled" : "resuming"),
        status: "interrupted",
      });
      if (cancelled) this.#finish(job.id, "cancelled", job.iteration, null);
    }
    for (let i = 0; i < this.#opts.gpus; i++) this.#slots.push(this.#spawn(i));
  }

  /** Directory of a job's checkpoints. */
  checkpointDir(id: string): string {
    return `${this.#opts.root}/checkpoints/${id}`;
  }

  /**
   * Queues a training job on the GPU with the shortest queue. Throws InvalidJobError naming the
   * field for an unknown model or dataset, a model that cannot fit, or a bad resume_from.
   */
  async submit(req: TrainRequest): Promise<Job> {
    const gpu = this.#pickGpu();
    const config = completeConfig(req, this.device(gpu));
    if (!(await this.#opts.datasetExists(config.dataset))) {
      throw new InvalidJobError("dataset", `Unknown dataset "${config.dataset}"`);
    }
    if (config.resume_from) await this.#resolveResume(config.resume_from);
    const id = `job_${crypto.randomUUID().replaceAll("-", "").slice(0, 12)}`;
    const job = this.#store.createJob(id, gpu, config);
    this.#emit(id, "log", { level: "info", message: `Queued on GPU ${gpu}`, status: "queued" });
    this.#dispatch(gpu);
    return job; // as accepted: "queued", even if its GPU already took it
  }

  /** Cancels a job: at once when waiting, between steps when running. Idempotent; 409 once it finished otherwise. */
  cancel(id: string): Job {
    const job = this.get(id);
    if (job.status === "cancelled" || job.cancel_requested) return job;
    if (isFinished(job.status)) {
      throw new JobConflictError(`Cannot cancel job "${id}": it already ${job.status}`);
    }
    if (job.status === "running") {
      const slot = this.#slots[job.gpu];
      if (slot?.job === id) Atomics.store(slot.cancel, CANCEL_FLAG, 1);
      this.#emit(id, "log", { level: "info", message: "Cancel requested" });
      return this.#store.updateJob(id, { cancel_requested: true });
    }
    this.#store.updateJob(id, {
      status: "cancelled",
      cancel_requested: true,
      finished_at: new Date().toISOString(),
    });
    this.#emit(id, "done", { status: "cancelled", iteration: job.iteration, error: null });
    return this.#store.getJob(id)!;
  }

  /** A job, or JobNotFoundError. */
  get(id: string): Job {
    const job = this.#store.getJob(id);
    if (!job) throw new JobNotFoundError(id);
    return job;
  }

  /** A job's checkpoints on disk, oldest first. */
  checkpoints(id: string): Promise<CheckpointInfo[]> {
    this.get(id);
    return listCheckpoints(this.checkpointDir(id));
  }

  /** Calls `fn` with every new event of job `id` until the returned function is called. */
  subscribe(id: string, fn: Listener): () => void {
    let set = this.#listeners.get(id);
    if (!set) this.#listeners.set(id, set = new Set());
    set.add(fn);
    return () => {
      set.delete(fn);
      if (set.size === 0) this.#listeners.delete(id);
    };
  }

  /** What GPU `gpu` reported about itself (for the memory fit check), or null before it is ready. */
  device(gpu: number): DeviceBudget | null {
    const s = this.#slots[gpu];
    if (!s || s.maxBinding === null) return null;
    return { adapter: s.adapter, max_binding_bytes: s.maxBinding, max_buffer_bytes: s.maxBuffer };
  }

  /** State of each GPU slot. */
  gpus(): GpuState[] {
    return this.#slots.map((s) => ({
      index: s.index,
      state: s.state,
      adapter: s.adapter,
      error: s.error,
      job: s.job,
      queued: this.#store.queue(s.index).length,
      max_buffer_bytes: s.maxBuffer,
    }));
  }

  /** Posts a generation message to GPU `gpu`'s Worker (see jobs/generation.ts). */
  postGeneration(gpu: number, msg: Extract<ToWorker, { type: "generate" | "generate_cancel" }>): void {
    const slot = this.#slots[gpu];
    if (!slot || this.#stopped) throw new Error(`GPU ${gpu} has no worker`);
    slot.worker.postMessage(msg);
  }

  /** Receives every Worker's generation reports (one receiver: the generation manager). */
  onGeneration(fn: (gpu: number, msg: GenerationReport) => void): void {
    this.#generation = fn;
  }

  /** Stops every Worker. Running jobs stay "running" in the store and resume on the next start. */
  shutdown(): void {
    this.#stopped = true;
    for (const s of this.#slots) {
      try {
        s.worker.postMessage({ type: "shutdown" });
      } catch { /* already gone */ }
      s.worker.terminate();
    }
    this.#listeners.clear();
  }

  #spawn(index: number): Slot {
    const cancelBuffer = new SharedArrayBuffer(4);
    const slot: Slot = {
      index,
      worker: this.#opts.spawn(index),
      cancel: new Int32Array(cancelBuffer),
      state: "starting",
      adapter: null,
      error: null,
      job: null,
      maxBuffer: null,
      maxBinding: null,
    };
    slot.worker.onmessage = (e) => this.#onMessage(slot, e.data);
    slot.worker.onerror = (e) => {
      e.preventDefault();
      this.#onCrash(slot, e.message ?? String(e));
    };
    slot.worker.postMessage({ type: "init", gpu: index, cancel: cancelBuffer });
    return slot;
  }

  #pickGpu(): number {
    let best = 0, bestLoad = Infinity;
    for (const s of this.#slots) {
      if (s.state === "unavailable" && this.#slots.some((o) => o.state !== "unavailable")) continue;
      const load = this.#store.queue(s.index).length + (s.job ? 1 : 0);
      if (load < bestLoad) [best, bestLoad] = [s.index, load];
    }
    return best;
  }

  async #resolveResume(spec: string): Promise<string> {
    const [jobId, name, ...rest] = spec.split("/");
    if (
      !/^[A-Za-z0-9_-]+$/.test(jobId) || rest.length > 0 || (name !== undefined && !/^iter_\d+$/.test(name))
    ) {
      throw new InvalidJobError(
        "resume_from",
        `Invalid resume_from "${spec}": expected "<job id>" or "<job id>/iter_N"`,
      );
    }
    const all = await listCheckpoints(this.checkpointDir(jobId));
    const found = name ? all.find((c) => c.name === name) : all.at(-1);
    if (!found) throw new InvalidJobError("resume_from", `Unknown checkpoint "${spec}"`);
    return found.path;
  }

  /** Starts the next waiting job on `gpu` if its Worker is free. */
  #dispatch(gpu: number): void {
    const slot = this.#slots[gpu];
    if (!slot || this.#stopped || slot.job) return;
    if (slot.state === "unavailable") {
      // No device behind this slot: fail what waits on it with the reason instead of queueing forever.
      for (const job of this.#store.queue(gpu)) this.#finish(job.id, "failed", job.iteration, slot.error);
      return;
    }
    if (slot.state !== "idle") return;
    const job = this.#store.nextQueued(gpu);
    if (!job) return;
    slot.job = job.id;
    slot.state = "busy";
    Atomics.store(slot.cancel, CANCEL_FLAG, 0);
    const wasInterrupted = job.status === "interrupted";
    this.#store.updateJob(job.id, {
      status: "running",
      started_at: job.started_at ?? new Date().toISOString(),
      resumes: job.resumes + (wasInterrupted ? 1 : 0),
    });
    this.#startOnWorker(slot, job).catch((e) => {
      if (this.#stopped) return;
      slot.job = null;
      slot.state = "idle";
      this.#finish(job.id, "failed", job.iteration, (e as Error).message);
      this.#dispatch(gpu);
    });
  }

  async #startOnWorker(slot: Slot, job: Job): Promise<void> {
    const dir = this.checkpointDir(job.id);
    const own = (await listCheckpoints(dir)).at(-1);
    const resume_path = own?.path ??
      (job.config.resume_from ? await this.#resolveResume(job.config.resume_from) : null);
    if (this.#stopped) return; // shut down meanwhile: the job stays "running" and resumes on the next start
    const msg: WorkerJob = {
      id: job.id,
      config: job.config,
      root: this.#opts.root,
      checkpoint_dir: dir,
      resume_path,
    };
    this.#emit(job.id, "log", {
      level: "info",
      message: resume_path
        ? `Running on GPU ${slot.index} from checkpoint "${resume_path}"`
        : `Running on GPU ${slot.index}`,
      status: "running",
    });
    slot.worker.postMessage({ type: "train", job: msg });
  }

  #onMessage(slot: Slot, msg: FromWorker): void {
    if (this.#stopped) return;
    switch (msg.type) {
      case "gen_started":
      case "gen_tokens":
      case "gen_done":
        this.#generation?.(slot.index, msg);
        return;
      case "ready":
        slot.state = "idle";
        slot.adapter = msg.adapter;
        slot.maxBuffer = msg.max_buffer_bytes;
        slot.maxBinding = msg.max_binding_bytes;
        this.#dispatch(slot.index);
        return;
      case "unavailable":
        slot.state = "unavailable";
        slot.error = msg.error;
        this.#dispatch(slot.index);
        return;
      case "started":
        this.#store.updateJob(msg.id, {
          iteration: msg.iteration,
          resumed_from: msg.resumed_from,
          metrics: { gpu_memory_bytes: msg.gpu_memory_bytes },
        });
        this.#emit(msg.id, "log", {
          level: "info",
          message: msg.resumed_from
            ? `Resumed from "${msg.resumed_from}" at iteration ${msg.iteration}`
            : `Started at iteration ${msg.iteration}`,
          iteration: msg.iteration,
          resumed_from: msg.resumed_from,
        });
        return;
      case "progress": {
        const { id, type: _, ...rest } = msg;
        this.#store.updateJob(id, {
          iteration: msg.iteration,
          metrics: {
            loss: msg.loss,
            grad_norm: msg.grad_norm,
            lr: msg.lr,
            tokens_per_s: msg.tokens_per_s,
            timings: msg.timings,
            gpu_memory_bytes: msg.gpu_memory_bytes,
          },
        });
        this.#store.addMetric(id, {
          iteration: msg.iteration,
          split: "train",
          loss: msg.loss,
          perplexity: Math.exp(msg.loss),
          lr: msg.lr,
          tokens_per_s: msg.tokens_per_s,
        });
        this.#emit(id, "progress", { kind: "train", ...rest });
        return;
      }
      case "eval": {
        const metrics = msg.split === "valid"
          ? { val_loss: msg.loss, val_perplexity: msg.perplexity }
          : { test_loss: msg.loss, test_perplexity: msg.perplexity };
        this.#store.updateJob(msg.id, { metrics });
        this.#store.addMetric(msg.id, {
          iteration: msg.iteration,
          split: msg.split,
          loss: msg.loss,
          perplexity: msg.perplexity,
          lr: null,
          tokens_per_s: null,
        });
        this.#emit(msg.id, "progress", {
          kind: "eval",
          split: msg.split,
          iteration: msg.iteration,
          loss: msg.loss,
          perplexity: msg.perplexity,
        });
        return;
      }
      case "log":
        this.#emit(msg.id, "log", { level: msg.level, message: msg.message });
        return;
      case "checkpoint":
        this.#store.updateJob(msg.id, { last_checkpoint: msg.name });
        this.#emit(msg.id, "checkpoint", { iteration: msg.iteration, name: msg.name, path: msg.path });
        return;
      case "done":
        slot.job = null;
        slot.state = "idle";
        this.#finish(msg.id, msg.status, msg.iteration, msg.error);
        this.#dispatch(slot.index);
        return;
    }
  }

  #finish(
    id: string,
    status: "succeeded" | "failed" | "cancelled",
    iteration: number,
    error: string | null,
  ): void {
    const job = this.#store.updateJob(id, {
      status,
      iteration,
      error,
      finished_at: new Date().toISOString(),
    });
    this.#emit(id, "done", {
      status,
      iteration,
      error,
      loss: job.metrics.loss,
      val_loss: job.metrics.val_loss,
      test_loss: job.metrics.test_loss,
    });
  }

  /** A Worker died: fail its job and start a fresh Worker for the slot. */
  #onCrash(slot: Slot, message: string): void {
    if (this.#stopped) return;
    const jobId = slot.job;
    slot.worker.terminate();
    const fresh = this.#spawn(slot.index);
    this.#slots[slot.index] = fresh;
    this.#generation?.(slot.index, { type: "gen_crash", error: `GPU worker crashed: ${message}` });
    if (jobId) {
      this.#finish(
        jobId,
        "failed",
        this.#store.getJob(jobId)?.iteration ?? 0,
        `GPU worker crashed: ${message}`,
      );
    }
  }

  #emit(id: string, type: JobEventType, data: Record<string, unknown>): void {
    const event = this.#store.addEvent(id, type, data);
    for (const fn of this.#listeners.get(id) ?? []) fn(event);
  }
}
