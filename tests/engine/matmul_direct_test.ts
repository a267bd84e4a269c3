/**
 * The CPU adapters' direct matmul (engine/kernels/matmul_direct.ts: no workgroup memory, no
 * barriers) against the tiled kernel of engine/kernels/matmul.ts on the same inputs: bit for bit in
 * every layout, with every epilogue (dropout included), the GELU prologue and f16 storage.
 */

import assert from "node:assert/strict";
import { readFloats } from "../../engine/device.ts";
import {
  chooseTile,
  type MatmulKernel,
  matmulKernels,
  type MatmulSpec,
} from "../../engine/kernels/matmul.ts";
import { matmulDirectError, matmulDirectKernel } from "../../engine/kernels/matmul_direct.ts";
import { dropThreshold } from "../../model/rng.ts";
import { encodeOps, makeOp, type Op, PipelineCache } from "../../engine/ops.ts";
import { noGpu, randomFloats, testContext } from "../_helpers.ts";

/** Outputs (out, out2) of the tiled kernels and of the direct one on the same random inputs. */
async function both(spec: MatmulSpec) {
  const ctx = (await testContext())!;
  const d = ctx.device;
  const f16 = new Set(Object.entries(spec.dtypes ?? {}).filter(([, t]) => t === "f16").map(([n]) => n));
  const data: Record<string, Float32Array> = {
    A: randomFloats(spec.M * spec.K, 1),
    B: randomFloats(spec.K * spec.N, 2),
    bias: randomFloats(spec.N, 3),
    res: randomFloats(spec.M * spec.N, 4),
    aux: randomFloats(spec.M * spec.N, 5),
    out: randomFloats(spec.M * spec.N, 6),
    out2: new Float32Array(spec.M * spec.N),
  };
  const upload = (name: string, v: Float32Array) => {
    const bytes = f16.has(name) ? new Uint8Array(Float16Array.from(v).buffer) : new Uint8Array(v.buffer);
    const b = d.createBuffer({
      size: Math.ceil(bytes.byteLength / 16) * 16,
      usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST,
    });
    d.queue.writeBuffer(b, 0, bytes as Uint8Array<ArrayBuffer>);
    return b;
  };
  const u = new Uint32Array(4);
  u[0] = 0x2468ace;
  u[1] = dropThreshold(0.25);
  new Float32Array(u.buffer)[2] = 1 / 0.75;
  const uniform = d.createBuffer({ size: 16, usage: GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST });
  d.queue.writeBuffer(uniform, 0, u);
  const cache = new PipelineCache(ctx);
  const results = [];
  const kernelSets: MatmulKernel[][] = [matmulKernels(spec, chooseTile(spec)), [matmulDirectKernel(spec)]];
  for (const kernels of kernelSets) {
    const bufs: Record<string, GPUBuffer> = {};
    for (const [n, v] of Object.entries(data)) bufs[n] = upload(n, v);
    const ops: Op[] = [];
    for (const k of kernels) {
      ops.push(makeOp(ctx, await cache.get("mm", k.code), {
        label: "mm",
        phase: "forward",
        kind: "matmul_fwd",
        views: k.bindings.map((n) => ({ buffer: bufs[n] })),
        grid: k.grid,
        uniform: k.uniform ? uniform : undefined,
      }));
    }
    const enc = d.createCommandEncoder();
    encodeOps(enc, ops);
    d.queue.submit([enc.finish()]);
    const read = async (n: string) =>
      f16.has(n)
        ? Float32Array.from(
          new Float16Array(await (await readFloats(ctx, bufs[n])).buffer, 0, spec.M * spec.N),
        )
        : await readFloats(ctx, bufs[n]);
    results.push({ out: await read("out"), out2: await read("out2") });
    Object.values(bufs).forEach((b) => b.destroy());
  }
  uniform.destroy();
  return { tiled: results[0], direct: results[1] };
}

const same = (a: Float32Array, b: Float32Array, what: string) => {
  let diff = 0;
  for (let i = 0; i < a.length; i++) if (!Object.is(a[i], b[i])) diff++;
  assert.equal(diff, 0, `${what}: ${diff} of ${a.length} elements differ`);
};

const base = { bias: false, epilogue: "store" as const, transA: false, transB: false };

Deno.test({
  name: "matmulDirectKernel() is bit-identical to the tiled kernel in every layout",
  ignore: noGpu,
  fn: async () => {
    for (const transA of [false, true]) {
      for (const transB of [false, true]) {
        // Shapes the tiles do not divide, and one long K.
        for (const [M, N, K] of [[36, 20, 44], [8, 12, 260]]) {
          const spec = { ...base, M, N, K, transA, transB } as MatmulSpec;
          const r = await both(spec);
          same(r.direct.out, r.tiled.out, JSON.stringify({ M, N, K, transA, transB }));
        }
      }
    }
  },
});

Deno.test({
  name:
    "matmulDirectKernel() applies every epilogue, the GELU prologue and f16 storage as the tiled kernel does",
  ignore: noGpu,
  fn: async () => {
    const ctx = (await testContext())!;
    const variants: Array<Partial<MatmulSpec>> = [
      { bias: true, epilogue: "gelu" },
      { bias: true, epilogue: "residual", dropout: { site: 0, nSites: 1 } },
      { epilogue: "gelu_grad" },
      { epilogue: "accumulate" },
      { epilogue: "store", prologueA: "gelu" },
      ...(ctx.hasF16
        ? [{ bias: true, epilogue: "gelu" as const, dtypes: { A: "f16" as const, out: "f16" as const } }]
        : []),
    ];
    for (const v of variants) {
      for (const transA of [false, true]) {
        const spec = { ...base, M: 32, N: 24, K: 40, transA, ...v } as MatmulSpec;
        const r = await both(spec);
        const what = `${JSON.stringify(v)} transA=${transA}`;
        same(r.direct.out, r.tiled.out, what);
        if (v.epilogue === "gelu") same(r.direct.out2, r.tiled.out2, `${what} out2`);
      }
    }
  },
});

Deno.test("matmulDirectError() refuses what the direct kernel cannot compute", () => {
  const spec = { ...base, M: 8, N: 8, K: 8 } as MatmulSpec;
  assert.equal(matmulDirectError(spec), null);
  assert.match(matmulDirectError({ ...spec, K: 6 })!, /multiples of 4/);
  assert.match(matmulDirectError({ ...spec, M: 10 })!, /multiples of 4/);
  assert.match(matmulDirectError({ ...spec, math: "f16" })!, /f16 math/);
  assert.throws(() => matmulDirectKernel({ ...spec, N: 2 }), /Direct matmul/);
});
