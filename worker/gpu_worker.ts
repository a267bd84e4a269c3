/**
 * The Worker that drives one GPU. It opens the device once, then runs the jobs the runner posts
 * one at a time (see train_loop.ts), polling the shared cancel and stop flags between steps. All
 * GPU waits (mapAsync, onSubmittedWorkDone) happen here, never on the HTTP thread. Generation
 * requests bypass the job queue: they run on their own loop (generation_service.ts) beside any
 * training job.
 *
 * `shutdown` stops generation, waits for the GPU to go idle and reports `closed`, but leaves the
 * device alive and the Worker parked: the process then exits with every device still open.
 * Measured on an H200 (bench/exit_probe.ts, bench/RESULTS.md): with two devices in one process,
 * destroying them on their Worker threads before exit crashed the process (SIGSEGV, or a hang) in
 * 4 to 7 of 10 runs whether or not the Workers were joined first, while exiting with the devices
 * open exited 0 in 5 of 5; the driver frees the memory of an exiting process itself. This is
 * wgpu issue 8365's failure (NVIDIA Vulkan, devices dropped on other threads around exit).
 */

/// <reference lib="deno.worker" />

import { describeDevice, type GpuContext, openDevice } from "../engine/device.ts";
import {
  CANCEL_FLAG,
  COMMIT_CHECK_MS,
  type FromWorker,
  SENT_COUNT,
  STOP_FLAG,
  type ToWorker,
  type ToWorkerThread,
} from "../protocol.ts";
import { runTraining } from "./train_loop.ts";
import { GenerationService } from "./serving.ts";
import { readWorkerSettings } from "./worker_settings.ts";

const settings = readWorkerSettings(Deno.env);

// Inside the GPU host, stdout carries the host protocol: route console output to stderr.
if (settings.hostChild) {
  console.log = console.error;
  console.info = console.error;
  console.debug = console.error;
}

/** The state of this Worker: its device, its GPU index and the shared flags. */
class GpuWorker {
  #ctx: GpuContext | null = null;
  #flags: Int32Array | null = null;
  #gpu = 0;
  #probe: GPUBuffer | null = null;
  #post: (msg: FromWorker) => void;
  #generation: GenerationService;
  /** Whether the driver's shader cache is off (said in compile reports). */
  #cacheDisabled: boolean;
  /** Commit checks waiting for the runner's answer, by request number. */
  #commits = new Map<number, (answer: { held: boolean; reason: string | null }) => void>();
  #commitRequests = 0;

  constructor(post: (msg: FromWorker) => void) {
    this.#post = post;
    this.#cacheDisabled = settings.generation.driverCacheDisabled ?? false;
    this.#generation = new GenerationService(() => this.#open(), post, {
      ...settings.generation,
      inbox: () => this.inbox,
      awaitPosted: (ms) => this.awaitPosted(ms),
    });
  }

  /** Messages taken in since `init` (each counted as it arrives, before it is handled). */
  received = 0;

  /** Messages posted to this thread and not taken in yet (0 before `init`). */
  get inbox(): number {
    return this.#flags === null ? 0 : Atomics.load(this.#flags, SENT_COUNT) - this.received;
  }

  /**
   * Blocks until a message is posted to this thread (the port counts it in SENT_COUNT and notifies)
   * or `ms` pass; returns whether one is on its way.
   */
  awaitPosted(ms: number): boolean {
    const f = this.#flags;
    if (f === null) return false;
    const sent = Atomics.load(f, SENT_COUNT);
    if (sent - this.received > 0) return true;
    return Atomics.wait(f, SENT_COUNT, sent, ms) !== "timed-out";
  }

  /** Generation messages, handled at once (not queued behind a training job). */
  generation(msg: Extract<ToWorkerThread, { type: "generate" | "generate_cancel" }>): void {
    if (msg.type === "generate") this.#generation.generate(msg.request);
    else this.#generation.cancel(msg.id);
  }

  /**
   * Asks the runner whether job `id`'s checkpoint `name` may be committed (its host still holds
   * the lease). No answer within COMMIT_CHECK_MS counts as not held: nothing is committed.
   */
  #commitCheck(
    id: string,
    iteration: number,
    name: string,
  ): Promise<{ held: boolean; reason: string | null }> {
    const request = ++this.#commitRequests;
    const { promise, resolve } = Promise.withResolvers<{ held: boolean; reason: string | null }>();
    const timer = setTimeout(() => {
      this.#commits.delete(request);
      resolve({ held: false, reason: `the server did not answer within ${COMMIT_CHECK_MS / 1000} s` });
    }, COMMIT_CHECK_MS);
    this.#commits.set(request, (answer) => {
      clearTimeout(timer);
      this.#commits.delete(request);
      resolve(answer);
    });
    this.#post({ type: "commit_check", id, request, iteration, name });
    return promise;
  }

  /** The runner's answer to a commit check (handled at once, while the job awaits it). */
  commitAnswer(msg: Extract<ToWorker, { type: "commit_answer" }>): void {
    this.#commits.get(msg.request)?.({ held: msg.held, reason: msg.reason });
  }

  /** The device, reopened if it was lost during an earlier job. */
  async #open(): Promise<GpuContext> {
    if (!this.#ctx || this.#ctx.lostReason) this.#ctx = await openDevice();
    return this.#ctx;
  }

  #flag(index: number): boolean {
    return this.#flags !== null && Atomics.load(this.#flags, index) !== 0;
  }

  /** Handles one message; the caller runs them strictly in order. */
  async handle(msg: ToWorkerThread): Promise<void> {
    switch (msg.type) {
      case "init": {
        this.#gpu = msg.gpu;
        this.#flags = new Int32Array(msg.flags);
        try {
          const c = await this.#open();
          if (msg.probe_bytes) {
            // Committed memory the GPU host can see in nvidia-smi, to learn which GPU this is.
            this.#probe = c.device.createBuffer({ size: msg.probe_bytes, usage: GPUBufferUsage.COPY_DST });
            const enc = c.device.createCommandEncoder();
            enc.clearBuffer(this.#probe);
            c.device.queue.submit([enc.finish()]);
            await c.device.queue.onSubmittedWorkDone();
          }
          this.#post({
            type: "ready",
            gpu: this.#gpu,
            adapter: describeDevice(c),
            max_buffer_bytes: c.limits.maxBufferSize,
            max_binding_bytes: c.limits.maxStorageBufferBindingSize,
          });
        } catch (e) {
          this.#post({ type: "unavailable", gpu: this.#gpu, error: (e as Error).message });
        }
        return;
      }
      case "probe_done":
        this.#probe?.destroy();
        this.#probe = null;
        return;
      case "train": {
        let ctx: GpuContext;
        try {
          ctx = await this.#open();
        } catch (e) {
          this.#post({
            type: "done",
            id: msg.job.id,
            status: "failed",
            iteration: 0,
            error: `Cannot open GPU ${this.#gpu}: ${(e as Error).message}`,
          });
          return;
        }
        this.#post(
          await runTraining(ctx, msg.job, {
            post: this.#post,
            cancelled: () => this.#flag(CANCEL_FLAG),
            stopRequested: () => this.#flag(STOP_FLAG),
            generation: this.#generation,
            comm: msg.comm,
            driverCacheDisabled: this.#cacheDisabled,
            commitCheck: (iteration, name) => this.#commitCheck(msg.job.id, iteration, name),
          }),
        );
        return;
      }
      case "shutdown":
        // Nothing is destroyed (see the file header): stop generating, let the GPU finish, report.
        await this.#generation.destroy();
        await this.#ctx?.device.queue.onSubmittedWorkDone().catch(() => {});
        this.#post({ type: "closed", gpu: this.#gpu });
        return;
    }
  }
}

const worker = new GpuWorker((msg) => self.postMessage(msg));
let chain: Promise<void> = Promise.resolve();
// Messages are handled strictly in order: a job runs to completion before the next starts.
self.onmessage = (e: MessageEvent<ToWorkerThread>) => {
  const msg = e.data;
  if (msg.type !== "init") worker.received++;
  if (msg.type === "generate" || msg.type === "generate_cancel") return worker.generation(msg);
  // The running job waits for this answer before committing a checkpoint: never queued behind it.
  if (msg.type === "commit_answer") return worker.commitAnswer(msg);
  chain = chain.then(() => worker.handle(msg));
};
