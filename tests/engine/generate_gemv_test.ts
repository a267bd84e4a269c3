/**
 * The decode matmuls against a float64 product: the skinny gemv in row groups (13 rows: two
 * groups, the second partial) with the LayerNorm prologue, and the LM-head gemv over a weight
 * stored [N, K], cooperative and per-thread, with and without gathering rows through sel, and
 * over that weight rounded to f16 (against the float64 product of the rounded weights).
 */

import assert from "node:assert/strict";
import { type GpuContext, readFloats } from "../../engine/device.ts";
import { encodeOps, makeOp, type Op, PipelineCache, type View } from "../../engine/ops.ts";
import {
  gemvGroupRows,
  gemvPartialWgsl,
  gemvReduceBindings,
  gemvReduceWgsl,
  gemvRowGroups,
  type GemvSpec,
  gemvTColumns,
  gemvTLanes,
  gemvTransposedWgsl,
  gemvTWgsl,
  gemvUboBlocks,
  gemvUboLayerWgsl,
  gemvUboWgsl,
  packF16,
} from "../../engine/kernels/gemv.ts";
import { noGpu, randomFloats, relNorm, testContext, upload } from "../_helpers.ts";

/** out[m, n] = Σ_k x[m, k] · w(k, n), in float64. */
function product(M: number, N: number, K: number, x: ArrayLike<number>, w: (k: number, n: number) => number) {
  const out = new Float64Array(M * N);
  for (let m = 0; m < M; m++) {
    for (let n = 0; n < N; n++) {
      let a = 0;
      for (let k = 0; k < K; k++) a += x[m * K + k] * w(k, n);
      out[m * N + n] = a;
    }
  }
  return out;
}

/** Rows of x [M, K] through a LayerNorm (eps 1e-5) of weight lnw and bias lnb, in float64; x itself without `ln`. */
function layerNorm64(
  x: Float32Array,
  M: number,
  K: number,
  lnw: Float32Array,
  lnb: Float32Array,
  ln: boolean,
) {
  const xn = new Float64Array(M * K);
  for (let m = 0; m < M; m++) {
    const row = x.subarray(m * K, (m + 1) * K);
    const mean = row.reduce((a, v) => a + v, 0) / K;
    const rstd = 1 / Math.sqrt(row.reduce((a, v) => a + (v - mean) ** 2, 0) / K + 1e-5);
    for (let k = 0; k < K; k++) xn[m * K + k] = ln ? (row[k] - mean) * rstd * lnw[k] + lnb[k] : row[k];
  }
  return xn;
}

/** A forward op of `code` over `views` (whole buffers or ranges), compiled once per code. */
async function kernelOp(
  ctx: GpuContext,
  cache: PipelineCache,
  label: string,
  code: string,
  views: Array<GPUBuffer | View>,
  grid: [number] | [number, number, number],
): Promise<Op> {
  return makeOp(ctx, await cache.get(label, code), {
    label,
    phase: "forward",
    kind: "matmul_fwd",
    views: views.map((v) => (v instanceof GPUBuffer ? { buffer: v } : v)),
    grid,
  });
}

/** Encodes `ops` in one pass and submits them. */
function submit(ctx: GpuContext, ops: Op[]): void {
  const enc = ctx.device.createCommandEncoder();
  encodeOps(enc, ops);
  ctx.device.queue.submit([enc.finish()]);
}

Deno.test({
  name:
    "gemvPartialWgsl() in row groups with the LayerNorm prologue matches a float64 product, plain, staged, unrolled 8 and in one group of up to 16 rows (bit-identical)",
  ignore: noGpu,
  fn: async () => {
    const ctx = (await testContext())!;
    const cache = new PipelineCache(ctx);
    // 13 rows: two row groups, the second partial. K = 300 in 2 splits: stretches of 128 and 22,
    // the unrolled loop and its tail. 3 rows: the wider k groups of small batches, no LayerNorm.
    // 10 rows: one workgroup for all of them (groupRows 16; with a LayerNorm that many rows
    // outgrow lavapipe's 32 KiB of workgroup memory).
    for (const [M, K, KS, ln] of [[13, 300, 2, true], [3, 200, 1, false], [10, 300, 3, false]] as const) {
      const N = 136;
      const x = randomFloats(M * K, 21), W = randomFloats(K * N, 22), bias = randomFloats(N, 23);
      const lnw = randomFloats(K, 24), lnb = randomFloats(K, 25);
      const xn = layerNorm64(x, M, K, lnw, lnb, ln);
      const ref = product(M, N, K, xn, (k, n) => W[k * N + n]).map((v, i) => v + bias[i % N]);
      const outs: Float32Array[] = [];
      const variants: Partial<GemvSpec>[] = [
        { staged: false },
        { staged: true },
        { staged: true, unroll: 8 },
        ...(ln ? [] : [{ staged: true, groupRows: 16 }]),
      ];
      for (const v of variants) {
        const spec: GemvSpec = { M, N, K, bias: true, epilogue: "store", KS, ln, ...v };
        const bufs: Record<string, GPUBuffer> = {
          x: await upload(ctx, "x", x),
          W: await upload(ctx, "W", W),
          part: await upload(ctx, "part", new Float32Array(KS * M * N)),
          out: await upload(ctx, "out", new Float32Array(M * N)),
          bias: await upload(ctx, "bias", bias),
          lnw: await upload(ctx, "lnw", lnw),
          lnb: await upload(ctx, "lnb", lnb),
        };
        const views = (names: string[]) => names.map((n) => bufs[n]);
        const partViews = views(["x", "W", "part", ...(ln ? ["lnw", "lnb"] : [])]);
        submit(ctx, [
          await kernelOp(ctx, cache, "gemv", gemvPartialWgsl(spec), partViews, [
            Math.ceil(N / 128),
            KS,
            gemvRowGroups(M, gemvGroupRows(spec)),
          ]),
          await kernelOp(ctx, cache, "gemv.sum", gemvReduceWgsl(spec), views(gemvReduceBindings(spec)), [
            Math.ceil((M * N) / 4 / 64),
          ]),
        ]);
        const got = await readFloats(ctx, bufs.out);
        const what = `M ${M} ${JSON.stringify(v)}`;
        assert.ok(relNorm(got, ref) < 1e-5, `${what}: rel err ${relNorm(got, ref)}`);
        outs.push(got);
        Object.values(bufs).forEach((b) => b.destroy());
        assert.deepEqual(got, outs[0], `${what}: sums differ from the plain kernel's`);
      }
    }
  },
});

Deno.test({
  name:
    "gemvPartialWgsl() lnOf (the previous gemv's residual reduce in its LayerNorm prologue) equals the reduce kernel then the plain LayerNorm gemv, bit for bit, and writes the reduced rows",
  ignore: noGpu,
  fn: async () => {
    const ctx = (await testContext())!;
    const cache = new PipelineCache(ctx);
    // The previous gemv's output width is this one's K: 200 (one trip of 256 threads, partial),
    // 600 (three trips, the last partial) and 512 (two whole trips); 1 to 3 rows, 1 to 5 splits.
    for (const [M, K, KSprev] of [[1, 200, 3], [3, 600, 5], [2, 512, 1]] as const) {
      const N = 136, KS = 2;
      const parts = randomFloats(KSprev * M * K, 31), res = randomFloats(M * K, 32), xb = randomFloats(K, 33);
      const W = randomFloats(K * N, 34), bias = randomFloats(N, 35);
      const lnw = randomFloats(K, 36), lnb = randomFloats(K, 37);
      const bufs: Record<string, GPUBuffer> = {
        prev: await upload(ctx, "prev", parts),
        res: await upload(ctx, "res", res),
        xb: await upload(ctx, "xb", xb),
        x: await upload(ctx, "x", new Float32Array(M * K)),
        xo: await upload(ctx, "xo", new Float32Array(M * K)),
        W: await upload(ctx, "W", W),
        part: await upload(ctx, "part", new Float32Array(KS * M * N)),
        part2: await upload(ctx, "part2", new Float32Array(KS * M * N)),
        bias: await upload(ctx, "bias", bias),
        lnw: await upload(ctx, "lnw", lnw),
        lnb: await upload(ctx, "lnb", lnb),
      };
      // The unfused pair: the previous gemv's reduce with its residual into x, then the gemv on x.
      const prev: GemvSpec = { M, N: K, K: 1, bias: true, epilogue: "residual", KS: KSprev };
      const prevViews: Record<string, GPUBuffer> = {
        part: bufs.prev,
        out: bufs.x,
        bias: bufs.xb,
        res: bufs.res,
      };
      const spec: GemvSpec = { M, N, K, bias: true, epilogue: "store", KS, ln: true };
      const fused: GemvSpec = { ...spec, lnOf: { KS: KSprev } };
      const grid: [number, number, number] = [Math.ceil(N / 128), KS, gemvRowGroups(M, gemvGroupRows(spec))];
      const b = (names: string[]) => names.map((n) => bufs[n]);
      submit(ctx, [
        await kernelOp(
          ctx,
          cache,
          "prev.sum",
          gemvReduceWgsl(prev),
          gemvReduceBindings(prev).map((n) => prevViews[n]),
          [
            Math.ceil((M * K) / 4 / 64),
          ],
        ),
        await kernelOp(ctx, cache, "gemv", gemvPartialWgsl(spec), b(["x", "W", "part", "lnw", "lnb"]), grid),
        await kernelOp(
          ctx,
          cache,
          "gemv.lnOf",
          gemvPartialWgsl(fused),
          b(["prev", "W", "part2", "lnw", "lnb", "res", "xb", "xo"]),
          grid,
        ),
      ]);
      const what = `M ${M} K ${K} KS ${KSprev}`;
      const x = await readFloats(ctx, bufs.x);
      assert.deepEqual(await readFloats(ctx, bufs.xo), x, `${what}: the reduced rows written back`);
      for (let i = 0; i < M * K; i++) {
        let v = 0;
        for (let ks = 0; ks < KSprev; ks++) v = Math.fround(v + parts[ks * M * K + i]);
        const want = Math.fround(res[i] + Math.fround(v + xb[i % K]));
        if (x[i] !== want) assert.fail(`${what}: the reduce's row value ${i} is ${x[i]}, want ${want}`);
      }
      assert.deepEqual(
        await readFloats(ctx, bufs.part2),
        await readFloats(ctx, bufs.part),
        `${what}: partial sums`,
      );
      Object.values(bufs).forEach((b) => b.destroy());
    }
  },
});

Deno.test({
  name: "gemvTWgsl() matches x · Wᵀ, cooperative and per-thread, with rows gathered through sel",
  ignore: noGpu,
  fn: async () => {
    const ctx = (await testContext())!;
    const cache = new PipelineCache(ctx);
    const N = 300, K = 64, X = 16;
    const x = randomFloats(X * K, 31), W = randomFloats(N * K, 32);
    for (
      const [M, perThread, gather] of [
        [3, false, false],
        [5, false, true],
        [3, true, true],
        [9, true, false],
        [16, false, false],
      ] as const
    ) {
      const sel = new Uint32Array(M * 4);
      const rows = Array.from({ length: M }, (_, m) => gather ? (m * 5 + 1) % X : m % X);
      rows.forEach((r, m) => (sel[m * 4] = r));
      const xs = Float32Array.from(rows.flatMap((r) => Array.from(x.subarray(r * K, (r + 1) * K))));
      const xin = gather ? x : xs;
      const bufs = {
        x: await upload(ctx, "x", xin),
        W: await upload(ctx, "W", W),
        out: await upload(ctx, "out", new Float32Array(M * N)),
        sel: await upload(ctx, "sel", sel),
      };
      const s = { M, N, K, perThread, gather: gather ? { selStride: 4 } : undefined };
      const views = [bufs.x, bufs.W, bufs.out, ...(gather ? [bufs.sel] : [])];
      submit(ctx, [
        await kernelOp(ctx, cache, "gemvT", gemvTWgsl(s), views, [Math.ceil(N / gemvTColumns(s))]),
      ]);
      const ref = product(M, N, K, xs, (k, n) => W[n * K + k]);
      const got = await readFloats(ctx, bufs.out);
      assert.ok(
        relNorm(got, ref) < 1e-5,
        `M=${M} perThread=${perThread} gather=${gather}: ${relNorm(got, ref)}`,
      );
      Object.values(bufs).forEach((b) => b.destroy());
    }
  },
});

Deno.test({
  name: "gemvTWgsl() summing its lanes by subgroup shuffles gives the workgroup-memory sums bit for bit",
  ignore: noGpu,
  fn: async () => {
    const ctx = (await testContext())!;
    if (!ctx.hasSubgroups) return console.log("not run: no subgroups on this adapter");
    const cache = new PipelineCache(ctx);
    const N = 150, X = 16;
    // K = 32: as many lanes as lavapipe's subgroups (8); K = 24: 6 vec4s over 8 lanes (two lanes
    // idle in the loop); K = 8: 2 lanes, where the butterfly runs out of lanes before values. With
    // the H200's 32-lane subgroups, K = 256 too.
    const Ks = [32, 24, 8, ...(ctx.subgroupMinSize >= 32 ? [256] : [])];
    let ran = 0;
    for (const K of Ks) {
      if (gemvTLanes(K) > ctx.subgroupMinSize) continue;
      const x = randomFloats(X * K, 71 + K), W = randomFloats(N * K, 72 + K);
      const W16 = packF16(W, 0, N * K);
      for (
        const [M, gather, f16] of [[1, false, false], [3, true, false], [9, false, true], [
          16,
          true,
          false,
        ]] as const
      ) {
        const sel = new Uint32Array(M * 4);
        const rows = Array.from({ length: M }, (_, m) => gather ? (m * 7 + 2) % X : m);
        rows.forEach((r, m) => (sel[m * 4] = r));
        const xs = Float32Array.from(rows.flatMap((r) => Array.from(x.subarray(r * K, (r + 1) * K))));
        const bufs = {
          x: await upload(ctx, "x", gather ? x : xs),
          W: await upload(ctx, "W", f16 ? W16 : W),
          out: await upload(ctx, "out", new Float32Array(M * N)),
          sel: await upload(ctx, "sel", sel),
        };
        const views = [bufs.x, bufs.W, bufs.out, ...(gather ? [bufs.sel] : [])];
        const outs: Float32Array[] = [];
        for (const shuffle of [false, true]) {
          const s = {
            M,
            N,
            K,
            gather: gather ? { selStride: 4 } : undefined,
            weights: f16 ? "f16" as const : "f32" as const,
            shuffle,
          };
          submit(ctx, [
            await kernelOp(ctx, cache, "gemvT", gemvTWgsl(s), views, [Math.ceil(N / gemvTColumns(s))]),
          ]);
          outs.push((await readFloats(ctx, bufs.out)).slice(0, M * N));
          ctx.device.queue.writeBuffer(bufs.out, 0, new Float32Array(M * N)); // the next variant writes every value
        }
        const Wr = f16 ? Float32Array.from(Float16Array.from(W)) : W;
        const ref = product(M, N, K, xs, (k, n) => Wr[n * K + k]);
        const what = `K=${K} M=${M} gather=${gather} f16=${f16}`;
        assert.ok(relNorm(outs[1], ref) < 1e-5, `${what}: rel err ${relNorm(outs[1], ref)}`);
        assert.deepEqual(outs[1], outs[0], `${what}: shuffled sums differ from the tree's`);
        Object.values(bufs).forEach((b) => b.destroy());
        ran++;
      }
    }
    assert.ok(ran > 0, `no K fits subgroups of ${ctx.subgroupMinSize}`);
  },
});

Deno.test({
  name: "gemvTWgsl() over f16 weights matches x · f16(W)ᵀ, with rows gathered through sel",
  ignore: noGpu,
  fn: async () => {
    const ctx = (await testContext())!;
    const cache = new PipelineCache(ctx);
    // K = 72: 18 vec4s over 32 lanes (some idle); N = 301 (odd: the packed rows end mid-word).
    const N = 301, K = 72, X = 16;
    const x = randomFloats(X * K, 61), W = randomFloats(N * K, 62);
    const W16 = Float32Array.from(Float16Array.from(W));
    const packed = packF16(W, 0, N * K);
    assert.equal(packed.length, Math.ceil((N * K) / 2));
    const wb = await upload(ctx, "W16", packed);
    for (const M of [1, 5, 16]) {
      for (const gather of [false, true]) {
        const sel = new Uint32Array(M * 4);
        const rows = Array.from({ length: M }, (_, m) => gather ? (m * 5 + 3) % X : m);
        rows.forEach((r, m) => (sel[m * 4] = r));
        const xs = Float32Array.from(rows.flatMap((r) => Array.from(x.subarray(r * K, (r + 1) * K))));
        const bufs = {
          x: await upload(ctx, "x", gather ? x : xs),
          out: await upload(ctx, "out", new Float32Array(M * N)),
          sel: await upload(ctx, "sel", sel),
        };
        const s = { M, N, K, gather: gather ? { selStride: 4 } : undefined, weights: "f16" as const };
        const views = [bufs.x, wb, bufs.out, ...(gather ? [bufs.sel] : [])];
        submit(ctx, [
          await kernelOp(ctx, cache, "gemvT16", gemvTWgsl(s), views, [Math.ceil(N / gemvTColumns(s))]),
        ]);
        const got = (await readFloats(ctx, bufs.out)).subarray(0, M * N); // the buffer is padded to 16 bytes
        const ref = product(M, N, K, xs, (k, n) => W16[n * K + k]);
        assert.ok(relNorm(got, ref) < 1e-5, `M=${M} gather=${gather}: rel err ${relNorm(got, ref)}`);
        // The rounding shows: against the f32 weights' product the error is the f16's, not the sums'.
        const ref32 = product(M, N, K, xs, (k, n) => W[n * K + k]);
        assert.ok(relNorm(got, ref32) > 1e-4, `M=${M} gather=${gather}: the f32 weights were read`);
        Object.values(bufs).forEach((b) => b.destroy());
      }
    }
    wb.destroy();
    assert.throws(() => gemvTWgsl({ M: 1, N, K, perThread: true, weights: "f16" }), RangeError);
  },
});

Deno.test({
  name:
    "gemvUboWgsl() over uniform blocks gives the transposed (up to 4 rows) and per-thread gemvs' logits bit for bit",
  ignore: noGpu,
  fn: async () => {
    const ctx = (await testContext())!;
    const cache = new PipelineCache(ctx);
    // N = 304 columns in blocks of 32: 10 blocks (the last partly padding) over dispatches of 3.
    const N = 304, K = 64, BC = 32, NB = 3, blocks = Math.ceil(N / BC);
    const W = randomFloats(N * K, 41), Wt = new Float32Array(K * N);
    for (let n = 0; n < N; n++) for (let k = 0; k < K; k++) Wt[k * N + n] = W[n * K + k];
    const uni = (label: string, data: Float32Array | Uint32Array) =>
      upload(ctx, label, data, GPUBufferUsage.UNIFORM);
    const align = ctx.device.limits.minUniformBufferOffsetAlignment, dispatches = Math.ceil(blocks / NB);
    const baseWords = new Uint32Array((dispatches * align) / 4);
    for (let d = 0; d < dispatches; d++) baseWords[(d * align) / 4] = d * NB;
    const wb = await uni("wb", gemvUboBlocks(W, 0, N, K, BC)), base = await uni("base", baseWords);
    const wt = await upload(ctx, "wt", Wt), wn = await upload(ctx, "wn", W);
    // 6 rows: two row groups, the second partial; the transposed gemv serves at most 4, the
    // per-thread one any number (the decode LM head of larger batches), with the same sums.
    for (const M of [1, 2, 4, 6]) {
      const x = randomFloats(M * K, 42 + M);
      const xb = await uni("x", x);
      const outT = await upload(ctx, "outT", new Float32Array(M * N));
      const outU = await upload(ctx, "outU", new Float32Array(M * N));
      const perThread = { M, N, K, perThread: true };
      const ops = [
        M <= 4
          ? await kernelOp(ctx, cache, "gemvT", gemvTransposedWgsl({ M, N, K }), [xb, wt, outT], [
            Math.ceil(N / 16 / 64),
          ])
          : await kernelOp(ctx, cache, "gemvP", gemvTWgsl(perThread), [xb, wn, outT], [
            Math.ceil(N / gemvTColumns(perThread)),
          ]),
      ];
      const code = gemvUboWgsl({ M, N, K, BC, NB });
      for (let d = 0; d < dispatches; d++) {
        ops.push(
          await kernelOp(ctx, cache, "gemvU", code, [
            { buffer: xb, offset: 0, size: M * K * 4 },
            { buffer: base, offset: d * align, size: 16 },
            outU,
            ...[...Array(NB).keys()].map((b) => ({
              buffer: wb,
              offset: Math.min(d * NB + b, blocks - 1) * K * BC * 4,
              size: K * BC * 4,
            })),
          ], [NB]),
        );
      }
      submit(ctx, ops);
      const [t, u] = [await readFloats(ctx, outT), await readFloats(ctx, outU)];
      const ref = product(M, N, K, x, (k, n) => W[n * K + k]);
      assert.ok(relNorm(u, ref) < 1e-5, `M=${M}: rel err ${relNorm(u, ref)}`);
      assert.deepEqual(u, t, `M=${M}: the uniform-buffer logits differ from the reference gemv's`);
      [xb, outT, outU].forEach((b) => b.destroy());
    }
    [wb, base, wt, wn].forEach((b) => b.destroy());
  },
});

Deno.test({
  name: "gemvUboLayerWgsl() over uniform slices matches a float64 product, with and without the LayerNorm",
  ignore: noGpu,
  fn: async () => {
    const ctx = (await testContext())!;
    const cache = new PipelineCache(ctx);
    // K = 40 in slices of 16 rows (the last of 8); 5 rows: a group of 4 and one of 1.
    const N = 24, K = 40, R = 16, M = 5;
    const W = randomFloats(K * N, 51), lnw = randomFloats(K, 52), lnb = randomFloats(K, 53);
    const x = randomFloats(M * K, 54);
    const align = ctx.device.limits.minUniformBufferOffsetAlignment / 4;
    const pad = (n: number) => Math.ceil(n / align) * align;
    for (const ln of [false, true]) {
      // Layout: x, then the LayerNorm block, then the slices, each at an aligned offset.
      const offs: number[] = [];
      let at = 0;
      const put = (n: number) => (offs.push(at), (at += pad(n)));
      put(M * K);
      put(2 * K);
      for (let r0 = 0; r0 < K; r0 += R) put(Math.min(R, K - r0) * N);
      const data = new Float32Array(at);
      data.set(x, offs[0]);
      data.set(lnw, offs[1]);
      data.set(lnb, offs[1] + K);
      for (let i = 0, r0 = 0; r0 < K; i++, r0 += R) {
        data.set(W.subarray(r0 * N, Math.min(K, r0 + R) * N), offs[2 + i]);
      }
      const buf = await upload(ctx, "ubo", data, GPUBufferUsage.UNIFORM);
      const part = await upload(ctx, "part", new Float32Array(M * N));
      const range = (o: number, n: number) => ({ buffer: buf, offset: o * 4, size: n * 4 });
      const slices = [];
      for (let i = 0, r0 = 0; r0 < K; i++, r0 += R) slices.push(range(offs[2 + i], Math.min(R, K - r0) * N));
      const views = [range(offs[0], M * K), part, ...(ln ? [range(offs[1], 2 * K)] : []), ...slices];
      submit(ctx, [await kernelOp(ctx, cache, "gemvUL", gemvUboLayerWgsl({ M, N, K, R, ln }), views, [1])]);
      const xn = layerNorm64(x, M, K, lnw, lnb, ln);
      const ref = product(M, N, K, xn, (k, n) => W[k * N + n]);
      const got = await readFloats(ctx, part);
      assert.ok(relNorm(got, ref) < 1e-5, `ln ${ln}: rel err ${relNorm(got, ref)}`);
      [buf, part].forEach((b) => b.destroy());
    }
  },
});
