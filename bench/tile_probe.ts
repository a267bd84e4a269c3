/**
 * Where an f16 matmul loses its 2× (issue 9): the register-tile inner loop of a 128×128 block
 * (256 threads, 8×8 outputs each) run from workgroup memory that is filled once, so no global
 * loads, no staging and (unless asked) no barriers. Variants:
 *
 *   f32        vec4<f32> operands, f32 accumulators (the f32 matmul's loop)
 *   f16 splat  vec4<f16> operands, each A value splat across a vec4 (today's f16 loop), f16 partial
 *              sums flushed into f32 accumulators every BK
 *   f16 kp     pairs of k packed per element, one vec2<f16> multiply-add per two products (kPairs)
 *   … +bar     the same with a workgroup barrier per BK (as the real loop has)
 *   … noflush  f16 partial sums never flushed (the upper bound of fewer conversions)
 *
 * If the inner loop alone runs near the bare FMA rate (bench/fma_probe.ts), the matmul loses its
 * speed in the staging; if it does not, in the loop's own loads and instruction mix.
 *
 *   deno run -A bench/tile_probe.ts [--reps 5] [--iters 64] [--bk 16] [--threads 256|128]
 */

import { createPipeline, describeDevice, openDevice } from "../engine/device.ts";
import { makeOp } from "../engine/ops.ts";
import { GpuTimer } from "./_gpu_bench.ts";

function arg(name: string, def: string): string {
  const i = Deno.args.indexOf(`--${name}`);
  return i >= 0 && i + 1 < Deno.args.length ? Deno.args[i + 1] : def;
}

const REPS = +arg("reps", "5"), ITERS = +arg("iters", "64"), BK = +arg("bk", "16");
// 2 groups of 4 rows and of 4 columns per thread; --threads 128 halves the block's rows (64×128),
// so that a register-heavy tile still fits several blocks per SM.
const TX = 16, TY = +arg("threads", "256") / TX, WG = TX * TY, G = 2;

type Variant = { name: string; kind: "f32" | "splat" | "kp"; barrier: boolean; flush: boolean };

function wgsl(v: Variant): string {
  const L: string[] = [];
  const acc: string[] = [], fill: string[] = [], loop: string[] = [], flush: string[] = [];
  const ids = [];
  for (let g = 0; g < G; g++) for (let i = 0; i < 4; i++) for (let h = 0; h < G; h++) ids.push([g, i, h]);
  for (const [g, i, h] of ids) acc.push(`var acc${g}_${i}_${h} = vec4<f32>(0.0);`);
  if (v.kind === "f32" || v.kind === "splat") {
    const t = v.kind === "f32" ? "vec4<f32>" : "vec4<f16>";
    L.push(`var<workgroup> As: array<array<${t}, ${TY * G}>, ${BK}>;`);
    L.push(`var<workgroup> Bs: array<array<${t}, ${TX * G}>, ${BK}>;`);
    fill.push(`for (var k = 0u; k < ${BK}u; k++) {`);
    fill.push(
      `  if (tid < ${TY * G}u) { As[k][tid] = ${t}(${v.kind === "f32" ? "" : "f16"}(f32(k + tid) * 1e-3)); }`,
    );
    fill.push(
      `  if (tid < ${TX * G}u) { Bs[k][tid] = ${t}(${
        v.kind === "f32" ? "" : "f16"
      }(f32(k * 3u + tid) * 1e-3)); }`,
    );
    fill.push(`}`);
    if (v.kind === "splat") {
      for (const [g, i, h] of ids) acc.push(`var p${g}_${i}_${h} = vec4<f16>(0.0);`);
      for (const [g, i, h] of ids) {
        flush.push(
          `acc${g}_${i}_${h} = acc${g}_${i}_${h} + vec4<f32>(p${g}_${i}_${h}); p${g}_${i}_${h} = vec4<f16>(0.0);`,
        );
      }
    }
    for (let kk = 0; kk < BK; kk++) {
      for (let g = 0; g < G; g++) loop.push(`let a${kk}_${g} = As[${kk}u][${g * TY}u + ty];`);
      for (let h = 0; h < G; h++) loop.push(`let b${kk}_${h} = Bs[${kk}u][${h * TX}u + tx];`);
      for (const [g, i, h] of ids) {
        loop.push(
          v.kind === "f32"
            ? `acc${g}_${i}_${h} = fma(vec4<f32>(a${kk}_${g}[${i}]), b${kk}_${h}, acc${g}_${i}_${h});`
            : `p${g}_${i}_${h} = fma(vec4<f16>(a${kk}_${g}[${i}]), b${kk}_${h}, p${g}_${i}_${h});`,
        );
      }
    }
  } else {
    const t = "array<vec4<f16>, 2>";
    L.push(`var<workgroup> As: array<array<${t}, ${TY * G}>, ${BK / 2}>;`);
    L.push(`var<workgroup> Bs: array<array<${t}, ${TX * G}>, ${BK / 2}>;`);
    fill.push(`for (var k = 0u; k < ${BK / 2}u; k++) {`);
    fill.push(
      `  if (tid < ${TY * G}u) { As[k][tid] = ${t}(vec4<f16>(f16(f32(k + tid) * 1e-3)), vec4<f16>(0.001)); }`,
    );
    fill.push(
      `  if (tid < ${TX * G}u) { Bs[k][tid] = ${t}(vec4<f16>(f16(f32(k + tid) * 2e-3)), vec4<f16>(0.002)); }`,
    );
    fill.push(`}`);
    for (const [g, i, h] of ids) {
      for (let j = 0; j < 4; j++) acc.push(`var p${g}_${i}_${h}_${j} = vec2<f16>(0.0);`);
    }
    for (const [g, i, h] of ids) {
      const p = (j: number) => `p${g}_${i}_${h}_${j}`;
      flush.push(
        `acc${g}_${i}_${h} = acc${g}_${i}_${h} + vec4<f32>(vec4<f16>(${
          [0, 1, 2, 3].map((j) => `${p(j)}.x + ${p(j)}.y`).join(", ")
        }));`,
        [0, 1, 2, 3].map((j) => `${p(j)} = vec2<f16>(0.0);`).join(" "),
      );
    }
    for (let kk = 0; kk < BK / 2; kk++) {
      for (let g = 0; g < G; g++) loop.push(`let a${kk}_${g} = As[${kk}u][${g * TY}u + ty];`);
      for (let h = 0; h < G; h++) loop.push(`let b${kk}_${h} = Bs[${kk}u][${h * TX}u + tx];`);
      for (const [g, i, h] of ids) {
        for (let j = 0; j < 4; j++) {
          const p = `p${g}_${i}_${h}_${j}`;
          loop.push(
            `${p} = fma(a${kk}_${g}[${i >> 1}].${i % 2 ? "zw" : "xy"}, b${kk}_${h}[${j >> 1}].${
              j % 2 ? "zw" : "xy"
            }, ${p});`,
          );
        }
      }
    }
  }
  const sum = ids.map(([g, i, h]) => `acc${g}_${i}_${h}`).join(" + ");
  const partial = v.kind === "f32"
    ? ""
    : ids.map(([g, i, h]) =>
      v.kind === "kp"
        ? [0, 1, 2, 3].map((j) => `f32(p${g}_${i}_${h}_${j}.x)`).join(" + ")
        : `f32(p${g}_${i}_${h}.x)`
    ).join(" + ");
  return `${v.kind === "f32" ? "" : "enable f16;\n"}
@group(0) @binding(0) var<storage, read_write> out: array<f32>;
${L.join("\n")}
@compute @workgroup_size(${WG})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let tx = tid % ${TX}u;
  let ty = tid / ${TX}u;
  ${fill.join("\n  ")}
  workgroupBarrier();
  ${acc.join("\n  ")}
  for (var r = 0u; r < ${ITERS}u; r++) {
    ${loop.join("\n    ")}
    ${v.flush ? flush.join("\n    ") : ""}
    ${v.barrier ? "workgroupBarrier();" : ""}
  }
  let s = ${sum};
  out[wg.x * ${WG}u + tid] = s.x + s.y + s.z + s.w${partial ? ` + ${partial}` : ""};
}`;
}

const ctx = await openDevice();
console.log(describeDevice(ctx));
const groups = 132 * 16;
const out = ctx.device.createBuffer({ size: groups * WG * 4, usage: GPUBufferUsage.STORAGE });
const variants: Variant[] = [
  { name: "f32", kind: "f32", barrier: false, flush: false },
  { name: "f32 +bar", kind: "f32", barrier: true, flush: false },
  { name: "f16 splat", kind: "splat", barrier: false, flush: true },
  { name: "f16 splat noflush", kind: "splat", barrier: false, flush: false },
  { name: "f16 splat +bar", kind: "splat", barrier: true, flush: true },
  { name: "f16 kp", kind: "kp", barrier: false, flush: true },
  { name: "f16 kp noflush", kind: "kp", barrier: false, flush: false },
  { name: "f16 kp +bar", kind: "kp", barrier: true, flush: true },
];
const timer = new GpuTimer(ctx);
console.log(`timing: ${timer.method}; ${TY * 8}x128 block, 8x8 per thread, BK ${BK}, ${ITERS} passes`);
const rows: Record<string, unknown>[] = [];
for (const v of variants) {
  if (v.kind !== "f32" && !ctx.hasF16) continue;
  const pipeline = await createPipeline(ctx, `tile ${v.name}`, wgsl(v));
  const op = makeOp(ctx, pipeline, {
    label: `tile ${v.name}`,
    phase: "forward",
    kind: "elementwise",
    views: [{ buffer: out }],
    grid: [groups],
  });
  const ms = (await timer.time([op], REPS, 1)).median_ms;
  const flops = groups * WG * ITERS * BK * 64 * 2;
  const tflops = flops / (ms / 1000) / 1e12;
  rows.push({ variant: v.name, ms, tflops });
  console.log(`${v.name.padEnd(20)} ${ms.toFixed(3)} ms, ${tflops.toFixed(1)} TFLOP/s`);
}
console.log(JSON.stringify(rows));
