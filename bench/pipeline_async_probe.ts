/**
 * Whether createComputePipelineAsync compiles in parallel here: N distinct tiled matmul kernels
 * (different shapes, so nothing is cached) created one at a time with createComputePipeline,
 * then N others all at once with createComputePipelineAsync, each set timed whole.
 */
import { openDevice } from "../engine/device.ts";
import { chooseTile, type MatmulSpec, matmulWgsl } from "../engine/kernels/matmul.ts";

const n = Number(Deno.args[0] ?? 24);
const ctx = await openDevice();
const d = ctx.device;
const code = (i: number) => {
  const spec: MatmulSpec = {
    M: 256 + 64 * i,
    N: 768,
    K: 768,
    transA: false,
    transB: i % 2 === 1,
    bias: true,
    epilogue: "store",
  };
  return matmulWgsl(spec, chooseTile(spec, ctx.limits.maxComputeInvocationsPerWorkgroup));
};
const desc = (i: number): GPUComputePipelineDescriptor => ({
  layout: "auto",
  compute: { module: d.createShaderModule({ code: code(i) }) },
});
let t = performance.now();
for (let i = 0; i < n; i++) d.createComputePipeline(desc(i));
const sync = performance.now() - t;
t = performance.now();
await Promise.all(Array.from({ length: n }, (_, i) => d.createComputePipelineAsync(desc(n + i))));
const parallel = performance.now() - t;
console.log(
  `${ctx.adapterInfo.description}: ${n} pipelines one at a time ${sync.toFixed(0)} ms, ` +
    `${n} others at once (async) ${parallel.toFixed(0)} ms`,
);
Deno.exit(0);
