/**
 * Tensor-parallel jobs through the runner with real GPU Workers (two sharing the test adapter):
 * a tensor_parallel 2 job reproduces the tensor_parallel 1 losses (hidden dropout on: its masks
 * apply to whole activations, the same on both ranks) with less memory per rank, reports its
 * exchanges, and its checkpoint (one shard per rank) resumes at tensor_parallel 1 on the same
 * course; greedy generation on one GPU from that checkpoint equals generation from its merged TP=1
 * copy token for token. A size that cannot shard the model is refused naming tensor_parallel.
 */

import assert from "node:assert/strict";
import { InvalidJobError, type TrainRequest } from "../../server/jobs/mod.ts";
import {
  checkpointName,
  loadCheckpointWeights,
  mergedModel,
  readManifest,
} from "../../checkpoint/checkpoint.ts";
import { reshardCheckpoint } from "../../checkpoint/reshard.ts";
import { Generator } from "../../engine/generator.ts";
import { noGpu, testContext } from "../_helpers.ts";
import { assertSameLosses, trainJob, withWorkerRunner } from "../_runner.ts";

const base: TrainRequest = {
  model: { n_layer: 2, n_head: 2, n_embd: 32, n_positions: 32 },
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
  attention_dropout: 0,
  hidden_dropout: 0.1,
  seed: 9,
  log_interval: 1,
  eval_interval: 0,
  eval_iters: 2,
  save_interval: 3,
  keep_checkpoints: 2,
};

Deno.test({
  name:
    "a tensor_parallel 2 job matches tensor_parallel 1 and its sharded checkpoint resumes at tensor_parallel 1",
  ignore: noGpu,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: async () => {
    await withWorkerRunner("gpt2_tp_", 2, async (runner, root) => {
      await assert.rejects(
        runner.submit({
          ...base,
          model: { ...base.model as object, n_head: 1 } as TrainRequest["model"],
          tensor_parallel: 2,
        }),
        (e) => {
          assert.ok(e instanceof InvalidJobError);
          assert.equal(e.field, "tensor_parallel");
          assert.match(e.message, /does not divide n_head 1/);
          return true;
        },
      );
      await assert.rejects(runner.submit({ ...base, tensor_parallel: 2, data_parallel: 2 }), (e) => {
        assert.ok(e instanceof InvalidJobError);
        assert.match(e.message, /data_parallel 2 × tensor_parallel 2 needs 4 GPU workers/);
        return true;
      });

      const one = await trainJob(runner, base);
      assert.equal(one.job.status, "succeeded", one.job.error ?? "");
      const two = await trainJob(runner, { ...base, tensor_parallel: 2 });
      assert.equal(two.job.status, "succeeded", two.job.error ?? "");
      assertSameLosses(two.losses, one.losses, [1, 2, 3, 4, 5, 6], "TP=2 vs TP=1");
      assert.ok(
        two.job.metrics.gpu_memory_bytes! < one.job.metrics.gpu_memory_bytes!,
        `TP=2 rank memory ${two.job.metrics.gpu_memory_bytes} vs ${one.job.metrics.gpu_memory_bytes}`,
      );
      const ranks = two.job.metrics.ranks!;
      assert.equal(ranks.length, 2);
      for (const r of ranks) assert.ok(r.tp_exchange_ms! > 0 && r.tp_allreduces! >= 8, JSON.stringify(r));
      assert.ok(
        Math.abs(two.job.metrics.val_loss! - one.job.metrics.val_loss!) < 1e-4 * one.job.metrics.val_loss!,
      );

      const dir = `${runner.checkpointDir(two.job.id)}/${checkpointName(3)}`;
      assert.equal((await readManifest(dir)).parallel.tensor_parallel, 2);
      // Generation on one GPU from the TP=2 checkpoint (its shards merged in memory) equals
      // generation from its merged TP=1 copy on disk, token for token (greedy).
      const merged = `${root}/merged`;
      await reshardCheckpoint(dir, merged, 1);
      const config = mergedModel(await readManifest(dir));
      const greedy = async (path: string) => {
        const gen = await Generator.create(
          (await testContext())!,
          config,
          await loadCheckpointWeights(path, config),
          {
            maxStreams: 1,
            chunk: 12,
          },
        );
        try {
          const h = await gen.admit([464, 3290, 318, 257], { temperature: 0, top_k: 0, top_p: 1, seed: 0 });
          return (await gen.step(11)).get(h)!.tokens;
        } finally {
          gen.destroy();
        }
      };
      const [fromShards, fromMerged] = [await greedy(dir), await greedy(merged)];
      assert.equal(fromShards.length, 12);
      assert.deepEqual(fromShards, fromMerged);

      const resumed = await trainJob(runner, { ...base, resume_from: `${two.job.id}/${checkpointName(3)}` });
      assert.equal(resumed.job.status, "succeeded", resumed.job.error ?? "");
      assertSameLosses(resumed.losses, one.losses, [4, 5, 6], "TP=2 checkpoint resumed at TP=1");
    });
  },
});

Deno.test({
  name: "a data_parallel 2 × tensor_parallel 2 job on four Workers matches one GPU with 2 accumulation steps",
  ignore: noGpu,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: async () => {
    await withWorkerRunner("gpt2_dptp_", 4, async (runner, _root) => {
      const req = { ...base, train_iters: 4, save_interval: 0, global_batch_size: 4 };
      const one = await trainJob(runner, req);
      assert.equal(one.job.status, "succeeded", one.job.error ?? "");
      const grid = await trainJob(runner, { ...req, data_parallel: 2, tensor_parallel: 2 });
      assert.equal(grid.job.status, "succeeded", grid.job.error ?? "");
      assertSameLosses(grid.losses, one.losses, [1, 2, 3, 4], "DP2×TP2 vs one GPU×2");
      assert.deepEqual(grid.job.metrics.gpus, [0, 1, 2, 3]);
      assert.equal(grid.job.metrics.ranks!.length, 4);
    });
  },
});
