/**
 * The generated matmul against a float64 CPU product, over every layout, guarded and unguarded
 * shapes, and each fused epilogue; generation 2 tiles (double buffering, warp tiles, both
 * transposing loads, split-K with its reduction) the same way, in f32 and f16; and chooseTile's
 * measured rules.
 */

import assert from "node:assert/strict";
import { createStorage, readBuffer, readFloats } from "../../engine/device.ts";
import {
  chooseTile,
  matmulKernels,
  matmulScratchBytes,
  type MatmulSpec,
  type MatmulTile,
  matmulTileError,
  matmulWgsl,
  tileName,
} from "../../engine/kernels/matmul.ts";
import type { TileRule } from "../../engine/kernels/matmul.ts";
import { dropKeep, dropThreshold } from "../../model/rng.ts";
import { encodeOps, makeOp, PipelineCache } from "../../engine/ops.ts";
import { gemvPartialWgsl, gemvReduceBindings, gemvReduceWgsl } from "../../engine/kernels/gemv.ts";
import { noGpu, randomFloats, relNorm, testContext, upload } from "../_helpers.ts";

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

const DROP_KEY = 0x2468ace, DROP_P = 0.25;

/** Runs the spec's kernels (split-K included) on random data (the same for every tile): the inputs and outputs. */
async function gpuRun(spec: MatmulSpec, tile: MatmulTile) {
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
    part: await upload(ctx, "part", new Float32Array(Math.max(4, matmulScratchBytes(spec, tile) / 4))),
  };
  const u = new Uint32Array(4);
  u[0] = DROP_KEY;
  u[1] = dropThreshold(DROP_P);
  new Float32Array(u.buffer)[2] = 1 / (1 - DROP_P);
  const uniform = ctx.device.createBuffer({
    size: 16,
    usage: GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST,
  });
  ctx.device.queue.writeBuffer(uniform, 0, u);
  const cache = new PipelineCache(ctx);
  const ops = [];
  const dimsBuffers: GPUBuffer[] = [];
  for (const k of matmulKernels(spec, tile)) {
    let dims: GPUBuffer | undefined;
    if (k.dims) {
      dims = ctx.device.createBuffer({ size: 16, usage: GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST });
      ctx.device.queue.writeBuffer(dims, 0, new Uint32Array(k.dims));
      dimsBuffers.push(dims);
    }
    ops.push(makeOp(ctx, await cache.get("matmul" + k.suffix, k.code), {
      label: "matmul" + k.suffix,
      phase: "forward",
      kind: "matmul_fwd",
      views: k.bindings.map((n) => ({ buffer: bufs[n] })),
      grid: k.grid,
      uniform: k.uniform ? uniform : dims,
    }));
  }
  const enc = ctx.device.createCommandEncoder();
  encodeOps(enc, ops);
  ctx.device.queue.submit([enc.finish()]);
  const got = await readFloats(ctx, bufs.out);
  const got2 = spec.epilogue === "gelu" ? await readFloats(ctx, bufs.out2) : undefined;
  Object.values(bufs).forEach((b) => b.destroy());
  uniform.destroy();
  dimsBuffers.forEach((b) => b.destroy());
  return { got, got2, A, B, bias, aux, init };
}

/** Runs the spec's kernels (split-K included) on random data; ‖got − float64 reference‖ / ‖reference‖. */
async function run(spec: MatmulSpec, tile: MatmulTile = chooseTile(spec)) {
  const { got, got2, A, B, bias, aux, init } = await gpuRun(spec, tile);
  const ref = cpuMatmul(spec, A, B, spec.bias ? bias : undefined);
  if (spec.epilogue === "accumulate") ref.forEach((v, i) => ref[i] = v + init[i]);
  if (spec.epilogue === "residual") {
    const th = dropThreshold(DROP_P), sc = 1 / (1 - DROP_P);
    ref.forEach((v, i) => {
      const d = !spec.dropout ? 1 : dropKeep(i, DROP_KEY, th) ? sc : 0;
      ref[i] = v * d + aux[i];
    });
  }
  if (spec.epilogue === "gelu") assert.ok(relNorm(got2!, ref.map(gelu)) < 1e-5, "gelu output");
  if (spec.epilogue === "gelu_grad") {
    ref.forEach((v, i) => {
      const x = aux[i], u = Math.sqrt(2 / Math.PI) * (x + 0.044715 * x ** 3), t = Math.tanh(u);
      ref[i] = v *
        (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * Math.sqrt(2 / Math.PI) * (1 + 3 * 0.044715 * x * x));
    });
  }
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

/** Generation 2 tiles, each knob in at least one layout (64- and 32-wide blocks keep lavapipe quick). */
const gen2Cases: Array<[boolean, boolean, MatmulTile]> = [
  [false, false, { BM: 64, BN: 64, BK: 16, TM: 4, TN: 4, gen: 2 }],
  [false, true, { BM: 64, BN: 64, BK: 16, TM: 4, TN: 4, gen: 2, buffers: 2, warpN: 8 }],
  [true, false, { BM: 64, BN: 64, BK: 8, TM: 8, TN: 4, gen: 2, buffers: 2, warpN: 4 }],
  [true, true, { BM: 64, BN: 64, BK: 32, TM: 4, TN: 4, gen: 2, transposeLoad: "k" }],
  [false, true, { BM: 32, BN: 32, BK: 16, TM: 4, TN: 4, gen: 2, buffers: 2, transposeLoad: "k", warpN: 8 }],
  [false, false, { BM: 64, BN: 32, BK: 8, TM: 8, TN: 4, gen: 2, buffers: 2 }],
];
Deno.test({
  name: "matmulWgsl() generation 2 matches a float64 product in every layout on ragged shapes",
  ignore: noGpu,
  fn: async () => {
    for (const [transA, transB, tile] of gen2Cases) {
      const err = await run({ ...base, M: 52, N: 100, K: 36, transA, transB }, tile);
      assert.ok(err < 1e-5, `${tileName(tile)} transA=${transA} transB=${transB}: rel err ${err}`);
    }
    // Unguarded, several k-tiles: an odd tile count ends the double-buffered loop half way.
    const tile: MatmulTile = { BM: 64, BN: 64, BK: 16, TM: 4, TN: 4, gen: 2, buffers: 2, warpN: 16 };
    const err = await run({ ...base, M: 64, N: 128, K: 80, transA: false, transB: false }, tile);
    assert.ok(err < 1e-5, `${tileName(tile)} unguarded: rel err ${err}`);
  },
});

Deno.test({
  name: "matmulWgsl() runs blocks 96 wide at depth 24 (192 threads) in both generations and layouts",
  ignore: noGpu,
  fn: async () => {
    // 768 / 96 = 8 column blocks: 512 workgroups for 124M's 8192 × 768 × 768, about two full waves
    // where 128 × 128's 384 leave the second half empty.
    const tiles: MatmulTile[] = [
      { BM: 128, BN: 96, BK: 24, TM: 8, TN: 8 },
      { BM: 128, BN: 96, BK: 24, TM: 8, TN: 8, gen: 2, buffers: 2, warpN: 4 },
      { BM: 128, BN: 96, BK: 24, TM: 8, TN: 8, gen: 2, buffers: 2, warpN: 4, transposeLoad: "k" },
    ];
    for (const tile of tiles) {
      for (const transB of [false, true]) {
        for (const [M, N, K] of [[256, 192, 96], [200, 100, 52]]) {
          const err = await run({ ...base, M, N, K, transA: false, transB }, tile);
          assert.ok(err < 1e-5, `${tileName(tile)} ${M}x${N}x${K} transB=${transB}: rel err ${err}`);
        }
      }
    }
  },
});

Deno.test({
  name:
    "matmulWgsl() runs thread tiles 12 wide or tall (blocks 96 or 192) in both generations, split-K included",
  ignore: noGpu,
  fn: async () => {
    // The tiles matmul_tiles.json picks for 124M's and 345M's shapes whose sides divide by 96 or
    // 192: 8 × 12 a thread on 128 × 192 (first generation) or 128 × 96 (second, split-K), and the
    // weight gradients' 12 × 8 and 8 × 12 at depth 32; a small 12-row tile for the guarded paths.
    const g2 = { gen: 2, buffers: 1, warpN: 8 } as const;
    const tiles: MatmulTile[] = [
      { BM: 128, BN: 192, BK: 16, TM: 8, TN: 12 },
      { BM: 128, BN: 96, BK: 16, TM: 8, TN: 12, ...g2, splitK: 3 },
      { BM: 192, BN: 128, BK: 32, TM: 12, TN: 8, ...g2 },
      { BM: 128, BN: 192, BK: 32, TM: 8, TN: 12, ...g2, splitK: 2 },
      { BM: 96, BN: 64, BK: 16, TM: 12, TN: 8, gen: 2, buffers: 1, warpN: 4 },
    ];
    for (const tile of tiles) {
      for (const [transA, transB] of [[false, false], [false, true], [true, false]]) {
        for (const [M, N, K] of [[256, 192, 64], [200, 100, 52]]) {
          const err = await run({ ...base, M, N, K, transA, transB, bias: true }, tile);
          assert.ok(err < 1e-5, `${tileName(tile)} ${M}x${N}x${K} ${transA}/${transB}: rel err ${err}`);
        }
      }
    }
    assert.match(
      matmulTileError({ ...base, M: 64, N: 64, K: 64, transA: false, transB: false }, {
        BM: 64,
        BN: 64,
        BK: 16,
        TM: 16,
        TN: 4,
      })!,
      /TM\/TN must be 4, 8 or 12/,
    );
  },
});

Deno.test({
  name:
    "Tiles that slice K alike give the same product bit for bit (a new tile rule moves no training result)",
  ignore: noGpu,
  fn: async () => {
    // Every thread sums its outputs' products in k order, one fused multiply-add at a time, in any
    // block or thread shape, so only the split-K slices change the rounding: 124M's new 8 × 12
    // tiles for qkv, fc and fc_proj (no split) and its LM head dx (4 slices of 16-deep k steps,
    // as before) leave the step's numbers as they were.
    const spec: MatmulSpec = { ...base, M: 256, N: 192, K: 96, transA: false, transB: false, bias: true };
    const old = await gpuRun(spec, { BM: 128, BN: 128, BK: 16, TM: 8, TN: 8 });
    const wide = await gpuRun(spec, { BM: 128, BN: 192, BK: 16, TM: 8, TN: 12 });
    assert.deepEqual(new Uint32Array(wide.got.buffer), new Uint32Array(old.got.buffer));
    const split = { gen: 2, buffers: 1, warpN: 8, splitK: 3 } as const;
    const oldSplit = await gpuRun(spec, { BM: 128, BN: 128, BK: 16, TM: 8, TN: 8, ...split });
    const wideSplit = await gpuRun(spec, { BM: 128, BN: 96, BK: 16, TM: 8, TN: 12, ...split });
    assert.deepEqual(new Uint32Array(wideSplit.got.buffer), new Uint32Array(oldSplit.got.buffer));
  },
});

Deno.test({
  name:
    "uniformDims: shapes of one tile share one kernel, reading their sizes from the uniform, and match float64",
  ignore: noGpu,
  fn: async () => {
    const g1: MatmulTile = { BM: 32, BN: 32, BK: 16, TM: 4, TN: 4 };
    const g2: MatmulTile = { BM: 32, BN: 32, BK: 16, TM: 4, TN: 4, gen: 2, buffers: 2, warpN: 8 };
    const split: MatmulTile = { ...g2, buffers: 1, splitK: 3 };
    const cases: Array<[MatmulTile, Partial<MatmulSpec>]> = [
      [g1, { transB: true }],
      [{ BM: 64, BN: 64, BK: 16, TM: 4, TN: 4 }, { bias: true }],
      [{ BM: 64, BN: 64, BK: 16, TM: 4, TN: 4 }, { epilogue: "gelu", bias: true }],
      [g1, { epilogue: "residual", bias: true }],
      [g2, { transA: true }],
      [g2, { epilogue: "gelu_grad", transB: true }],
      // The weight gradient's split-K partial sums: slices of 64, 64 and 32 of K = 160.
      [split, { transA: true, epilogue: "accumulate" }],
    ];
    for (const [tile, c] of cases) {
      const a: MatmulSpec = {
        ...base,
        M: 64,
        N: 128,
        K: 160,
        transA: false,
        transB: false,
        ...c,
        uniformDims: true,
      };
      const b: MatmulSpec = { ...a, M: 128, N: 64, K: 64 };
      const [ka, kb] = [matmulKernels(a, tile)[0], matmulKernels(b, tile)[0]];
      assert.equal(ka.code, kb.code, `${tileName(tile)} ${JSON.stringify(c)}: one kernel for both shapes`);
      assert.ok(ka.code.includes("var<uniform> dims"));
      assert.deepEqual(ka.dims, [64, 128, 160, (tile.splitK ?? 1) > 1 ? 64 : 160]);
      for (const spec of [a, b]) {
        const err = await run(spec, tile);
        assert.ok(
          err < 1e-5,
          `${tileName(tile)} ${JSON.stringify(c)} ${spec.M}x${spec.N}x${spec.K}: rel err ${err}`,
        );
      }
    }
    // A guarded shape, or one with dropout (its group-1 uniform), keeps its sizes in the code.
    for (
      const spec of [
        { ...base, M: 52, N: 96, K: 160, transA: false, transB: false, uniformDims: true },
        {
          ...base,
          M: 64,
          N: 96,
          K: 160,
          transA: false,
          transB: false,
          epilogue: "residual" as const,
          dropout: { site: 0, nSites: 1 },
          uniformDims: true,
        },
      ]
    ) {
      const k = matmulKernels(spec, g2)[0];
      assert.ok(!k.code.includes("dims") && k.dims === undefined, `${JSON.stringify(spec)}: literal sizes`);
      assert.ok(await run(spec, g2) < 1e-5);
    }
  },
});

Deno.test({
  name: "matmulKernels() split-K sums its slices and applies every epilogue in the reduction",
  ignore: noGpu,
  fn: async () => {
    const tile: MatmulTile = { BM: 32, BN: 32, BK: 16, TM: 4, TN: 4, gen: 2, buffers: 2, splitK: 3 };
    const cases: Array<Partial<MatmulSpec>> = [
      { epilogue: "store", bias: true },
      { epilogue: "accumulate", transA: true },
      { epilogue: "residual", bias: true, dropout: { site: 0, nSites: 1 } },
      { epilogue: "gelu", bias: true, transB: true },
      { epilogue: "gelu_grad", transA: true, prologueA: "gelu" },
      // A prefill's MLP projection: gelu on A as it loads, bias and the residual in the reduction.
      { epilogue: "residual", bias: true, prologueA: "gelu" },
    ];
    for (const c of cases) {
      // K = 196: slices of 80, 80 and 36, the last ragged against BK.
      const spec: MatmulSpec = { ...base, M: 52, N: 100, K: 196, transA: false, transB: false, ...c };
      assert.deepEqual(matmulKernels(spec, tile).map((k) => k.grid[2]), [3, 1]);
      const err = await run(spec, tile);
      assert.ok(err < 1e-5, `${JSON.stringify(c)}: rel err ${err}`);
    }
  },
});

Deno.test({
  name: "matmulWgsl() generation 2 with f16 storage, and f16 math with split-K, match float64",
  ignore: noGpu,
  fn: async () => {
    const ctx = (await testContext())!;
    if (!ctx.hasF16) return;
    const f16 = (x: Float32Array) => Float16Array.from(x);
    // The split-K weight-gradient shape (A stored [K, M]), f16 math.
    const wgrad: MatmulSpec = {
      ...base,
      M: 64,
      N: 64,
      K: 200,
      transA: true,
      transB: false,
      dtypes: { A: "f16", B: "f16" },
      math: "f16",
    };
    const cases: Array<[MatmulSpec, MatmulTile, number]> = [
      [
        {
          ...base,
          M: 52,
          N: 100,
          K: 72,
          transA: false,
          transB: true,
          dtypes: { A: "f16", B: "f16", out: "f16" },
        },
        { BM: 64, BN: 64, BK: 16, TM: 4, TN: 4, gen: 2, buffers: 2, warpN: 8 },
        2e-3,
      ],
      [wgrad, { BM: 32, BN: 32, BK: 16, TM: 4, TN: 4, gen: 2, buffers: 2, splitK: 2 }, 5e-3],
      // k pairs (every layout; ragged M, N and K; split-K; flushing every 2 tiles).
      ...([[false, false], [false, true], [true, false], [true, true]] as const).map(([transA, transB]) =>
        [
          { ...base, M: 52, N: 100, K: 76, transA, transB, dtypes: { A: "f16", B: "f16" }, math: "f16" },
          { BM: 64, BN: 64, BK: 32, TM: 4, TN: 4, gen: 2, buffers: 2, warpN: 8, kPairs: true },
          5e-3,
        ] as [MatmulSpec, MatmulTile, number]
      ),
      [
        wgrad,
        { BM: 32, BN: 32, BK: 16, TM: 4, TN: 4, gen: 2, buffers: 1, splitK: 2, kPairs: true, flushEvery: 2 },
        5e-3,
      ],
      [
        {
          ...base,
          M: 64,
          N: 128,
          K: 96,
          transA: false,
          transB: true,
          dtypes: { A: "f16", B: "f16" },
          math: "f16",
        },
        { BM: 64, BN: 128, BK: 32, TM: 4, TN: 8, gen: 2, buffers: 1, transposeLoad: "k", kPairs: true },
        5e-3,
      ],
    ];
    for (const [spec, tile, tol] of cases) {
      const A = Float32Array.from(f16(randomFloats(spec.M * spec.K, 21)));
      const B = Float32Array.from(f16(randomFloats(spec.K * spec.N, 22)));
      const outF16 = spec.dtypes?.out === "f16";
      const mk = async (label: string, data: Float32Array, half: boolean) => {
        const bytes = half ? f16(data) : data;
        const b = await createStorage(ctx, label, bytes.byteLength);
        ctx.device.queue.writeBuffer(b, 0, bytes.buffer as ArrayBuffer, 0, bytes.byteLength);
        return b;
      };
      const bufs: Record<string, GPUBuffer> = {
        A: await mk("A", A, true),
        B: await mk("B", B, true),
        out: await mk("out", new Float32Array(spec.M * spec.N), outF16),
        part: await mk("part", new Float32Array(Math.max(4, matmulScratchBytes(spec, tile) / 4)), false),
      };
      const cache = new PipelineCache(ctx);
      const ops = [];
      for (const k of matmulKernels(spec, tile)) {
        ops.push(makeOp(ctx, await cache.get("matmul16" + k.suffix, k.code), {
          label: "matmul16" + k.suffix,
          phase: "forward",
          kind: "matmul_fwd",
          views: k.bindings.map((n) => ({ buffer: bufs[n] })),
          grid: k.grid,
        }));
      }
      const enc = ctx.device.createCommandEncoder();
      encodeOps(enc, ops);
      ctx.device.queue.submit([enc.finish()]);
      const raw = await readBuffer(ctx, bufs.out);
      const got = outF16 ? Float32Array.from(new Float16Array(raw)) : new Float32Array(raw);
      const err = relNorm(got, cpuMatmul(spec, A, B));
      assert.ok(err < tol, `${tileName(tile)} ${spec.math ?? "f32"} math: rel err ${err}`);
      Object.values(bufs).forEach((b) => b.destroy());
    }
  },
});

Deno.test("matmulWgsl() refuses generation-2 fields on generation 1 and split-K outside matmulKernels", () => {
  const spec: MatmulSpec = { ...base, M: 64, N: 64, K: 256, transA: true, transB: false };
  assert.throws(() => matmulWgsl(spec, { BM: 64, BN: 64, BK: 16, TM: 4, TN: 4, buffers: 2 }), /need gen 2/);
  const split: MatmulTile = { BM: 64, BN: 64, BK: 16, TM: 4, TN: 4, gen: 2, splitK: 4 };
  assert.throws(() => matmulWgsl(spec, split), /build it with matmulKernels/);
  assert.deepEqual(matmulKernels(spec, split).map((k) => [k.suffix, k.grid]), [[".part", [1, 1, 4]], [
    ".sum",
    [16, 1, 1],
  ]]);
  assert.equal(matmulScratchBytes(spec, split), 4 * 64 * 64 * 4);
  assert.throws(
    () => matmulWgsl(spec, { BM: 64, BN: 64, BK: 16, TM: 4, TN: 4, gen: 2, warpN: 32 }),
    /cannot be cut into 1x32 warps/,
  );
});

Deno.test("chooseTile() takes the first measured rule that matches and fits, else its built-in rules", () => {
  const g2: MatmulTile = { BM: 128, BN: 128, BK: 16, TM: 8, TN: 8, gen: 2, buffers: 2, warpN: 8 };
  const split: MatmulTile = { ...g2, splitK: 4 };
  const rules: TileRule[] = [
    { M: 1024, N: 1024, K: 8192, layout: "TN", tile: split },
    { M: 1024, N: 1024, K: 8192, layout: "TN", tile: { ...g2, buffers: 1 } },
    { layout: "NN", math: "f16", tile: { ...g2, BK: 32, buffers: 1 } },
    { layout: "NN", tile: g2 },
  ];
  const dw = { M: 1024, N: 1024, K: 8192, transA: true, transB: false };
  const big = { maxWorkgroupBytes: 49152, rules };
  // Split-K only for a caller that runs matmulKernels.
  assert.deepEqual(chooseTile(dw, 256, { ...big, splitK: true }), split);
  assert.deepEqual(chooseTile(dw, 256, big), { ...g2, buffers: 1 });
  // Layout and math must agree; a double-buffered 32 KB tile needs the device's limit passed.
  const nn = { M: 8192, N: 3072, K: 1024, transA: false, transB: false };
  assert.deepEqual(chooseTile(nn, 256, big), g2);
  assert.deepEqual(
    chooseTile({ ...nn, dtypes: { A: "f16", B: "f16" }, math: "f16" }, 256, big),
    { ...g2, BK: 32, buffers: 1 },
  );
  assert.deepEqual(chooseTile(nn, 256, { rules }), { BM: 128, BN: 128, BK: 16, TM: 8, TN: 8 });
  // Too many threads for the device: no rule applies.
  assert.equal(chooseTile(nn, 128, big).gen, undefined);
  // No rules: unchanged built-in choices.
  assert.deepEqual(chooseTile({ M: 1024, N: 1024, K: 8192 }, 256, { rules: [] }), {
    BM: 128,
    BN: 64,
    BK: 16,
    TM: 8,
    TN: 4,
  });
});
