/**
 * The runner with the real GPU Worker (no HTTP): a configuration the device cannot hold fails
 * its job with a clear message while the Worker stays usable, and a running job stops between
 * steps when cancelled through the shared flag. Skipped without a WebGPU adapter.
 */

import assert from "node:assert/strict";
import { type Job, type JobEvent, type JobRunner, type TrainRequest } from "../../server/jobs/mod.ts";
import { noGpu } from "../_helpers.ts";
import { withWorkerRunner } from "../_runner.ts";

const base: TrainRequest = {
  model: "gpt2-tiny",
  dataset: "sotu",
  split: "949,50,1",
  train_iters: 1000,
  batch_size: 2,
  seq_len: 32,
  lr: 1e-3,
  min_lr: 1e-4,
  lr_decay_style: "cosine",
  warmup: 0,
  weight_decay: 0.1,
  clip_grad: 1,
  attention_dropout: 0,
  hidden_dropout: 0,
  seed: 3,
  log_interval: 1,
  eval_interval: 0,
  eval_iters: 1,
  save_interval: 0,
  keep_checkpoints: 1,
};

/** Resolves with the job once its `done` event arrives. */
function finished(runner: JobRunner, id: string, onEvent?: (e: JobEvent) => void): Promise<Job> {
  return new Promise((resolve) => {
    const off = runner.subscribe(id, (e) => {
      onEvent?.(e);
      if (e.type === "done") {
        off();
        resolve(runner.get(id));
      }
    });
  });
}

Deno.test({
  name:
    "the GPU worker fails a job too big for the device with a clear message, then cancels a running job between steps",
  ignore: noGpu,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: async () => {
    await withWorkerRunner("gpt2_worker_", 1, async (runner, _root) => {
      const big = await runner.submit({ ...base, batch_size: 4096, seq_len: 64 });
      const failed = await finished(runner, big.id);
      assert.equal(failed.status, "failed");
      assert.match(failed.error!, /^Cannot train this configuration: Invalid model config: batch_size: /);

      const job = await runner.submit(base);
      let progress = 0;
      const done = finished(runner, job.id, (e) => {
        if (e.type === "progress" && ++progress === 2) runner.cancel(job.id);
      });
      const cancelled = await done;
      assert.equal(cancelled.status, "cancelled");
      assert.equal(cancelled.cancel_requested, true);
      assert.ok(cancelled.iteration >= 2 && cancelled.iteration < 20, `stopped at ${cancelled.iteration}`);
      assert.equal(runner.gpus()[0].state, "idle");
    });
  },
});
