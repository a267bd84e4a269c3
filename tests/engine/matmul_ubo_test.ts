/**
 * The CPU adapters' uniform-buffer matmul (engine/kernels/matmul_ubo.ts) against the tiled kernel of
 * engine/kernels/matmul.ts on the same inputs: bit for bit in both forms (lanes over N, lanes over M),
 * in one dispatch and split into chunks, with every epilogue (dropout included) and the GELU
 * prologue; within float tolerance where the accumulate epilogue spans several K chunks.
 */

import assert from "node:assert/strict";
import { readFloats } from "../../engine/device.ts";
import { chooseTile, matmulKernels, type MatmulSpec } from "../../engine/kernels/matmul.ts";
import { type UboMatmulLimits, uboMatmulPlan } from "../../engine/kernels/matmul_ubo.ts";
import { dropThreshold } from "../../model/rng.ts";
import { encodeOps, makeOp, type Op, PipelineCache } from "../../engine/ops.ts";
import { noGpu, randomFloats, relNorm, testContext } from "../_helpers.ts";

function buffer(ctx: GPUDevice, data: Float32Array): GPUBuffer {
  const b = ctx.createBuffer({
    size: data.byteLength,
    usage: GPUBufferUsage.STORAGE | GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_SRC |
      GPUBufferUsage.COPY_DST,
  });
  ctx.queue.writeBuffer(b, 0, data.buffer as ArrayBuffer, data.byteOffset, data.byteLength);
  return b;
}

/** Outputs (out, out2) of the tiled kernel and of the uniform-buffer plan, and the plan's dispatch count. */
async function both(spec: MatmulSpec, maxUniformBytes: number) {
  const ctx = (await testContext())!;
  const d = ctx.device;
  const lim: UboMatmulLimits = {
    maxUniformBytes,
    uniformAlign: d.limits.minUniformBufferOffsetAlignment,
    storageAlign: d.limits.minStorageBufferOffsetAlignment,
  };
  const plan = uboMatmulPlan(spec, lim);
  if (typeof plan === "string") throw new Error(plan);
  const data: Record<string, Float32Array> = {
    A: randomFloats(spec.M * spec.K, 1),
    B: randomFloats(spec.K * spec.N, 2),
    bias: randomFloats(spec.N, 3),
    res: randomFloats(spec.M * spec.N, 4),
    aux: randomFloats(spec.M * spec.N, 5),
    out: randomFloats(spec.M * spec.N, 6),
    out2: new Float32Array(spec.M * spec.N),
  };
  const u = new Uint32Array(4);
  u[0] = 0x2468ace;
  u[1] = dropThreshold(0.25);
  new Float32Array(u.buffer)[2] = 1 / 0.75;
  const uniform = d.createBuffer({ size: 16, usage: GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST });
  d.queue.writeBuffer(uniform, 0, u);
  const cache = new PipelineCache(ctx);
  const results = [];
  for (const which of ["tiled", "ubo"]) {
    const bufs: Record<string, GPUBuffer> = {};
    for (const [n, v] of Object.entries(data)) bufs[n] = buffer(d, v);
    const ops: Op[] = [];
    if (which === "tiled") {
      for (const k of matmulKernels(spec, chooseTile(spec))) {
        ops.push(makeOp(ctx, await cache.get("tiled", k.code), {
          label: "tiled",
          phase: "forward",
          kind: "matmul_fwd",
          views: k.bindings.map((n) => ({ buffer: bufs[n] })),
          grid: k.grid,
          uniform: k.uniform ? uniform : undefined,
        }));
      }
    } else {
      for (const k of plan) {
        ops.push(makeOp(ctx, await cache.get("ubo", k.code), {
          label: "ubo",
          phase: "forward",
          kind: "matmul_fwd",
          views: k.bindings.map((n) => ({ buffer: bufs[n], ...k.ranges[n] })),
          grid: k.grid,
          uniform: k.uniform ? uniform : undefined,
        }));
      }
    }
    const enc = d.createCommandEncoder();
    encodeOps(enc, ops);
    d.queue.submit([enc.finish()]);
    results.push({ out: await readFloats(ctx, bufs.out), out2: await readFloats(ctx, bufs.out2) });
    Object.values(bufs).forEach((b) => b.destroy());
  }
  uniform.destroy();
  return { tiled: results[0], ubo: results[1], dispatches: plan.length, operand: plan[0].operand };
}

const same = (a: Float32Array, b: Float32Array, what: string) => {
  let diff = 0;
  for (let i = 0; i < a.length; i++) if (!Object.is(a[i], b[i])) diff++;
  assert.equal(diff, 0, `${what}: ${diff} of ${a.length} elements differ`);
};

const base = { bias: false, epilogue: "store" as const };

Deno.test({
  name: "uboMatmulPlan() is bit-identical to the tiled kernel in every layout it serves, whole and chunked",
  ignore: noGpu,
  fn: async () => {
    const cases: Array<[Partial<MatmulSpec>, string]> = [
      [{ transA: false, transB: true }, "A"], // the LM head forward
      [{ transA: false, transB: false }, "A"],
      [{ transA: true, transB: false }, "B"], // the LM head's weight gradient
    ];
    for (const [layout, operand] of cases) {
      for (const maxBytes of [65536, 2048]) {
        const spec = { ...base, M: 64, N: 48, K: 96, transA: false, transB: false, ...layout } as MatmulSpec;
        const r = await both(spec, maxBytes);
        assert.equal(r.operand, operand);
        if (maxBytes === 2048) assert.ok(r.dispatches > 1, `chunked into ${r.dispatches}`);
        same(r.ubo.out, r.tiled.out, `${JSON.stringify(layout)} max ${maxBytes} B`);
      }
    }
    // Lanes over M when A's rows exceed the uniform binding (the LM head's input gradient), in K chunks.
    const dx = { ...base, M: 32, N: 16, K: 512, transA: false, transB: false } as MatmulSpec;
    const r = await both(dx, 4096);
    assert.equal(r.operand, "B");
    assert.ok(r.dispatches >= 4, `${r.dispatches} K chunks`);
    same(r.ubo.out, r.tiled.out, "lanes over M, K chunks");
  },
});

Deno.test({
  name: "uboMatmulPlan() applies every epilogue and the GELU prologue as the tiled kernel does",
  ignore: noGpu,
  fn: async () => {
    const epilogues: Array<Partial<MatmulSpec>> = [
      { bias: true, epilogue: "gelu" },
      { bias: true, epilogue: "residual", dropout: { site: 0, nSites: 1 } },
      { epilogue: "gelu_grad" },
      { epilogue: "accumulate" },
      { epilogue: "store", prologueA: "gelu" },
    ];
    for (const e of epilogues) {
      for (const transA of [false, true]) {
        for (const maxBytes of [65536, 2048]) {
          const spec = { ...base, M: 64, N: 32, K: 64, transA, transB: false, ...e } as MatmulSpec;
          const r = await both(spec, maxBytes);
          const what = `${JSON.stringify(e)} transA=${transA} max ${maxBytes} B (${r.dispatches} dispatches)`;
          if (e.epilogue === "accumulate" && transA && r.dispatches > 1) {
            // Over several K chunks the chain starts from out's prior value: rounding differs.
            assert.ok(relNorm(r.ubo.out, r.tiled.out) < 1e-6, what);
          } else same(r.ubo.out, r.tiled.out, what);
          if (e.epilogue === "gelu") same(r.ubo.out2, r.tiled.out2, `${what} out2`);
        }
      }
    }
  },
});

Deno.test("uboMatmulPlan() refuses what it cannot compute", () => {
  const lim = { maxUniformBytes: 65536, uniformAlign: 256, storageAlign: 256 };
  const spec = { ...base, M: 64, N: 64, K: 64, transA: true, transB: true } as MatmulSpec;
  assert.equal(typeof uboMatmulPlan(spec, lim), "string");
  assert.equal(typeof uboMatmulPlan({ ...spec, transA: false, K: 62 }, lim), "string");
  assert.equal(typeof uboMatmulPlan({ ...spec, transA: false, dtypes: { A: "f16" } }, lim), "string");
  assert.notEqual(typeof uboMatmulPlan({ ...spec, transA: false }, lim), "string");
});
