/**
 * Skinny matmul for decoding: out[M,N] = x[M,K] · W[K,N] (+ bias, epilogue) with M ≤ 8 rows (one
 * per stream). The tiled matmul wastes most of its block and, with few column blocks, leaves the
 * GPU idle; decoding is bound by reading W once. Here each workgroup streams a slice of K for 128
 * columns (coalesced vec4 loads, k-groups summed in workgroup memory), split over enough
 * workgroups to fill the GPU, and a second small kernel sums the K-splits and applies the epilogue.
 */

import { GELU_WGSL } from "./common.ts";
import { STATE_WORDS } from "./sample.ts";

/** Fused work of the reduce kernel. */
export type GemvEpilogue = "store" | "residual" | "gelu";

/** A skinny matmul. */
export interface GemvSpec {
  M: number;
  N: number;
  K: number;
  bias: boolean;
  epilogue: GemvEpilogue;
  /** Workgroups along K (each sums a contiguous slice). */
  KS: number;
  /** Fuse the preceding LayerNorm: x is the raw residual stream, normalised on the fly (bindings lnw, lnb). */
  ln?: boolean;
  /** Also append the key and value columns of this qkv output to the KV cache at each stream's position. */
  kv?: { H: number; D: number; Tmax: number };
}

/** Largest M this kernel serves. */
export const GEMV_MAX_ROWS = 8;

/** K-splits that give about `target` workgroups (two per SM on an H200). */
export function chooseKSplit(N: number, K: number, target = 264): number {
  const colBlocks = Math.ceil(N / 128);
  return Math.max(1, Math.min(Math.ceil(target / colBlocks), Math.floor(K / 32)));
}

function kGroups(M: number): number {
  return M <= 4 ? 8 : 4;
}

/** Partial sums: part[ks, m, n]. Grid (ceil(N/128), KS). */
export function gemvPartialWgsl(s: GemvSpec): string {
  if (s.M < 1 || s.M > GEMV_MAX_ROWS) {
    throw new RangeError(`Gemv serves 1 to ${GEMV_MAX_ROWS} rows, got ${s.M}`);
  }
  if (s.N % 4 !== 0) throw new RangeError(`Gemv N ${s.N} must be a multiple of 4`);
  const KG = kGroups(s.M), N4 = s.N / 4, Kc = Math.ceil(s.K / s.KS), T = 32 * KG;
  const rows = [...Array(s.M).keys()];
  // LayerNorm prologue: every workgroup computes each row's mean and rstd (two passes, as the
  // LayerNorm kernel does), then normalises x as it reads it.
  const lnReduce = (v: string) =>
    `${rows.map((m) => `lns[${m * T}u + tid] = ${v}${m};`).join(" ")}
  workgroupBarrier();
  for (var st = ${T / 2}u; st > 0u; st = st >> 1u) {
    if (tid < st) { ${
      rows.map((m) => `lns[${m * T}u + tid] = lns[${m * T}u + tid] + lns[${m * T}u + tid + st];`).join(" ")
    } }
    workgroupBarrier();
  }`;
  const prologue = !s.ln ? "" : `
  ${rows.map((m) => `var su${m} = 0.0;`).join(" ")}
  for (var k = tid; k < ${s.K}u; k = k + ${T}u) { ${
    rows.map((m) => `su${m} = su${m} + x[${m * s.K}u + k];`).join(" ")
  } }
  ${lnReduce("su")}
  ${rows.map((m) => `let mean${m} = lns[${m * T}u] / ${s.K}.0;`).join(" ")}
  workgroupBarrier();
  ${rows.map((m) => `var sq${m} = 0.0;`).join(" ")}
  for (var k = tid; k < ${s.K}u; k = k + ${T}u) {
    ${
    rows.map((m) => `let d${m} = x[${m * s.K}u + k] - mean${m}; sq${m} = sq${m} + d${m} * d${m};`).join(" ")
  }
  }
  ${lnReduce("sq")}
  ${rows.map((m) => `let rstd${m} = inverseSqrt(lns[${m * T}u] / ${s.K}.0 + 1e-5);`).join(" ")}`;
  const xin = (m: number) =>
    s.ln ? `(x[${m * s.K}u + k] - mean${m}) * rstd${m} * lnw[k] + lnb[k]` : `x[${m * s.K}u + k]`;
  return `
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> W: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> part: array<vec4<f32>>;
${s.ln ? "@group(0) @binding(3) var<storage, read> lnw: array<f32>;" : ""}
${s.ln ? "@group(0) @binding(4) var<storage, read> lnb: array<f32>;" : ""}
${s.ln ? `var<workgroup> lns: array<f32, ${s.M * T}>;` : ""}
var<workgroup> red: array<vec4<f32>, ${KG * s.M * 32}>;
@compute @workgroup_size(${T})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let lane = tid % 32u;
  let g = tid / 32u;
  let c4 = wg.x * 32u + lane;
  let k0 = wg.y * ${Kc}u;
  let k1 = min(${s.K}u, k0 + ${Kc}u);
  ${prologue}
  ${rows.map((m) => `var acc${m} = vec4<f32>(0.0);`).join("\n  ")}
  if (c4 < ${N4}u) {
    for (var k = k0 + g; k < k1; k = k + ${KG}u) {
      let w = W[k * ${N4}u + c4];
      ${rows.map((m) => `acc${m} = fma(vec4<f32>(${xin(m)}), w, acc${m});`).join("\n      ")}
    }
  }
  ${rows.map((m) => `red[(g * ${s.M}u + ${m}u) * 32u + lane] = acc${m};`).join("\n  ")}
  workgroupBarrier();
  if (g == 0u && c4 < ${N4}u) {
    for (var m = 0u; m < ${s.M}u; m = m + 1u) {
      var t = vec4<f32>(0.0);
      for (var h = 0u; h < ${KG}u; h = h + 1u) { t = t + red[(h * ${s.M}u + m) * 32u + lane]; }
      part[(wg.y * ${s.M}u + m) * ${N4}u + c4] = t;
    }
  }
}
`;
}

/** Storage bindings of the reduce kernel, in order. */
export function gemvReduceBindings(s: GemvSpec): string[] {
  const b = ["part", "out"];
  if (s.bias) b.push("bias");
  if (s.epilogue === "residual") b.push("res");
  if (s.epilogue === "gelu") b.push("out2");
  if (s.kv) b.push("state", "kc", "vc");
  return b;
}

/** Sums the K-splits and applies bias and the epilogue. Grid (ceil(M·N4/64)). */
export function gemvReduceWgsl(s: GemvSpec): string {
  const N4 = s.N / 4;
  const rw = new Set(["out", "out2", "kc", "vc"]);
  const decl = gemvReduceBindings(s).map((n, i) =>
    `@group(0) @binding(${i}) var<storage, ${rw.has(n) ? "read_write" : "read"}> ${n}: array<${
      n === "state" ? "u32" : "vec4<f32>"
    }>;`
  );
  let kv = "";
  if (s.kv) {
    const D4 = s.kv.D / 4, C4 = s.kv.H * D4;
    if (s.N !== 3 * s.kv.H * s.kv.D || s.epilogue !== "store") {
      throw new RangeError(
        `Gemv KV append needs a qkv output of ${3 * s.kv.H * s.kv.D} columns and the store epilogue`,
      );
    }
    kv = `
  let m = i / ${N4}u;
  let c = i % ${N4}u;
  if (c >= ${C4}u) {
    let c2 = (c - ${C4}u) % ${C4}u;
    let dst = ((m * ${s.kv.H}u + c2 / ${D4}u) * ${s.kv.Tmax}u + state[m * ${STATE_WORDS}u + 1u]) * ${D4}u + c2 % ${D4}u;
    if (c >= ${2 * C4}u) { vc[dst] = v; } else { kc[dst] = v; }
  }`;
  }
  return `
${decl.join("\n")}
${s.epilogue === "gelu" ? GELU_WGSL : ""}
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  if (i >= ${s.M * N4}u) { return; }
  var v = vec4<f32>(0.0);
  for (var ks = 0u; ks < ${s.KS}u; ks = ks + 1u) { v = v + part[ks * ${s.M * N4}u + i]; }
  ${s.bias ? `v = v + bias[i % ${N4}u];` : ""}
  ${
    s.epilogue === "residual"
      ? "out[i] = res[i] + v;"
      : s.epilogue === "gelu"
      ? "out[i] = v;\n  out2[i] = gelu4(v);"
      : "out[i] = v;"
  }${kv}
}
`;
}
