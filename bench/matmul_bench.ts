/**
 * Matmul tile sweep: times the generated kernel for GPT-2's shapes (and 4096³) under several
 * tilings, to choose `chooseTile`'s rules from measurements. Timed by wall clock over many
 * dispatches in one submission, after a warmup.
 *
 *   deno run -A --no-config --no-check bench/matmul_bench.ts [--reps 20]
 */

import { createStorage, describeDevice, openDevice, readFloats } from "../gpu/device.ts";
import {
  matmulBindings,
  matmulGrid,
  type MatmulSpec,
  type MatmulTile,
  matmulWgsl,
} from "../gpu/kernels/matmul.ts";
import { encodeOps, makeOp, PipelineCache } from "../gpu/ops.ts";

const ctx = await openDevice();
console.log(describeDevice(ctx));
const reps = +(Deno.args[Deno.args.indexOf("--reps") + 1] ?? 20) || 20;
const cache = new PipelineCache(ctx);
const tiles: MatmulTile[] = [
  { BM: 128, BN: 128, BK: 8, TM: 8, TN: 8 },
  { BM: 128, BN: 128, BK: 16, TM: 8, TN: 8 },
  { BM: 64, BN: 64, BK: 16, TM: 4, TN: 4 },
  { BM: 64, BN: 128, BK: 16, TM: 4, TN: 8 },
  { BM: 128, BN: 64, BK: 16, TM: 8, TN: 4 },
];
const BT = 8192, C = 1024, V = 50304;
const shapes: Array<[string, MatmulSpec]> = [
  ["4096^3 NN", { M: 4096, N: 4096, K: 4096, transA: false, transB: false, bias: false, epilogue: "store" }],
  ["qkv fwd", { M: BT, N: 3 * C, K: C, transA: false, transB: false, bias: true, epilogue: "store" }],
  ["fc fwd gelu", { M: BT, N: 4 * C, K: C, transA: false, transB: false, bias: true, epilogue: "gelu" }],
  ["proj fwd res", { M: BT, N: C, K: 4 * C, transA: false, transB: false, bias: true, epilogue: "residual" }],
  ["lm_head NT", { M: BT, N: V, K: C, transA: false, transB: true, bias: false, epilogue: "store" }],
  ["lm_head dx NN", { M: BT, N: C, K: V, transA: false, transB: false, bias: false, epilogue: "store" }],
  ["lm_head dw TN", { M: V, N: C, K: BT, transA: true, transB: false, bias: false, epilogue: "store" }],
  ["fc dx NT", { M: BT, N: C, K: 4 * C, transA: false, transB: true, bias: false, epilogue: "store" }],
  ["fc dw TN", { M: C, N: 4 * C, K: BT, transA: true, transB: false, bias: false, epilogue: "store" }],
  ["attn_proj dw TN", { M: C, N: C, K: BT, transA: true, transB: false, bias: false, epilogue: "store" }],
];
const maxElems = Math.max(...shapes.map(([, s]) => Math.max(s.M * s.K, s.K * s.N, s.M * s.N)));
const bufs: Record<string, GPUBuffer> = {};
for (const n of ["A", "B", "out", "bias", "res", "out2", "aux"]) {
  bufs[n] = await createStorage(ctx, n, maxElems * 4);
  const fill = new Float32Array(Math.min(maxElems, 1 << 24)).map((_, i) =>
    ((i * 2654435761) % 1000) / 1000 - 0.5
  );
  for (let off = 0; off < maxElems; off += fill.length) {
    ctx.device.queue.writeBuffer(bufs[n], off * 4, fill, 0, Math.min(fill.length, maxElems - off));
  }
}
console.log("shape              tile            ms      TFLOP/s");
for (const [name, spec] of shapes) {
  for (const tile of tiles) {
    let code: string;
    if (spec.M % tile.BM || spec.N % tile.BN) continue;
    try {
      code = matmulWgsl(spec, tile);
    } catch {
      continue;
    }
    const pipeline = await cache.get(name, code);
    const views = matmulBindings(spec).map((n) => ({ buffer: bufs[n] }));
    const op = makeOp(ctx, pipeline, {
      label: name,
      phase: "forward",
      kind: "matmul_fwd",
      views,
      grid: matmulGrid(spec, tile),
    });
    const run = async (n: number) => {
      const enc = ctx.device.createCommandEncoder();
      encodeOps(enc, Array(n).fill(op));
      ctx.device.queue.submit([enc.finish()]);
      await readFloats(ctx, bufs.out, 0, 4);
    };
    await run(2);
    // The difference of two batch sizes cancels the fixed submit + readback cost.
    let t0 = performance.now();
    await run(reps);
    const t1 = performance.now() - t0;
    t0 = performance.now();
    await run(2 * reps);
    const ms = (performance.now() - t0 - t1) / reps;
    const tflops = (2 * spec.M * spec.N * spec.K) / (ms / 1000) / 1e12;
    console.log(
      `${name.padEnd(18)} ${`${tile.BM}x${tile.BN}x${tile.BK}/${tile.TM}x${tile.TN}`.padEnd(15)} ${
        ms.toFixed(3).padStart(7)
      }  ${tflops.toFixed(2).padStart(6)}`,
    );
  }
}
ctx.device.destroy();
Deno.exit(0);
