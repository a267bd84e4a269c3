/**
 * A GPU port: what the runner talks to for one GPU. `LocalGpuPort` wraps a Worker thread of this
 * process (worker/gpu_worker.ts): it owns the Worker's shared flags and raises them itself on
 * `cancel` and `stop`, since a training Worker does not yield to its event loop between steps.
 * The GPU host process runs one LocalGpuPort per GPU; tests may run them in-process too.
 */

import {
  CANCEL_FLAG,
  FLAG_COUNT,
  type FromWorker,
  type JobComm,
  SENT_COUNT,
  type SpawnWorker,
  STOP_FLAG,
  type ToWorker,
  type ToWorkerThread,
  type WorkerPort,
} from "../protocol.ts";
import { abortCommBuffer } from "../engine/parallel/allreduce.ts";
import { jobComm, releaseJobComm } from "./comms.ts";

/** A Worker thread in this process, with its shared cancel/stop flags. */
export class LocalGpuPort implements WorkerPort {
  onmessage: ((e: MessageEvent<FromWorker>) => void) | null = null;
  onerror: ((e: ErrorEvent) => void) | null = null;
  readonly #worker: Worker;
  readonly #flagsBuffer = new SharedArrayBuffer(4 * FLAG_COUNT);
  readonly #flags = new Int32Array(this.#flagsBuffer);
  /** Bytes the Worker holds after init until `probeDone()` (see host/gpu_select.ts). */
  readonly #probeBytes: number;
  /** The data-parallel run this Worker is a rank of, while it runs. */
  #run: { id: string; job: string; comm: JobComm } | null = null;

  constructor(opts: { probeBytes?: number } = {}) {
    this.#probeBytes = opts.probeBytes ?? 0;
    this.#worker = new Worker(new URL("../worker/gpu_worker.ts", import.meta.url).href, { type: "module" });
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
    releaseJobComm(run.id);
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
          train.comm = jobComm(msg.job);
          this.#run = { id: msg.job.parallel.run, job: msg.job.id, comm: train.comm };
        }
        this.#send(train);
        return;
      }
      default:
        this.#send(msg);
    }
  }

  /** Posts to the Worker thread, counted in the shared flags (SENT_COUNT) first. */
  #send(msg: ToWorkerThread): void {
    Atomics.add(this.#flags, SENT_COUNT, 1);
    this.#worker.postMessage(msg);
    Atomics.notify(this.#flags, SENT_COUNT); // a gathering Worker waits on it (GpuWorker.awaitPosted)
  }

  /** Lets the Worker free its placement probe buffer. */
  probeDone(): void {
    this.#send({ type: "probe_done" });
  }

  terminate(): void {
    this.#leaveRun(true);
    this.#worker.terminate();
  }
}

/** Spawns a Worker thread in this process (tests, and the GPU host itself). */
export const spawnGpuWorker: SpawnWorker = () => new LocalGpuPort();
