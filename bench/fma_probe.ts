/**
 * Peak arithmetic through WGSL on this GPU: chains of fused multiply-adds on independent
 * accumulators in f32 and f16 (vec4 and vec2), no memory traffic but one store per thread. It
 * tells whether f16 arithmetic runs at twice the f32 rate through this stack (naga's SPIR-V, the
 * driver's compiler), which is what an f16 matmul needs to beat an f32 one. Timed by timestamp
 * queries where the adapter has them (the GPU's own time of the dispatch), else by wall clock.
 *
 *   deno run -A bench/fma_probe.ts [--iters 4096] [--reps 5] [--acc 8]
 */

import { createPipeline, describeDevice, openDevice } from "../engine/device.ts";
import { makeOp } from "../engine/ops.ts";
import { GpuTimer } from "./_gpu_bench.ts";

function arg(name: string, def: string): string {
  const i = Deno.args.indexOf(`--${name}`);
  return i >= 0 && i + 1 < Deno.args.length ? Deno.args[i + 1] : def;
}

const ITERS = +arg("iters", "4096"), REPS = +arg("reps", "5"), ACC = +arg("acc", "8"), WG = 256;

function wgsl(type: "f32" | "f16", lanes: 2 | 4): string {
  const v = `vec${lanes}<${type}>`;
  const decl = Array.from({ length: ACC }, (_, i) => `var a${i} = ${v}(${type}(${i}) * ${type}(0.001));`)
    .join("\n  ");
  const body = Array.from({ length: ACC }, (_, i) => `a${i} = fma(a${i}, m, c);`).join("\n    ");
  const sum = Array.from({ length: ACC }, (_, i) => `a${i}`).join(" + ");
  return `${type === "f16" ? "enable f16;\n" : ""}
@group(0) @binding(0) var<storage, read_write> out: array<f32>;
@compute @workgroup_size(${WG})
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let m = ${v}(${type}(0.999) + ${type}(f32(gid.x & 1u) * 0.0001));
  let c = ${v}(${type}(0.0001));
  ${decl}
  for (var i = 0u; i < ${ITERS}u; i++) {
    ${body}
  }
  let s = ${sum};
  out[gid.x] = f32(s.x) + f32(s.y);
}`;
}

const ctx = await openDevice();
console.log(describeDevice(ctx));
const groups = 132 * 64;
const out = ctx.device.createBuffer({ size: groups * WG * 4, usage: GPUBufferUsage.STORAGE });
const variants: ["f32" | "f16", 2 | 4][] = [["f32", 4], ["f32", 2], ["f16", 4], ["f16", 2]];
const rows: Record<string, unknown>[] = [];
const timer = new GpuTimer(ctx);
console.log(`timing: ${timer.method}`);
for (const [type, lanes] of variants) {
  if (type === "f16" && !ctx.hasF16) continue;
  const pipeline = await createPipeline(ctx, `fma ${type}x${lanes}`, wgsl(type, lanes));
  const op = makeOp(ctx, pipeline, {
    label: `fma ${type}x${lanes}`,
    phase: "forward",
    kind: "elementwise",
    views: [{ buffer: out }],
    grid: [groups],
  });
  const ms = (await timer.time([op], REPS, 1)).median_ms;
  const flops = groups * WG * ITERS * ACC * lanes * 2;
  const tflops = flops / (ms / 1000) / 1e12;
  rows.push({ type, lanes, ms, tflops });
  console.log(`${type} vec${lanes}: ${ms.toFixed(2)} ms, ${tflops.toFixed(1)} TFLOP/s`);
}
console.log(JSON.stringify(rows));
