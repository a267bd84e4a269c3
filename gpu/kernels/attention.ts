/**
 * Causal multi-head attention, tiled with an online softmax (FlashAttention style): the B×H×T×T
 * score matrix is never stored. Forward keeps each row's log-sum-exp; backward recomputes the
 * probabilities from it in two kernels, one parallel over keys (dK, dV) and one over queries (dQ),
 * so no atomics are needed and results are deterministic.
 *
 * Layout: qkv is (B, T, 3C) with q, k, v in column blocks [0,C), [C,2C), [2C,3C); head h uses
 * columns h·D … h·D+D-1 of each block. Output y is (B, T, C); lse and delta are (B, H, T).
 * Attention dropout (seeded, see rng.ts) multiplies probabilities of element ((b·H+h)·T+i)·T+j.
 */

import { dropWgsl, type StorageDtype, withStorageDtypes } from "./common.ts";

/** Attention problem sizes and tiling. */
export interface AttentionSpec {
  B: number;
  T: number;
  H: number;
  /** Head size (multiple of 4). */
  D: number;
  /** Queries per workgroup (threads of the forward and dQ kernels). */
  BQ: number;
  /** Keys per tile (threads of the dK/dV kernel). */
  BKV: number;
  dropout?: { site: number; nSites: number };
  /**
   * Threads per row: 1 = the plain kernels; 2 or 4 = the subgroup variants (forward, dK/dV,
   * dQ), where S adjacent threads split a row's head dimension (needs the "subgroups" feature,
   * a subgroup size ≥ S, and D/4 divisible by S).
   */
  split?: 1 | 2 | 4;
  /** Element type of qkv and of the output y in memory (arithmetic is f32); default f32. */
  dtype?: StorageDtype;
  /** Element type of the gradients dy and dqkv in memory; default f32. */
  gradDtype?: StorageDtype;
}

/** Picks tiles that fit the device's workgroup memory. */
export function chooseAttentionTiles(
  dims: Pick<AttentionSpec, "T" | "D">,
  maxWorkgroupBytes: number,
): { BQ: number; BKV: number } {
  let BQ = 64, BKV = 32;
  const bwdBytes = (bq: number, bkv: number) => (2 * bq * dims.D + 2 * bkv * (dims.D + 4) + 2 * bq) * 4;
  while (BKV > 8 && bwdBytes(BQ, BKV) > maxWorkgroupBytes) {
    if (BQ > BKV) BQ /= 2;
    else BKV /= 2;
  }
  while (BQ > 8 && bwdBytes(BQ, BKV) > maxWorkgroupBytes) BQ /= 2;
  return { BQ: Math.min(BQ, 64), BKV };
}

/** The widest split (4, 2 or 1) that divides D/4; 1 without subgroups. */
export function chooseAttentionSplit(D: number, hasSubgroups: boolean): 1 | 2 | 4 {
  if (!hasSubgroups) return 1;
  return (D / 4) % 4 === 0 ? 4 : (D / 4) % 2 === 0 ? 2 : 1;
}

/**
 * Tiles for the split (subgroup) backward kernels: the dK/dV kernel runs BKV·S threads and keeps
 * Q/dO tiles of BQ rows plus lse/delta in workgroup memory; the dQ kernel runs BQ·S threads with
 * K/V tiles of BKV rows, as does the split forward (BQ·S threads).
 */
export function chooseSplitAttentionTiles(
  dims: Pick<AttentionSpec, "T" | "D">,
  maxWorkgroupBytes: number,
  split: number,
  maxThreads = 256,
): { BQ: number; BKV: number } {
  let BQ = 64, BKV = 64;
  while (BQ > 8 && BQ * split > maxThreads) BQ /= 2;
  while (BKV > 8 && BKV * split > maxThreads) BKV /= 2;
  while (BQ > 8 && splitKVBytes(BQ, dims.D) > maxWorkgroupBytes) BQ /= 2;
  while (BKV > 8 && splitQBytes(BKV, dims.D) > maxWorkgroupBytes) BKV /= 2;
  return { BQ, BKV };
}

/** Workgroup bytes of the split dK/dV kernel (Q, dO tiles; lse, delta). */
export const splitKVBytes = (BQ: number, D: number) => (2 * BQ * D + 2 * BQ) * 4;
/** Workgroup bytes of the split dQ kernel and of the forward (K, V tiles). */
export const splitQBytes = (BKV: number, D: number) => 2 * BKV * D * 4;

function dotExpr(a: (c: number) => string, b: (c: number) => string, D4: number): string {
  const terms: string[] = [];
  for (let c = 0; c < D4; c++) terms.push(`dot(${a(c)}, ${b(c)})`);
  return terms.join(" + ");
}

function header(s: AttentionSpec) {
  const D4 = s.D / 4, C4 = (s.H * s.D) / 4, R4 = 3 * C4;
  return { D4, C4, R4, scale: 1 / Math.sqrt(s.D) };
}

/** Bindings of the forward kernels: qkv in, y and lse out (and the dropout uniform). */
function forwardBindings(s: AttentionSpec): string {
  return `@group(0) @binding(0) var<storage, read> qkv: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> y: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> lse: array<f32>;
${s.dropout ? dropWgsl(s.dropout.nSites) : ""}`;
}

/** Bindings of the backward kernels: qkv, dy, lse, delta in, dqkv out (and the dropout uniform). */
function backwardBindings(s: AttentionSpec): string {
  return `@group(0) @binding(0) var<storage, read> qkv: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> dy: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> lse: array<f32>;
@group(0) @binding(3) var<storage, read> delta: array<f32>;
@group(0) @binding(4) var<storage, read_write> dqkv: array<vec4<f32>>;
${s.dropout ? dropWgsl(s.dropout.nSites) : ""}`;
}

const dropIdx = (s: AttentionSpec) => `((b * ${s.H}u + h) * ${s.T}u + qi) * ${s.T}u + kj`;

/** Forward: y = softmax(q kᵀ/√D, causal) v per head; writes lse. Grid (ceil(T/BQ), H, B). */
export function attentionForwardWgsl(s: AttentionSpec): string {
  return withStorageDtypes(attentionForwardPlainWgsl(s), { qkv: s.dtype, y: s.dtype });
}

/** delta[b,h,i] = dot(dy_i, y_i) over the head's columns. Grid1d over B·T·H/64. */
export function attentionDeltaWgsl(s: AttentionSpec): string {
  return withStorageDtypes(attentionDeltaPlainWgsl(s), { y: s.dtype, dy: s.gradDtype });
}

/** dK and dV. Grid (ceil(T/BKV), H, B). */
export function attentionBackwardKVWgsl(s: AttentionSpec): string {
  return withStorageDtypes(attentionBackwardKVPlainWgsl(s), {
    qkv: s.dtype,
    dy: s.gradDtype,
    dqkv: s.gradDtype,
  });
}

/** dQ. Grid (ceil(T/BQ), H, B). */
export function attentionBackwardQWgsl(s: AttentionSpec): string {
  return withStorageDtypes(attentionBackwardQPlainWgsl(s), {
    qkv: s.dtype,
    dy: s.gradDtype,
    dqkv: s.gradDtype,
  });
}

/** Forward: y = softmax(q kᵀ/√D, causal) v per head; writes lse. Grid (ceil(T/BQ), H, B). */
function attentionForwardPlainWgsl(s: AttentionSpec): string {
  if ((s.split ?? 1) > 1) return attentionForwardSplitWgsl(s);
  const { D4, C4, R4, scale } = header(s);
  const range = (n: number) => [...Array(n).keys()];
  return `
${forwardBindings(s)}
var<workgroup> Ks: array<vec4<f32>, ${s.BKV * D4}>;
var<workgroup> Vs: array<vec4<f32>, ${s.BKV * D4}>;

@compute @workgroup_size(${s.BQ})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let h = wg.y;
  let b = wg.z;
  let qi = wg.x * ${s.BQ}u + tid;
  let qok = qi < ${s.T}u;
  let qrow = (b * ${s.T}u + min(qi, ${s.T - 1}u)) * ${R4}u + h * ${D4}u;
  ${range(D4).map((c) => `let q${c} = qkv[qrow + ${c}u] * ${scale};`).join("\n  ")}
  ${range(D4).map((c) => `var o${c} = vec4<f32>(0.0);`).join("\n  ")}
  var m = -1e30;
  var l = 0.0;
  let kvEnd = min(${s.T}u, wg.x * ${s.BQ}u + ${s.BQ}u);
  for (var kt = 0u; kt < kvEnd; kt = kt + ${s.BKV}u) {
    for (var e = tid; e < ${s.BKV * D4}u; e = e + ${s.BQ}u) {
      let kr = kt + e / ${D4}u;
      let src = (b * ${s.T}u + min(kr, ${s.T - 1}u)) * ${R4}u + h * ${D4}u + e % ${D4}u;
      Ks[e] = qkv[src + ${C4}u];
      Vs[e] = qkv[src + ${2 * C4}u];
    }
    workgroupBarrier();
    let jn = u32(clamp(i32(qi) + 1 - i32(kt), 0, ${s.BKV}));
    for (var j = 0u; j < jn; j = j + 1u) {
      let kb = j * ${D4}u;
      let sc = ${dotExpr((c) => `q${c}`, (c) => `Ks[kb + ${c}u]`, D4)};
      if (sc > m) {
        let corr = exp(m - sc);
        l = l * corr;
        ${range(D4).map((c) => `o${c} = o${c} * corr;`).join(" ")}
        m = sc;
      }
      let p = exp(sc - m);
      l = l + p;
      ${s.dropout ? `let kj = kt + j; let pd = p * keep(${dropIdx(s)}, ${s.dropout.site}u);` : "let pd = p;"}
      ${range(D4).map((c) => `o${c} = fma(vec4<f32>(pd), Vs[kb + ${c}u], o${c});`).join("\n      ")}
    }
    workgroupBarrier();
  }
  if (qok) {
    let orow = (b * ${s.T}u + qi) * ${C4}u + h * ${D4}u;
    let inv = 1.0 / l;
    ${range(D4).map((c) => `y[orow + ${c}u] = o${c} * inv;`).join("\n    ")}
    lse[(b * ${s.H}u + h) * ${s.T}u + qi] = m + log(l);
  }
}
`;
}

/**
 * Forward, split variant: S adjacent threads per query, each holding D/S columns of q and the
 * output accumulator in registers; scores combined by subgroup shuffles. Key loop bounds are
 * uniform per workgroup and the causal mask is a select(). Grid (ceil(T/BQ), H, B).
 */
function attentionForwardSplitWgsl(s: AttentionSpec): string {
  const { D4, C4, R4, scale } = header(s);
  const S = s.split!, N = D4 / S, NT = s.BQ * S;
  if (D4 % S) throw new Error(`split ${S} does not divide D/4 = ${D4}`);
  const range = (n: number) => [...Array(n).keys()];
  const col = (c: number) => `${c * S}u + part`;
  return `
${forwardBindings(s)}
var<workgroup> Ks: array<vec4<f32>, ${s.BKV * D4}>;
var<workgroup> Vs: array<vec4<f32>, ${s.BKV * D4}>;

@compute @workgroup_size(${NT})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let h = wg.y;
  let b = wg.z;
  let part = tid % ${S}u;
  let qi = wg.x * ${s.BQ}u + tid / ${S}u;
  let qok = qi < ${s.T}u;
  let qrow = (b * ${s.T}u + min(qi, ${s.T - 1}u)) * ${R4}u + h * ${D4}u;
  ${range(N).map((c) => `let q${c} = qkv[qrow + ${col(c)}] * ${scale};`).join("\n  ")}
  ${range(N).map((c) => `var o${c} = vec4<f32>(0.0);`).join("\n  ")}
  var m = -1e30;
  var l = 0.0;
  let qLast = min(wg.x * ${s.BQ}u + ${s.BQ - 1}u, ${s.T - 1}u);
  for (var kt = 0u; kt <= qLast; kt = kt + ${s.BKV}u) {
    for (var e = tid; e < ${s.BKV * D4}u; e = e + ${NT}u) {
      let kr = kt + e / ${D4}u;
      let src = (b * ${s.T}u + min(kr, ${s.T - 1}u)) * ${R4}u + h * ${D4}u + e % ${D4}u;
      Ks[e] = qkv[src + ${C4}u];
      Vs[e] = qkv[src + ${2 * C4}u];
    }
    workgroupBarrier();
    let jn = min(qLast + 1u - kt, ${s.BKV}u);
    for (var j = 0u; j < jn; j = j + 1u) {
      let kb = j * ${D4}u + part;
      var sc = ${dotExpr((c) => `q${c}`, (c) => `Ks[kb + ${c * S}u]`, N)};
      ${rowSum("sc", S)}
      let kj = kt + j;
      let ok = kj <= qi;
      if (ok && sc > m) {
        let corr = exp(m - sc);
        l = l * corr;
        ${range(N).map((c) => `o${c} = o${c} * corr;`).join(" ")}
        m = sc;
      }
      let p = select(0.0, exp(sc - m), ok);
      l = l + p;
      ${s.dropout ? `let pd = p * keep(${dropIdx(s)}, ${s.dropout.site}u);` : "let pd = p;"}
      ${range(N).map((c) => `o${c} = fma(vec4<f32>(pd), Vs[kb + ${c * S}u], o${c});`).join("\n      ")}
    }
    workgroupBarrier();
  }
  if (qok) {
    let orow = (b * ${s.T}u + qi) * ${C4}u + h * ${D4}u;
    let inv = 1.0 / l;
    ${range(N).map((c) => `y[orow + ${col(c)}] = o${c} * inv;`).join("\n    ")}
    if (part == 0u) { lse[(b * ${s.H}u + h) * ${s.T}u + qi] = m + log(l); }
  }
}
`;
}

/** delta[b,h,i] = dot(dy_i, y_i) over the head's columns. One thread per (b, t, h); grid1d over B·T·H/64. */
function attentionDeltaPlainWgsl(s: AttentionSpec): string {
  const { D4, C4 } = header(s);
  return `
@group(0) @binding(0) var<storage, read> y: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> dy: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> delta: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
  let g = (wg.x + wg.y * nwg.x) * 64u + tid;
  if (g >= ${s.B * s.T * s.H}u) { return; }
  let h = g % ${s.H}u;
  let bt = g / ${s.H}u;
  let base = bt * ${C4}u + h * ${D4}u;
  var acc = 0.0;
  for (var c = 0u; c < ${D4}u; c = c + 1u) { acc = acc + dot(y[base + c], dy[base + c]); }
  let b = bt / ${s.T}u;
  let t = bt % ${s.T}u;
  delta[(b * ${s.H}u + h) * ${s.T}u + t] = acc;
}
`;
}

/** dK and dV: one thread per key, looping over the queries that see it. Grid (ceil(T/BKV), H, B). */
function attentionBackwardKVPlainWgsl(s: AttentionSpec): string {
  if ((s.split ?? 1) > 1) return attentionBackwardKVSplitWgsl(s);
  const { D4, C4, R4, scale } = header(s);
  const P = D4 + 1; // padded row stride of the per-thread rows, against bank conflicts
  const range = (n: number) => [...Array(n).keys()];
  return `
${backwardBindings(s)}
var<workgroup> Qs: array<vec4<f32>, ${s.BQ * D4}>;
var<workgroup> dOs: array<vec4<f32>, ${s.BQ * D4}>;
var<workgroup> Ls: array<f32, ${s.BQ}>;
var<workgroup> Ds: array<f32, ${s.BQ}>;
var<workgroup> Kown: array<vec4<f32>, ${s.BKV * P}>;
var<workgroup> Vown: array<vec4<f32>, ${s.BKV * P}>;

@compute @workgroup_size(${s.BKV})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let h = wg.y;
  let b = wg.z;
  let kj = wg.x * ${s.BKV}u + tid;
  let kok = kj < ${s.T}u;
  let krow = (b * ${s.T}u + min(kj, ${s.T - 1}u)) * ${R4}u + h * ${D4}u;
  let own = tid * ${P}u;
  ${range(D4).map((c) => `Kown[own + ${c}u] = qkv[krow + ${C4 + c}u];`).join("\n  ")}
  ${range(D4).map((c) => `Vown[own + ${c}u] = qkv[krow + ${2 * C4 + c}u];`).join("\n  ")}
  ${range(D4).map((c) => `var dk${c} = vec4<f32>(0.0);`).join("\n  ")}
  ${range(D4).map((c) => `var dv${c} = vec4<f32>(0.0);`).join("\n  ")}
  let lhbase = (b * ${s.H}u + h) * ${s.T}u;
  for (var qt = (wg.x * ${s.BKV}u / ${s.BQ}u) * ${s.BQ}u; qt < ${s.T}u; qt = qt + ${s.BQ}u) {
    workgroupBarrier();
    for (var e = tid; e < ${s.BQ * D4}u; e = e + ${s.BKV}u) {
      let qr = min(qt + e / ${D4}u, ${s.T - 1}u);
      Qs[e] = qkv[(b * ${s.T}u + qr) * ${R4}u + h * ${D4}u + e % ${D4}u] * ${scale};
      dOs[e] = dy[(b * ${s.T}u + qr) * ${C4}u + h * ${D4}u + e % ${D4}u];
    }
    for (var e = tid; e < ${s.BQ}u; e = e + ${s.BKV}u) {
      let qr = min(qt + e, ${s.T - 1}u);
      Ls[e] = lse[lhbase + qr];
      Ds[e] = delta[lhbase + qr];
    }
    workgroupBarrier();
    let i0 = u32(clamp(i32(kj) - i32(qt), 0, ${s.BQ}));
    let i1 = min(${s.BQ}u, ${s.T}u - qt);
    for (var i = i0; i < i1; i = i + 1u) {
      let qb = i * ${D4}u;
      let sc = ${dotExpr((c) => `Qs[qb + ${c}u]`, (c) => `Kown[own + ${c}u]`, D4)};
      let p = exp(sc - Ls[i]);
      var dp = ${dotExpr((c) => `dOs[qb + ${c}u]`, (c) => `Vown[own + ${c}u]`, D4)};
      ${
    s.dropout
      ? `let qi = qt + i; let kp = keep(${dropIdx(s)}, ${s.dropout.site}u); let pd = p * kp; dp = dp * kp;`
      : "let pd = p;"
  }
      let ds = p * (dp - Ds[i]);
      ${range(D4).map((c) => `dv${c} = fma(vec4<f32>(pd), dOs[qb + ${c}u], dv${c});`).join("\n      ")}
      ${range(D4).map((c) => `dk${c} = fma(vec4<f32>(ds), Qs[qb + ${c}u], dk${c});`).join("\n      ")}
    }
  }
  if (kok) {
    ${range(D4).map((c) => `dqkv[krow + ${C4 + c}u] = dk${c};`).join("\n    ")}
    ${range(D4).map((c) => `dqkv[krow + ${2 * C4 + c}u] = dv${c};`).join("\n    ")}
  }
}
`;
}

/** dQ: one thread per query, looping over the keys it sees. Grid (ceil(T/BQ), H, B). */
function attentionBackwardQPlainWgsl(s: AttentionSpec): string {
  if ((s.split ?? 1) > 1) return attentionBackwardQSplitWgsl(s);
  const { D4, C4, R4, scale } = header(s);
  const P = D4 + 1;
  const range = (n: number) => [...Array(n).keys()];
  return `
${backwardBindings(s)}
var<workgroup> Ks: array<vec4<f32>, ${s.BKV * D4}>;
var<workgroup> Vs: array<vec4<f32>, ${s.BKV * D4}>;
var<workgroup> Qown: array<vec4<f32>, ${s.BQ * P}>;
var<workgroup> dOown: array<vec4<f32>, ${s.BQ * P}>;

@compute @workgroup_size(${s.BQ})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let h = wg.y;
  let b = wg.z;
  let qi = wg.x * ${s.BQ}u + tid;
  let qok = qi < ${s.T}u;
  let qrow = (b * ${s.T}u + min(qi, ${s.T - 1}u)) * ${R4}u + h * ${D4}u;
  let orow = (b * ${s.T}u + min(qi, ${s.T - 1}u)) * ${C4}u + h * ${D4}u;
  let own = tid * ${P}u;
  ${range(D4).map((c) => `Qown[own + ${c}u] = qkv[qrow + ${c}u] * ${scale};`).join("\n  ")}
  ${range(D4).map((c) => `dOown[own + ${c}u] = dy[orow + ${c}u];`).join("\n  ")}
  ${range(D4).map((c) => `var dq${c} = vec4<f32>(0.0);`).join("\n  ")}
  let li = lse[(b * ${s.H}u + h) * ${s.T}u + min(qi, ${s.T - 1}u)];
  let di = delta[(b * ${s.H}u + h) * ${s.T}u + min(qi, ${s.T - 1}u)];
  let kvEnd = min(${s.T}u, wg.x * ${s.BQ}u + ${s.BQ}u);
  for (var kt = 0u; kt < kvEnd; kt = kt + ${s.BKV}u) {
    workgroupBarrier();
    for (var e = tid; e < ${s.BKV * D4}u; e = e + ${s.BQ}u) {
      let kr = min(kt + e / ${D4}u, ${s.T - 1}u);
      let src = (b * ${s.T}u + kr) * ${R4}u + h * ${D4}u + e % ${D4}u;
      Ks[e] = qkv[src + ${C4}u];
      Vs[e] = qkv[src + ${2 * C4}u];
    }
    workgroupBarrier();
    let jn = u32(clamp(i32(qi) + 1 - i32(kt), 0, ${s.BKV}));
    for (var j = 0u; j < jn; j = j + 1u) {
      let kb = j * ${D4}u;
      let sc = ${dotExpr((c) => `Qown[own + ${c}u]`, (c) => `Ks[kb + ${c}u]`, D4)};
      let p = exp(sc - li);
      var dp = ${dotExpr((c) => `dOown[own + ${c}u]`, (c) => `Vs[kb + ${c}u]`, D4)};
      ${s.dropout ? `let kj = kt + j; dp = dp * keep(${dropIdx(s)}, ${s.dropout.site}u);` : ""}
      let ds = p * (dp - di);
      ${range(D4).map((c) => `dq${c} = fma(vec4<f32>(ds), Ks[kb + ${c}u], dq${c});`).join("\n      ")}
    }
  }
  if (qok) {
    ${range(D4).map((c) => `dqkv[qrow + ${c}u] = dq${c} * ${scale};`).join("\n    ")}
  }
}
`;
}

/**
 * Sum over the S threads of a row (adjacent invocations tid ^ 1, tid ^ 2): every thread ends with
 * the full value. Must run in uniform control flow.
 */
function rowSum(v: string, S: number): string {
  const out: string[] = [];
  for (let m = 1; m < S; m *= 2) out.push(`${v} = ${v} + subgroupShuffleXor(${v}, ${m}u);`);
  return out.join(" ");
}

/**
 * dK and dV, split variant: S adjacent threads per key, thread `part` holding vec4 columns
 * c·S + part (c < D/4/S) of k, v, dk, dv in registers; scores and dP dots are combined with
 * subgroup shuffles. The query loop bounds are uniform per workgroup and the causal mask is a
 * select(), so all threads of a subgroup shuffle together. Grid (ceil(T/BKV), H, B).
 */
function attentionBackwardKVSplitWgsl(s: AttentionSpec): string {
  const { D4, C4, R4, scale } = header(s);
  const S = s.split!, N = D4 / S, NT = s.BKV * S;
  if (D4 % S) throw new Error(`split ${S} does not divide D/4 = ${D4}`);
  const range = (n: number) => [...Array(n).keys()];
  const col = (c: number) => `${c * S}u + part`;
  return `
${backwardBindings(s)}
var<workgroup> Qs: array<vec4<f32>, ${s.BQ * D4}>;
var<workgroup> dOs: array<vec4<f32>, ${s.BQ * D4}>;
var<workgroup> Ls: array<f32, ${s.BQ}>;
var<workgroup> Ds: array<f32, ${s.BQ}>;

@compute @workgroup_size(${NT})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let h = wg.y;
  let b = wg.z;
  let part = tid % ${S}u;
  let kFirst = wg.x * ${s.BKV}u;
  let kj = kFirst + tid / ${S}u;
  let kok = kj < ${s.T}u;
  let krow = (b * ${s.T}u + min(kj, ${s.T - 1}u)) * ${R4}u + h * ${D4}u;
  ${range(N).map((c) => `let k${c} = qkv[krow + ${C4}u + ${col(c)}];`).join("\n  ")}
  ${range(N).map((c) => `let v${c} = qkv[krow + ${2 * C4}u + ${col(c)}];`).join("\n  ")}
  ${range(N).map((c) => `var dk${c} = vec4<f32>(0.0);`).join("\n  ")}
  ${range(N).map((c) => `var dv${c} = vec4<f32>(0.0);`).join("\n  ")}
  let lhbase = (b * ${s.H}u + h) * ${s.T}u;
  for (var qt = (kFirst / ${s.BQ}u) * ${s.BQ}u; qt < ${s.T}u; qt = qt + ${s.BQ}u) {
    workgroupBarrier();
    for (var e = tid; e < ${s.BQ * D4}u; e = e + ${NT}u) {
      let qr = min(qt + e / ${D4}u, ${s.T - 1}u);
      Qs[e] = qkv[(b * ${s.T}u + qr) * ${R4}u + h * ${D4}u + e % ${D4}u] * ${scale};
      dOs[e] = dy[(b * ${s.T}u + qr) * ${C4}u + h * ${D4}u + e % ${D4}u];
    }
    for (var e = tid; e < ${s.BQ}u; e = e + ${NT}u) {
      let qr = min(qt + e, ${s.T - 1}u);
      Ls[e] = lse[lhbase + qr];
      Ds[e] = delta[lhbase + qr];
    }
    workgroupBarrier();
    let i0 = u32(clamp(i32(kFirst) - i32(qt), 0, ${s.BQ}));
    let i1 = min(${s.BQ}u, ${s.T}u - qt);
    for (var i = i0; i < i1; i = i + 1u) {
      let qb = i * ${D4}u + part;
      var sd = vec2<f32>(${dotExpr((c) => `Qs[qb + ${c * S}u]`, (c) => `k${c}`, N)}, ${
    dotExpr((c) => `dOs[qb + ${c * S}u]`, (c) => `v${c}`, N)
  });
      ${rowSum("sd", S)}
      let qi = qt + i;
      let p = select(0.0, exp(sd.x - Ls[i]), qi >= kj);
      ${
    s.dropout
      ? `let kp = keep(${dropIdx(s)}, ${s.dropout.site}u); let pd = p * kp; let dp = sd.y * kp;`
      : "let pd = p; let dp = sd.y;"
  }
      let ds = p * (dp - Ds[i]);
      ${range(N).map((c) => `dv${c} = fma(vec4<f32>(pd), dOs[qb + ${c * S}u], dv${c});`).join("\n      ")}
      ${range(N).map((c) => `dk${c} = fma(vec4<f32>(ds), Qs[qb + ${c * S}u], dk${c});`).join("\n      ")}
    }
  }
  if (kok) {
    ${range(N).map((c) => `dqkv[krow + ${C4}u + ${col(c)}] = dk${c};`).join("\n    ")}
    ${range(N).map((c) => `dqkv[krow + ${2 * C4}u + ${col(c)}] = dv${c};`).join("\n    ")}
  }
}
`;
}

/**
 * dQ, split variant: S adjacent threads per query, each holding D/S columns of q, dO and dq in
 * registers; K/V tiles in workgroup memory. Uniform key bounds, causal mask by select().
 * Grid (ceil(T/BQ), H, B).
 */
function attentionBackwardQSplitWgsl(s: AttentionSpec): string {
  const { D4, C4, R4, scale } = header(s);
  const S = s.split!, N = D4 / S, NT = s.BQ * S;
  if (D4 % S) throw new Error(`split ${S} does not divide D/4 = ${D4}`);
  const range = (n: number) => [...Array(n).keys()];
  const col = (c: number) => `${c * S}u + part`;
  return `
${backwardBindings(s)}
var<workgroup> Ks: array<vec4<f32>, ${s.BKV * D4}>;
var<workgroup> Vs: array<vec4<f32>, ${s.BKV * D4}>;

@compute @workgroup_size(${NT})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let h = wg.y;
  let b = wg.z;
  let part = tid % ${S}u;
  let qi = wg.x * ${s.BQ}u + tid / ${S}u;
  let qok = qi < ${s.T}u;
  let qc = min(qi, ${s.T - 1}u);
  let qrow = (b * ${s.T}u + qc) * ${R4}u + h * ${D4}u;
  let orow = (b * ${s.T}u + qc) * ${C4}u + h * ${D4}u;
  ${range(N).map((c) => `let q${c} = qkv[qrow + ${col(c)}] * ${scale};`).join("\n  ")}
  ${range(N).map((c) => `let o${c} = dy[orow + ${col(c)}];`).join("\n  ")}
  ${range(N).map((c) => `var dq${c} = vec4<f32>(0.0);`).join("\n  ")}
  let li = lse[(b * ${s.H}u + h) * ${s.T}u + qc];
  let di = delta[(b * ${s.H}u + h) * ${s.T}u + qc];
  let qLast = min(wg.x * ${s.BQ}u + ${s.BQ - 1}u, ${s.T - 1}u);
  for (var kt = 0u; kt <= qLast; kt = kt + ${s.BKV}u) {
    workgroupBarrier();
    for (var e = tid; e < ${s.BKV * D4}u; e = e + ${NT}u) {
      let kr = min(kt + e / ${D4}u, ${s.T - 1}u);
      let src = (b * ${s.T}u + kr) * ${R4}u + h * ${D4}u + e % ${D4}u;
      Ks[e] = qkv[src + ${C4}u];
      Vs[e] = qkv[src + ${2 * C4}u];
    }
    workgroupBarrier();
    let jn = min(qLast + 1u - kt, ${s.BKV}u);
    for (var j = 0u; j < jn; j = j + 1u) {
      let kb = j * ${D4}u + part;
      var sd = vec2<f32>(${dotExpr((c) => `q${c}`, (c) => `Ks[kb + ${c * S}u]`, N)}, ${
    dotExpr((c) => `o${c}`, (c) => `Vs[kb + ${c * S}u]`, N)
  });
      ${rowSum("sd", S)}
      let kj = kt + j;
      let p = select(0.0, exp(sd.x - li), kj <= qi);
      ${s.dropout ? `let dp = sd.y * keep(${dropIdx(s)}, ${s.dropout.site}u);` : "let dp = sd.y;"}
      let ds = p * (dp - di);
      ${range(N).map((c) => `dq${c} = fma(vec4<f32>(ds), Ks[kb + ${c * S}u], dq${c});`).join("\n      ")}
    }
  }
  if (qok) {
    ${range(N).map((c) => `dqkv[qrow + ${col(c)}] = dq${c} * ${scale};`).join("\n    ")}
  }
}
`;
}

/** FLOPs of causal attention forward (QKᵀ and PV over the lower triangle). */
export function attentionFlops(s: Pick<AttentionSpec, "B" | "T" | "H" | "D">): number {
  return 2 * 2 * s.B * s.H * s.D * (s.T * (s.T + 1)) / 2;
}
