/**
 * The LayerNorm kernels with each row's trips written out (PlanOptions kernels.layernormWritten:
 * loads kept in registers across the passes) against the loop kernels, bit for bit, and both
 * against float64: rows of C = 100 (one partial trip of 64 threads), 768 (three whole trips),
 * 1024 and 1600 (six whole trips and a partial one); the backward storing dx and adding into it.
 */

import assert from "node:assert/strict";
import { type GpuContext, readFloats } from "../../engine/device.ts";
import { encodeOps, makeOp, PipelineCache } from "../../engine/ops.ts";
import {
  colsumPartialWgsl,
  layernormBackwardWgsl,
  layernormForwardWgsl,
  reduceRowsWgsl,
  ROW_BLOCK,
} from "../../engine/kernels/layernorm.ts";
import { noGpu, randomFloats, relNorm, testContext, upload } from "../_helpers.ts";

const ROWS = 5;

async function runKernel(ctx: GpuContext, code: string, bufs: GPUBuffer[], grid: [number, number?] = [ROWS]) {
  const cache = new PipelineCache(ctx);
  const op = makeOp(ctx, await cache.get("ln", code), {
    label: "ln",
    phase: "forward",
    kind: "layernorm",
    views: bufs.map((buffer) => ({ buffer })),
    grid: grid[1] === undefined ? [grid[0]] : [grid[0], grid[1], 1],
  });
  const enc = ctx.device.createCommandEncoder();
  encodeOps(enc, [op]);
  ctx.device.queue.submit([enc.finish()]);
}

/** Row statistics and LN in float64: mean, rstd (eps 1e-5, biased variance). */
function stats64(x: Float32Array, C: number, r: number) {
  const row = Array.from(x.subarray(r * C, (r + 1) * C));
  const mean = row.reduce((a, v) => a + v, 0) / C;
  const rstd = 1 / Math.sqrt(row.reduce((a, v) => a + (v - mean) ** 2, 0) / C + 1e-5);
  return { row, mean, rstd };
}

Deno.test({
  name:
    "LayerNorm forward and backward with the rows' trips written out equal the loop kernels bit for bit, and float64",
  ignore: noGpu,
  fn: async () => {
    const ctx = (await testContext())!;
    for (const C of [100, 768, 1024, 1600]) {
      const x = randomFloats(ROWS * C, C), w = randomFloats(C, C + 1), b = randomFloats(C, C + 2);
      const dy = randomFloats(ROWS * C, C + 3), dx0 = randomFloats(ROWS * C, C + 4);
      // Forward: out and (mean, rstd) per row.
      const fwd = async (written: boolean) => {
        const bufs = [
          await upload(ctx, "x", x),
          await upload(ctx, "w", w),
          await upload(ctx, "b", b),
          await upload(ctx, "out", new Float32Array(ROWS * C)),
          await upload(ctx, "stats", new Float32Array(ROWS * 2)),
        ];
        await runKernel(ctx, layernormForwardWgsl(C, "f32", written), bufs);
        const got = { out: await readFloats(ctx, bufs[3]), stats: await readFloats(ctx, bufs[4]) };
        bufs.forEach((x) => x.destroy());
        return got;
      };
      const loops = await fwd(false), written = await fwd(true);
      assert.deepEqual(written.out, loops.out, `C ${C}: forward out`);
      assert.deepEqual(written.stats, loops.stats, `C ${C}: forward statistics`);
      const ref = new Float64Array(ROWS * C);
      for (let r = 0; r < ROWS; r++) {
        const { row, mean, rstd } = stats64(x, C, r);
        row.forEach((v, c) => (ref[r * C + c] = (v - mean) * rstd * w[c] + b[c]));
      }
      assert.ok(relNorm(loops.out, ref) < 1e-5, `C ${C}: forward rel err ${relNorm(loops.out, ref)}`);
      // Backward: dx stored, and added into dx0.
      for (const accumulate of [false, true]) {
        const bwd = async (written: boolean) => {
          const bufs = [
            await upload(ctx, "dy", dy),
            await upload(ctx, "x", x),
            await upload(ctx, "w", w),
            await upload(ctx, "stats", loops.stats),
            await upload(ctx, "dx", dx0),
          ];
          await runKernel(ctx, layernormBackwardWgsl(C, accumulate, written), bufs);
          const got = await readFloats(ctx, bufs[4]);
          bufs.forEach((x) => x.destroy());
          return got;
        };
        const a = await bwd(false), bw = await bwd(true);
        assert.deepEqual(bw, a, `C ${C}, accumulate ${accumulate}: backward dx`);
        const dref = new Float64Array(ROWS * C);
        for (let r = 0; r < ROWS; r++) {
          const { row, mean, rstd } = stats64(x, C, r);
          const g = row.map((_, c) => dy[r * C + c] * w[c]), xh = row.map((v) => (v - mean) * rstd);
          const mg = g.reduce((s, v) => s + v, 0) / C, mgx = g.reduce((s, v, c) => s + v * xh[c], 0) / C;
          g.forEach((
            v,
            c,
          ) => (dref[r * C + c] = rstd * (v - mg - xh[c] * mgx) + (accumulate ? dx0[r * C + c] : 0)));
        }
        assert.ok(
          relNorm(a, dref) < 1e-5,
          `C ${C}, accumulate ${accumulate}: dx rel err ${relNorm(a, dref)}`,
        );
      }
    }
  },
});

Deno.test({
  name:
    "the column sums with 8, 16 and 32 loads in flight per thread give the same sums bit for bit (PlanOptions kernels.columnSumUnroll)",
  ignore: noGpu,
  fn: async () => {
    const ctx = (await testContext())!;
    // 3,200 rows: 100 blocks of ROW_BLOCK, so the reduce's unrolled trips and its rest both run.
    const rows = 100 * ROW_BLOCK, N = 136, blocks = rows / ROW_BLOCK;
    const src = randomFloats(rows * N, 41);
    const sums: Float32Array[] = [];
    for (const unroll of [8, 16, 32]) {
      const s = await upload(ctx, "src", src), part = await upload(ctx, "part", new Float32Array(blocks * N));
      const out = await upload(ctx, "out", new Float32Array(N));
      await runKernel(ctx, colsumPartialWgsl(N, rows, "f32", unroll), [s, part], [
        Math.ceil(N / 4 / 64),
        blocks,
      ]);
      await runKernel(ctx, reduceRowsWgsl(N, blocks, false, unroll), [part, out], [Math.ceil(N / 4 / 64)]);
      sums.push(await readFloats(ctx, out));
      [s, part, out].forEach((b) => b.destroy());
    }
    const ref = new Float64Array(N);
    for (let r = 0; r < rows; r++) for (let c = 0; c < N; c++) ref[c] += src[r * N + c];
    assert.ok(relNorm(sums[0], ref) < 1e-5, `rel err ${relNorm(sums[0], ref)}`);
    assert.deepEqual(sums[1], sums[0], "16 loads in flight");
    assert.deepEqual(sums[2], sums[0], "32 loads in flight");
  },
});
