/**
 * The generated matmul against a float64 CPU product, over every layout, guarded and unguarded
 * shapes, and each fused epilogue.
 */

import assert from "node:assert/strict";
import { readFloats } from "../gpu/device.ts";
import {
  chooseTile,
  matmulBindings,
  matmulGrid,
  type MatmulSpec,
  matmulWgsl,
} from "../gpu/kernels/matmul.ts";
import { encodeOps, makeOp, PipelineCache } from "../gpu/ops.ts";
import { gemvPartialWgsl, gemvReduceBindings, gemvReduceWgsl } from "../gpu/kernels/gemv.ts";
import { noGpu, randomFloats, relNorm, testContext, upload } from "./_helpers.ts";

const gelu = (x: number) => 0.5 * x * (1 + Math.tanh(Math.sqrt(2 / Math.PI) * (x + 0.044715 * x ** 3)));

function cpuMatmul(s: MatmulSpec, A: Float32Array, B: Float32Array, bias?: Float32Array): Float64Array {
  const out = new Float64Array(s.M * s.N);
  for (let m = 0; m < s.M; m++) {
    for (let n = 0; n < s.N; n++) {
      let acc = bias ? bias[n] : 0;
      for (let k = 0; k < s.K; k++) {
        const a0 = s.transA ? A[k * s.M + m] : A[m * s.K + k];
        const a = s.prologueA === "gelu" ? gelu(a0) : a0;
        const b = s.transB ? B[n * s.K + k] : B[k * s.N + n];
        acc += a * b;
      }
      out[m * s.N + n] = acc;
    }
  }
  return out;
}

async function run(spec: MatmulSpec, tile = chooseTile(spec)) {
  const ctx = (await testContext())!;
  const A = randomFloats(spec.M * spec.K, 1), B = randomFloats(spec.K * spec.N, 2);
  const bias = randomFloats(spec.N, 3), aux = randomFloats(spec.M * spec.N, 4);
  const init = randomFloats(spec.M * spec.N, 5);
  const bufs: Record<string, GPUBuffer> = {
    A: await upload(ctx, "A", A),
    B: await upload(ctx, "B", B),
    out: await upload(ctx, "out", init),
    bias: await upload(ctx, "bias", bias),
    res: await upload(ctx, "res", aux),
    aux: await upload(ctx, "aux", aux),
    out2: await upload(ctx, "out2", new Float32Array(spec.M * spec.N)),
  };
  const pipeline = await new PipelineCache(ctx).get("matmul", matmulWgsl(spec, tile));
  const op = makeOp(ctx, pipeline, {
    label: "matmul",
    phase: "forward",
    kind: "matmul_fwd",
    views: matmulBindings(spec).map((n) => ({ buffer: bufs[n] })),
    grid: matmulGrid(spec, tile),
  });
  const enc = ctx.device.createCommandEncoder();
  encodeOps(enc, [op]);
  ctx.device.queue.submit([enc.finish()]);
  const got = await readFloats(ctx, bufs.out);
  const ref = cpuMatmul(spec, A, B, spec.bias ? bias : undefined);
  if (spec.epilogue === "accumulate") ref.forEach((v, i) => ref[i] = v + init[i]);
  if (spec.epilogue === "residual") ref.forEach((v, i) => ref[i] = v + aux[i]);
  if (spec.epilogue === "gelu") {
    const got2 = await readFloats(ctx, bufs.out2);
    assert.ok(relNorm(got2, ref.map(gelu)) < 1e-5, "gelu output");
  }
  if (spec.epilogue === "gelu_grad") {
    ref.forEach((v, i) => {
      const x = aux[i], u = Math.sqrt(2 / Math.PI) * (x + 0.044715 * x ** 3), t = Math.tanh(u);
      ref[i] = v *
        (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * Math.sqrt(2 / Math.PI) * (1 + 3 * 0.044715 * x * x));
    });
  }
  Object.values(bufs).forEach((b) => b.destroy());
  return relNorm(got, ref);
}

const base = { bias: false, epilogue: "store" as const };

Deno.test({
  name: "matmulWgsl() matches a float64 product in all four layouts",
  ignore: noGpu,
  fn: async () => {
    for (const transA of [false, true]) {
      for (const transB of [false, true]) {
        const err = await run({ ...base, M: 64, N: 96, K: 80, transA, transB });
        assert.ok(err < 1e-5, `transA=${transA} transB=${transB}: rel err ${err}`);
      }
    }
  },
});

Deno.test({
  name: "matmulWgsl() guards ragged shapes with every tile size",
  ignore: noGpu,
  fn: async () => {
    for (const tile of [{ BM: 32, BN: 32, BK: 16, TM: 4, TN: 4 }, { BM: 64, BN: 64, BK: 16, TM: 4, TN: 4 }]) {
      for (const transA of [false, true]) {
        for (const transB of [false, true]) {
          const err = await run({ ...base, M: 52, N: 100, K: 36, transA, transB }, tile);
          assert.ok(err < 1e-5, `tile ${tile.BM} transA=${transA} transB=${transB}: rel err ${err}`);
        }
      }
    }
    const big = { BM: 128, BN: 128, BK: 16, TM: 8, TN: 8 };
    const err = await run({ ...base, M: 136, N: 132, K: 24, transA: false, transB: true }, big);
    assert.ok(err < 1e-5, `tile 128: rel err ${err}`);
  },
});

Deno.test({
  name: "matmulWgsl() fuses bias, accumulate, residual, gelu and gelu_grad epilogues",
  ignore: noGpu,
  fn: async () => {
    for (const epilogue of ["store", "accumulate", "residual", "gelu", "gelu_grad"] as const) {
      const err = await run({
        M: 64,
        N: 64,
        K: 32,
        transA: false,
        transB: false,
        bias: epilogue !== "gelu_grad",
        epilogue,
      });
      assert.ok(err < 1e-5, `${epilogue}: rel err ${err}`);
    }
  },
});

Deno.test({
  name: "matmulWgsl() applies GELU to A as it loads it (plain and transposed A, guarded K)",
  ignore: noGpu,
  fn: async () => {
    for (const transA of [false, true]) {
      const err = await run({
        M: 64,
        N: 64,
        K: 36,
        transA,
        transB: false,
        bias: true,
        epilogue: "residual",
        prologueA: "gelu",
      });
      assert.ok(err < 1e-5, `transA ${transA}: rel err ${err}`);
    }
  },
});

Deno.test({
  name: "gemvPartialWgsl() + gemvReduceWgsl() match a float64 product for 1 to 8 rows and every epilogue",
  ignore: noGpu,
  fn: async () => {
    const ctx = (await testContext())!;
    const cache = new PipelineCache(ctx);
    for (
      const [M, epilogue, KS] of [[1, "store", 3], [3, "residual", 1], [8, "gelu", 5], [
        5,
        "store",
        2,
      ]] as const
    ) {
      const N = 200, K = 97;
      const x = randomFloats(M * K, 11),
        W = randomFloats(K * N, 12),
        bias = randomFloats(N, 13),
        res = randomFloats(M * N, 14);
      const spec = { M, N, K, bias: true, epilogue, KS };
      const bufs: Record<string, GPUBuffer> = {
        x: await upload(ctx, "x", x),
        W: await upload(ctx, "W", W),
        part: await upload(ctx, "part", new Float32Array(KS * M * N)),
        out: await upload(ctx, "out", new Float32Array(M * N)),
        out2: await upload(ctx, "out2", new Float32Array(M * N)),
        bias: await upload(ctx, "bias", bias),
        res: await upload(ctx, "res", res),
      };
      const p1 = makeOp(ctx, await cache.get("gemv", gemvPartialWgsl(spec)), {
        label: "gemv",
        phase: "forward",
        kind: "matmul_fwd",
        views: [{ buffer: bufs.x }, { buffer: bufs.W }, { buffer: bufs.part }],
        grid: [Math.ceil(N / 128), KS],
      });
      const p2 = makeOp(ctx, await cache.get("gemv.sum", gemvReduceWgsl(spec)), {
        label: "gemv.sum",
        phase: "forward",
        kind: "matmul_fwd",
        views: gemvReduceBindings(spec).map((n) => ({ buffer: bufs[n] })),
        grid: [Math.ceil((M * N) / 4 / 64)],
      });
      const enc = ctx.device.createCommandEncoder();
      encodeOps(enc, [p1, p2]);
      ctx.device.queue.submit([enc.finish()]);
      const ref = cpuMatmul(
        { M, N, K, transA: false, transB: false, bias: true, epilogue: "store" },
        x,
        W,
        bias,
      );
      if (epilogue === "residual") ref.forEach((v, i) => ref[i] = v + res[i]);
      const got = await readFloats(ctx, bufs.out);
      assert.ok(relNorm(got, ref) < 1e-5, `M=${M} ${epilogue}: rel err ${relNorm(got, ref)}`);
      if (epilogue === "gelu") {
        const got2 = await readFloats(ctx, bufs.out2);
        assert.ok(relNorm(got2, ref.map(gelu)) < 1e-5, `M=${M} gelu output`);
      }
      Object.values(bufs).forEach((b) => b.destroy());
    }
  },
});
