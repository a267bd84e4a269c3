/**
 * The job runner: the HTTP process's side of training. It is one of the GPU pool's two clients
 * (server/gpus/gpu_pool.ts holds one Worker per GPU; the generation manager is the other): it
 * feeds each GPU's FIFO queue from the store (a free GPU with nothing of its own to run takes the
 * next job waiting on another's), turns Worker reports into stored metrics and events, and fans
 * events out to live subscribers (the SSE routes). Jobs whose Worker died, or that a dead
 * server left running, are marked interrupted; they go to the head of their queue and resume from
 * their newest checkpoint. A graceful `stop()` has every running job save a checkpoint at its
 * current step first.
 *
 * Several hosts (`leases`, PostgreSQL): the queue is shared. A host claims the next waiting job
 * it can place (server/jobs/leases.ts) whenever a training GPU frees up, a job is queued anywhere
 * or once a second, and every write it makes for a job it holds is fenced on the lease. A write
 * refused because another host took the job over (this one missed its lease), or a heartbeat
 * that says so, stops the job here at once: its Worker is replaced, not asked to stop (that would
 * save a checkpoint), and nothing more is written for it. A cancel sent through another host
 * reaches this one at its next heartbeat. Finished and interrupted jobs give their lease back.
 * Checkpoint files are fenced too: before committing one, the Worker asks (`commit_check`), and
 * the runner answers from the lease as the database has it at that moment.
 */

import { isFinished, type JobStore } from "./job_store.ts";
import { Placement } from "./placement.ts";
import { StoreBacklog, type StoreState } from "./store_backlog.ts";
import { JobRecords, type Listener } from "./job_records.ts";
import type { LeaseKeeper } from "./leases.ts";
import {
  GpuUnavailableError,
  InvalidJobError,
  JobConflictError,
  JobNotFoundError,
} from "../../job/errors.ts";
import type { FromWorker, ModelSource, SpawnWorker, WorkerJob } from "../../protocol.ts";
import type { HostStatus } from "../gpus/host_client.ts";
import { GpuPool, type GpuSlot, type GpuState, type JobReport } from "../gpus/gpu_pool.ts";
import { type CheckpointInfo, listCheckpoints } from "../../checkpoint/checkpoint.ts";
import type { Job } from "../../job/job.ts";
import { CommitFence } from "./commit_fence.ts";
import { ReportRecorder } from "./job_reports.ts";
import { checkEvaluation, checkTrainConfig, modelSource, resolveResume, unknownModel } from "./job_checks.ts";
import {
  completeConfig,
  completeEvalConfig,
  type DeviceBudget,
  estimateBytes,
  type EvaluateRequest,
  type TrainRequest,
} from "../../job/job_config.ts";

export type { SpawnWorker, WorkerPort } from "../../protocol.ts";

type Slot = GpuSlot;

/** A data-parallel job on several slots: its ranks in order, and what each has reported at its end. */
interface Gang {
  job: string;
  size: number;
  /** Slots of the ranks (rank order), gathered while the job waits for them. */
  slots: Slot[];
  started: boolean;
  outcomes: Map<number, Extract<FromWorker, { type: "done" }>>;
  /** A rank's Worker died: the job resumes (or fails after repeated crashes) once the others ended. */
  crash: string | null;
}

/** Errors a rank reports because a peer failed first; the peer's own error is the one worth showing. */
const PEER_FAILURE = /^Communicator (aborted|timed out)/;

/** Options of {@link JobRunner}. */
export interface RunnerOptions {
  /** Data directory: datasets and `checkpoints/<job id>/`. */
  root: string;
  /** Number of GPUs (one Worker each). */
  gpus: number;
  spawn: SpawnWorker;
  /** Whether a dataset id can be trained on (prepared, or a builtin prepared on first use). */
  datasetExists: (id: string) => Promise<boolean>;
  /** Tokens per split of a prepared dataset (null when not known before it is prepared), to refuse splits shorter than one sequence. */
  splitTokens?: (id: string) => Promise<{ train: number; valid: number; test: number } | null>;
  /** The GPU host's state, when the Workers run in one (shown by /health). */
  host?: () => HostStatus;
  /** GPUs that take training jobs (GPT2_GPU_ROLES); default all. */
  trainGpus?: number[];
  /** Several hosts on one database: claims and leases of the shared queue (default: one host). */
  leases?: LeaseKeeper;
  /** With `leases`: ms between looks at the shared queue (default 1000). */
  pollMs?: number;
  /**
   * A running job whose Worker reports nothing (no step, log, evaluation or compile progress) for
   * this long is stopped there and resumes from its newest checkpoint on a fresh Worker, or fails
   * after repeated stalls (GPT2_STALL_S; default 600 s; 0 turns the watchdog off).
   */
  stallMs?: number;
  /** First pause between tries of a job store that is away, ms (default 500). */
  storeRetryMs?: number;
  /** Users at their running-jobs quota (server/auth/quotas.ts): their waiting jobs wait (default none). */
  skipOwners?: () => string[];
}

/** Schedules jobs onto GPU Workers and records what they report. */
export class JobRunner {
  #store: JobStore;
  #opts: RunnerOptions;
  /** The GPU slots and their Workers, shared with the generation manager. */
  #pool: GpuPool;
  #stopped = false;
  /** Set by stop(): no new job starts; running ones save and end "interrupted". */
  #draining = false;
  /** Data-parallel jobs gathering GPUs or running, by job id. */
  #gangs = new Map<string, Gang>();
  /** Writes what Workers report on their jobs (through the fenced, ordered writes below). */
  #recorder = new ReportRecorder({
    update: (id, patch) => this.#records.update(id, patch),
    metric: (id, p) => this.#records.metric(id, p),
    emit: (id, type, data) => this.#records.emit(id, type, data),
    progressed: (id) => this.#records.progressed(id),
  });
  /** Answers Workers asking whether they may commit a checkpoint (the fence on the files). */
  #fence: CommitFence;
  #poll: ReturnType<typeof setInterval> | null = null;
  #unlistenStore: (() => void) | null = null;
  /** Writes kept, in order, while the store is away. */
  #backlog: StoreBacklog;
  /** The job's records, events and lease, fenced and kept in order. */
  #records: JobRecords;
  /** One host's GPU queues: where a job waits, and moves. */
  #placement: Placement;
  /** Each GPU's queue length when the store last answered (shown while it is away). */
  #queued: number[] = [];

  constructor(store: JobStore, opts: RunnerOptions) {
    this.#store = store;
    this.#opts = opts;
    this.#pool = new GpuPool({ gpus: opts.gpus, spawn: opts.spawn, host: opts.host, stallMs: opts.stallMs });
    this.#backlog = new StoreBacklog({
      probe: () => store.writeError(),
      retryMs: opts.storeRetryMs,
      onLost: (error) =>
        console.error(`Job store unreachable: ${error}; training goes on, its records wait in order`),
      onRecovered: (ms) => {
        console.log(`Job store reachable again after ${(ms / 1000).toFixed(1)} s; kept records written`);
        // Other hosts' leases ran out too: let them renew before any is taken over; renew ours now.
        const leases = this.#opts.leases;
        if (leases) {
          leases.holdTakeovers();
          try {
            leases.beat();
          } catch { /* the next beat tries again */ }
        }
        if (!this.#stopped && !this.#draining) { for (const s of this.#pool.slots) this.#dispatch(s.index); }
      },
    });
    this.#records = new JobRecords(store, this.#backlog, opts.leases, (id) => this.#leaseLost(id));
    this.#placement = new Placement({
      store,
      records: this.#records,
      trainSlots: () => this.#trainSlots(),
      skipOwners: () => this.#opts.skipOwners?.() ?? [],
      dispatch: (gpu) => this.#dispatch(gpu),
    });
    this.#fence = new CommitFence({
      leases: opts.leases,
      pool: this.#pool,
      records: this.#records,
      backlog: this.#backlog,
      stopped: () => this.#stopped,
      forgetCrashes: (id) => this.#records.progressed(id),
    });
  }

  /** The store as the runner last found it: reachable, or away since when and why (`/health`). */
  storeState(): StoreState {
    return this.#backlog.state();
  }

  /**
   * A call of a route found the store unreachable: the runner's state follows (and it tries the
   * store until it answers). Returns whether `e` was such an error.
   */
  storeFailed(e: unknown): boolean {
    return this.#backlog.failed(e);
  }

  /** The store the runner records into. */
  get store(): JobStore {
    return this.#store;
  }

  /** Recovers interrupted jobs and starts one Worker per GPU. */
  start(): void {
    const leases = this.#opts.leases;
    if (leases) {
      // Only this host's own jobs are let go (any host may resume them); the others' stay theirs.
      for (const job of leases.start()) this.#records.recovered(job);
      const look = () => queueMicrotask(() => this.#claimWaiting());
      this.#poll = setInterval(look, this.#opts.pollMs ?? 1000);
      this.#unlistenStore = this.#store.onEvent((e) => {
        if (e.type === "done" || e.data.status === "queued" || e.data.status === "interrupted") look();
      });
    } else {
      // Jobs left on GPUs this server does not have (fewer GPUs than last time) move to the others.
      this.#store.requeueBeyond(this.#opts.gpus);
      for (const job of this.#store.markInterrupted()) this.#records.recovered(job);
    }
    this.#pool.start({
      slotChanged: (slot) => this.#dispatch(slot.index),
      report: (slot, msg) => this.#onReport(slot, msg),
      crashed: (slot, message) => this.#onCrash(slot, message),
      stalled: (slot, message) => this.#records.emit(slot.job!, "log", { level: "error", message }),
    });
  }

  /** The GPU slots and their Workers (the generation manager's way to the GPUs). */
  get pool(): GpuPool {
    return this.#pool;
  }

  /** A heartbeat found that another host took job `id` over: stop it here at once. */
  leaseLost(id: string): void {
    this.#leaseLost(id);
  }

  /** A cancel for job `id`, running here, was sent through another host. */
  cancelFromElsewhere(id: string): void {
    const running = this.#pool.slots.filter((s) => s.job === id);
    if (running.length === 0) return;
    for (const slot of running) slot.worker.postMessage({ type: "cancel" });
    this.#records.emit(id, "log", { level: "info", message: "Cancel requested through another host" });
  }

  /** Whether dataset `id` exists (a built-in, or prepared under the data directory). */
  datasetExists(id: string): Promise<boolean> {
    return this.#opts.datasetExists(id);
  }

  /** Directory of a job's checkpoints. */
  checkpointDir(id: string): string {
    return `${this.#opts.root}/checkpoints/${id}`;
  }

  /** The error naming `id` unknown in `field`, as {@link modelSource} words it: the same for a model that is another user's. */
  unknownModel(id: string, field: string): InvalidJobError {
    return unknownModel(id, field);
  }

  /**
   * Queues a training job, owned by `owner` (null: no user), on the GPU with the shortest queue
   * (jobs held by their owner's running quota not counted). Throws InvalidJobError naming the
   * field for an unknown model or dataset, a model that cannot fit, or a bad resume_from.
   */
  async submit(req: TrainRequest, owner: string | null = null): Promise<Job> {
    if (this.#draining) {
      throw new GpuUnavailableError("Server is shutting down: submit again once it is back");
    }
    const gpu = this.#placement.pickGpu();
    const source = req.init_from ? await this.modelSource(req.init_from, "init_from") : null;
    const config = completeConfig(req, this.device(gpu), source);
    await checkTrainConfig(this.#opts, config, this.#trainSlots().length);
    const id = `job_${crypto.randomUUID().replaceAll("-", "").slice(0, 12)}`;
    this.#store.createJob(id, gpu, config, owner);
    const job = this.#store.updateJob(id, {
      metrics: { gpu_memory_estimate_bytes: estimateBytes(config, this.device(gpu)) },
    });
    this.#records.emit(id, "log", { level: "info", message: `Queued on GPU ${gpu}`, status: "queued" });
    this.#dispatch(gpu);
    return job; // as accepted: "queued", even if its GPU already took it
  }

  /**
   * A model the server knows (see checkpoint/model_source.ts), for `field`: an unknown or unusable
   * one is an InvalidJobError naming that field.
   */
  modelSource(id: string, field: string): Promise<ModelSource> {
    return modelSource(this.#opts.root, id, field);
  }

  /**
   * Queues an evaluation job (`POST /evaluate`), owned by `owner`, like a training job on one GPU. Throws
   * InvalidJobError naming the field for an unknown model or dataset, or a window the model cannot take.
   */
  async submitEvaluation(req: EvaluateRequest, owner: string | null = null): Promise<Job> {
    if (this.#draining) {
      throw new GpuUnavailableError("Server is shutting down: submit again once it is back");
    }
    const source = await this.modelSource(req.model, "model");
    const config = completeEvalConfig(req, source);
    await checkEvaluation(this.#opts, req);
    const gpu = this.#placement.pickGpu();
    const id = `eval_${crypto.randomUUID().replaceAll("-", "").slice(0, 12)}`;
    this.#store.createJob(id, gpu, config, owner);
    const job = this.#store.updateJob(id, {
      metrics: { gpu_memory_estimate_bytes: estimateBytes(config, this.device(gpu)), evaluation: null },
    });
    this.#records.emit(id, "log", {
      level: "info",
      message: `Queued on GPU ${gpu}: ${req.task} of "${source.id}"`,
      status: "queued",
    });
    this.#dispatch(gpu);
    return job;
  }

  /** Cancels a job: at once when waiting, between steps when running. Idempotent; 409 once it finished otherwise. */
  cancel(id: string): Job {
    const job = this.get(id);
    if (job.status === "cancelled" || job.cancel_requested) return job;
    if (isFinished(job.status)) {
      throw new JobConflictError(`Cannot cancel job "${id}": it already ${job.status}`);
    }
    if (job.status === "running") {
      for (const slot of this.#pool.slots) if (slot.job === id) slot.worker.postMessage({ type: "cancel" });
      this.#records.emit(id, "log", { level: "info", message: "Cancel requested" }, false);
      return this.#store.updateJob(id, { cancel_requested: true });
    }
    const gang = this.#gangs.get(id);
    if (gang && !gang.started) {
      // It was gathering GPUs: give them back.
      this.#gangs.delete(id);
      for (const s of gang.slots) s.reserved = null;
      queueMicrotask(() => gang.slots.forEach((s) => this.#dispatch(s.index)));
    }
    this.#store.updateJob(id, {
      status: "cancelled",
      cancel_requested: true,
      finished_at: new Date().toISOString(),
    });
    this.#records.emit(id, "done", { status: "cancelled", iteration: job.iteration, error: null }, false);
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

  /**
   * Deletes a finished job: its checkpoints on disk, then its record, metrics and events.
   * JobConflictError while it may still change (cancel it first).
   */
  async remove(id: string): Promise<void> {
    const job = this.get(id);
    if (!isFinished(job.status)) {
      throw new JobConflictError(`Cannot delete job "${id}": it is ${job.status} (cancel it first)`);
    }
    await Deno.remove(this.checkpointDir(id), { recursive: true }).catch((e) => {
      if (!(e instanceof Deno.errors.NotFound)) throw e;
    });
    this.#store.deleteJob(id);
    this.#records.forget(id);
  }

  /** Calls `fn` with every new event of job `id` until the returned function is called. */
  subscribe(id: string, fn: Listener): () => void {
    return this.#records.subscribe(id, fn);
  }

  /** What GPU `gpu` reported about itself (for the memory fit check), or null before it is ready. */
  device(gpu: number): DeviceBudget | null {
    return this.#pool.device(gpu);
  }

  /** The GPU host's state, or null when Workers run in this process. */
  hostStatus(): HostStatus | null {
    return this.#pool.hostStatus();
  }

  /** State of each GPU slot. */
  gpus(): GpuState[] {
    return this.#pool.slots.map((s) => ({
      index: s.index,
      state: s.state,
      adapter: s.adapter,
      error: s.error,
      job: s.job,
      queued: this.#queueLength(s.index),
      max_buffer_bytes: s.maxBuffer,
      pci_bus: s.pciBus,
    }));
  }

  /** GPU `gpu`'s queue length, or the last one known while the store is away. */
  #queueLength(gpu: number): number {
    if (this.#backlog.reachable) {
      try {
        return this.#queued[gpu] = this.#store.queueLength(gpu);
      } catch (e) {
        if (!this.#backlog.failed(e)) throw e;
      }
    }
    return this.#queued[gpu] ?? 0;
  }

  /** Whether stop() has begun. */
  get draining(): boolean {
    return this.#draining;
  }

  /**
   * Graceful stop, within `timeoutMs`: no new job starts, each running job saves a checkpoint at
   * its current step and becomes "interrupted" (it resumes there on the next start), open event
   * streams get a final `shutdown` event, and every Worker destroys its device and ends. Whatever
   * has not finished by the deadline is left to resume from its newest checkpoint.
   */
  async stop(timeoutMs: number): Promise<void> {
    if (this.#draining) return;
    this.#draining = true;
    const deadline = Date.now() + timeoutMs;
    const until = async (done: () => boolean) => {
      while (!done() && Date.now() < deadline) await new Promise((r) => setTimeout(r, 20));
    };
    this.#pool.drain();
    for (const s of this.#pool.slots) if (s.job) s.worker.postMessage({ type: "stop" });
    await until(() => this.#pool.slots.every((s) => !s.job || s.state === "unavailable"));
    this.#pool.generationsLost("Server is shutting down");
    this.#records.shutdownEvent("Server is shutting down");
    await this.#pool.close(deadline);
    // Records kept while the store was away: one last try (what stays unwritten is logged).
    if (this.#backlog.state().pending > 0) this.#backlog.flush();
    const { pending } = this.#backlog.state();
    if (pending > 0) console.error(`Job store still unreachable: ${pending} job record(s) not written`);
    this.shutdown();
  }

  /** Stops at once: every Worker is terminated. Running jobs stay "running" in the store and resume on the next start. */
  shutdown(): void {
    this.#stopped = true;
    this.#draining = true;
    this.#backlog.stop();
    if (this.#poll !== null) clearInterval(this.#poll);
    this.#fence.stop();
    this.#unlistenStore?.();
    this.#pool.shutdown();
    this.#records.clear();
  }

  /** Slots that take training jobs. */
  #trainSlots(): Slot[] {
    return this.#pool.slots.filter((s) => !this.#opts.trainGpus || this.#opts.trainGpus.includes(s.index));
  }

  /**
   * Starts the next waiting job on `gpu` if its Worker is free. A data-parallel job first gathers
   * free training GPUs (holding each as it frees up, so smaller jobs cannot starve it) and starts
   * once it has one per rank.
   */
  #dispatch(gpu: number): void {
    // The store is away: nothing new starts (running jobs go on); every slot looks again once it is back.
    if (!this.#backlog.reachable) return;
    try {
      this.#dispatchNow(gpu);
    } catch (e) {
      if (!this.#backlog.failed(e)) throw e;
    }
  }

  #dispatchNow(gpu: number): void {
    const slot = this.#pool.slots[gpu];
    if (!slot || this.#stopped || this.#draining || slot.job) return;
    if (slot.state === "unavailable") {
      // (With several hosts the queue is shared: another host may place those jobs.)
      if (!this.#opts.leases) this.#placement.rehome(slot);
      return;
    }
    if (slot.state !== "idle" || slot.reserved) return;
    const waiting = [...this.#gangs.values()].find((g) => !g.started);
    if (waiting && this.#trainSlots().includes(slot)) {
      slot.reserved = waiting.job;
      waiting.slots.push(slot);
      this.#startGang(waiting);
      return;
    }
    const job = this.#next(slot) ?? (this.#opts.leases ? null : this.#placement.steal(slot));
    if (!job) return;
    // A data- or tensor-parallel job needs a slot per rank.
    const dp = (job.config.data_parallel ?? 1) * (job.config.tensor_parallel ?? 1);
    if (dp > 1) {
      const gang: Gang = {
        job: job.id,
        size: dp,
        slots: [slot],
        started: false,
        outcomes: new Map(),
        crash: null,
      };
      slot.reserved = job.id;
      this.#gangs.set(job.id, gang);
      for (const s of this.#trainSlots()) {
        if (gang.slots.length >= dp) break;
        if (s !== slot && s.state === "idle" && !s.job && !s.reserved) {
          s.reserved = job.id;
          gang.slots.push(s);
        }
      }
      if (gang.slots.length < dp) {
        this.#records.emit(job.id, "log", {
          level: "info",
          message: `Waiting for ${dp - gang.slots.length} more free GPU(s) for its ${dp} ranks`,
        });
      }
      this.#startGang(gang);
      return;
    }
    slot.job = job.id;
    slot.state = "busy";
    const wasInterrupted = job.status === "interrupted";
    this.#records.update(job.id, {
      status: "running",
      started_at: job.started_at ?? new Date().toISOString(),
      resumes: job.resumes + (wasInterrupted ? 1 : 0),
    });
    this.#startOnWorker(slot, job).catch((e) => {
      if (this.#stopped) return;
      slot.job = null;
      slot.state = "idle";
      this.#records.finish(job.id, "failed", job.iteration, (e as Error).message);
      this.#dispatch(gpu);
    });
  }

  /** The next job for `slot`: its GPU's queue, or with several hosts a claim on the shared queue. */
  #next(slot: Slot): Job | null {
    const leases = this.#opts.leases;
    const skip = this.#opts.skipOwners?.() ?? [];
    if (!leases) return this.#store.nextQueued(slot.index, skip);
    const train = this.#trainSlots();
    if (!train.includes(slot)) return null;
    const free = train.filter((s) => s.state === "idle" && !s.job && !s.reserved).length;
    let claim;
    try {
      claim = leases.claim(free, skip);
    } catch (e) {
      if (!this.#backlog.failed(e)) {
        console.error(`Cannot claim a job from the shared queue: ${(e as Error).message}`);
      }
      return null;
    }
    if (!claim) return null;
    const { job } = claim;
    this.#records.lost.delete(job.id);
    if (job.cancel_requested) {
      this.#records.finish(job.id, "cancelled", job.iteration, null);
      return this.#next(slot);
    }
    if (job.status !== "running") return job;
    // Its host stopped renewing the lease (dead, paused or cut off): it resumes here.
    this.#records.emit(job.id, "log", {
      level: "warn",
      message: `The host running job "${job.id}" stopped renewing its lease at iteration ${job.iteration}: ` +
        `resuming on host "${leases.hostId}" from the newest checkpoint`,
      status: "interrupted",
    });
    return { ...job, status: "interrupted" };
  }

  /** With several hosts: every idle training GPU looks at the shared queue. */
  #claimWaiting(): void {
    if (this.#stopped || this.#draining || !this.#backlog.reachable) return;
    for (const s of this.#trainSlots()) this.#dispatch(s.index);
  }

  /**
   * Another host took job `id` over: its Workers here are replaced at once (not asked to stop,
   * which would save a checkpoint), its lease forgotten, and nothing more is written for it.
   */
  #leaseLost(id: string): void {
    if (this.#records.lost.has(id)) return;
    const iteration = this.#pool.slots.find((s) => s.job === id) ? " while it ran here" : "";
    // Recorded unfenced, as a user's cancel is: the job's other records are the new holder's now.
    this.#records.emit(id, "log", {
      level: "warn",
      message:
        `Host "${this.#opts.leases?.hostId}" lost its lease on the job${iteration} (it could not renew ` +
        "it in time, e.g. while the job store was unreachable, and another host claimed it): stopped here " +
        "without saving; the job resumes from its newest checkpoint",
    }, false);
    this.#records.lost.add(id);
    this.#opts.leases?.forget(id);
    this.#records.progressed(id);
    this.#replaceWorkers(id);
    console.error(
      `Job "${id}" was taken over by another host after this one missed its lease: stopped here, ` +
        `nothing more is written for it`,
    );
  }

  /** Replaces the Workers running job `id` (terminated, not asked to stop) and frees its reserved slots. */
  #replaceWorkers(id: string): void {
    this.#gangs.delete(id);
    for (const s of [...this.#pool.slots]) {
      if (s.reserved === id) s.reserved = null;
      if (s.job !== id) continue;
      s.job = null;
      this.#pool.replace(s);
    }
  }

  /** Starts a data-parallel job once it holds a slot per rank. */
  #startGang(gang: Gang): void {
    if (gang.started || gang.slots.length < gang.size) return;
    const job = this.#store.getJob(gang.job);
    if (!job || isFinished(job.status)) {
      for (const s of gang.slots) s.reserved = null;
      this.#gangs.delete(gang.job);
      for (const s of gang.slots) this.#dispatch(s.index);
      return;
    }
    gang.started = true;
    const run = crypto.randomUUID();
    for (const s of gang.slots) {
      s.job = job.id;
      s.state = "busy";
      s.reserved = null;
    }
    const wasInterrupted = job.status === "interrupted";
    this.#records.update(job.id, {
      status: "running",
      started_at: job.started_at ?? new Date().toISOString(),
      resumes: job.resumes + (wasInterrupted ? 1 : 0),
      metrics: { gpus: gang.slots.map((s) => s.index) },
    });
    gang.slots.forEach((s, rank) => {
      this.#startOnWorker(s, job, { rank, size: gang.size, run }).catch((e) => {
        if (this.#stopped) return;
        // A rank that never started: the others fail at their first exchange (timeout) or are cancelled.
        for (const o of gang.slots) if (o.job === job.id) o.worker.postMessage({ type: "cancel" });
        this.#onRankDone(s, {
          type: "done",
          id: job.id,
          status: "failed",
          iteration: job.iteration,
          error: (e as Error).message,
        });
      });
    });
  }

  /** One rank of a data-parallel job ended; once all have, the job ends with the most telling outcome. */
  #onRankDone(slot: Slot, msg: Extract<FromWorker, { type: "done" }>): void {
    const gang = this.#gangs.get(msg.id);
    if (!gang) return;
    const rank = gang.slots.indexOf(slot);
    gang.outcomes.set(rank, msg);
    if (slot.job === msg.id) {
      slot.job = null;
      slot.state = "idle";
    }
    if (gang.outcomes.size < gang.size) return;
    this.#gangs.delete(gang.job);
    const lead = gang.outcomes.get(0)!;
    const all = [...gang.outcomes.values()];
    const failed = all.filter((o) => o.status === "failed");
    if (gang.crash !== null) {
      this.#records.crashed(gang.job, gang.crash);
    } else if (failed.length > 0) {
      const own = failed.find((o) => !PEER_FAILURE.test(o.error ?? "")) ?? failed[0];
      this.#records.finish(gang.job, "failed", lead.iteration, own.error);
    } else if (lead.status === "interrupted") {
      this.#records.interrupted(gang.job, lead.iteration);
    } else {
      this.#records.finish(gang.job, lead.status as "succeeded" | "cancelled", lead.iteration, lead.error);
    }
    // As for a job on one GPU: its owner's running quota may have freed, for a job on any GPU's queue.
    for (const s of this.#opts.skipOwners ? [...this.#pool.slots] : gang.slots) this.#dispatch(s.index);
  }

  async #startOnWorker(slot: Slot, job: Job, parallel?: WorkerJob["parallel"]): Promise<void> {
    const dir = this.checkpointDir(job.id);
    // Its own checkpoints newest first: the Worker passes over one that fails to load or verify.
    const own = (await listCheckpoints(dir)).reverse().map((ck) => ck.path);
    const resume_path = own[0] ??
      (job.config.resume_from ? await resolveResume(this.#opts.root, job.config.resume_from) : null);
    // A fine-tuning job's source (until it has checkpoints of its own), or the evaluated model.
    const c = job.config;
    const init = c.evaluate?.model ?? (resume_path ? undefined : c.init_from);
    const init_source = init ? await this.modelSource(init, c.evaluate ? "model" : "init_from") : undefined;
    if (this.#stopped) return; // shut down meanwhile: the job stays "running" and resumes on the next start
    if (slot.job !== job.id) return; // taken over by another host meanwhile
    const msg: WorkerJob = {
      id: job.id,
      config: job.config,
      root: this.#opts.root,
      checkpoint_dir: dir,
      resume_path,
      ...(own.length > 1 ? { resume_candidates: own } : {}),
      ...(init_source ? { init_source } : {}),
      ...(parallel ? { parallel } : {}),
    };
    if (!parallel || parallel.rank === 0) {
      const gang = this.#gangs.get(job.id);
      let where = gang
        ? `GPUs ${gang.slots.map((s) => s.index).join(", ")} (data_parallel ${
          job.config.data_parallel ?? 1
        }, ` +
          `tensor_parallel ${job.config.tensor_parallel ?? 1})`
        : `GPU ${slot.index}`;
      const leases = this.#opts.leases;
      if (leases) where += ` of host "${leases.hostId}"`;
      this.#records.emit(job.id, "log", {
        level: "info",
        message: resume_path
          ? `Running on ${where} from checkpoint "${resume_path}"`
          : init_source
          ? `Running on ${where} from the weights of "${init_source.id}"`
          : `Running on ${where}`,
        status: "running",
      });
    }
    slot.worker.postMessage({ type: "train", job: msg });
  }

  /**
   * A Worker's report on a job. Nothing it causes may escape to the port: an error there would stop
   * the host's relay of every GPU's messages (and with it the host). It is logged instead, and an
   * unreachable store becomes the runner's store state.
   */
  #onReport(slot: Slot, msg: JobReport): void {
    if (this.#stopped) return;
    try {
      this.#handle(slot, msg);
    } catch (e) {
      if (this.#backlog.failed(e)) return;
      console.error(
        `Job runner: handling "${msg.type}" from GPU ${slot.index} failed: ${(e as Error).stack ?? e}`,
      );
    }
  }

  #handle(slot: Slot, msg: JobReport): void {
    switch (msg.type) {
      case "commit_check":
        this.#fence.check(slot, msg);
        return;
      case "done":
        if (this.#gangs.has(msg.id)) {
          this.#onRankDone(slot, msg);
          this.#fence.settled(msg.id);
          return;
        }
        slot.job = null;
        slot.state = "idle";
        this.#fence.settled(msg.id);
        if (msg.status === "interrupted") {
          this.#records.interrupted(msg.id, msg.iteration);
        } else {
          this.#records.finish(msg.id, msg.status, msg.iteration, msg.error);
        }
        // A user's running quota may have freed: a job of theirs left waiting on another GPU may go.
        if (this.#opts.skipOwners) { for (const s of this.#pool.slots) this.#dispatch(s.index); }
        else this.#dispatch(slot.index);
        return;
      default:
        this.#recorder.record(slot.index, msg);
    }
  }

  /**
   * A Worker (or the whole GPU host) died, and the pool lost its generations: its job becomes
   * "interrupted" and resumes from its newest checkpoint on a fresh Worker, unless it keeps
   * crashing without getting further.
   */
  #onCrash(slot: Slot, message: string): void {
    const jobId = slot.job;
    const gang = jobId ? this.#gangs.get(jobId) : undefined;
    if (gang) {
      // The other ranks fail at their next exchange (the port aborts the communicators); the job
      // resumes once all of them have ended.
      gang.crash ??= message;
      for (const s of gang.slots) if (s !== slot && s.job === jobId) s.worker.postMessage({ type: "cancel" });
      const replacement = this.#pool.replace(slot);
      gang.slots[gang.slots.indexOf(slot)] = replacement;
      this.#onRankDone(replacement, {
        type: "done",
        id: jobId!,
        status: "failed",
        iteration: 0,
        error: `GPU worker crashed: ${message}`,
      });
      return;
    }
    if (jobId) this.#records.crashed(jobId, message);
    this.#pool.replace(slot);
  }
}
