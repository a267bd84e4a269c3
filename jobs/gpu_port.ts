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
  STOP_FLAG,
  type ToWorker,
  type ToWorkerThread,
} from "./messages.ts";

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

  constructor(opts: { probeBytes?: number } = {}) {
    this.#probeBytes = opts.probeBytes ?? 0;
    this.#worker = new Worker(new URL("./gpu_worker.ts", import.meta.url).href, { type: "module" });
    this.#worker.onmessage = (e: MessageEvent<FromWorker>) => this.onmessage?.(e);
    this.#worker.onerror = (e: ErrorEvent) => {
      if (this.onerror) this.onerror(e);
    };
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
      case "train":
        // A new job starts uncancelled; a stop (shutdown) stays raised.
        Atomics.store(this.#flags, CANCEL_FLAG, 0);
        this.#worker.postMessage(msg);
        return;
      default:
        this.#worker.postMessage(msg);
    }
  }

  /** Lets the Worker free its placement probe buffer. */
  probeDone(): void {
    this.#worker.postMessage({ type: "probe_done" } satisfies ToWorkerThread);
  }

  terminate(): void {
    this.#worker.terminate();
  }
}

/** Spawns a Worker thread in this process (tests, and the GPU host itself). */
export const spawnGpuWorker: SpawnWorker = () => new LocalGpuPort();
