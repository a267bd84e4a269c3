/**
 * The memory estimator and the fit check: the estimate equals the bytes the engine allocates for
 * tiny models in every mode (one plan feeds both) plus the allocator's modelled waste under the
 * order the engine allocates in, the parameter and FLOP formulas, `GET /estimate` and the GPU it
 * plans for (the server's, a named preset, or the default when the server's cannot hold the model),
 * and `POST /train`'s refusal naming the biggest part.
 */

import assert from "node:assert/strict";
import { ConfigError, makeConfig, parameterCount, paramLayout, presetConfig } from "../../model/config.ts";
import { describeDevice } from "../../engine/device.ts";
import {
  DEFAULT_GPU,
  DEFAULT_PLAN_LIMITS,
  estimateForGpu,
  estimateTraining,
  GPU_PRESET_NAMES,
  GPU_PRESETS,
  type GpuDescription,
  knownDeviceMemory,
  megatronFlops,
  parametersPerGpu,
} from "../../model/memory_estimate.ts";
import {
  allocationOrder,
  allocatorWaste,
  CATEGORIES,
  type ChunkOptions,
  planModel,
  type Precision,
  scoresFloats,
} from "../../model/plan.ts";
import { Trainer } from "../../engine/trainer.ts";
import { estimateJob, storesScores } from "../../job/job_config.ts";
import {
  completeConfig,
  InvalidJobError,
  JobRunner,
  JobStore,
  type TrainRequest,
} from "../../server/jobs/mod.ts";
import { ScriptedWorker } from "../fakes/fake_worker.ts";
import { createApp } from "../../server/routes/mod.ts";
import { noGpu, testContext } from "../_helpers.ts";
import { apiError } from "../_api.ts";
import { estimateGpu } from "../../web/shapes.js";

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

Deno.test("planModel() with attentionScores sizes the logits for dS where it fits 1 GiB and the binding limit", () => {
  const big = { maxStorageBufferBindingSize: 2 ** 31 - 4, maxBufferSize: 2 ** 31 - 4 };
  const logits = (limits: typeof big, model: string, B: number, o = {}) =>
    planModel(limits, { config: presetConfig(model), B, T: 1024 }, { attentionScores: true, ...o })
      .byLabel.get("logits")!.bytes;
  const chunk = 2048 * 50304 * 4; // 4 chunks of the 8·1024 rows' logits under HEAD_CHUNK_BYTES
  // 124M: 8·12·1024² f32 of dS (402.7 MB) fit the chunk's 412 MB; 345M's 537 MB grow the buffer.
  assert.equal(logits(big, "gpt2-124M", 8), chunk);
  assert.equal(logits(big, "gpt2-345M", 8), 8 * 16 * 1024 ** 2 * 4);
  assert.equal(
    scoresFloats(big, { config: presetConfig("gpt2-345M"), B: 8, T: 1024 }, { attentionScores: true }),
    8 * 16 * 1024 ** 2,
  );
  // Tensor parallelism halves the heads; above 1 GiB (345M at batch 24) or the binding limit: no dS.
  // (A rank's chunk holds twice the rows of half the vocabulary: the same 412 MB.)
  assert.equal(
    scoresFloats(big, { config: presetConfig("gpt2-345M"), B: 8, T: 1024 }, {
      attentionScores: true,
      tensorParallel: 2,
    }),
    8 * 8 * 1024 ** 2,
  );
  assert.equal(logits(big, "gpt2-345M", 8, { tensorParallel: 2 }), chunk);
  assert.equal(
    scoresFloats(big, { config: presetConfig("gpt2-345M"), B: 24, T: 1024 }, { attentionScores: true }),
    0,
  );
  const small = { maxStorageBufferBindingSize: 2 ** 28, maxBufferSize: 2 ** 30 };
  assert.equal(
    scoresFloats(small, { config: presetConfig("gpt2-124M"), B: 8, T: 1024 }, { attentionScores: true }),
    0,
  );
  // Off by default, and never in a plan without training.
  assert.equal(
    planModel(big, { config: presetConfig("gpt2-345M"), B: 8, T: 1024 }).byLabel.get("logits")!.bytes,
    chunk,
  );
  assert.equal(
    scoresFloats(big, { config: presetConfig("gpt2-345M"), B: 8, T: 1024 }, {
      attentionScores: true,
      train: false,
    }),
    0,
  );
});

Deno.test("A job's estimate counts the dS the engine stores on a GPU with subgroups, not on CPU adapters", () => {
  const h200 = {
    adapter: "NVIDIA H200 [subgroups, timestamp-query, shader-f16] storage binding 2.00 GiB",
    max_binding_bytes: 2 ** 31 - 4,
    max_buffer_bytes: 2 ** 32,
  };
  const cpu = { ...h200, adapter: "llvmpipe (LLVM 15.0.6, 256 bits) [subgroups, timestamp-query]" };
  const plain = { ...h200, adapter: "NVIDIA H200 [timestamp-query]" };
  const m345 = presetConfig("gpt2-345M");
  assert.equal(storesScores(h200, m345), true);
  assert.equal(storesScores(cpu, m345), false);
  assert.equal(storesScores(plain, m345), false);
  assert.equal(storesScores(null, m345), false);
  const q = { model: "gpt2-345M", batch_size: 8, seq_len: 1024, precision: "fp32" as const };
  const q2 = {
    ...q,
    checkpoint_activations: false,
    checkpoint_num_layers: 0,
    tensor_parallel: 1,
    data_parallel: 1,
  };
  // 345M at 8 × 1024: dS (537 MB) outgrows the logits chunk (412 MB) on the H200 alone.
  const grown = estimateJob(q2, h200).buffer_bytes - estimateJob(q2, cpu).buffer_bytes;
  assert.equal(grown, 8 * 16 * 1024 ** 2 * 4 - 2048 * 50304 * 4);
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
    // No GPU has reported (the runner was not started): planned for the default preset.
    assert.deepEqual(body.planned_for, {
      preset: "h200",
      name: "NVIDIA H200",
      memory_bytes: 140 * 2 ** 30,
      max_storage_buffer_binding_size: 2 ** 31 - 4,
      max_buffer_size: 2 ** 32,
      why: "default because the server's GPU cannot hold it: the server has no GPU ready",
    });
    assert.equal(body.gpu_memory_bytes, 140 * 2 ** 30);
    assert.equal(body.fits, true);
    assert.equal(body.fits_server_gpu, null);
    assert.equal(estimateGpu(body), "NVIDIA H200, the default: this server has no GPU ready");

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

/** 12·L·h² + 13·L·h + (V+P)·h + 2h, V the padded vocabulary. */
function formulaParameters(name: string): number {
  const c = presetConfig(name), L = c.n_layer, h = c.n_embd;
  return 12 * L * h * h + 13 * L * h + (c.padded_vocab_size + c.n_positions) * h + 2 * h;
}

/** What lavapipe (Mesa's Vulkan CPU driver) reports under Deno's WebGPU: a 128 MiB binding. */
const LAVAPIPE: GpuDescription = {
  name: "llvmpipe (LLVM 15.0.6, 256 bits)",
  memoryBytes: null,
  maxStorageBufferBindingSize: 2 ** 27,
  maxBufferSize: 2 ** 31 - 1,
};
const M345_FP16_CKPT = { batchSize: 8, seqLen: 1024, precision: "fp16", checkpointLayers: 1 } as const;
const WTE_REFUSAL =
  /tensor "wte\.weight" of 206045184 bytes exceeds the device's buffer binding limit of 134217728/;

Deno.test("GPU_PRESETS: memory as the fit check knows it, NVIDIA's limits as measured, WebGPU's defaults", () => {
  assert.deepEqual(GPU_PRESET_NAMES, ["h200", "h100", "a100-80gb", "a100-40gb", "webgpu-default"]);
  for (const name of GPU_PRESET_NAMES) {
    assert.equal(knownDeviceMemory(GPU_PRESETS[name].name), GPU_PRESETS[name].memoryBytes, name);
  }
  assert.equal(GPU_PRESETS.h200.memoryBytes, 140 * 2 ** 30);
  assert.equal(GPU_PRESETS["a100-40gb"].memoryBytes, 40 * 2 ** 30);
  assert.equal(GPU_PRESETS.h200.maxStorageBufferBindingSize, 2 ** 31 - 4);
  assert.equal(GPU_PRESETS["webgpu-default"].maxStorageBufferBindingSize, 128 * 2 ** 20);
  assert.equal(GPU_PRESETS["webgpu-default"].maxBufferSize, 256 * 2 ** 20);
  assert.equal(DEFAULT_GPU, "h200");
  assert.equal(DEFAULT_PLAN_LIMITS.maxStorageBufferBindingSize, GPU_PRESETS.h200.maxStorageBufferBindingSize);
});

Deno.test("estimateForGpu() plans for the server's GPU when it holds the model, else the named or default preset", () => {
  const plan = (config: string, opts: object = {}) => (gpu: GpuDescription) =>
    estimateTraining({ config: presetConfig(config), batchSize: 4, seqLen: 64, ...opts, limits: gpu });
  // gpt2-tiny binds on lavapipe: its own GPU, memory unknown.
  const tiny = estimateForGpu(plan("gpt2-tiny"), LAVAPIPE);
  assert.equal(tiny.planned_for.preset, null);
  assert.equal(tiny.planned_for.name, LAVAPIPE.name);
  assert.equal(tiny.planned_for.why, "server");
  assert.equal(tiny.planned_for.max_storage_buffer_binding_size, 2 ** 27);
  assert.equal(tiny.fits_server_gpu, null);

  // gpt2-345M's embedding does not bind there: the default preset, the refusal as the reason.
  const big = estimateForGpu(plan("gpt2-345M", M345_FP16_CKPT), LAVAPIPE);
  assert.equal(big.planned_for.preset, "h200");
  assert.match(big.planned_for.why, /^default because the server's GPU cannot hold it: /);
  assert.match(big.planned_for.why, WTE_REFUSAL);
  assert.equal(big.fits_server_gpu, false);
  assert.equal(big.estimate.parameters, formulaParameters("gpt2-345M"));
  assert.deepEqual(big.estimate, plan("gpt2-345M", M345_FP16_CKPT)(GPU_PRESETS.h200));

  // A GPU of known memory too small for the estimate; no GPU at all.
  const small = { ...GPU_PRESETS.h200, name: "NVIDIA A100 40GB", memoryBytes: 2 ** 30 };
  const over = estimateForGpu(plan("gpt2-345M"), small);
  assert.equal(over.planned_for.preset, "h200");
  assert.match(over.planned_for.why, /: the estimate of [\d.]+ GiB exceeds its 1\.00 GiB$/);
  assert.equal(over.fits_server_gpu, false);
  const none = estimateForGpu(plan("gpt2-tiny"), null);
  assert.equal(
    none.planned_for.why,
    "default because the server's GPU cannot hold it: the server has no GPU ready",
  );
  assert.equal(none.fits_server_gpu, null);

  // A named preset wins even when the server holds the model; the server's fit is still reported.
  const named = estimateForGpu(plan("gpt2-tiny"), { ...LAVAPIPE, memoryBytes: 2 ** 30 }, "h100");
  assert.equal(named.planned_for.preset, "h100");
  assert.equal(named.planned_for.why, "query");
  assert.equal(named.planned_for.memory_bytes, 80 * 2 ** 30);
  assert.equal(named.fits_server_gpu, true);
  // What no GPU can plan is refused for the GPU planned for.
  assert.throws(() => estimateForGpu(plan("gpt2-345M"), LAVAPIPE, "webgpu-default"), ConfigError);
  assert.throws(
    () => estimateForGpu(plan("gpt2-1558M", { batchSize: 128, seqLen: 1024 }), LAVAPIPE),
    /storage binding limit of 2147483644 bytes/,
  );
});

/** A started runner whose one GPU reports `ready` as given (a ScriptedWorker: nothing runs). */
async function withServerGpu(
  ready: { adapter: string; max_binding_bytes: number; max_buffer_bytes: number } | null,
  fn: (app: ReturnType<typeof createApp>) => Promise<void>,
): Promise<void> {
  const root = await Deno.makeTempDir({ prefix: "gpt2_estimate_" });
  const store = new JobStore(":memory:");
  const worker = new ScriptedWorker({});
  const runner = new JobRunner(store, {
    root,
    gpus: 1,
    spawn: () => worker,
    datasetExists: () => Promise.resolve(true),
  });
  try {
    runner.start();
    await new Promise((r) => setTimeout(r, 0)); // the scripted `ready`
    if (ready) worker.send({ type: "ready", gpu: 0, ...ready });
    assert.ok(runner.device(0), "the GPU reported its limits");
    await fn(createApp({ runner, token: null }));
  } finally {
    runner.shutdown();
    store.close();
    await Deno.remove(root, { recursive: true });
  }
}

const M345_QUERY =
  "/estimate?model=gpt2-345M&batch_size=8&seq_len=1024&precision=fp16&checkpoint_activations=true";

Deno.test("GET /estimate of gpt2-345M on a server whose GPU binds 128 MiB plans for the default H200", async () => {
  // The scripted Worker reports a 128 MiB binding and a 256 MiB buffer, as lavapipe's binding.
  await withServerGpu(null, async (app) => {
    const res = await app.request(M345_QUERY);
    assert.equal(res.status, 200);
    const body = await res.json();
    assert.equal(body.parameters, formulaParameters("gpt2-345M"));
    assert.equal(body.parameters, 354_871_296);
    const direct = estimateTraining({ config: presetConfig("gpt2-345M"), ...M345_FP16_CKPT });
    assert.deepEqual(body.bytes_per_gpu, direct.bytes_per_gpu);
    assert.equal(body.planned_for.preset, "h200");
    assert.equal(body.planned_for.name, "NVIDIA H200");
    assert.equal(body.planned_for.memory_bytes, 140 * 2 ** 30);
    assert.match(body.planned_for.why, /^default because the server's GPU cannot hold it: /);
    assert.match(body.planned_for.why, WTE_REFUSAL);
    assert.equal(body.gpu_memory_bytes, 140 * 2 ** 30);
    assert.equal(body.fits, true);
    assert.equal(body.fits_server_gpu, false);
    assert.equal(estimateGpu(body), "NVIDIA H200: this server's GPU cannot hold it", "the dashboard's line");

    // gpt2-tiny binds there: the server's own GPU, as before.
    const tiny = await (await app.request("/estimate?model=gpt2-tiny")).json();
    assert.equal(tiny.planned_for.why, "server");
    assert.equal(tiny.planned_for.preset, null);
    assert.equal(tiny.planned_for.name, "scripted test double");
    assert.equal(tiny.planned_for.max_storage_buffer_binding_size, 2 ** 27);
    assert.equal(tiny.gpu_memory_bytes, null);
    assert.equal(tiny.fits, null);
    assert.equal(tiny.fits_server_gpu, null);
    assert.equal(estimateGpu(tiny), "this server's GPU (scripted test double)");

    const h100 = await app.request(`${M345_QUERY}&gpu=h100`);
    assert.equal(h100.status, 200);
    const named = await h100.json();
    assert.equal(named.gpu, "h100");
    assert.equal(named.planned_for.preset, "h100");
    assert.equal(named.planned_for.name, "NVIDIA H100 80GB");
    assert.equal(named.planned_for.why, "query");
    assert.equal(named.gpu_memory_bytes, 80 * 2 ** 30);
    assert.equal(named.fits, true);
    assert.equal(named.fits_server_gpu, false);

    await apiError(await app.request(`${M345_QUERY}&gpu=nope`), 400, {
      param: "gpu",
      message: /gpu: Unknown GPU preset: expected one of h200, h100, a100-80gb, a100-40gb, webgpu-default/,
    });
    await apiError(await app.request(`${M345_QUERY}&gpu=webgpu-default`), 400, {
      param: "model",
      message: WTE_REFUSAL,
    });
  });
});

Deno.test({
  name: "GET /estimate on this machine's own adapter: gpt2-345M plans for the default unless it binds",
  ignore: noGpu,
  fn: async () => {
    const ctx = (await testContext())!;
    const ready = {
      adapter: describeDevice(ctx),
      max_binding_bytes: ctx.limits.maxStorageBufferBindingSize,
      max_buffer_bytes: ctx.limits.maxBufferSize,
    };
    await withServerGpu(ready, async (app) => {
      const res = await app.request(M345_QUERY);
      assert.equal(res.status, 200);
      const body = await res.json();
      assert.equal(body.parameters, formulaParameters("gpt2-345M"));
      const binds = ctx.limits.maxStorageBufferBindingSize >= 206045184;
      assert.equal(body.planned_for.why === "server", binds, body.planned_for.why);
      if (!binds) assert.match(body.planned_for.why, /tensor "wte\.weight" of 206045184 bytes exceeds/);
      const tiny = await (await app.request("/estimate?model=gpt2-tiny")).json();
      assert.equal(tiny.planned_for.why, "server");
      assert.equal(tiny.planned_for.name, ctx.adapterInfo.description || ctx.adapterInfo.vendor);
    });
  },
});
