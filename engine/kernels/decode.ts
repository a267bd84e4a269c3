/**
 * Kernels of incremental decoding with a KV cache. Positions and tokens live on the GPU in the
 * per-stream state buffer (see sample.ts), so several decode steps run in one submission with no
 * readback: embed the current token at its position, append its key and value to the cache, and
 * attend over the cache up to that position.
 *
 * Cache layout per layer: k and v each (slots, H, Tmax, D). A decode row is not its cache slot:
 * row r's slot is in its state (word STATE_SLOT), so rows stay dense as streams come and go
 * while their caches stay put.
 */

import { treeReduce } from "./common.ts";

import { STATE_SLOT, STATE_WORDS } from "./sample.ts";

/** Sizes of the decode kernels. */
export interface DecodeSpec {
  /** Rows decoded together. */
  S: number;
  H: number;
  D: number;
  /** Cache length (the model's n_positions). */
  Tmax: number;
}

/** x[s] = wte[token[s]] + wpe[pos[s]]. Grid (ceil(S·C4/64)). */
export function embedDecodeWgsl(s: DecodeSpec): string {
  const C4 = (s.H * s.D) / 4;
  return `
@group(0) @binding(0) var<storage, read> state: array<u32>;
@group(0) @binding(1) var<storage, read> wte: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> wpe: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> x: array<vec4<f32>>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let g = gid.x;
  if (g >= ${s.S * C4}u) { return; }
  let st = (g / ${C4}u) * ${STATE_WORDS}u;
  let c = g % ${C4}u;
  x[g] = wte[state[st] * ${C4}u + c] + wpe[state[st + 1u] * ${C4}u + c];
}
`;
}

/**
 * Writes keys and values from qkv rows (3C wide) into the cache. `append`: row r is a decode row's
 * current token, written at its position in its slot (binding 0 is the state buffer; rows = S).
 * `prefill`: B prompts of Tb rows each; rows t < len of prompt b go to positions t of its slot
 * (binding 0 is sel, SEL_WORDS per prompt: [source row, slot, len, state row]; rows = B·Tb).
 * Grid (ceil(rows·C4/64)).
 */
export function kvWriteWgsl(
  s: DecodeSpec,
  mode: { append: true } | { prefill: { B: number; Tb: number } },
): string {
  const D4 = s.D / 4, C4 = s.H * D4;
  const append = "append" in mode;
  const rows = append ? s.S : mode.prefill.B * mode.prefill.Tb;
  const Tb = append ? 1 : mode.prefill.Tb;
  const head = append
    ? `let slot = sel[row * ${STATE_WORDS}u + ${STATE_SLOT}u];
  let pos = sel[row * ${STATE_WORDS}u + 1u];`
    : `let b = row / ${Tb}u;
  let pos = row % ${Tb}u;
  if (pos >= sel[b * ${SEL_WORDS}u + 2u]) { return; }
  let slot = sel[b * ${SEL_WORDS}u + 1u];`;
  return `
@group(0) @binding(0) var<storage, read> sel: array<u32>;
@group(0) @binding(1) var<storage, read> qkv: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> kc: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> vc: array<vec4<f32>>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
  let g = gid.x + gid.y * nwg.x * 64u;
  let row = g / ${C4}u;
  if (row >= ${rows}u) { return; }
  ${head}
  let c = g % ${C4}u;
  let dst = ((slot * ${s.H}u + c / ${D4}u) * ${s.Tmax}u + pos) * ${D4}u + c % ${D4}u;
  kc[dst] = qkv[row * ${3 * C4}u + ${C4}u + c];
  vc[dst] = qkv[row * ${3 * C4}u + ${2 * C4}u + c];
}
`;
}

/** u32 words per prompt of a batched prefill's selection buffer: [source row, slot, len, state row]. */
export const SEL_WORDS = 4;

const WG = 256;

/**
 * One query per (row, head) against its slot's cache up to the row's position: scores in workgroup
 * memory, max and sum by reduction, then the weighted sum of values by (column, key group).
 * Grid (S, H).
 */
export function attentionDecodeWgsl(s: DecodeSpec, fused?: { KS: number }): string {
  const D4 = s.D / 4, C4 = s.H * D4, G = WG / D4; // key groups for the output reduction
  if (WG % D4 !== 0) throw new RangeError(`Head size ${s.D} does not divide the decode workgroup`);
  const scale = 1 / Math.sqrt(s.D);
  const N4 = 3 * C4;
  // Fused: the qkv gemv's K-split sums of this row and head (as gemvReduceWgsl adds them, in the
  // same order, so the values are the same), the query kept here, the key and value appended.
  const sum = (col: string) =>
    fused!.KS <= 64
      ? [...Array(fused!.KS).keys()].map((ks) => `v = v + qkvp[${ks * s.S * N4}u + sidx * ${N4}u + ${col}];`)
        .join(" ")
      : `for (var ks = 0u; ks < ${
        fused!.KS
      }u; ks = ks + 1u) { v = v + qkvp[(ks * ${s.S}u + sidx) * ${N4}u + ${col}]; }`;
  const prologue = !fused ? "" : `
  if (tid < ${3 * D4}u) {
    let which = tid / ${D4}u;
    let c = tid % ${D4}u;
    let col = which * ${C4}u + h * ${D4}u + c;
    var v = vec4<f32>(0.0);
    ${sum("col")}
    v = v + bias[col];
    if (which == 0u) { qs[c] = v; } else {
      let dst = (cb + n - 1u) * ${D4}u + c;
      if (which == 1u) { kc[dst] = v; } else { vc[dst] = v; }
    }
  }
  storageBarrier();
  workgroupBarrier();`;
  const bindings = fused
    ? `@group(0) @binding(0) var<storage, read> state: array<u32>;
@group(0) @binding(1) var<storage, read> qkvp: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> bias: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> kc: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> vc: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> y: array<vec4<f32>>;
var<workgroup> qs: array<vec4<f32>, ${D4}>;`
    : `@group(0) @binding(0) var<storage, read> state: array<u32>;
@group(0) @binding(1) var<storage, read> qkv: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> kc: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> vc: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> y: array<vec4<f32>>;`;
  const q = (c: string) => fused ? `qs[${c}]` : `qkv[qb + ${c}]`;
  return `
${bindings}
var<workgroup> sc: array<f32, ${s.Tmax}>;
var<workgroup> red: array<f32, ${WG}>;
var<workgroup> part: array<vec4<f32>, ${WG}>;
@compute @workgroup_size(${WG})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let sidx = wg.x;
  let h = wg.y;
  let n = state[sidx * ${STATE_WORDS}u + 1u] + 1u;
  let slot = state[sidx * ${STATE_WORDS}u + ${STATE_SLOT}u];
  ${fused ? "" : `let qb = sidx * ${3 * C4}u + h * ${D4}u;`}
  let cb = (slot * ${s.H}u + h) * ${s.Tmax}u;${prologue}
  var m = -3.0e38;
  for (var j = tid; j < n; j = j + ${WG}u) {
    let kb = (cb + j) * ${D4}u;
    // Written out (a WGSL loop keeps its loads one at a time); the same additions in the same order.
    var d = 0.0;
    ${[...Array(D4).keys()].map((c) => `d = d + dot(${q(`${c}u`)}, kc[kb + ${c}u]);`).join(" ")}
    d = d * ${scale};
    sc[j] = d;
    m = max(m, d);
  }
  red[tid] = m;
  workgroupBarrier();
  ${treeReduce("red", WG, "max")}
  let mx = red[0];
  workgroupBarrier();
  var z = 0.0;
  for (var j = tid; j < n; j = j + ${WG}u) { let p = exp(sc[j] - mx); sc[j] = p; z = z + p; }
  red[tid] = z;
  workgroupBarrier();
  ${treeReduce("red", WG, "+")}
  let zs = red[0];
  let c = tid % ${D4}u;
  let grp = tid / ${D4}u;
  var acc = vec4<f32>(0.0);
  // Four keys' value loads in flight per trip, added in key order as one at a time would.
  var j = grp;
  for (; j + ${3 * G}u < n; j = j + ${4 * G}u) {
    ${[0, 1, 2, 3].map((u) => `let v${u} = vc[(cb + j + ${u * G}u) * ${D4}u + c];`).join(" ")}
    ${[0, 1, 2, 3].map((u) => `acc = acc + sc[j + ${u * G}u] * v${u};`).join(" ")}
  }
  for (; j < n; j = j + ${G}u) { acc = acc + sc[j] * vc[(cb + j) * ${D4}u + c]; }
  part[tid] = acc;
  workgroupBarrier();
  if (grp == 0u) {
    var tot = vec4<f32>(0.0);
    for (var g = 0u; g < ${G}u; g = g + 1u) { tot = tot + part[g * ${D4}u + c]; }
    y[sidx * ${C4}u + h * ${D4}u + c] = tot / zs;
  }
}
`;
}

/** u32 words per row of the state remap table: [source row or REMAP_NEW, unused ×7, new state ×STATE_WORDS]. */
export const REMAP_WORDS = 2 * STATE_WORDS;
/** Source marker of a remap entry that takes the state written in its table entry. */
export const REMAP_NEW = 0xffffffff;

/**
 * The start of a chunk of steps, with the GPU's state authoritative: state row i becomes the row
 * of `prev` (a copy of the state as the work before left it) that entry i names, or, for
 * REMAP_NEW, the state written in the entry; the steps-written word is zeroed either way. This is how
 * rows move when streams end and new ones join without the CPU reading the state first, so a
 * chunk can be queued while the one before is still running. One entry per state row.
 * Grid (ceil(rows/64)).
 */
export function stateRemapWgsl(): string {
  return `
@group(0) @binding(0) var<storage, read> prev: array<u32>;
@group(0) @binding(1) var<storage, read> table: array<u32>;
@group(0) @binding(2) var<storage, read_write> state: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  if (i >= arrayLength(&table) / ${REMAP_WORDS}u) { return; }
  let e = i * ${REMAP_WORDS}u;
  let src = table[e];
  for (var w = 0u; w < ${STATE_WORDS}u; w = w + 1u) {
    var v = table[e + ${STATE_WORDS}u + w];
    if (src != ${REMAP_NEW}u) { v = prev[src * ${STATE_WORDS}u + w]; }
    if (w == 3u) { v = 0u; }
    state[i * ${STATE_WORDS}u + w] = v;
  }
}
`;
}
