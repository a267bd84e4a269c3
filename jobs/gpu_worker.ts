/**
 * The Worker that drives one GPU. It opens the device once, then runs the jobs the runner posts
 * one at a time (see train_loop.ts), polling a shared cancel flag between steps. All GPU waits
 * (mapAsync, onSubmittedWorkDone) happen here, never on the HTTP thread.
 */

/// <reference lib="deno.worker" />

import { describeDevice, type GpuContext, openDevice } from "../gpu/device.ts";
import { CANCEL_FLAG, type FromWorker, type ToWorker } from "./messages.ts";
import { runTraining } from "./train_loop.ts";

let ctx: GpuContext | null = null;
let cancel: Int32Array | null = null;
let gpu = 0;
let chain: Promise<void> = Promise.resolve();

const post = (msg: FromWorker) => self.postMessage(msg);

async function open(): Promise<GpuContext> {
  if (!ctx || ctx.lostReason) ctx = await openDevice();
  return ctx;
}

async function handle(msg: ToWorker): Promise<void> {
  switch (msg.type) {
    case "init": {
      gpu = msg.gpu;
      cancel = new Int32Array(msg.cancel);
      try {
        const c = await open();
        post({
          type: "ready",
          gpu,
          adapter: describeDevice(c),
          max_buffer_bytes: c.limits.maxBufferSize,
          max_binding_bytes: c.limits.maxStorageBufferBindingSize,
        });
      } catch (e) {
        post({ type: "unavailable", gpu, error: (e as Error).message });
      }
      return;
    }
    case "train": {
      const c = await open().catch(() => null);
      if (!c) {
        post({
          type: "done",
          id: msg.job.id,
          status: "failed",
          iteration: 0,
          error: "GPU device could not be opened",
        });
        return;
      }
      const done = await runTraining(c, msg.job, {
        post,
        cancelled: () => cancel !== null && Atomics.load(cancel, CANCEL_FLAG) !== 0,
      });
      post(done);
      return;
    }
    case "shutdown":
      ctx?.device.destroy();
      ctx = null;
      self.close();
      return;
  }
}

// Messages are handled strictly in order: a job runs to completion before the next starts.
self.onmessage = (e: MessageEvent<ToWorker>) => {
  chain = chain.then(() => handle(e.data));
};
