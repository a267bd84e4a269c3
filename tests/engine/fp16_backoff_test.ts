/**
 * fp16 jobs through the training loop on the GPU (lavapipe on CI): the dynamic loss scaler starts
 * at Megatron's 2^32, so a gpt2-tiny job's first steps overflow while it backs off. Those skipped
 * steps are reported but do not count toward the limit of consecutive non-finite steps (issue
 * 37): a 10-iteration job, every step of which may overflow, succeeds, and a 200-iteration one
 * trains (its loss falls) at a scale below 2^32. Skipped without an adapter or without f16.
 */

import assert from "node:assert/strict";
import { prepareDataset } from "../../data/mod.ts";
import type { FromWorker } from "../../protocol.ts";
import type { TrainConfig } from "../../server/jobs/mod.ts";
import { runTraining } from "../../worker/train_loop.ts";
import { noGpu, testContext } from "../_helpers.ts";

const noF16 = noGpu || !(await testContext())?.hasF16;

const base: TrainConfig = {
  model: "gpt2-tiny",
  dataset: "sotu",
  split: "949,50,1",
  train_iters: 10,
  // Small, so that 200 iterations take about half a minute on lavapipe with 2 cores.
  batch_size: 1,
  seq_len: 16,
  lr: 1e-3,
  min_lr: 1e-4,
  lr_decay_style: "cosine",
  warmup: 0.1,
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
  precision: "fp16",
};

async function run(root: string, id: string, config: TrainConfig) {
  const ctx = (await testContext())!;
  const messages: FromWorker[] = [];
  const t0 = performance.now();
  const done = await runTraining(ctx, {
    id,
    config,
    root,
    checkpoint_dir: `${root}/checkpoints/${id}`,
    resume_path: null,
  }, { post: (m) => messages.push(m), cancelled: () => false });
  const seconds = (performance.now() - t0) / 1000;
  const progress = messages.flatMap((m) => m.type === "progress" ? [m] : []);
  return { done, messages, progress, seconds };
}

const jobTest = (name: string, fn: (root: string) => Promise<void>) =>
  Deno.test({
    name,
    ignore: noF16,
    sanitizeResources: false,
    sanitizeOps: false,
    fn: async () => {
      const root = await Deno.makeTempDir({ prefix: "gpt2_fp16_" });
      try {
        await prepareDataset(root, { builtin: "sotu" });
        await fn(root);
      } finally {
        await Deno.remove(root, { recursive: true });
      }
    },
  });

jobTest(
  "fp16 gpt2-tiny job of 10 iterations succeeds while the loss scale backs off from 2^32",
  async (root) => {
    const r = await run(root, "fp16_10", base);
    assert.equal(r.done.status, "succeeded", r.done.error ?? "");
    assert.equal(r.done.iteration, 10);
    assert.equal(r.progress.length, 10);
    const last = r.progress.at(-1)!;
    // Hysteresis 2: the first overflow keeps 2^32, each later one halves it.
    assert.ok(last.skipped_steps >= 2, `skipped ${last.skipped_steps} steps`);
    assert.ok(last.loss_scale < 2 ** 32, `scale ${last.loss_scale}`);
    for (const [i, p] of r.progress.entries()) {
      const prev = i > 0 ? r.progress[i - 1] : { skipped_steps: 0, loss_scale: 2 ** 32 };
      if (p.skipped_steps > prev.skipped_steps) {
        assert.equal(p.grad_norm, null, `iteration ${p.iteration}: a skipped step reports no norm`);
        if (i > 0) assert.equal(p.loss_scale, prev.loss_scale / 2, `iteration ${p.iteration}: backed off`);
      } else {
        assert.equal(p.loss_scale, prev.loss_scale, `iteration ${p.iteration}: clean steps keep the scale`);
      }
    }
    assert.ok(
      r.messages.some((m) => m.type === "log" && m.level === "warn" && m.message.startsWith("Skipped ")),
      "skipped steps are still reported",
    );
    console.log(
      `fp16 10 iterations: ${last.skipped_steps} skipped, scale ${last.loss_scale}, ${
        r.seconds.toFixed(1)
      } s`,
    );
  },
);

jobTest("fp16 gpt2-tiny job of 200 iterations trains below a backed-off loss scale", async (root) => {
  const r = await run(root, "fp16_200", { ...base, train_iters: 200, log_interval: 10 });
  assert.equal(r.done.status, "succeeded", r.done.error ?? "");
  assert.equal(r.done.iteration, 200);
  const last = r.progress.at(-1)!;
  assert.equal(last.iteration, 200);
  assert.ok(last.loss_scale < 2 ** 32 && last.loss_scale >= 1, `scale ${last.loss_scale}`);
  assert.ok(last.skipped_steps > 0 && last.skipped_steps < 100, `skipped ${last.skipped_steps}`);
  const losses = r.progress.flatMap((p) => p.loss !== null ? [p.loss] : []);
  assert.ok(losses.length >= 15, `finite losses logged: ${losses.length}`);
  // One row of 16 tokens a step is noisy: the mean of the last three logged losses.
  const first = losses[0], end = losses.slice(-3).reduce((a, b) => a + b) / 3;
  assert.ok(end < first - 1, `loss went from ${first} to ${end}`);
  console.log(
    `fp16 200 iterations: loss ${first.toFixed(3)} -> ${end.toFixed(3)}, ${last.skipped_steps} skipped, ` +
      `scale ${last.loss_scale}, ${r.seconds.toFixed(1)} s`,
  );
});
