/**
 * fp16 training: the storage-dtype rewrite of a kernel, an f16 matmul against a float64 product of
 * the same f16-rounded inputs, and the fp16 trainer (f16 weights and activations, fp32 master
 * weights, gradients and AdamW, loss scale 2^32) against the float64 CPU reference with stated
 * tolerances; checkpointing stays bit-identical in fp16 too.
 */

import assert from "node:assert/strict";
import { makeConfig, paramLayout } from "../../model/config.ts";
import { withStorageDtypes } from "../../engine/kernels/common.ts";
import {
  chooseTile,
  matmulBindings,
  matmulGrid,
  type MatmulSpec,
  matmulWgsl,
} from "../../engine/kernels/matmul.ts";
import { encodeOps, makeOp, PipelineCache } from "../../engine/ops.ts";
import { createStorage, readBuffer } from "../../engine/device.ts";
import { initParams } from "../../model/init.ts";
import { referenceLossAndGrads } from "../reference/cpu_gpt2.ts";
import { Trainer, type TrainerOptions } from "../../engine/trainer.ts";
import { DEFAULT_LOSS_SCALER } from "../../engine/kernels/adamw.ts";
import { noGpu, randomFloats, relNorm, testContext } from "../_helpers.ts";

const ctx0 = await testContext();
const noF16 = noGpu || !ctx0?.hasF16;

Deno.test("withStorageDtypes() retypes a binding and converts its reads and stores", () => {
  const code = `@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> out: array<vec4<f32>>;
fn f(i: u32) { out[i] = out[i] + x[i * 2u] * 2.0; let ax = x[i]; }`;
  const got = withStorageDtypes(code, { x: "f16", out: "f16" });
  assert.match(got, /^enable f16;/);
  assert.match(got, /var<storage, read> x: array<vec4<f16>>;/);
  assert.match(got, /out\[i\] = vec4<f16>\(vec4<f32>\(out\[i\]\) \+ vec4<f32>\(x\[i \* 2u\]\) \* 2\.0\);/);
  assert.match(got, /let ax = vec4<f32>\(x\[i\]\);/);
  assert.equal(withStorageDtypes(code, { x: "f32" }), code);
  assert.throws(() => withStorageDtypes(code, { y: "f16" }), /no vec4<f32> storage binding "y"/);
});

async function upload16(label: string, data: Float32Array): Promise<GPUBuffer> {
  const ctx = ctx0!;
  const h = Float16Array.from(data);
  const buf = await createStorage(ctx, label, h.byteLength);
  ctx.device.queue.writeBuffer(buf, 0, h.buffer as ArrayBuffer, 0, h.byteLength);
  return buf;
}

const matmulCases: Array<{ math: "f32" | "f16"; transA: boolean; tol: number }> = [
  { math: "f32", transA: true, tol: 2e-3 },
  { math: "f16", transA: true, tol: 5e-3 },
  { math: "f16", transA: false, tol: 5e-3 },
];
for (const mc of matmulCases) {
  Deno.test({
    name:
      `matmul with f16 A, B and output (${mc.math} math, transA ${mc.transA}) matches float64 to ${mc.tol}`,
    ignore: noF16,
    fn: async () => {
      const ctx = ctx0!;
      const spec: MatmulSpec = {
        M: 96,
        N: 64,
        K: 200,
        transA: mc.transA,
        transB: false,
        bias: false,
        epilogue: "store",
        dtypes: { A: "f16", B: "f16", out: "f16" },
        math: mc.math,
      };
      const A = Float32Array.from(Float16Array.from(randomFloats(spec.M * spec.K, 11)));
      const B = Float32Array.from(Float16Array.from(randomFloats(spec.K * spec.N, 12)));
      const bufs: Record<string, GPUBuffer> = {
        A: await upload16("A", A),
        B: await upload16("B", B),
        out: await createStorage(ctx, "out", spec.M * spec.N * 2),
      };
      const tile = chooseTile(spec);
      const pipeline = await new PipelineCache(ctx).get("matmul16", matmulWgsl(spec, tile));
      const op = makeOp(ctx, pipeline, {
        label: "matmul16",
        phase: "forward",
        kind: "matmul_fwd",
        views: matmulBindings(spec).map((n) => ({ buffer: bufs[n] })),
        grid: matmulGrid(spec, tile),
      });
      const enc = ctx.device.createCommandEncoder();
      encodeOps(enc, [op]);
      ctx.device.queue.submit([enc.finish()]);
      const got = Float32Array.from(new Float16Array(await readBuffer(ctx, bufs.out)));
      const ref = new Float64Array(spec.M * spec.N);
      for (let m = 0; m < spec.M; m++) {
        for (let n = 0; n < spec.N; n++) {
          let acc = 0;
          for (let k = 0; k < spec.K; k++) {
            acc += A[mc.transA ? k * spec.M + m : m * spec.K + k] * B[k * spec.N + n];
          }
          ref[m * spec.N + n] = acc;
        }
      }
      const err = relNorm(got, ref);
      assert.ok(err < mc.tol, `relative error ${err}`);
      for (const b of Object.values(bufs)) b.destroy();
    },
  });
}

const config = makeConfig({ n_layer: 2, n_head: 2, n_embd: 64, n_positions: 32, vocab_size: 256 });
const Bt = 2, T = 32;

function batch(seed: number): Uint16Array {
  const out = new Uint16Array(Bt * (T + 1));
  let s = seed;
  for (let i = 0; i < out.length; i++) {
    s = (Math.imul(s, 1103515245) + 12345) >>> 0;
    out[i] = (s >>> 16) % config.vocab_size;
  }
  return out;
}

async function trainer(extra: Partial<TrainerOptions>): Promise<Trainer> {
  return await Trainer.create(ctx0!, {
    config,
    batchSize: Bt,
    seqLen: T,
    schedule: { lr: 1e-3, min_lr: 1e-4, warmup_iters: 0, decay_iters: 10, style: "cosine" },
    adamw: { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, clip_grad: 1 },
    attnDropout: 0.1,
    hiddenDropout: 0.1,
    seed: 4,
    precision: "fp16",
    ...extra,
  });
}

Deno.test({
  name: "fp16 Trainer matches the CPU reference: loss to 1e-3, every gradient to 1e-2 (relative norm)",
  ignore: noF16,
  fn: async () => {
    // Scale 2^10: the f16 activation gradients stay in range from the first step.
    const tr = await trainer({ lossScaler: { ...DEFAULT_LOSS_SCALER, initialScale: 1024 } });
    const tokens = batch(3);
    const params = Float64Array.from(initParams(config, 4));
    const ref = referenceLossAndGrads(config, params, tokens, Bt, T, {
      seed: 4,
      step: 0,
      attnDropout: 0.1,
      hiddenDropout: 0.1,
    });
    tr.trainStep(tokens);
    const s = await tr.lastStats();
    assert.equal(s.lossScale, 1024);
    assert.equal(s.skippedSteps, 0);
    assert.ok(Math.abs(s.loss - ref.loss) < 1e-3 * ref.loss, `loss ${s.loss} vs reference ${ref.loss}`);
    const grads = await tr.gradients();
    const worst: string[] = [];
    let maxErr = 0;
    for (const t of paramLayout(config).tensors) {
      const g = grads.subarray(t.offset, t.offset + t.size).map((x) => x / 1024);
      const err = relNorm(g, ref.grads.subarray(t.offset, t.offset + t.size));
      maxErr = Math.max(maxErr, err);
      if (!(err < 1e-2)) worst.push(`${t.name}: ${err.toExponential(2)}`);
    }
    assert.deepEqual(worst, [], `tensors whose gradient differs: ${worst.join(", ")}`);
    console.log(
      `fp16 vs reference: loss ${s.loss} vs ${ref.loss}, worst gradient error ${maxErr.toExponential(2)}`,
    );
    for (let i = 1; i < 4; i++) tr.trainStep(batch(3 + i));
    const after = await tr.lastStats();
    assert.ok(Number.isFinite(after.loss) && after.skippedSteps === 0, `loss ${after.loss} after 4 steps`);
    tr.destroy();
  },
});

Deno.test({
  name:
    "fp16 Trainer from Megatron's 2^32: f16 gradients overflow, steps are skipped and the scale backs off",
  ignore: noF16,
  fn: async () => {
    const tr = await trainer({});
    const before = (await tr.exportState()).params;
    tr.trainStep(batch(30));
    const s0 = await tr.lastStats();
    assert.equal(s0.skippedSteps, 1, "2^32 overflows the f16 gradients at once");
    assert.equal(s0.lossScale, 2 ** 32, "hysteresis 2: the first overflow does not back off");
    assert.ok((await tr.exportState()).params.every((x, i) => Object.is(x, before[i])), "weights unchanged");
    assert.equal(s0.consecutiveSkipped, 0, "a step skipped while the scale can back off is no failure");
    let s = s0, skipping = true;
    for (let i = 1; i < 40 && skipping; i++) {
      tr.trainStep(batch(30 + i));
      const next = await tr.lastStats();
      skipping = next.skippedSteps > s.skippedSteps;
      s = next;
      assert.equal(s.consecutiveSkipped, 0, `step ${i} at scale ${s.lossScale}: not counted as a failure`);
    }
    assert.ok(!skipping, `still skipping at scale ${s.lossScale}`);
    assert.ok(s.lossScale < 2 ** 32 && s.lossScale >= 1, `scale ${s.lossScale}`);
    assert.equal(s.lossScale, 2 ** (32 - (s.skippedSteps - 1)), "halved on every overflow after the first");
    assert.equal(s.optimizerStep, 1);
    assert.ok(Number.isFinite(s.loss) && Number.isFinite(s.gradNorm));
    tr.destroy();
  },
});

Deno.test({
  name: "fp16 Trainer with activation checkpointing is bit-identical to storing everything",
  ignore: noF16,
  fn: async () => {
    const full = await trainer({}), ckpt = await trainer({ checkpointLayers: 1 });
    assert.ok(ckpt.memoryBytes < full.memoryBytes);
    for (let i = 0; i < 2; i++) {
      full.trainStep(batch(20 + i));
      ckpt.trainStep(batch(20 + i));
      const [a, b] = [await full.lastStats(), await ckpt.lastStats()];
      assert.ok(Object.is(a.loss, b.loss), `step ${i}: ${a.loss} vs ${b.loss}`);
    }
    const [pa, pb] = [(await full.exportState()).params, (await ckpt.exportState()).params];
    assert.ok(pa.every((x, i) => Object.is(x, pb[i])), "parameters identical");
    full.destroy();
    ckpt.destroy();
  },
});
