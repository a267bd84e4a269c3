/**
 * Exact resume on the GPU (lavapipe on CI): a job resumed from its checkpoint at iteration 6
 * produces bit-identical losses for iterations 7-12 to the same job run without interruption,
 * dropout included. Runs the Worker's training loop in-process; skipped without an adapter.
 */

import assert from "node:assert/strict";
import { prepareDataset } from "../../data/mod.ts";
import { type FromWorker } from "../../protocol.ts";
import { listCheckpoints } from "../../checkpoint/checkpoint.ts";
import { type TrainConfig } from "../../server/jobs/mod.ts";
import { runTraining } from "../../worker/train_loop.ts";
import { noGpu, testContext } from "../_helpers.ts";

const config: TrainConfig = {
  model: "gpt2-tiny",
  dataset: "sotu",
  split: "949,50,1",
  train_iters: 12,
  batch_size: 2,
  seq_len: 32,
  lr: 1e-3,
  min_lr: 1e-4,
  lr_decay_style: "cosine",
  warmup: 0.2,
  weight_decay: 0.1,
  clip_grad: 1,
  attention_dropout: 0.1,
  hidden_dropout: 0.1,
  seed: 42,
  log_interval: 1,
  eval_interval: 4,
  eval_iters: 2,
  save_interval: 6,
  keep_checkpoints: 5,
};

async function run(root: string, id: string, resume_path: string | null) {
  const ctx = (await testContext())!;
  const messages: FromWorker[] = [];
  const done = await runTraining(ctx, {
    id,
    config,
    root,
    checkpoint_dir: `${root}/checkpoints/${id}`,
    resume_path,
  }, { post: (m) => messages.push(m), cancelled: () => false });
  const losses = new Map<number, number>();
  for (const m of messages) if (m.type === "progress" && m.loss !== null) losses.set(m.iteration, m.loss);
  return { done, messages, losses };
}

Deno.test({
  name: "runTraining() resumed from a checkpoint gives bit-identical losses to an uninterrupted run",
  ignore: noGpu,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: async () => {
    const root = await Deno.makeTempDir({ prefix: "gpt2_resume_" });
    try {
      await prepareDataset(root, { builtin: "sotu" });
      const full = await run(root, "job_full", null);
      assert.equal(full.done.status, "succeeded", full.done.error ?? "");
      assert.equal(full.done.iteration, 12);
      assert.deepEqual([...full.losses.keys()], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]);
      const ckpts = await listCheckpoints(`${root}/checkpoints/job_full`);
      assert.deepEqual(ckpts.map((c) => c.name), ["iter_0000006", "iter_0000012"]);
      const evals = full.messages.filter((m) => m.type === "eval").map((m) => [m.iteration, m.split]);
      assert.deepEqual(evals, [[4, "valid"], [8, "valid"], [12, "valid"], [12, "test"]]);

      const resumed = await run(root, "job_resumed", ckpts[0].path);
      assert.equal(resumed.done.status, "succeeded", resumed.done.error ?? "");
      const started = resumed.messages.find((m) => m.type === "started");
      assert.deepEqual(started && [started.iteration, started.resumed_from], [6, ckpts[0].path]);
      assert.deepEqual([...resumed.losses.keys()], [7, 8, 9, 10, 11, 12]);
      for (const [it, loss] of resumed.losses) {
        assert.ok(Object.is(loss, full.losses.get(it)), `iteration ${it}: ${loss} vs ${full.losses.get(it)}`);
      }
    } finally {
      await Deno.remove(root, { recursive: true });
    }
  },
});
