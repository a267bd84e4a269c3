/**
 * A GPU port: what the runner talks to for one GPU. `LocalGpuPort` wraps a Worker thread of this
 * process (jobs/gpu_worker.ts): it owns the Worker's shared flags and raises them itself on
 * `cancel` and `stop`, since a training Worker does not yield to its event loop between steps.
 * The GPU host process runs one LocalGpuPort per GPU; tests may run them in-process too.
 */

import {
  CANCEL_FLAG,
  FLAG_COUNT,
  type FromWorker,
  type JobComm,
  STOP_FLAG,
  type ToWorker,
  type ToWorkerThread,
  type WorkerJob,
} from "./messages.ts";
import { paramLayout } from "../gpu/config.ts";
import { abortCommBuffer, createCommBuffer, createControlBuffer, wireDtype } from "../gpu/parallel/mod.ts";
import { resolveModel } from "./model.ts";

/** Gradient bucket capacity in elements (64 MiB of fp32), or the whole model when smaller. */
const BUCKET_ELEMENTS = 16 << 20;
/** Gradient lanes: one bucket read back while the previous one is summed. */
const GRAD_LANES = 2;

/** Communicators of the data-parallel runs of this process, by run id, with the ranks still using them. */
const runs = new Map<string, { comm: JobComm; users: number }>();

/** The shared communicators of a data-parallel run: made by its first rank's port, shared by the rest. */
function commOf(job: WorkerJob): JobComm {
  const p = job.parallel!;
  const hit = runs.get(p.run);
  if (hit) {
    hit.users++;
    return hit.comm;
  }
  const n = paramLayout(resolveModel(job.config)).totalSize;
  const capacity = Math.min(BUCKET_ELEMENTS, Math.ceil(n / 4) * 4);
  const dtype = wireDtype(job.config.allreduce_dtype);
  const comm: JobComm = {
    grads: Array.from({ length: GRAD_LANES }, () => createCommBuffer({ ranks: p.size, capacity, dtype })),
    control: createControlBuffer(p.size),
  };
  if (job.config.distributed_optimizer) {
    comm.weights = Array.from(
      { length: GRAD_LANES },
      () => createCommBuffer({ ranks: p.size, capacity, dtype: "f32" }),
    );
  }
  runs.set(p.run, { comm, users: 1 });
  return comm;
}

/** A rank is done with its run's communicators; the last one frees them. */
function releaseComm(run: string): void {
  const hit = runs.get(run);
  if (hit && --hit.users <= 0) runs.delete(run);
}

/** What the runner needs of a GPU's Worker (a local Worker thread, one inside the GPU host, or a test double). */
export interface WorkerPort {
  postMessage(msg: ToWorker): void;
  onmessage: ((e: MessageEvent<FromWorker>) => void) | null;
  onerror: ((e: ErrorEvent) => void) | null;
  terminate(): void;
}

/** Creates the port that drives GPU `gpu`. */
export type SpawnWorker = (gpu: number) => WorkerPort;

/** A Worker thread in this process, with its shared cancel/stop flags. */
export class LocalGpuPort implements WorkerPort {
  onmessage: ((e: MessageEvent<FromWorker>) => void) | null = null;
  onerror: ((e: ErrorEvent) => void) | null = null;
  readonly #worker: Worker;
  readonly #flagsBuffer = new SharedArrayBuffer(4 * FLAG_COUNT);
  readonly #flags = new Int32Array(this.#flagsBuffer);
  /** Bytes the Worker holds after init until `probeDone()` (see jobs/gpu_select.ts). */
  readonly #probeBytes: number;
  /** The data-parallel run this Worker is a rank of, while it runs. */
  #run: { id: string; job: string; comm: JobComm } | null = null;

  constructor(opts: { probeBytes?: number } = {}) {
    this.#probeBytes = opts.probeBytes ?? 0;
    this.#worker = new Worker(new URL("./gpu_worker.ts", import.meta.url).href, { type: "module" });
    this.#worker.onmessage = (e: MessageEvent<FromWorker>) => {
      const msg = e.data;
      if (msg.type === "done" && this.#run?.job === msg.id) this.#leaveRun(false);
      this.onmessage?.(e);
    };
    this.#worker.onerror = (e: ErrorEvent) => {
      // The peers of a dead rank would wait for it: fail their communicators now.
      this.#leaveRun(true);
      if (this.onerror) this.onerror(e);
    };
  }

  #leaveRun(abort: boolean): void {
    const run = this.#run;
    if (!run) return;
    this.#run = null;
    if (abort) { for (const sab of [...run.comm.grads, run.comm.control]) abortCommBuffer(sab); }
    releaseComm(run.id);
  }

  postMessage(msg: ToWorker): void {
    switch (msg.type) {
      case "init": {
        const init: ToWorkerThread = { type: "init", gpu: msg.gpu, flags: this.#flagsBuffer };
        if (this.#probeBytes > 0) init.probe_bytes = this.#probeBytes;
        this.#worker.postMessage(init);
        return;
      }
      case "cancel":
        Atomics.store(this.#flags, CANCEL_FLAG, 1);
        return;
      case "stop":
        Atomics.store(this.#flags, STOP_FLAG, 1);
        return;
      case "train": {
        // A new job starts uncancelled; a stop (shutdown) stays raised.
        Atomics.store(this.#flags, CANCEL_FLAG, 0);
        const train: ToWorkerThread = { type: "train", job: msg.job };
        if (msg.job.parallel && msg.job.parallel.size > 1) {
          this.#leaveRun(true);
          train.comm = commOf(msg.job);
          this.#run = { id: msg.job.parallel.run, job: msg.job.id, comm: train.comm };
        }
        this.#worker.postMessage(train);
        return;
      }
      default:
        this.#worker.postMessage(msg);
    }
  }

  /** Lets the Worker free its placement probe buffer. */
  probeDone(): void {
    this.#worker.postMessage({ type: "probe_done" } satisfies ToWorkerThread);
  }

  terminate(): void {
    this.#leaveRun(true);
    this.#worker.terminate();
  }
}

/** Spawns a Worker thread in this process (tests, and the GPU host itself). */
export const spawnGpuWorker: SpawnWorker = () => new LocalGpuPort();
