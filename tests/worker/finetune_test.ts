/**
 * Fine-tuning with `init_from` (issue 28): a job starting from another job's checkpoint loads its
 * weights bit for bit with zero AdamW moments at iteration 0, and its loss falls on the new data;
 * one starting from a Hugging Face-shaped folder the test writes loads that folder's tensors; the
 * weights load at another tensor-parallel size with padded vocabulary rows zero; over HTTP a
 * `model` that disagrees with the source, an unknown source, or init_from with resume_from is a
 * 400 naming the field, an omitted `model` takes the source's dimensions, and a fine-tuning job
 * with a checkpoint of its own resumes from it after a crash; a job fine-tuned from
 * a tensor_parallel 2 checkpoint trains alike at tensor_parallel 1 and 2. GPU tests run
 * in-process on the test adapter (lavapipe on CI) and skip without one.
 */

import assert from "node:assert/strict";
import { presetConfig } from "../../model/config.ts";
import { tensorParallelConfig } from "../../model/shard.ts";
import { prepareDataset } from "../../data/mod.ts";
import {
  exportTensors,
  hfConfig,
  listCheckpoints,
  loadCheckpoint,
  saveCheckpoint,
} from "../../checkpoint/checkpoint.ts";
import { type FromWorker } from "../../protocol.ts";
import { JobRunner, JobStore, type TrainConfig, type TrainRequest } from "../../server/jobs/mod.ts";
import { loadWeightsAt, resolveModelSource } from "../../checkpoint/model_source.ts";
import { writeSafetensors } from "../../checkpoint/safetensors.ts";
import { assertSameLosses, trainJob, withWorkerRunner } from "../_runner.ts";
import { splitParams } from "../../model/shard.ts";
import { runTraining, type TrainHooks } from "../../worker/train_loop.ts";
import type { ModelSource } from "../../protocol.ts";
import { initParams } from "../reference/cpu_gpt2.ts";
import { noGpu, testContext } from "../_helpers.ts";
import { ScriptedWorker } from "../fakes/fake_worker.ts";
import { createApp } from "../../server/routes/mod.ts";
import { apiError } from "../_api.ts";
import { until } from "../_wait.ts";

const tiny = presetConfig("gpt2-tiny");

const base: TrainConfig = {
  model: "gpt2-tiny",
  dataset: "sotu",
  split: "949,50,1",
  train_iters: 3,
  batch_size: 2,
  seq_len: 32,
  lr: 3e-3,
  min_lr: 3e-3,
  lr_decay_style: "constant",
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
  keep_checkpoints: 5,
};

async function train(
  root: string,
  id: string,
  config: TrainConfig,
  init_source?: ModelSource,
  hooks: Partial<TrainHooks> = {},
) {
  const ctx = (await testContext())!;
  const messages: FromWorker[] = [];
  const done = await runTraining(ctx, {
    id,
    config,
    root,
    checkpoint_dir: `${root}/checkpoints/${id}`,
    resume_path: null,
    ...(init_source ? { init_source } : {}),
  }, { post: (m) => messages.push(m), cancelled: () => false, ...hooks });
  assert.ok(done.status === "succeeded" || done.status === "interrupted", done.error ?? "");
  const losses = messages.flatMap((m) => m.type === "progress" && m.loss !== null ? [m.loss] : []);
  return { done, losses };
}

/** Writes a Hugging Face GPT-2 folder (config.json, model.safetensors with transformer.-prefixed names). */
async function writeHfFolder(root: string, name: string, params: Float32Array): Promise<void> {
  const dir = `${root}/models/${name}`;
  await Deno.mkdir(dir, { recursive: true });
  await Deno.writeTextFile(
    `${dir}/config.json`,
    JSON.stringify(hfConfig(tiny, { attention_dropout: 0.1, hidden_dropout: 0.1 })),
  );
  const tensors = exportTensors(tiny, params).map((t) => ({ ...t, name: `transformer.${t.name}` }));
  await writeSafetensors(`${dir}/model.safetensors`, tensors);
}

const gpuTest = (name: string, fn: (root: string) => Promise<void>) =>
  Deno.test({
    name,
    ignore: noGpu,
    sanitizeResources: false,
    sanitizeOps: false,
    fn: async () => {
      const root = await Deno.makeTempDir({ prefix: "gpt2_finetune_" });
      try {
        await prepareDataset(root, { builtin: "sotu" });
        await fn(root);
      } finally {
        await Deno.remove(root, { recursive: true });
      }
    },
  });

gpuTest(
  "init_from a checkpoint loads its weights bit for bit, zero moments, iteration 0; the loss falls",
  async (root) => {
    await train(root, "job_src", base);
    const src = (await listCheckpoints(`${root}/checkpoints/job_src`)).at(-1)!;
    const source = await resolveModelSource(root, "job_src");
    const want = (await loadCheckpoint(src.path, tiny)).state;
    assert.equal(want.step, 3);

    // Stopped before its first step: the checkpoint it saves holds exactly what it loaded.
    await prepareDataset(root, { builtin: "moby-dick" });
    const ft = { ...base, dataset: "moby-dick", init_from: "job_src", train_iters: 12 };
    const first = await train(root, "job_ft0", ft, source, { stopRequested: () => true });
    assert.equal(first.done.iteration, 0);
    const [ck] = await listCheckpoints(`${root}/checkpoints/job_ft0`);
    const got = await loadCheckpoint(ck.path, tiny);
    assert.equal(got.manifest.iteration, 0);
    assert.equal(got.state.step, 0);
    assert.deepEqual(got.state.params, want.params);
    assert.ok(got.state.m.every((x) => x === 0) && got.state.v.every((x) => x === 0), "fresh AdamW moments");
    assert.equal(got.manifest.train.dataset, "moby-dick");

    // Run to the end: the training loss on the new data falls.
    const run = await train(root, "job_ft", ft, source);
    assert.equal(run.done.iteration, 12);
    const head = (run.losses[0] + run.losses[1]) / 2, tail = (run.losses.at(-1)! + run.losses.at(-2)!) / 2;
    assert.ok(tail < head - 0.05, `loss ${head} → ${tail}`);
  },
);

gpuTest("init_from a Hugging Face-shaped folder loads its tensors", async (root) => {
  const params = initParams(tiny, 99);
  await writeHfFolder(root, "hf_tiny", params);
  const source = await resolveModelSource(root, "hf_tiny");
  assert.equal(source.kind, "safetensors");
  await train(root, "job_hf", { ...base, init_from: "hf_tiny" }, source, { stopRequested: () => true });
  const [ck] = await listCheckpoints(`${root}/checkpoints/job_hf`);
  const got = await loadCheckpoint(ck.path, tiny);
  assert.equal(got.state.step, 0);
  assert.deepEqual(got.state.params, params);
});

Deno.test("loadWeightsAt() cuts a source for any tensor-parallel size, padded vocabulary rows zero", async () => {
  const root = await Deno.makeTempDir({ prefix: "gpt2_finetune_tp_" });
  try {
    const params = initParams(tiny, 5);
    await writeHfFolder(root, "hf_tp", params);
    const source = await resolveModelSource(root, "hf_tp");
    const whole = await loadWeightsAt(source, tiny);
    assert.deepEqual(whole, params.map((x, i) => i < whole.length ? x : 0));
    const tp2 = tensorParallelConfig(tiny, 2);
    const full2 = await loadWeightsAt(source, tp2, 1);
    const ranks = await Promise.all([0, 1].map((r) => loadWeightsAt(source, tp2, 2, r)));
    assert.deepEqual(ranks, splitParams(tp2, 2, full2));
    // wte rows past the real vocabulary are zero in the padded layout.
    const C = tiny.n_embd;
    const wte = full2.subarray(0, tp2.padded_vocab_size * C); // wte is the first tensor
    assert.ok(wte.subarray(tiny.vocab_size * C).every((x) => x === 0));
    assert.ok(wte.subarray(0, tiny.vocab_size * C).some((x) => x !== 0));
  } finally {
    await Deno.remove(root, { recursive: true });
  }
});

Deno.test("POST /train with init_from: model from the source, a disagreeing model and bad sources are 400s naming the field", async () => {
  const root = await Deno.makeTempDir({ prefix: "gpt2_finetune_routes_" });
  const store = new JobStore(":memory:");
  const workers: ScriptedWorker[] = [];
  const runner = new JobRunner(store, {
    root,
    gpus: 1,
    spawn: () => {
      const w = new ScriptedWorker();
      workers.push(w);
      return w;
    },
    datasetExists: (id) => Promise.resolve(id === "sotu"),
  });
  runner.start();
  try {
    await writeHfFolder(root, "hf_src", initParams(tiny, 1));
    const app = createApp({ runner, token: null, maxBodyBytes: 4096, maxUploadBytes: 8192 });
    const post = (body: unknown) =>
      app.request("/train", {
        method: "POST",
        body: JSON.stringify(body),
        headers: { "Content-Type": "application/json" },
      });
    await apiError(await post({ init_from: "hf_src", model: "gpt2-small-test" }), 400, {
      param: "model",
      message: /Cannot fine-tune "model": "gpt2-small-test" has n_layer 4, init_from "hf_src" has 2/,
    });
    await apiError(await post({ init_from: "no_such_model" }), 400, {
      param: "init_from",
      message: /Unknown model "no_such_model" in init_from/,
    });
    await apiError(await post({ init_from: "hf_src", resume_from: "job_x" }), 400, { param: "init_from" });

    const ok = await post({ init_from: "hf_src", train_iters: 5 });
    assert.equal(ok.status, 202, await ok.clone().text());
    const { job } = await ok.json();
    assert.deepEqual(job.config.model, { n_layer: 2, n_head: 4, n_embd: 64, n_positions: 64 });
    assert.equal((await post({ init_from: "hf_src", model: "gpt2-tiny" })).status, 202);
    await until(() => workers[0].jobs.length === 1, "the job on the worker");
    const handed = workers[0].jobs[0];
    assert.equal(handed.init_source?.id, "hf_src");
    assert.equal(handed.init_source?.kind, "safetensors");
    assert.equal(handed.resume_path, null);

    // Once it has a checkpoint of its own, a crash resumes it from there, not from the source.
    const params = initParams(tiny, 2), zeros = new Float32Array(params.length);
    await saveCheckpoint(
      handed.checkpoint_dir,
      {
        job_id: handed.id,
        model: tiny,
        train: handed.config,
        sampler: { epoch: 0, position: 0 },
        metrics: { loss: null, val_loss: null },
      },
      { step: 2, params, m: zeros, v: zeros },
      1,
    );
    workers[0].onerror!(new ErrorEvent("error", { message: "boom", cancelable: true }));
    await until(() => workers[1]?.jobs.length === 1, "the job again on a fresh worker");
    const again = workers[1].jobs[0];
    assert.equal(again.id, handed.id);
    assert.match(again.resume_path ?? "", /iter_0000002$/);
    assert.equal(again.init_source, undefined);
  } finally {
    runner.shutdown();
    store.close();
    await Deno.remove(root, { recursive: true });
  }
});

Deno.test({
  name:
    "init_from a tensor_parallel 2 checkpoint fine-tunes at tensor_parallel 1 and 2 alike, from its weights",
  ignore: noGpu,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: () =>
    withWorkerRunner("gpt2_finetune_tp_", 2, async (runner) => {
      const req: TrainRequest = {
        model: { n_layer: 2, n_head: 2, n_embd: 32, n_positions: 32 },
        dataset: "sotu",
        split: "949,50,1",
        train_iters: 3,
        batch_size: 2,
        seq_len: 16,
        lr: 3e-3,
        min_lr: 3e-3,
        lr_decay_style: "constant",
        warmup: 0,
        weight_decay: 0.1,
        clip_grad: 1,
        attention_dropout: 0,
        hidden_dropout: 0,
        seed: 4,
        log_interval: 1,
        eval_interval: 0,
        eval_iters: 1,
        save_interval: 0,
        keep_checkpoints: 1,
      };
      // The source is written as two shards.
      const src = await trainJob(runner, { ...req, tensor_parallel: 2 });
      assert.equal(src.job.status, "succeeded", src.job.error ?? "");
      const ft = { ...req, model: undefined, init_from: src.job.id, seed: 5 };
      const one = await trainJob(runner, ft);
      const two = await trainJob(runner, { ...ft, tensor_parallel: 2 });
      const fresh = await trainJob(runner, { ...req, seed: 5 });
      for (const r of [one, two, fresh]) assert.equal(r.job.status, "succeeded", r.job.error ?? "");
      assert.equal(one.job.resumed_from, null);
      assertSameLosses(two.losses, one.losses, [1, 2, 3], "tp 2 vs tp 1 fine-tuning");
      // The first step's loss is the source's weights on the new batch: not a fresh model's.
      assert.ok(Math.abs(one.losses.get(1)! - fresh.losses.get(1)!) > 1e-3, "weights came from the source");
      assert.ok(one.losses.get(1)! < src.losses.get(1)!, "the source had learned something");
    }),
});
