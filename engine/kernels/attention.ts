/**
 * Causal multi-head attention, tiled with an online softmax (FlashAttention style): the B×H×T×T
 * score matrix is never stored. Forward keeps each row's log-sum-exp; backward recomputes the
 * probabilities from it in two kernels, one parallel over keys (dK, dV) and one over queries (dQ),
 * so no atomics are needed and results are deterministic.
 *
 * Two families: the plain and subgroup-split kernels (one query or key per thread or per S
 * threads), and the flash kernels (`spec.flash`: FlashAttention-2 style register blocks of
 * 4 rows × several keys per thread, one max and rescale per tile, exp2 with log2 e folded into q).
 * The flash forward lives in attention_flash.ts, the spec and tile choosers in attention_spec.ts
 * (both re-exported here). A flash backward (dS written once for a dQ = dS·K kernel) lives in
 * bench/experiments/flash_backward.ts: the product runs the split backward kernels. With `writeDS`
 * the split dK/dV kernel also stores dS, and dQ becomes a matmul over it (attention_dq.ts; the
 * plan option `attentionScores`, on by default where the split kernels run: 1.23x on the H200).
 *
 * Layout: qkv is (B, T, 3C) with q, k, v in column blocks [0,C), [C,2C), [2C,3C); head h uses
 * columns h·D … h·D+D-1 of each block. Output y is (B, T, C); lse and delta are (B, H, T).
 * Attention dropout (seeded, see rng.ts) multiplies probabilities of element ((b·H+h)·T+i)·T+j.
 */

import { withStorageDtypes } from "./common.ts";
import {
  type AttentionSpec,
  backwardBindings,
  backwardKVSpec,
  backwardQSpec,
  forwardBindings,
  header,
} from "./attention_spec.ts";
import { flashForwardWgsl } from "./attention_flash.ts";
import { scoresPathError } from "./attention_dq.ts";

export * from "./attention_spec.ts";
export {
  chooseFlashForward,
  flashForwardBytes,
  flashForwardCandidates,
  flashForwardError,
  flashForwardFits,
  type FlashLimits,
  flashThreads,
  type FlashTiles,
  ft,
} from "./attention_flash.ts";

const range = (n: number) => [...Array(n).keys()];

/**
 * One WGSL line per vec4 column c < n, joined by `sep`: a newline and that many spaces of indent,
 * or the string given (" " keeps them on one line).
 */
function cols(n: number, f: (c: number) => string, sep: number | string): string {
  return range(n).map(f).join(typeof sep === "number" ? "\n" + " ".repeat(sep) : sep);
}

/**
 * One key of the forward's online softmax: the running max m, sum l and output columns o0…o(n-1)
 * take score `sc`, rescaled when it raises the max; `ok` (a bool expression) masks the key without
 * branching away, `pd` declares the key's weight in the output from `p`, `v(c)` is the key's value
 * column c. Lines after the first are indented by `ind` spaces.
 */
function onlineSoftmaxStep(
  o: { n: number; ok?: string; pd: string; v: (c: number) => string },
  ind: number,
): string {
  const nl = "\n" + " ".repeat(ind);
  return [
    `if (${o.ok ? `${o.ok} && ` : ""}sc > m) {`,
    `  let corr = exp(m - sc);`,
    `  l = l * corr;`,
    `  ${cols(o.n, (c) => `o${c} = o${c} * corr;`, " ")}`,
    `  m = sc;`,
    `}`,
    `let p = ${o.ok ? `select(0.0, exp(sc - m), ${o.ok})` : "exp(sc - m)"};`,
    `l = l + p;`,
    o.pd,
    cols(o.n, (c) => `o${c} = fma(vec4<f32>(pd), ${o.v(c)}, o${c});`, ind),
  ].join(nl);
}

function dotExpr(a: (c: number) => string, b: (c: number) => string, D4: number): string {
  const terms: string[] = [];
  for (let c = 0; c < D4; c++) terms.push(`dot(${a(c)}, ${b(c)})`);
  return terms.join(" + ");
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

/** dK and dV (and with `writeDS` the dS entries for attention_dq.ts). Grid (ceil(T/BKV), H, B). */
export function attentionBackwardKVWgsl(s: AttentionSpec): string {
  const kv = backwardKVSpec(s), err = s.writeDS ? scoresPathError(kv) : null;
  if (err) throw new RangeError(`writeDS: ${err}`);
  return withStorageDtypes(attentionBackwardKVPlainWgsl(kv), {
    qkv: s.dtype,
    dy: s.gradDtype,
    dqkv: s.gradDtype,
  });
}

/** dQ. Grid (ceil(T/BQ), H, B). */
export function attentionBackwardQWgsl(s: AttentionSpec): string {
  return withStorageDtypes(attentionBackwardQPlainWgsl(backwardQSpec(s)), {
    qkv: s.dtype,
    dy: s.gradDtype,
    dqkv: s.gradDtype,
  });
}

/** Forward: y = softmax(q kᵀ/√D, causal) v per head; writes lse. Grid (ceil(T/BQ), H, B). */
function attentionForwardPlainWgsl(s: AttentionSpec): string {
  if (s.direct) return attentionForwardDirectWgsl(s);
  if (s.flash) return flashForwardWgsl(s);
  if ((s.split ?? 1) > 1) return attentionForwardSplitWgsl(s);
  const { D4, C4, R4, scale } = header(s);
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
  ${cols(D4, (c) => `let q${c} = qkv[qrow + ${c}u] * ${scale};`, 2)}
  ${cols(D4, (c) => `var o${c} = vec4<f32>(0.0);`, 2)}
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
      ${
    onlineSoftmaxStep({
      n: D4,
      pd: s.dropout ? `let kj = kt + j; let pd = p * keep(${dropIdx(s)});` : "let pd = p;",
      v: (c) => `Vs[kb + ${c}u]`,
    }, 6)
  }
    }
    workgroupBarrier();
  }
  if (qok) {
    let orow = (b * ${s.T}u + qi) * ${C4}u + h * ${D4}u;
    let inv = 1.0 / l;
    ${cols(D4, (c) => `y[orow + ${c}u] = o${c} * inv;`, 4)}
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
  ${cols(N, (c) => `let q${c} = qkv[qrow + ${col(c)}] * ${scale};`, 2)}
  ${cols(N, (c) => `var o${c} = vec4<f32>(0.0);`, 2)}
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
      ${
    onlineSoftmaxStep({
      n: N,
      ok: "ok",
      pd: s.dropout ? `let pd = p * keep(${dropIdx(s)});` : "let pd = p;",
      v: (c) => `Vs[kb + ${c * S}u]`,
    }, 6)
  }
    }
    workgroupBarrier();
  }
  if (qok) {
    let orow = (b * ${s.T}u + qi) * ${C4}u + h * ${D4}u;
    let inv = 1.0 / l;
    ${cols(N, (c) => `y[orow + ${col(c)}] = o${c} * inv;`, 4)}
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
  if (s.direct) return attentionBackwardKVDirectWgsl(s);
  if ((s.split ?? 1) > 1) return attentionBackwardKVSplitWgsl(s);
  const { D4, C4, R4, scale } = header(s);
  const P = D4 + 1; // padded row stride of the per-thread rows, against bank conflicts
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
  ${cols(D4, (c) => `Kown[own + ${c}u] = qkv[krow + ${C4 + c}u];`, 2)}
  ${cols(D4, (c) => `Vown[own + ${c}u] = qkv[krow + ${2 * C4 + c}u];`, 2)}
  ${cols(D4, (c) => `var dk${c} = vec4<f32>(0.0);`, 2)}
  ${cols(D4, (c) => `var dv${c} = vec4<f32>(0.0);`, 2)}
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
      ? `let qi = qt + i; let kp = keep(${dropIdx(s)}); let pd = p * kp; dp = dp * kp;`
      : "let pd = p;"
  }
      let ds = p * (dp - Ds[i]);
      ${cols(D4, (c) => `dv${c} = fma(vec4<f32>(pd), dOs[qb + ${c}u], dv${c});`, 6)}
      ${cols(D4, (c) => `dk${c} = fma(vec4<f32>(ds), Qs[qb + ${c}u], dk${c});`, 6)}
    }
  }
  if (kok) {
    ${cols(D4, (c) => `dqkv[krow + ${C4 + c}u] = dk${c};`, 4)}
    ${cols(D4, (c) => `dqkv[krow + ${2 * C4 + c}u] = dv${c};`, 4)}
  }
}
`;
}

/** dQ: one thread per query, looping over the keys it sees. Grid (ceil(T/BQ), H, B). */
function attentionBackwardQPlainWgsl(s: AttentionSpec): string {
  if (s.direct) return attentionBackwardQDirectWgsl(s);
  if ((s.split ?? 1) > 1) return attentionBackwardQSplitWgsl(s);
  const { D4, C4, R4, scale } = header(s);
  const P = D4 + 1;
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
  ${cols(D4, (c) => `Qown[own + ${c}u] = qkv[qrow + ${c}u] * ${scale};`, 2)}
  ${cols(D4, (c) => `dOown[own + ${c}u] = dy[orow + ${c}u];`, 2)}
  ${cols(D4, (c) => `var dq${c} = vec4<f32>(0.0);`, 2)}
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
      ${s.dropout ? `let kj = kt + j; dp = dp * keep(${dropIdx(s)});` : ""}
      let ds = p * (dp - di);
      ${cols(D4, (c) => `dq${c} = fma(vec4<f32>(ds), Ks[kb + ${c}u], dq${c});`, 6)}
    }
  }
  if (qok) {
    ${cols(D4, (c) => `dqkv[qrow + ${c}u] = dq${c} * ${scale};`, 4)}
  }
}
`;
}

/**
 * Forward for CPU adapters: the plain kernel without its workgroup tiles. Mesa compiles a shader
 * with barriers as an LLVM coroutine whose frame holds every value live across them (the q and
 * o registers here): the plain kernels took 2-20 s each on llvmpipe with an empty shader cache,
 * these well under one. Keys are visited in the same order with the same arithmetic, so the
 * results equal the plain kernel's. Grid (ceil(T/BQ), H, B).
 */
function attentionForwardDirectWgsl(s: AttentionSpec): string {
  const { D4, C4, R4, scale } = header(s);
  return `
${forwardBindings(s)}

@compute @workgroup_size(${s.BQ})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let h = wg.y;
  let b = wg.z;
  let qi = wg.x * ${s.BQ}u + tid;
  if (qi >= ${s.T}u) { return; }
  let qrow = (b * ${s.T}u + qi) * ${R4}u + h * ${D4}u;
  ${cols(D4, (c) => `let q${c} = qkv[qrow + ${c}u] * ${scale};`, 2)}
  ${cols(D4, (c) => `var o${c} = vec4<f32>(0.0);`, 2)}
  var m = -1e30;
  var l = 0.0;
  for (var kj = 0u; kj <= qi; kj = kj + 1u) {
    let kb = (b * ${s.T}u + kj) * ${R4}u + h * ${D4}u;
    let sc = ${dotExpr((c) => `q${c}`, (c) => `qkv[kb + ${C4 + c}u]`, D4)};
    ${
    onlineSoftmaxStep({
      n: D4,
      pd: s.dropout ? `let pd = p * keep(${dropIdx(s)});` : "let pd = p;",
      v: (c) => `qkv[kb + ${2 * C4 + c}u]`,
    }, 4)
  }
  }
  let orow = (b * ${s.T}u + qi) * ${C4}u + h * ${D4}u;
  let inv = 1.0 / l;
  ${cols(D4, (c) => `y[orow + ${c}u] = o${c} * inv;`, 2)}
  lse[(b * ${s.H}u + h) * ${s.T}u + qi] = m + log(l);
}
`;
}

/** dK and dV for CPU adapters: the plain kernel without workgroup tiles (see attentionForwardDirectWgsl). */
function attentionBackwardKVDirectWgsl(s: AttentionSpec): string {
  const { D4, C4, R4, scale } = header(s);
  return `
${backwardBindings(s)}

@compute @workgroup_size(${s.BKV})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let h = wg.y;
  let b = wg.z;
  let kj = wg.x * ${s.BKV}u + tid;
  if (kj >= ${s.T}u) { return; }
  let krow = (b * ${s.T}u + kj) * ${R4}u + h * ${D4}u;
  ${cols(D4, (c) => `let k${c} = qkv[krow + ${C4 + c}u];`, 2)}
  ${cols(D4, (c) => `let v${c} = qkv[krow + ${2 * C4 + c}u];`, 2)}
  ${cols(D4, (c) => `var dk${c} = vec4<f32>(0.0);`, 2)}
  ${cols(D4, (c) => `var dv${c} = vec4<f32>(0.0);`, 2)}
  let lhbase = (b * ${s.H}u + h) * ${s.T}u;
  for (var qi = kj; qi < ${s.T}u; qi = qi + 1u) {
    let qrow = (b * ${s.T}u + qi) * ${R4}u + h * ${D4}u;
    let orow = (b * ${s.T}u + qi) * ${C4}u + h * ${D4}u;
    ${cols(D4, (c) => `let q${c} = qkv[qrow + ${c}u] * ${scale};`, 4)}
    ${cols(D4, (c) => `let do${c} = dy[orow + ${c}u];`, 4)}
    let sc = ${dotExpr((c) => `q${c}`, (c) => `k${c}`, D4)};
    let p = exp(sc - lse[lhbase + qi]);
    var dp = ${dotExpr((c) => `do${c}`, (c) => `v${c}`, D4)};
    ${s.dropout ? `let kp = keep(${dropIdx(s)}); let pd = p * kp; dp = dp * kp;` : "let pd = p;"}
    let ds = p * (dp - delta[lhbase + qi]);
    ${cols(D4, (c) => `dv${c} = fma(vec4<f32>(pd), do${c}, dv${c});`, 4)}
    ${cols(D4, (c) => `dk${c} = fma(vec4<f32>(ds), q${c}, dk${c});`, 4)}
  }
  ${cols(D4, (c) => `dqkv[krow + ${C4 + c}u] = dk${c};`, 2)}
  ${cols(D4, (c) => `dqkv[krow + ${2 * C4 + c}u] = dv${c};`, 2)}
}
`;
}

/** dQ for CPU adapters: the plain kernel without workgroup tiles (see attentionForwardDirectWgsl). */
function attentionBackwardQDirectWgsl(s: AttentionSpec): string {
  const { D4, C4, R4, scale } = header(s);
  return `
${backwardBindings(s)}

@compute @workgroup_size(${s.BQ})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let h = wg.y;
  let b = wg.z;
  let qi = wg.x * ${s.BQ}u + tid;
  if (qi >= ${s.T}u) { return; }
  let qrow = (b * ${s.T}u + qi) * ${R4}u + h * ${D4}u;
  let orow = (b * ${s.T}u + qi) * ${C4}u + h * ${D4}u;
  ${cols(D4, (c) => `let q${c} = qkv[qrow + ${c}u] * ${scale};`, 2)}
  ${cols(D4, (c) => `let do${c} = dy[orow + ${c}u];`, 2)}
  ${cols(D4, (c) => `var dq${c} = vec4<f32>(0.0);`, 2)}
  let li = lse[(b * ${s.H}u + h) * ${s.T}u + qi];
  let di = delta[(b * ${s.H}u + h) * ${s.T}u + qi];
  for (var kj = 0u; kj <= qi; kj = kj + 1u) {
    let kb = (b * ${s.T}u + kj) * ${R4}u + h * ${D4}u;
    let sc = ${dotExpr((c) => `q${c}`, (c) => `qkv[kb + ${C4 + c}u]`, D4)};
    let p = exp(sc - li);
    var dp = ${dotExpr((c) => `do${c}`, (c) => `qkv[kb + ${2 * C4 + c}u]`, D4)};
    ${s.dropout ? `dp = dp * keep(${dropIdx(s)});` : ""}
    let ds = p * (dp - di);
    ${cols(D4, (c) => `dq${c} = fma(vec4<f32>(ds), qkv[kb + ${C4 + c}u], dq${c});`, 4)}
  }
  ${cols(D4, (c) => `dqkv[qrow + ${c}u] = dq${c} * ${scale};`, 2)}
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
 * Declarations that hold scalar expressions `vals` in vec4 (and a last vec2 or scalar) variables
 * named `${name}0`, `${name}1`…, each summed over the S threads of a row, and the accessor of
 * value j. Must run in uniform control flow (see rowSum).
 */
function packedRowSums(name: string, vals: string[], S: number): { code: string; at: (j: number) => string } {
  const out: string[] = [];
  for (let g = 0; g * 4 < vals.length; g++) {
    const part = vals.slice(g * 4, g * 4 + 4);
    const ty = part.length === 1 ? "f32" : `vec${part.length}<f32>`;
    out.push(`var ${name}${g} = ${ty}(${part.join(", ")});`, rowSum(`${name}${g}`, S));
  }
  const one = vals.length % 4 === 1 ? Math.floor(vals.length / 4) : -1;
  return {
    code: out.filter((l) => l).join("\n      "),
    at: (j) => {
      const g = Math.floor(j / 4);
      return g === one ? `${name}${g}` : `${name}${g}.${"xyzw"[j % 4]}`;
    },
  };
}

/**
 * A loop of `v` over [from, to) with `body` (which reads `v`) written out U times per trip, so
 * that U rows' loads, shuffles and exps are independent work in one basic block (WGSL loops get a
 * counter from the compiler, which keeps the driver from unrolling them), then the rest one at a
 * time. `to` must be uniform where the body shuffles.
 */
function unrolledLoop(v: string, from: string, to: string, U: number, body: string): string {
  if (![1, 2, 4].includes(U)) throw new RangeError(`unroll ${U} must be 1, 2 or 4`);
  const one = `for (; ${v}b < ${to}; ${v}b = ${v}b + 1u) { let ${v} = ${v}b;${body}\n    }`;
  if (U === 1) return `for (var ${v} = ${from}; ${v} < ${to}; ${v} = ${v} + 1u) {${body}\n    }`;
  const copies = [...Array(U).keys()].map((u) => `{ let ${v} = ${v}b + ${u}u;${body}\n      }`);
  return `var ${v}b = ${from};
    for (; ${v}b + ${U - 1}u < ${to}; ${v}b = ${v}b + ${U}u) {
      ${copies.join("\n      ")}
    }
    ${one}`;
}

/**
 * A tile fill: `body` (which reads `e`) for e = tid, tid + NT, … below `count`, as a loop or, with
 * `written` (AttentionSpec.writtenFills), one block per trip, the last guarded when NT does not
 * divide `count`, so the trips' loads are independent work in one basic block.
 */
export function tileFill(count: number, NT: number, written: boolean, body: string): string {
  if (!written) return `for (var e = tid; e < ${count}u; e = e + ${NT}u) {${body}\n    }`;
  return [...Array(Math.ceil(count / NT)).keys()].map((t) => {
    const last = (t + 1) * NT > count;
    return `{ let e = tid + ${t * NT}u;${last ? ` if (e < ${count}u) {` : ""}${body}${
      last ? " }" : ""
    }\n    }`;
  }).join("\n    ");
}

/** Rows per thread group of the split backward kernels, checked against the tile. */
function splitRows(R: number, tile: number, what: string): number {
  if (![1, 2, 4].includes(R) || tile % R) {
    throw new Error(`rows ${R} must be 1, 2 or 4 and divide ${what} ${tile}`);
  }
  return R;
}

/**
 * dK and dV, split variant: S adjacent threads per group of R keys (keys g, g + BKV/R, …), thread
 * `part` holding vec4 columns c·S + part (c < D/4/S) of k, v, dk, dv for each of them in registers;
 * scores and dP dots are combined with subgroup shuffles. Each query row read from workgroup memory
 * serves all R keys. The query loop bounds are uniform per workgroup and the causal mask is a
 * select(), so all threads of a subgroup shuffle together. Grid (ceil(T/BKV), H, B).
 */
function attentionBackwardKVSplitWgsl(s: AttentionSpec): string {
  const { D4, C4, R4, scale } = header(s);
  const S = s.split!, N = D4 / S, R = splitRows(s.kvRows ?? 1, s.BKV, "BKV"), G = s.BKV / R, NT = G * S;
  if (D4 % S) throw new Error(`split ${S} does not divide D/4 = ${D4}`);
  const col = (c: number) => `${c * S}u + part`;
  const each = (f: (r: number) => string, sep = "\n  ") => range(R).map(f).join(sep);
  const eachRC = (f: (r: number, c: number) => string, sep = "\n  ") =>
    range(R).flatMap((r) => range(N).map((c) => f(r, c))).join(sep);
  const sums = packedRowSums("sd", [
    ...range(R).map((r) => dotExpr((c) => `q${c}`, (c) => `k${r}_${c}`, N)),
    ...range(R).map((r) => dotExpr((c) => `o${c}`, (c) => `v${r}_${c}`, N)),
  ], S);
  const idx = (r: number) => `((b * ${s.H}u + h) * ${s.T}u + qi) * ${s.T}u + kj${r}`;
  const scatter = !!s.scatterSums && R > 1 && S > 1;
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
  ${scatter ? `let perm = ${scatterPerm(R, S)};\n  ` : ""}${
    // Storing dS: a group's R keys are consecutive, so its lane 0 writes them as one vector. With
    // the sums reduce-scattered, a thread holds its group's keys in the order of scatterPerm.
    each((r) => {
      const slot = scatter ? `(${r}u ^ perm)` : `${r}u`;
      return s.writeDS
        ? `let kj${r} = kFirst + (tid / ${S}u) * ${R}u + ${slot};`
        : scatter
        ? `let kj${r} = kFirst + ${slot} * ${G}u + tid / ${S}u;`
        : `let kj${r} = kFirst + ${r * G}u + tid / ${S}u;`;
    })}
  ${each((r) => `let krow${r} = (b * ${s.T}u + min(kj${r}, ${s.T - 1}u)) * ${R4}u + h * ${D4}u;`)}
  ${eachRC((r, c) => `let k${r}_${c} = qkv[krow${r} + ${C4}u + ${col(c)}];`)}
  ${eachRC((r, c) => `let v${r}_${c} = qkv[krow${r} + ${2 * C4}u + ${col(c)}];`)}
  ${eachRC((r, c) => `var dk${r}_${c} = vec4<f32>(0.0);`)}
  ${eachRC((r, c) => `var dv${r}_${c} = vec4<f32>(0.0);`)}
  let lhbase = (b * ${s.H}u + h) * ${s.T}u;
  for (var qt = (kFirst / ${s.BQ}u) * ${s.BQ}u; qt < ${s.T}u; qt = qt + ${s.BQ}u) {
    workgroupBarrier();
    ${
    tileFill(
      s.BQ * D4,
      NT,
      !!s.writtenFills,
      `
      let qr = min(qt + e / ${D4}u, ${s.T - 1}u);
      Qs[e] = qkv[(b * ${s.T}u + qr) * ${R4}u + h * ${D4}u + e % ${D4}u] * ${scale};
      dOs[e] = dy[(b * ${s.T}u + qr) * ${C4}u + h * ${D4}u + e % ${D4}u];`,
    )
  }
    ${
    tileFill(
      s.BQ,
      NT,
      !!s.writtenFills,
      `
      let qr = min(qt + e, ${s.T - 1}u);
      Ls[e] = lse[lhbase + qr];
      Ds[e] = delta[lhbase + qr];`,
    )
  }
    workgroupBarrier();
    let i0 = u32(clamp(i32(kFirst) - i32(qt), 0, ${s.BQ}));
    let i1 = min(${s.BQ}u, ${s.T}u - qt);
    ${
    unrolledLoop(
      "i",
      "i0",
      "i1",
      s.kvUnroll ?? 1,
      `
      let qb = i * ${D4}u + part;
      ${cols(N, (c) => `let q${c} = Qs[qb + ${c * S}u];`, " ")}
      ${cols(N, (c) => `let o${c} = dOs[qb + ${c * S}u];`, " ")}
      ${scatter ? "" : sums.code}
      let qi = qt + i;
      let li = Ls[i];
      let di = Ds[i];
      ${
        scatter ? scatteredScores(s, R, S, idx) : each((r) => {
          const p = `let p${r} = select(0.0, exp(${sums.at(r)} - li), qi >= kj${r});`;
          const rest = s.dropout
            ? `let kp${r} = keep(${idx(r)}); let pd${r} = p${r} * kp${r}; ` +
              `let ds${r} = p${r} * (${sums.at(R + r)} * kp${r} - di);`
            : `let pd${r} = p${r}; let ds${r} = p${r} * (${sums.at(R + r)} - di);`;
          return `${p} ${rest}`;
        }, "\n      ")
      }
      ${s.writeDS ? writeDS(s, R) : ""}
      ${eachRC((r, c) => `dv${r}_${c} = fma(vec4<f32>(pd${r}), o${c}, dv${r}_${c});`, "\n      ")}
      ${eachRC((r, c) => `dk${r}_${c} = fma(vec4<f32>(ds${r}), q${c}, dk${r}_${c});`, "\n      ")}`,
    )
  }
  }
  ${
    each((r) =>
      `if (kj${r} < ${s.T}u) {
    ${cols(N, (c) => `dqkv[krow${r} + ${C4}u + ${col(c)}] = dk${r}_${c};`, 4)}
    ${cols(N, (c) => `dqkv[krow${r} + ${2 * C4}u + ${col(c)}] = dv${r}_${c};`, 4)}
  }`
    )
  }
}
`;
}

/**
 * The halvings of a reduce-scatter of R pairs over S threads: at shuffle distance m (1, 2, …) while
 * more than one pair is left, each thread keeps `half` of them.
 */
function scatterHalvings(R: number, S: number): { m: number; half: number }[] {
  const out: { m: number; half: number }[] = [];
  for (let m = 1, c = R; m < S && c > 1; m *= 2, c /= 2) out.push({ m, half: c / 2 });
  return out;
}

/**
 * The order in which a thread of a group holds its R keys when their sums are reduce-scattered:
 * slot i holds key i ^ perm, perm having `half` set where the thread's bit m is (for each halving).
 * A thread then always keeps its first slots and sends the rest, and its partner, whose order
 * differs in that bit, sends the very keys it keeps: no selects. Thread 0 of a group holds them in
 * key order (perm 0), so its store of dS is unchanged.
 */
function scatterPerm(R: number, S: number): string {
  const terms = scatterHalvings(R, S).map(({ m, half }) => `select(0u, ${half}u, (part & ${m}u) != 0u)`);
  return terms.length ? terms.join(" | ") : "0u";
}

/**
 * The split dK/dV kernel's scores and dP reduce-scattered (AttentionSpec.scatterSums): each thread
 * starts with the partial sums of its columns for its R keys, as R pairs (score, dP), its keys in
 * the order of scatterPerm. At each shuffle distance m = 1, 2, … below S, while a thread holds more
 * than one pair, it keeps the first half of its pairs, sends the second, and adds what its partner
 * sends to what it kept: the butterfly's sum of the same two threads' values, with half the values
 * moved. Once one pair is left the levels go on as the butterfly. Each thread then holds whole sums
 * of its first R / 2^halvings slots (one at S = 8, R = 4), takes their exp and dS, and the halving
 * levels run backwards to gather every slot's (pd, ds) again, as `pd${r}`/`ds${r}` of key `kj${r}`.
 * Uniform control flow (the loop bounds are uniform per workgroup).
 */
function scatteredScores(s: AttentionSpec, R: number, S: number, idx: (r: number) => string): string {
  const { D4 } = header(s), N = D4 / S;
  const out: string[] = [];
  let names = range(R).map((r) => {
    out.push(
      `let x_${r} = vec2<f32>(${dotExpr((c) => `q${c}`, (c) => `k${r}_${c}`, N)}, ${
        dotExpr((c) => `o${c}`, (c) => `v${r}_${c}`, N)
      });`,
    );
    return `x_${r}`;
  });
  const halvings = scatterHalvings(R, S);
  for (let m = 1; m < S; m *= 2) {
    const half = names.length / 2;
    names = names.length > 1
      ? range(half).map((i) => {
        out.push(`let x${m}_${i} = ${names[i]} + subgroupShuffleXor(${names[half + i]}, ${m}u);`);
        return `x${m}_${i}`;
      })
      : [names[0]].map((y) => {
        out.push(`let x${m}_0 = ${y} + subgroupShuffleXor(${y}, ${m}u);`);
        return `x${m}_0`;
      });
  }
  let list = names.map((y, i) => {
    out.push(`let ps${i} = select(0.0, exp(${y}.x - li), qi >= kj${i});`);
    if (s.dropout) {
      out.push(`let kps${i} = keep(${idx(i)});`);
      out.push(`let z_${i} = vec2<f32>(ps${i} * kps${i}, ps${i} * (${y}.y * kps${i} - di));`);
    } else {
      out.push(`let z_${i} = vec2<f32>(ps${i}, ps${i} * (${y}.y - di));`);
    }
    return `z_${i}`;
  });
  for (const { m } of [...halvings].reverse()) {
    list = [
      ...list,
      ...list.map((z, i) => {
        out.push(`let w${m}_${i} = subgroupShuffleXor(${z}, ${m}u);`);
        return `w${m}_${i}`;
      }),
    ];
  }
  for (let r = 0; r < R; r++) out.push(`let pd${r} = ${list[r]}.x; let ds${r} = ${list[r]}.y;`);
  return out.join("\n      ");
}

/**
 * The split dK/dV kernel's store of dS (writeDS): lane 0 of each thread group writes its R
 * consecutive keys' entries as one vector (R ≤ 4; T a multiple of 4, so they are in T together).
 */
function writeDS(s: AttentionSpec, R: number): string {
  const vals = [...Array(R).keys()].map((r) => `ds${r}`).join(", ");
  const v = R === 1 ? vals : `vec${R}<f32>(${vals})`;
  return `if (part == 0u && kj0 < ${s.T}u) { dst[(((b * ${s.H}u + h) * ${s.T}u + qi) * ${s.T}u + kj0) / ${R}u] = ${v}; }`;
}

/**
 * dQ, split variant: S adjacent threads per group of R queries (queries g, g + BQ/R, …), each
 * thread holding D/S columns of q, dO and dq for each of them in registers; K/V tiles in workgroup
 * memory, each key row read serving all R queries. Uniform key bounds, causal mask by select().
 * Grid (ceil(T/BQ), H, B).
 */
function attentionBackwardQSplitWgsl(s: AttentionSpec): string {
  const { D4, C4, R4, scale } = header(s);
  const S = s.split!, N = D4 / S, R = splitRows(s.qRows ?? 1, s.BQ, "BQ"), G = s.BQ / R, NT = G * S;
  if (D4 % S) throw new Error(`split ${S} does not divide D/4 = ${D4}`);
  const col = (c: number) => `${c * S}u + part`;
  const each = (f: (r: number) => string, sep = "\n  ") => range(R).map(f).join(sep);
  const eachRC = (f: (r: number, c: number) => string, sep = "\n  ") =>
    range(R).flatMap((r) => range(N).map((c) => f(r, c))).join(sep);
  const sums = packedRowSums("sd", [
    ...range(R).map((r) => dotExpr((c) => `q${r}_${c}`, (c) => `k${c}`, N)),
    ...range(R).map((r) => dotExpr((c) => `o${r}_${c}`, (c) => `v${c}`, N)),
  ], S);
  const idx = (r: number) => `((b * ${s.H}u + h) * ${s.T}u + qi${r}) * ${s.T}u + kj`;
  return `
${backwardBindings(s)}
var<workgroup> Ks: array<vec4<f32>, ${s.BKV * D4}>;
var<workgroup> Vs: array<vec4<f32>, ${s.BKV * D4}>;

@compute @workgroup_size(${NT})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let h = wg.y;
  let b = wg.z;
  let part = tid % ${S}u;
  ${each((r) => `let qi${r} = wg.x * ${s.BQ}u + ${r * G}u + tid / ${S}u;`)}
  ${each((r) => `let qc${r} = min(qi${r}, ${s.T - 1}u);`)}
  ${each((r) => `let qrow${r} = (b * ${s.T}u + qc${r}) * ${R4}u + h * ${D4}u;`)}
  ${each((r) => `let orow${r} = (b * ${s.T}u + qc${r}) * ${C4}u + h * ${D4}u;`)}
  ${eachRC((r, c) => `let q${r}_${c} = qkv[qrow${r} + ${col(c)}] * ${scale};`)}
  ${eachRC((r, c) => `let o${r}_${c} = dy[orow${r} + ${col(c)}];`)}
  ${eachRC((r, c) => `var dq${r}_${c} = vec4<f32>(0.0);`)}
  ${each((r) => `let li${r} = lse[(b * ${s.H}u + h) * ${s.T}u + qc${r}];`)}
  ${each((r) => `let di${r} = delta[(b * ${s.H}u + h) * ${s.T}u + qc${r}];`)}
  let qLast = min(wg.x * ${s.BQ}u + ${s.BQ - 1}u, ${s.T - 1}u);
  for (var kt = 0u; kt <= qLast; kt = kt + ${s.BKV}u) {
    workgroupBarrier();
    ${
    tileFill(
      s.BKV * D4,
      NT,
      !!s.writtenFills,
      `
      let kr = min(kt + e / ${D4}u, ${s.T - 1}u);
      let src = (b * ${s.T}u + kr) * ${R4}u + h * ${D4}u + e % ${D4}u;
      Ks[e] = qkv[src + ${C4}u];
      Vs[e] = qkv[src + ${2 * C4}u];`,
    )
  }
    workgroupBarrier();
    let jn = min(qLast + 1u - kt, ${s.BKV}u);
    ${
    unrolledLoop(
      "j",
      "0u",
      "jn",
      s.qUnroll ?? 1,
      `
      let kb = j * ${D4}u + part;
      ${cols(N, (c) => `let k${c} = Ks[kb + ${c * S}u];`, " ")}
      ${cols(N, (c) => `let v${c} = Vs[kb + ${c * S}u];`, " ")}
      ${sums.code}
      let kj = kt + j;
      ${
        each((r) => {
          const dp = s.dropout ? `${sums.at(R + r)} * keep(${idx(r)})` : sums.at(R + r);
          return `let ds${r} = select(0.0, exp(${sums.at(r)} - li${r}), kj <= qi${r}) * (${dp} - di${r});`;
        }, "\n      ")
      }
      ${eachRC((r, c) => `dq${r}_${c} = fma(vec4<f32>(ds${r}), k${c}, dq${r}_${c});`, "\n      ")}`,
    )
  }
  }
  ${
    each((r) =>
      `if (qi${r} < ${s.T}u) {
    ${cols(N, (c) => `dqkv[qrow${r} + ${col(c)}] = dq${r}_${c} * ${scale};`, 4)}
  }`
    )
  }
}
`;
}
