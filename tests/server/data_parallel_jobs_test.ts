/**
 * Data-parallel jobs through the runner with real GPU Workers (two of them sharing the test
 * adapter): a data_parallel 2 job reproduces the losses of a data_parallel 1 job with the same
 * global batch (2 accumulation steps), shows each rank's timings, and its checkpoint resumes at
 * data_parallel 1 with the same continuation. A job asking for more ranks than GPUs is refused
 * naming data_parallel; a cancelled one stops on every rank and frees both GPUs.
 */

import assert from "node:assert/strict";
import { InvalidJobError, type Job, type TrainRequest } from "../../server/jobs/mod.ts";
import { checkpointName } from "../../checkpoint/checkpoint.ts";
import { noGpu } from "../_helpers.ts";
import { assertSameLosses, trainJob, withWorkerRunner } from "../_runner.ts";

const base: TrainRequest = {
  model: { n_layer: 1, n_head: 2, n_embd: 32, n_positions: 32 },
  dataset: "sotu",
  split: "949,50,1",
  train_iters: 6,
  batch_size: 2,
  seq_len: 16,
  lr: 3e-3,
  min_lr: 3e-4,
  lr_decay_style: "cosine",
  warmup: 0,
  weight_decay: 0.1,
  clip_grad: 1,
  attention_dropout: 0.1,
  hidden_dropout: 0.1,
  seed: 5,
  log_interval: 1,
  eval_interval: 0,
  eval_iters: 2,
  save_interval: 0,
  keep_checkpoints: 1,
  global_batch_size: 4,
};

Deno.test({
  name:
    "a data_parallel 2 job matches data_parallel 1 with 2 accumulation steps and resumes at data_parallel 1",
  ignore: noGpu,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: async () => {
    await withWorkerRunner("gpt2_dp_", 2, async (runner, _root) => {
      await assert.rejects(runner.submit({ ...base, data_parallel: 3, global_batch_size: 6 }), (e) => {
        assert.ok(e instanceof InvalidJobError);
        assert.equal(e.field, "data_parallel");
        assert.match(e.message, /data_parallel 3 needs 3 GPU workers .* has 2/);
        return true;
      });

      const one = await trainJob(runner, base);
      assert.equal(one.job.status, "succeeded", one.job.error ?? "");
      // Same schedule (train_iters 6); the checkpoint at iteration 3 is resumed below.
      const two = await trainJob(runner, {
        ...base,
        data_parallel: 2,
        save_interval: 3,
        keep_checkpoints: 2,
      });
      assert.equal(two.job.status, "succeeded", two.job.error ?? "");
      assertSameLosses(two.losses, one.losses, [1, 2, 3, 4, 5, 6], "DP=2 vs DP=1×2");
      assert.deepEqual(two.job.metrics.gpus, [0, 1]);
      const ranks = two.job.metrics.ranks!;
      assert.equal(ranks.length, 2);
      for (const r of ranks) {
        assert.ok(r.step_ms > 0 && r.allreduce_ms > 0, JSON.stringify(r));
        // Overlapped by default: the exposed part and the hidden share are reported.
        assert.ok(r.allreduce_exposed_ms! > 0, JSON.stringify(r));
        assert.ok(r.allreduce_hidden! >= 0 && r.allreduce_hidden! <= 1, JSON.stringify(r));
      }
      assert.ok(two.job.metrics.timings!.allreduce_ms > 0);
      assert.ok(two.job.metrics.val_loss! > 0 && two.job.metrics.test_loss! > 0);

      // The DP=2 checkpoint continues at DP=1 exactly where DP=1 itself would have gone.
      const resumed = await trainJob(runner, { ...base, resume_from: `${two.job.id}/${checkpointName(3)}` });
      assert.equal(resumed.job.status, "succeeded", resumed.job.error ?? "");
      assertSameLosses(resumed.losses, one.losses, [4, 5, 6], "DP=2 resumed at DP=1 vs DP=1");
      assert.equal(runner.gpus().every((g) => g.state === "idle"), true);

      // The distributed optimizer: the same losses, and its checkpoint (moments gathered from both
      // ranks) resumes at data_parallel 1 on the same course.
      const zero = await trainJob(runner, {
        ...base,
        data_parallel: 2,
        distributed_optimizer: true,
        save_interval: 3,
        keep_checkpoints: 2,
      });
      assert.equal(zero.job.status, "succeeded", zero.job.error ?? "");
      assertSameLosses(zero.losses, one.losses, [1, 2, 3, 4, 5, 6], "DP=2 distributed optimizer vs DP=1×2");
      assert.ok(
        zero.job.metrics.gpu_memory_bytes! < two.job.metrics.gpu_memory_bytes!,
        "sharded moments take less memory",
      );
      const zeroResumed = await trainJob(runner, {
        ...base,
        resume_from: `${zero.job.id}/${checkpointName(3)}`,
      });
      assertSameLosses(
        zeroResumed.losses,
        one.losses,
        [4, 5, 6],
        "distributed-optimizer checkpoint resumed at DP=1",
      );

      // Cancelled mid-run, every rank stops at the same step and both GPUs come free.
      const long = await runner.submit({ ...base, data_parallel: 2, train_iters: 10_000 });
      let seen = 0;
      const cancelled = await new Promise<Job>((resolve) => {
        const off = runner.subscribe(long.id, (e) => {
          if (e.type === "progress" && ++seen === 2) runner.cancel(long.id);
          if (e.type === "done") {
            off();
            resolve(runner.get(long.id));
          }
        });
      });
      assert.equal(cancelled.status, "cancelled", cancelled.error ?? "");
      assert.ok(cancelled.iteration >= 2 && cancelled.iteration < 50, `stopped at ${cancelled.iteration}`);
      assert.equal(runner.gpus().every((g) => g.state === "idle" && g.job === null), true);
    });
  },
});

Deno.test({
  name: "a data_parallel 3 job on three Workers matches data_parallel 1 with 3 accumulation steps",
  ignore: noGpu,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: async () => {
    await withWorkerRunner("gpt2_dp3_", 3, async (runner, _root) => {
      const req = { ...base, train_iters: 3, global_batch_size: 6 };
      const one = await trainJob(runner, req);
      assert.equal(one.job.status, "succeeded", one.job.error ?? "");
      const three = await trainJob(runner, { ...req, data_parallel: 3 });
      assert.equal(three.job.status, "succeeded", three.job.error ?? "");
      assertSameLosses(three.losses, one.losses, [1, 2, 3], "DP=3 vs DP=1×3");
      assert.deepEqual(three.job.metrics.gpus, [0, 1, 2]);
    });
  },
});
