/**
 * The Worker that drives one GPU. It opens the device once, then runs the jobs the runner posts
 * one at a time (see train_loop.ts), polling a shared cancel flag between steps. All GPU waits
 * (mapAsync, onSubmittedWorkDone) happen here, never on the HTTP thread. Generation requests
 * bypass the job queue: they run on their own loop (generation_service.ts) beside any training job.
 */

/// <reference lib="deno.worker" />

import { describeDevice, type GpuContext, openDevice } from "../gpu/device.ts";
import { CANCEL_FLAG, type FromWorker, type ToWorker } from "./messages.ts";
import { runTraining } from "./train_loop.ts";
import { generationOptionsFromEnv, GenerationService } from "./generation_service.ts";

/** The state of this Worker: its device, its GPU index and the shared cancel flag. */
class GpuWorker {
  #ctx: GpuContext | null = null;
  #cancel: Int32Array | null = null;
  #gpu = 0;
  #post: (msg: FromWorker) => void;
  #generation: GenerationService;

  constructor(post: (msg: FromWorker) => void) {
    this.#post = post;
    this.#generation = new GenerationService(() => this.#open(), post, generationOptionsFromEnv(Deno.env));
  }

  /** Generation messages, handled at once (not queued behind a training job). */
  generation(msg: Extract<ToWorker, { type: "generate" | "generate_cancel" }>): void {
    if (msg.type === "generate") this.#generation.generate(msg.request);
    else this.#generation.cancel(msg.id);
  }

  /** The device, reopened if it was lost during an earlier job. */
  async #open(): Promise<GpuContext> {
    if (!this.#ctx || this.#ctx.lostReason) this.#ctx = await openDevice();
    return this.#ctx;
  }

  /** Handles one message; the caller runs them strictly in order. */
  async handle(msg: ToWorker): Promise<void> {
    switch (msg.type) {
      case "init": {
        this.#gpu = msg.gpu;
        this.#cancel = new Int32Array(msg.cancel);
        try {
          const c = await this.#open();
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
        const cancel = this.#cancel;
        this.#post(
          await runTraining(ctx, msg.job, {
            post: this.#post,
            cancelled: () => cancel !== null && Atomics.load(cancel, CANCEL_FLAG) !== 0,
            generation: this.#generation,
          }),
        );
        return;
      }
      case "shutdown":
        await this.#generation.destroy();
        this.#ctx?.device.destroy();
        this.#ctx = null;
        self.close();
        return;
    }
  }
}

const worker = new GpuWorker((msg) => self.postMessage(msg));
let chain: Promise<void> = Promise.resolve();
// Messages are handled strictly in order: a job runs to completion before the next starts.
self.onmessage = (e: MessageEvent<ToWorker>) => {
  const msg = e.data;
  if (msg.type === "generate" || msg.type === "generate_cancel") return worker.generation(msg);
  chain = chain.then(() => worker.handle(e.data));
};
