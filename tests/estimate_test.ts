/**
 * The memory estimator and the fit check: the estimate equals the bytes the engine allocates for
 * tiny models in every mode (one plan feeds both) plus the allocator's modelled waste under the
 * order the engine allocates in, the parameter and FLOP formulas, `GET /estimate`, and `POST
 * /train`'s refusal naming the biggest part.
 */

import assert from "node:assert/strict";
import { makeConfig, parameterCount, paramLayout, presetConfig } from "../gpu/config.ts";
import { estimateTraining, megatronFlops, parametersPerGpu } from "../gpu/estimate.ts";
import {
  allocationOrder,
  allocatorWaste,
  CATEGORIES,
  type ChunkOptions,
  planModel,
  type Precision,
} from "../gpu/plan.ts";
import { Trainer } from "../gpu/trainer.ts";
import { completeConfig, InvalidJobError, JobRunner, JobStore, type TrainRequest } from "../jobs/mod.ts";
import { ScriptedWorker } from "../jobs/testing.ts";
import { createApp } from "../routes/mod.ts";
import { noGpu, testContext } from "./_helpers.ts";
import { apiError } from "./_api.ts";

const H200 = { adapter: "NVIDIA H200", max_binding_bytes: 2 ** 31 - 4, max_buffer_bytes: 2 ** 40 };
const tiny = makeConfig({ n_layer: 2, n_head: 2, n_embd: 32, n_positions: 32, vocab_size: 256 });

Deno.test("parametersPerGpu() is the 12Lh² + 13Lh + (V+P)h + 2h formula, divided by tensor parallelism", () => {
  for (const name of ["gpt2-124M", "gpt2-345M", "gpt2-774M", "gpt2-1558M"]) {
    const c = presetConfig(name);
    assert.equal(parametersPerGpu(c), parameterCount(c), name);
    assert.equal(
      estimateTraining({ config: c, batchSize: 1, seqLen: 64 }).parameters,
      paramLayout(c).numParams,
    );
  }
  // Tensor parallel 2: matrices, column-parallel biases and the vocabulary halve; the rest stays.
  const c = presetConfig("gpt2-345M"), h = c.n_embd, L = c.n_layer;
  const replicated = L * 6 * h + c.n_positions * h + 2 * h;
  assert.equal(parametersPerGpu(c, 2), (parameterCount(c) - replicated) / 2 + replicated);
});

Deno.test("megatronFlops() is 72BsLh² + 12Bs²Lh + 6BshV", () => {
  const c = presetConfig("gpt2-345M"), B = 8, s = 1024, L = 24, h = 1024, V = 50304;
  const expected = 72 * B * s * L * h * h + 12 * B * s * s * L * h + 6 * B * s * h * V;
  assert.ok(Math.abs(megatronFlops(c, B, s) - expected) < 1e-9 * expected);
  const est = estimateTraining({ config: c, batchSize: B, seqLen: s, dataParallel: 4 });
  assert.ok(Math.abs(est.flops_per_step - 4 * expected) < 1e-9 * expected, "data parallel counts every rank");
});

Deno.test("estimateTraining() of gpt2-345M at 8×1024: weights, gradients and moments by formula", () => {
  const c = presetConfig("gpt2-345M");
  const est = estimateTraining({ config: c, batchSize: 8, seqLen: 1024 });
  const flat = paramLayout(c).totalSize * 4;
  assert.equal(est.bytes_per_gpu.weights, flat);
  assert.equal(est.bytes_per_gpu.gradients, flat);
  assert.equal(est.bytes_per_gpu.optimizer, 2 * flat);
  assert.equal(est.biggest.category, "activations");
  // Per-layer activations: atty, res2 (C each), qkv (3C), fch (4C; gelu(fch) is never stored) of B·T
  // rows, LayerNorm statistics and the softmax's log-sum-exp. The LayerNorm outputs are not stored:
  // one shared B·T·C buffer takes each while it is read (recomputed from res and the statistics).
  const BT = 8 * 1024, C = 1024, perLayer = BT * C * 4 * (2 + 3 + 4) + BT * 4 * (2 + 2) + 8 * 16 * 1024 * 4;
  const residuals = 25 * BT * C * 4, lnf = BT * C * 4 + BT * 2 * 4, shared = BT * C * 4;
  assert.equal(est.bytes_per_gpu.activations, 24 * perLayer + residuals + lnf + shared);
  // Logits in chunks of at most 512 MiB (not 1.53 GiB), plus the per-row losses.
  assert.equal(est.bytes_per_gpu.logits, 2048 * 50304 * 4 + BT * 4);
  // The buffers' 13.69 GiB and the allocator's waste of its 256 MiB blocks under the engine's
  // order: 33 blocks for the buffers under 256 MiB, the last one mostly empty.
  const buffers = CATEGORIES.reduce((a, k) => a + est.bytes_per_gpu[k], 0);
  assert.equal(est.buffer_bytes, buffers);
  assert.equal(est.bytes_per_gpu.total, buffers + est.bytes_per_gpu.allocator);
  assert.ok(est.bytes_per_gpu.allocator > 0 && est.bytes_per_gpu.allocator < 256 * 2 ** 20);
  const ckpt = estimateTraining({ config: c, batchSize: 8, seqLen: 1024, checkpointLayers: 1 });
  assert.ok(ckpt.bytes_per_gpu.activations < 0.2 * est.bytes_per_gpu.activations);
});

const modes: Array<
  { name: string; opts: { chunks?: ChunkOptions; checkpointLayers?: number; precision?: Precision } }
> = [
  { name: "training", opts: {} },
  { name: "checkpointing 1 layer", opts: { checkpointLayers: 1 } },
  { name: "fp16", opts: { precision: "fp16" } },
  {
    name: "fp16, checkpointing 2 layers, segmented",
    opts: { precision: "fp16", checkpointLayers: 2, chunks: { maxSegmentBytes: 40 * 1024 } },
  },
  { name: "segmented and head-chunked", opts: { chunks: { maxSegmentBytes: 40 * 1024, headChunkRows: 64 } } },
];
for (const mode of modes) {
  Deno.test({
    name: `Trainer allocates exactly the estimate's buffers, in the order it models (${mode.name})`,
    ignore: noGpu,
    fn: async () => {
      const ctx = (await testContext())!;
      const B = 3, T = 32;
      const tr = await Trainer.create(ctx, {
        config: tiny,
        batchSize: B,
        seqLen: T,
        schedule: { lr: 1e-3, min_lr: 1e-4, warmup_iters: 0, decay_iters: 10, style: "cosine" },
        adamw: { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, clip_grad: 1 },
        attnDropout: 0,
        hiddenDropout: 0,
        seed: 1,
        ...mode.opts,
      });
      const est = estimateTraining({
        config: tiny,
        batchSize: B,
        seqLen: T,
        limits: ctx.limits,
        chunks: mode.opts.chunks,
        checkpointLayers: mode.opts.checkpointLayers,
        precision: mode.opts.precision,
      });
      const allocated = tr.model.buffers.reduce((a, b) => a + b.size, 0);
      assert.equal(allocated, est.buffer_bytes);
      assert.equal(tr.memoryBytes, est.buffer_bytes);
      assert.equal(tr.model.buffers.length, est.buffers);
      // The estimate is the buffers plus what the allocator wastes under the order they were
      // allocated in, which is allocationOrder()'s.
      assert.equal(est.bytes_per_gpu.total, allocated + est.bytes_per_gpu.allocator);
      assert.equal(allocatorWaste(tr.model.buffers.map((b) => b.size)), est.bytes_per_gpu.allocator);
      const plan = planModel(ctx.limits, { config: tiny, B, T }, { ...mode.opts.chunks, ...mode.opts });
      assert.deepEqual(
        tr.model.buffers.map((b) => b.label),
        allocationOrder(plan.buffers).order.map((b) => b.label),
      );
      tr.destroy();
    },
  });
}

Deno.test("planModel() for inference plans no gradients, moments or backward scratch", () => {
  const limits = { maxStorageBufferBindingSize: 2 ** 30, maxBufferSize: 2 ** 30 };
  const plan = planModel(limits, { config: tiny, B: 1, T: 32 }, { train: false, sharedParams: true });
  const cats = new Set(plan.buffers.map((b) => b.category));
  assert.ok(!cats.has("gradients") && !cats.has("optimizer") && !cats.has("weights"));
  assert.equal(plan.headRows, 32);
});

function request(over: Partial<TrainRequest>): TrainRequest {
  return {
    model: "gpt2-345M",
    dataset: "sotu",
    split: "949,50,1",
    train_iters: 10,
    batch_size: 8,
    seq_len: 1024,
    lr: 1e-4,
    min_lr: 1e-5,
    lr_decay_style: "cosine",
    warmup: 0,
    weight_decay: 0.1,
    clip_grad: 1,
    attention_dropout: 0,
    hidden_dropout: 0,
    seed: 1,
    log_interval: 1,
    eval_interval: 0,
    eval_iters: 1,
    save_interval: 0,
    keep_checkpoints: 1,
    ...over,
  };
}

Deno.test("completeConfig() refuses a config whose estimate exceeds the GPU, naming the biggest part", () => {
  assert.equal(completeConfig(request({}), H200).batch_size, 8);
  assert.equal(completeConfig(request({ model: "gpt2-1558M", batch_size: 8 }), H200).model, "gpt2-1558M");
  const big = request({ model: "gpt2-1558M", batch_size: 48 });
  assert.throws(() => completeConfig(big, H200), (e: unknown) => {
    assert.ok(e instanceof InvalidJobError);
    assert.equal(e.field, "batch_size");
    assert.match(
      e.message,
      /^Model does not fit the GPU: the estimate of [\d.]+ GiB exceeds the GPU's 140\.00 GiB/,
    );
    assert.match(e.message, /the biggest part is activations/);
    return true;
  });
  // Checkpointing brings the same batch within the GPU.
  completeConfig({ ...big, checkpoint_activations: true }, H200);
  // An unknown adapter's memory is not guessed; its binding limit still applies.
  completeConfig(big, { ...H200, adapter: "Some GPU" });
  const small = { ...H200, adapter: "Some GPU", max_binding_bytes: 2 ** 27 };
  assert.throws(() => completeConfig(request({}), small), /Model does not fit the GPU: tensor "wte.weight"/);
});

Deno.test("GET /estimate returns parameters, bytes per category and FLOPs; bad input names the field", async () => {
  const root = await Deno.makeTempDir({ prefix: "gpt2_estimate_" });
  const store = new JobStore(":memory:");
  const runner = new JobRunner(store, {
    root,
    gpus: 1,
    spawn: () => new ScriptedWorker({}),
    datasetExists: () => Promise.resolve(true),
  });
  try {
    const app = createApp({ runner, token: null });
    const res = await app.request(
      "/estimate?model=gpt2-345M&batch_size=8&seq_len=1024&checkpoint_activations=true",
    );
    assert.equal(res.status, 200);
    const body = await res.json();
    const direct = estimateTraining({
      config: presetConfig("gpt2-345M"),
      batchSize: 8,
      seqLen: 1024,
      checkpointLayers: 1,
    });
    assert.equal(body.parameters, 354871296);
    assert.deepEqual(body.bytes_per_gpu, direct.bytes_per_gpu);
    assert.equal(body.flops_per_step, direct.flops_per_step);
    assert.equal(body.checkpoint_activations, true);
    assert.equal(body.gpu_memory_bytes, null);

    assert.equal(body.total_bytes, direct.bytes_per_gpu.total);
    assert.ok(body.bytes_per_gpu.allocator > 0, "the allocator's waste is its own part");
    assert.equal(body.buffer_bytes, direct.bytes_per_gpu.total - body.bytes_per_gpu.allocator);
    const dims = await app.request(
      `/estimate?model=${encodeURIComponent('{"n_layer":2,"n_head":2,"n_embd":64,"n_positions":32}')}`,
    );
    assert.equal(dims.status, 200);
    assert.equal(
      (await dims.json()).parameters,
      parameterCount(makeConfig({ n_layer: 2, n_head: 2, n_embd: 64, n_positions: 32 })),
    );

    await apiError(await app.request("/estimate?model=gpt2-345M&batch_size=0"), 400, { param: "batch_size" });
    await apiError(await app.request("/estimate?model=gpt2-9B"), 400, { param: "model" });
    await apiError(await app.request("/estimate?model=gpt2-tiny&seq_len=65"), 400, { param: "seq_len" });
    await apiError(await app.request("/estimate?precision=bf16"), 400, { param: "precision" });
  } finally {
    runner.shutdown();
    store.close();
    await Deno.remove(root, { recursive: true });
  }
});
