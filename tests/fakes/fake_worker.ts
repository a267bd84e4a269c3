/**
 * A test double of the GPU Worker for route and runner tests that must not touch a GPU: it
 * answers `init` like a real Worker (ready, or unavailable), records the jobs it is handed, and
 * lets the test play back the messages a real Worker would send. It trains nothing. Rehearsals (the
 * server's warm-up) it answers itself with the real Worker's code (worker/serving.ts), as a GPU's
 * Worker does, and records them apart from the generations a test answers.
 */

import type { FromWorker, ToWorker, WorkerGeneration, WorkerJob } from "../../protocol.ts";
import type { WorkerPort } from "../../protocol.ts";
import { GenerationService } from "../../worker/serving.ts";

/** A scripted stand-in for worker/gpu_worker.ts. */
export class ScriptedWorker implements WorkerPort {
  onmessage: ((e: MessageEvent<FromWorker>) => void) | null = null;
  onerror: ((e: ErrorEvent) => void) | null = null;
  /** Jobs received, in order. */
  readonly jobs: WorkerJob[] = [];
  /** Generation requests received, in order; the test answers them with `send`. */
  readonly generations: WorkerGeneration[] = [];
  /** Rehearsals received (answered by the real Worker's code, never by the test). */
  readonly rehearsals: WorkerGeneration[] = [];
  #serving = new GenerationService(
    () => Promise.reject(new Error("a rehearsal opened the GPU")),
    (m) => this.send(m),
  );
  /** Ids of generations the runner asked to cancel. */
  readonly generationCancels: string[] = [];
  terminated = false;
  /** Whether the runner asked the running job to stop and end cancelled. */
  cancelRequested = false;
  /** Whether the runner asked the running job to save and stop (shutdown). */
  stopRequested = false;
  /** Whether the runner asked the Worker to shut down; it answers `closed`. */
  shutDown = false;
  #gpu = 0;
  #unavailable: string | null;

  /** `unavailable`: answer init as a Worker with no adapter would, with this message. */
  constructor(opts: { unavailable?: string } = {}) {
    this.#unavailable = opts.unavailable ?? null;
  }

  postMessage(msg: ToWorker): void {
    if (msg.type === "init") {
      this.#gpu = msg.gpu;
      const reply: FromWorker = this.#unavailable
        ? { type: "unavailable", gpu: msg.gpu, error: this.#unavailable }
        : {
          type: "ready",
          gpu: msg.gpu,
          adapter: "scripted test double",
          max_buffer_bytes: 2 ** 28,
          max_binding_bytes: 2 ** 27,
        };
      queueMicrotask(() => this.send(reply));
    } else if (msg.type === "train") {
      this.cancelRequested = false;
      this.jobs.push(msg.job);
    } else if (msg.type === "cancel") {
      this.cancelRequested = true;
    } else if (msg.type === "stop") {
      this.stopRequested = true;
    } else if (msg.type === "shutdown") {
      this.shutDown = true;
      queueMicrotask(() => this.send({ type: "closed", gpu: this.#gpu }));
    } else if (msg.type === "generate" && msg.request.rehearsal) {
      this.rehearsals.push(msg.request);
      this.#serving.generate(msg.request);
    } else if (msg.type === "generate") {
      this.generations.push(msg.request);
    } else if (msg.type === "generate_cancel") {
      this.generationCancels.push(msg.id);
    }
  }

  /** Delivers `msg` to the runner as if the Worker had posted it. */
  send(msg: FromWorker): void {
    this.onmessage?.(new MessageEvent("message", { data: msg }));
  }

  get gpu(): number {
    return this.#gpu;
  }

  terminate(): void {
    this.terminated = true;
  }
}
