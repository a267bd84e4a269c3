/**
 * The training loop's guards on the GPU (lavapipe on CI), in-process: a stop request saves a
 * checkpoint at the current step and ends "interrupted"; an injected non-finite gradient is
 * skipped and counted; ten in a row fail the job naming the iteration, with only finite weights
 * ever saved; a test split smaller than one batch still gets a finite loss over all its windows.
 * Skipped without an adapter.
 */

import assert from "node:assert/strict";
import { presetConfig } from "../../model/config.ts";
import { prepareDataset } from "../../data/mod.ts";
import { type FromWorker } from "../../protocol.ts";
import { listCheckpoints, loadCheckpoint } from "../../checkpoint/checkpoint.ts";
import { type TrainConfig } from "../../server/jobs/mod.ts";
import { runTraining, type TrainHooks } from "../../worker/train_loop.ts";
import { noGpu, testContext } from "../_helpers.ts";

const base: TrainConfig = {
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
  attention_dropout: 0,
  hidden_dropout: 0,
  seed: 3,
  log_interval: 1,
  eval_interval: 0,
  eval_iters: 2,
  save_interval: 0,
  keep_checkpoints: 20,
};

async function run(root: string, id: string, config: TrainConfig, hooks: Partial<TrainHooks> = {}) {
  const ctx = (await testContext())!;
  const messages: FromWorker[] = [];
  const done = await runTraining(ctx, {
    id,
    config,
    root,
    checkpoint_dir: `${root}/checkpoints/${id}`,
    resume_path: null,
  }, { post: (m) => messages.push(m), cancelled: () => false, ...hooks });
  return { done, messages, progress: messages.filter((m) => m.type === "progress") };
}

const gpuTest = (name: string, fn: (root: string) => Promise<void>) =>
  Deno.test({
    name,
    ignore: noGpu,
    sanitizeResources: false,
    sanitizeOps: false,
    fn: async () => {
      const root = await Deno.makeTempDir({ prefix: "gpt2_loop_" });
      try {
        await prepareDataset(root, { builtin: "sotu" });
        await fn(root);
      } finally {
        await Deno.remove(root, { recursive: true });
      }
    },
  });

gpuTest(
  "runTraining() asked to stop saves a checkpoint at its current step and ends interrupted",
  async (root) => {
    let polls = 0;
    const r = await run(root, "job_stop", base, { stopRequested: () => ++polls > 5 });
    assert.equal(r.done.status, "interrupted", r.done.error ?? "");
    assert.equal(r.done.iteration, 5);
    const ckpts = await listCheckpoints(`${root}/checkpoints/job_stop`);
    assert.deepEqual(ckpts.map((c) => c.iteration), [5]);
    assert.ok(!r.messages.some((m) => m.type === "eval"), "no evaluation on the way out");
  },
);

gpuTest("runTraining() skips a step with a non-finite gradient, counts it, and trains on", async (root) => {
  const r = await run(root, "job_skip", base, { nonFiniteAt: [3] });
  assert.equal(r.done.status, "succeeded", r.done.error ?? "");
  const at = (it: number) => r.progress.find((m) => m.iteration === it)!;
  assert.equal(at(3).skipped_steps, 0);
  assert.equal(at(4).skipped_steps, 1);
  assert.equal(at(4).grad_norm, null, "the skipped step's gradient norm is reported as null");
  assert.equal(at(12).skipped_steps, 1);
  assert.ok(Number.isFinite(at(12).loss));
  assert.ok(r.messages.some((m) => m.type === "log" && m.message.startsWith("Skipped 1 step(s)")));
});

gpuTest(
  "runTraining() fails after ten consecutive non-finite steps and never saves non-finite weights",
  async (root) => {
    const config = { ...base, train_iters: 30, save_interval: 2 };
    const r = await run(root, "job_nan", config, {
      nonFiniteAt: Array.from({ length: 20 }, (_, i) => 3 + i),
    });
    assert.equal(r.done.status, "failed");
    assert.equal(r.done.iteration, 13);
    assert.match(r.done.error!, /non-finite for 10 consecutive steps, up to iteration 13/);
    const ckpts = await listCheckpoints(`${root}/checkpoints/job_nan`);
    assert.deepEqual(ckpts.map((c) => c.iteration), [2, 4, 6, 8, 10, 12]);
    const model = presetConfig("gpt2-tiny");
    const [first, last] = [
      await loadCheckpoint(ckpts[1].path, model),
      await loadCheckpoint(ckpts.at(-1)!.path, model),
    ];
    for (const p of last.state.params) assert.ok(Number.isFinite(p));
    // Skipped steps leave the weights as they were after iteration 3.
    assert.deepEqual(last.state.params, first.state.params);
  },
);

gpuTest("runTraining() evaluates a test split smaller than one batch over all its windows", async (root) => {
  // 9990,9,1 of sotu's 2,074,287 tokens: a test split of 207 tokens, 6 windows of 32 for batch 8.
  const r = await run(root, "job_small", { ...base, split: "9990,9,1", batch_size: 8, train_iters: 2 });
  assert.equal(r.done.status, "succeeded", r.done.error ?? "");
  const test = r.messages.find((m) => m.type === "eval" && m.split === "test");
  assert.ok(test && test.type === "eval");
  assert.ok(Number.isFinite(test.loss) && test.loss > 0, String(test.loss));
  assert.equal(test.tokens, 6 * 32);
});
