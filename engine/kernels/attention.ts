/**
 * Causal multi-head attention, tiled with an online softmax (FlashAttention style): the B×H×T×T
 * score matrix is never stored. Forward keeps each row's log-sum-exp; backward recomputes the
 * probabilities from it in two kernels, one parallel over keys (dK, dV) and one over queries (dQ),
 * so no atomics are needed and results are deterministic.
 *
 * Two families: the plain and subgroup-split kernels (one query or key per thread or per S
 * threads), and the flash kernels (`spec.flash`: FlashAttention-2 style register blocks of
 * 4 rows × several keys per thread, one max and rescale per tile, exp2 with log2 e folded into q).
 * chooseFlashForward picks the flash forward tiling that fits a device. A flash backward (dS
 * written once for a dQ = dS·K kernel) lives in bench/experiments/flash_backward.ts: the product
 * runs the plain backward kernels, and the few helpers exported below serve that experiment.
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
  split?: 1 | 2 | 4 | 8;
  /**
   * Split backward kernels: keys per group of S threads in the dK/dV kernel (default 1). R keys
   * share each query row read from workgroup memory, so a thread does R times the multiply-adds
   * per load; its registers grow by the same factor.
   */
  kvRows?: 1 | 2 | 4;
  /** Split backward kernels: queries per group of S threads in the dQ kernel (default 1), as kvRows. */
  qRows?: 1 | 2 | 4;
  /** The dK/dV kernel's own tiling, replacing split, BQ, BKV and kvRows for it (see backwardKVSpec). */
  bwdKV?: BackwardTiling;
  /** The dQ kernel's own tiling, replacing split, BQ, BKV and qRows for it (see backwardQSpec). */
  bwdQ?: BackwardTiling;
  /** Element type of qkv and of the output y in memory (arithmetic is f32); default f32. */
  dtype?: StorageDtype;
  /** Element type of the gradients dy and dqkv in memory; default f32. */
  gradDtype?: StorageDtype;
  /**
   * FlashAttention-2 style register blocking for the forward (see flashForwardWgsl; the fused
   * backward experiment in bench/experiments/ reads it too); `split` is then unused.
   */
  flash?: FlashOptions;
  /**
   * CPU adapters: one thread per query (forward, dQ) or key (dK/dV) reading keys and queries
   * straight from storage, with no workgroup memory and no barriers, which Mesa compiles in a
   * fraction of a second instead of 2-20 s (see attentionForwardDirectWgsl). Same loop order and
   * arithmetic as the plain kernels; `split` and `flash` are then unused.
   */
  direct?: boolean;
}

/**
 * A split backward kernel's tiling: S threads per row, the BQ-query and BKV-key tiles, and rows per
 * thread group (keys in dK/dV, queries in dQ).
 */
export interface BackwardTiling {
  split: 1 | 2 | 4 | 8;
  BQ: number;
  BKV: number;
  rows: 1 | 2 | 4;
}

/** The spec the dK/dV kernel runs: `s` with its own tiling applied (its grid is ceil(T/BKV), H, B). */
export function backwardKVSpec(s: AttentionSpec): AttentionSpec {
  const t = s.bwdKV;
  return t ? { ...s, split: t.split, BQ: t.BQ, BKV: t.BKV, kvRows: t.rows } : s;
}

/** The spec the dQ kernel runs: `s` with its own tiling applied (its grid is ceil(T/BQ), H, B). */
export function backwardQSpec(s: AttentionSpec): AttentionSpec {
  const t = s.bwdQ;
  return t ? { ...s, split: t.split, BQ: t.BQ, BKV: t.BKV, qRows: t.rows } : s;
}

/**
 * How the flash kernels block the work. `lanes` threads share 4 query rows (forward, dQ) or 4
 * keys (dK/dV); each holds a 4 × BKV/lanes block of scores and a 4 × D/lanes block of its
 * output. Row statistics combine across the lanes by subgroup shuffles ("subgroup": needs the
 * feature and a subgroup of at least `lanes`) or through workgroup memory ("shared").
 */
export interface FlashOptions {
  lanes: 4 | 8 | 16;
  reduce: "subgroup" | "shared";
  /** Load the next K/V tile into registers while the current one is multiplied (default true). */
  prefetch?: boolean;
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
 * The split backward kernels' own tilings, where the device fits them: candidates in order of
 * their speed measured on an H200 (bench/attention_bench.ts, GPT-2 124M and 345M at T = 1024; see
 * bench/RESULTS.md), the first that fits each kernel. Smaller tiles of the rows a workgroup loops
 * over (queries for dK/dV, keys for dQ) leave room for more workgroups per SM, and several rows per
 * thread group share each row read. Null for a kernel where none fits (the shared tiling stays).
 */
export function chooseBackwardTilings(
  dims: Pick<AttentionSpec, "T" | "D">,
  lim: { maxWorkgroupBytes: number; maxThreads: number; subgroupMinSize: number },
  candidates: { kv: readonly BackwardTiling[]; q: readonly BackwardTiling[] } = {
    kv: BACKWARD_KV_TILINGS,
    q: BACKWARD_Q_TILINGS,
  },
): { bwdKV?: BackwardTiling; bwdQ?: BackwardTiling } {
  const fits = (t: BackwardTiling, kv: boolean) =>
    lim.subgroupMinSize >= t.split && (dims.D / 4) % t.split === 0 &&
    (kv ? t.BKV : t.BQ) % t.rows === 0 && ((kv ? t.BKV : t.BQ) / t.rows) * t.split <= lim.maxThreads &&
    (kv ? splitKVBytes(t.BQ, dims.D) : splitQBytes(t.BKV, dims.D)) <= lim.maxWorkgroupBytes;
  const kv = candidates.kv.find((t) => fits(t, true));
  const q = candidates.q.find((t) => fits(t, false));
  return { ...(kv ? { bwdKV: kv } : {}), ...(q ? { bwdQ: q } : {}) };
}

/** dK/dV tilings, fastest first (see chooseBackwardTilings). */
export const BACKWARD_KV_TILINGS: readonly BackwardTiling[] = [
  { split: 8, BQ: 32, BKV: 64, rows: 4 },
  { split: 4, BQ: 32, BKV: 64, rows: 2 },
];

/** dQ tilings, fastest first (see chooseBackwardTilings). */
export const BACKWARD_Q_TILINGS: readonly BackwardTiling[] = [
  { split: 4, BQ: 64, BKV: 32, rows: 2 },
];

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

export function header(s: AttentionSpec) {
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
export function backwardBindings(s: AttentionSpec): string {
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
  return withStorageDtypes(attentionBackwardKVPlainWgsl(backwardKVSpec(s)), {
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
  if (s.direct) return attentionBackwardKVDirectWgsl(s);
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
  if (s.direct) return attentionBackwardQDirectWgsl(s);
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
 * Forward for CPU adapters: the plain kernel without its workgroup tiles. Mesa compiles a shader
 * with barriers as an LLVM coroutine whose frame holds every value live across them (the q and
 * o registers here): the plain kernels took 2-20 s each on llvmpipe with an empty shader cache,
 * these well under one. Keys are visited in the same order with the same arithmetic, so the
 * results equal the plain kernel's. Grid (ceil(T/BQ), H, B).
 */
function attentionForwardDirectWgsl(s: AttentionSpec): string {
  const { D4, C4, R4, scale } = header(s);
  const range = (n: number) => [...Array(n).keys()];
  return `
${forwardBindings(s)}

@compute @workgroup_size(${s.BQ})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let h = wg.y;
  let b = wg.z;
  let qi = wg.x * ${s.BQ}u + tid;
  if (qi >= ${s.T}u) { return; }
  let qrow = (b * ${s.T}u + qi) * ${R4}u + h * ${D4}u;
  ${range(D4).map((c) => `let q${c} = qkv[qrow + ${c}u] * ${scale};`).join("\n  ")}
  ${range(D4).map((c) => `var o${c} = vec4<f32>(0.0);`).join("\n  ")}
  var m = -1e30;
  var l = 0.0;
  for (var kj = 0u; kj <= qi; kj = kj + 1u) {
    let kb = (b * ${s.T}u + kj) * ${R4}u + h * ${D4}u;
    let sc = ${dotExpr((c) => `q${c}`, (c) => `qkv[kb + ${C4 + c}u]`, D4)};
    if (sc > m) {
      let corr = exp(m - sc);
      l = l * corr;
      ${range(D4).map((c) => `o${c} = o${c} * corr;`).join(" ")}
      m = sc;
    }
    let p = exp(sc - m);
    l = l + p;
    ${s.dropout ? `let pd = p * keep(${dropIdx(s)}, ${s.dropout.site}u);` : "let pd = p;"}
    ${range(D4).map((c) => `o${c} = fma(vec4<f32>(pd), qkv[kb + ${2 * C4 + c}u], o${c});`).join("\n    ")}
  }
  let orow = (b * ${s.T}u + qi) * ${C4}u + h * ${D4}u;
  let inv = 1.0 / l;
  ${range(D4).map((c) => `y[orow + ${c}u] = o${c} * inv;`).join("\n  ")}
  lse[(b * ${s.H}u + h) * ${s.T}u + qi] = m + log(l);
}
`;
}

/** dK and dV for CPU adapters: the plain kernel without workgroup tiles (see attentionForwardDirectWgsl). */
function attentionBackwardKVDirectWgsl(s: AttentionSpec): string {
  const { D4, C4, R4, scale } = header(s);
  const range = (n: number) => [...Array(n).keys()];
  return `
${backwardBindings(s)}

@compute @workgroup_size(${s.BKV})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let h = wg.y;
  let b = wg.z;
  let kj = wg.x * ${s.BKV}u + tid;
  if (kj >= ${s.T}u) { return; }
  let krow = (b * ${s.T}u + kj) * ${R4}u + h * ${D4}u;
  ${range(D4).map((c) => `let k${c} = qkv[krow + ${C4 + c}u];`).join("\n  ")}
  ${range(D4).map((c) => `let v${c} = qkv[krow + ${2 * C4 + c}u];`).join("\n  ")}
  ${range(D4).map((c) => `var dk${c} = vec4<f32>(0.0);`).join("\n  ")}
  ${range(D4).map((c) => `var dv${c} = vec4<f32>(0.0);`).join("\n  ")}
  let lhbase = (b * ${s.H}u + h) * ${s.T}u;
  for (var qi = kj; qi < ${s.T}u; qi = qi + 1u) {
    let qrow = (b * ${s.T}u + qi) * ${R4}u + h * ${D4}u;
    let orow = (b * ${s.T}u + qi) * ${C4}u + h * ${D4}u;
    ${range(D4).map((c) => `let q${c} = qkv[qrow + ${c}u] * ${scale};`).join("\n    ")}
    ${range(D4).map((c) => `let do${c} = dy[orow + ${c}u];`).join("\n    ")}
    let sc = ${dotExpr((c) => `q${c}`, (c) => `k${c}`, D4)};
    let p = exp(sc - lse[lhbase + qi]);
    var dp = ${dotExpr((c) => `do${c}`, (c) => `v${c}`, D4)};
    ${
    s.dropout
      ? `let kp = keep(${dropIdx(s)}, ${s.dropout.site}u); let pd = p * kp; dp = dp * kp;`
      : "let pd = p;"
  }
    let ds = p * (dp - delta[lhbase + qi]);
    ${range(D4).map((c) => `dv${c} = fma(vec4<f32>(pd), do${c}, dv${c});`).join("\n    ")}
    ${range(D4).map((c) => `dk${c} = fma(vec4<f32>(ds), q${c}, dk${c});`).join("\n    ")}
  }
  ${range(D4).map((c) => `dqkv[krow + ${C4 + c}u] = dk${c};`).join("\n  ")}
  ${range(D4).map((c) => `dqkv[krow + ${2 * C4 + c}u] = dv${c};`).join("\n  ")}
}
`;
}

/** dQ for CPU adapters: the plain kernel without workgroup tiles (see attentionForwardDirectWgsl). */
function attentionBackwardQDirectWgsl(s: AttentionSpec): string {
  const { D4, C4, R4, scale } = header(s);
  const range = (n: number) => [...Array(n).keys()];
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
  ${range(D4).map((c) => `let q${c} = qkv[qrow + ${c}u] * ${scale};`).join("\n  ")}
  ${range(D4).map((c) => `let do${c} = dy[orow + ${c}u];`).join("\n  ")}
  ${range(D4).map((c) => `var dq${c} = vec4<f32>(0.0);`).join("\n  ")}
  let li = lse[(b * ${s.H}u + h) * ${s.T}u + qi];
  let di = delta[(b * ${s.H}u + h) * ${s.T}u + qi];
  for (var kj = 0u; kj <= qi; kj = kj + 1u) {
    let kb = (b * ${s.T}u + kj) * ${R4}u + h * ${D4}u;
    let sc = ${dotExpr((c) => `q${c}`, (c) => `qkv[kb + ${C4 + c}u]`, D4)};
    let p = exp(sc - li);
    var dp = ${dotExpr((c) => `do${c}`, (c) => `qkv[kb + ${2 * C4 + c}u]`, D4)};
    ${s.dropout ? `dp = dp * keep(${dropIdx(s)}, ${s.dropout.site}u);` : ""}
    let ds = p * (dp - di);
    ${range(D4).map((c) => `dq${c} = fma(vec4<f32>(ds), qkv[kb + ${C4 + c}u], dq${c});`).join("\n    ")}
  }
  ${range(D4).map((c) => `dqkv[qrow + ${c}u] = dq${c} * ${scale};`).join("\n  ")}
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
  const range = (n: number) => [...Array(n).keys()];
  const col = (c: number) => `${c * S}u + part`;
  const each = (f: (r: number) => string, sep = "\n  ") => range(R).map(f).join(sep);
  const eachRC = (f: (r: number, c: number) => string, sep = "\n  ") =>
    range(R).flatMap((r) => range(N).map((c) => f(r, c))).join(sep);
  const sums = packedRowSums("sd", [
    ...range(R).map((r) => dotExpr((c) => `q${c}`, (c) => `k${r}_${c}`, N)),
    ...range(R).map((r) => dotExpr((c) => `o${c}`, (c) => `v${r}_${c}`, N)),
  ], S);
  const idx = (r: number) => `((b * ${s.H}u + h) * ${s.T}u + qi) * ${s.T}u + kj${r}`;
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
  ${each((r) => `let kj${r} = kFirst + ${r * G}u + tid / ${S}u;`)}
  ${each((r) => `let krow${r} = (b * ${s.T}u + min(kj${r}, ${s.T - 1}u)) * ${R4}u + h * ${D4}u;`)}
  ${eachRC((r, c) => `let k${r}_${c} = qkv[krow${r} + ${C4}u + ${col(c)}];`)}
  ${eachRC((r, c) => `let v${r}_${c} = qkv[krow${r} + ${2 * C4}u + ${col(c)}];`)}
  ${eachRC((r, c) => `var dk${r}_${c} = vec4<f32>(0.0);`)}
  ${eachRC((r, c) => `var dv${r}_${c} = vec4<f32>(0.0);`)}
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
      ${range(N).map((c) => `let q${c} = Qs[qb + ${c * S}u];`).join(" ")}
      ${range(N).map((c) => `let o${c} = dOs[qb + ${c * S}u];`).join(" ")}
      ${sums.code}
      let qi = qt + i;
      let li = Ls[i];
      let di = Ds[i];
      ${
    each((r) => {
      const p = `let p${r} = select(0.0, exp(${sums.at(r)} - li), qi >= kj${r});`;
      const rest = s.dropout
        ? `let kp${r} = keep(${idx(r)}, ${s.dropout.site}u); let pd${r} = p${r} * kp${r}; ` +
          `let ds${r} = p${r} * (${sums.at(R + r)} * kp${r} - di);`
        : `let pd${r} = p${r}; let ds${r} = p${r} * (${sums.at(R + r)} - di);`;
      return `${p} ${rest}`;
    }, "\n      ")
  }
      ${eachRC((r, c) => `dv${r}_${c} = fma(vec4<f32>(pd${r}), o${c}, dv${r}_${c});`, "\n      ")}
      ${eachRC((r, c) => `dk${r}_${c} = fma(vec4<f32>(ds${r}), q${c}, dk${r}_${c});`, "\n      ")}
    }
  }
  ${
    each((r) =>
      `if (kj${r} < ${s.T}u) {
    ${range(N).map((c) => `dqkv[krow${r} + ${C4}u + ${col(c)}] = dk${r}_${c};`).join("\n    ")}
    ${range(N).map((c) => `dqkv[krow${r} + ${2 * C4}u + ${col(c)}] = dv${r}_${c};`).join("\n    ")}
  }`
    )
  }
}
`;
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
  const range = (n: number) => [...Array(n).keys()];
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
      ${range(N).map((c) => `let k${c} = Ks[kb + ${c * S}u];`).join(" ")}
      ${range(N).map((c) => `let v${c} = Vs[kb + ${c * S}u];`).join(" ")}
      ${sums.code}
      let kj = kt + j;
      ${
    each((r) => {
      const dp = s.dropout ? `${sums.at(R + r)} * keep(${idx(r)}, ${s.dropout.site}u)` : sums.at(R + r);
      return `let ds${r} = select(0.0, exp(${sums.at(r)} - li${r}), kj <= qi${r}) * (${dp} - di${r});`;
    }, "\n      ")
  }
      ${eachRC((r, c) => `dq${r}_${c} = fma(vec4<f32>(ds${r}), k${c}, dq${r}_${c});`, "\n      ")}
    }
  }
  ${
    each((r) =>
      `if (qi${r} < ${s.T}u) {
    ${range(N).map((c) => `dqkv[qrow${r} + ${col(c)}] = dq${r}_${c} * ${scale};`).join("\n    ")}
  }`
    )
  }
}
`;
}

/** Workgroup bytes of the flash forward: Q tile, K tile (reused for P), V tile, and the "shared" row scratch. */
export function flashForwardBytes(BQ: number, BKV: number, D: number, f: FlashOptions): number {
  return 4 * (D * BQ + Math.max(D * BKV, BQ * BKV) + BKV * D + (f.reduce === "shared" ? f.lanes * BQ : 0));
}

/** Threads of a flash kernel's workgroup: `lanes` per 4 rows of its BQ (forward, dQ) or BKV (dK/dV) tile. */
export function flashThreads(rows: number, f: FlashOptions): number {
  return (rows / 4) * f.lanes;
}

/** Why a spec's flash tiling is not valid, or null (forward: rows = BQ; the backward checks its own). */
export function flashForwardError(s: AttentionSpec): string | null {
  const f = s.flash;
  if (!f) return "no flash options";
  const L = f.lanes, NT = flashThreads(s.BQ, f), D4 = s.D / 4;
  if (![4, 8, 16].includes(L)) return `lanes ${L} must be 4, 8 or 16`;
  if (s.D % (4 * L) || s.BKV % (4 * L)) return `D ${s.D} and BKV ${s.BKV} must be multiples of ${4 * L}`;
  if (s.BQ % 4) return `BQ ${s.BQ} must be a multiple of 4`;
  if ((s.BKV * D4) % NT || (s.BQ * D4) % NT) {
    return `tile ${s.BQ}x${s.BKV} does not divide among ${NT} threads`;
  }
  return null;
}

/** vec4<bool> of the 4 keys kb…kb+3 that query qi may see (causal, inside T). */
const seen = (kb: string, qi: string, T: number) =>
  `(vec4<u32>(${kb}) + vec4<u32>(0u, 1u, 2u, 3u) <= vec4<u32>(${qi})) & (vec4<u32>(${kb}) + vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(${T}u))`;

/** The lane-combining step of the flash kernels: `v` (vec4) becomes op over the `lanes` threads of its group. */
function laneReduce(
  f: FlashOptions,
  v: string,
  op: "max" | "+",
  red: string,
  g: string,
  c: string,
): string[] {
  const comb = (a: string, b: string) => (op === "max" ? `max(${a}, ${b})` : `${a} + ${b}`);
  if (f.reduce === "subgroup") {
    const out: string[] = [];
    for (let m = 1; m < f.lanes; m *= 2) out.push(`${v} = ${comb(v, `subgroupShuffleXor(${v}, ${m}u)`)};`);
    return out;
  }
  const out = [`${red}[${c}][${g}] = ${v};`, `workgroupBarrier();`, `${v} = ${red}[0][${g}];`];
  for (let k = 1; k < f.lanes; k++) out.push(`${v} = ${comb(v, `${red}[${k}][${g}]`)};`);
  out.push(`workgroupBarrier();`);
  return out;
}

/**
 * Forward, FlashAttention-2 style: a workgroup owns BQ queries; thread (qg, c) holds the scores of
 * rows qg·4…+3 against keys h·4L + c·4…+3 of each K tile (h < BKV/4L) and the output columns
 * g·4L + c·4…+3 (g < D/4L), L = lanes. Scores are in log2 units (scale·log2 e folded into q as it
 * is loaded), the running maximum is combined across the L lanes once per tile, the output and the
 * per-thread partial row sums are rescaled once per tile, and P goes through the K tile's
 * workgroup memory to the P·V product (its columns XOR-swizzled by row group, so the row groups of
 * one warp read different banks). Query tiles run last-first (the longest first). Grid
 * (ceil(T/BQ), H, B).
 */
function flashForwardWgsl(s: AttentionSpec): string {
  const err = flashForwardError(s);
  if (err) throw new RangeError(`Flash attention forward: ${err}`);
  const f = s.flash!, L = f.lanes;
  const { D4, C4, R4, scale } = header(s);
  const { T, BQ, BKV, D } = s;
  const QG = BQ / 4, NT = flashThreads(BQ, f), KQ = BKV / 4;
  const gk = BKV / (4 * L), gd = D / (4 * L);
  const kvSlots = (BKV * D4) / NT, qSlots = (BQ * D4) / NT;
  const prefetch = f.prefetch ?? true;
  const KPn = Math.max(D * BKV, BQ * BKV) / 4;
  const nQT = Math.ceil(T / BQ);
  const range = (n: number) => [...Array(n).keys()];
  const rows = range(4), hs = range(gk), gs = range(gd);
  const loads: string[] = [], stores: string[] = [];
  for (let sl = 0; sl < kvSlots; sl++) {
    const lin = `(${sl * NT}u + tid)`;
    loads.push(
      `{ let j = ${lin} % ${BKV}u; let dq = ${lin} / ${BKV}u;`,
      `  rk${sl} = qkv[(base + min(kt + j, ${T - 1}u)) * ${R4}u + ${C4}u + h * ${D4}u + dq];`,
      `  let jv = ${lin} / ${D4}u; let dv = ${lin} % ${D4}u;`,
      `  rv${sl} = qkv[(base + min(kt + jv, ${T - 1}u)) * ${R4}u + ${2 * C4}u + h * ${D4}u + dv]; }`,
    );
    stores.push(
      `{ let j = ${lin} % ${BKV}u; let dq = ${lin} / ${BKV}u;`,
      ...range(4).map((e) => `  KP[(dq * 4u + ${e}u) * ${KQ}u + j / 4u][j % 4u] = rk${sl}[${e}];`),
      `  Vs[${lin} / ${D4}u][${lin} % ${D4}u] = rv${sl}; }`,
    );
  }
  const qLoad: string[] = [];
  for (let sl = 0; sl < qSlots; sl++) {
    const lin = `(${sl * NT}u + tid)`;
    qLoad.push(
      `{ let i = ${lin} % ${BQ}u; let dq = ${lin} / ${BQ}u;`,
      `  let v = qkv[(base + min(q0 + i, ${T - 1}u)) * ${R4}u + h * ${D4}u + dq] * ${scale * Math.LOG2E};`,
      ...range(4).map((e) => `  Qs[dq * 4u + ${e}u][i / 4u][i % 4u] = v[${e}];`),
      `}`,
    );
  }
  const scoreFma: string[] = [];
  for (let d = 0; d < D; d++) {
    scoreFma.push(`qv = Qs[${d}][qg];`);
    for (const h of hs) scoreFma.push(`kv${h} = KP[${d * KQ + h * L}u + c];`);
    for (const r of rows) {
      for (const h of hs) scoreFma.push(`s${r}_${h} = fma(vec4<f32>(qv[${r}]), kv${h}, s${r}_${h});`);
    }
  }
  const soft: string[] = [];
  for (const r of rows) {
    for (const h of hs) {
      soft.push(`let ok${r}_${h} = ${seen(`kt + ${h * 4 * L}u + c * 4u`, `q0 + qg * 4u + ${r}u`, T)};`);
      soft.push(`s${r}_${h} = select(vec4<f32>(-1e30), s${r}_${h}, ok${r}_${h});`);
    }
  }
  const max4 = (v: string) => `max(max(${v}.x, ${v}.y), max(${v}.z, ${v}.w))`;
  const rowMax = (r: number) => hs.map((h) => max4(`s${r}_${h}`)).reduce((a, b) => `max(${a}, ${b})`);
  soft.push(`var mx = vec4<f32>(${rows.map(rowMax).join(", ")});`);
  soft.push(...laneReduce(f, "mx", "max", "red", "qg", "c"));
  soft.push(`let mn = max(m, mx);`, `let alpha = exp2(m - mn);`, `m = mn;`);
  soft.push(`var ls = vec4<f32>(0.0);`);
  for (const r of rows) {
    for (const g of gs) soft.push(`o${r}_${g} = o${r}_${g} * alpha[${r}];`);
    for (const h of hs) {
      soft.push(
        `let p${r}_${h} = select(vec4<f32>(0.0), exp2(s${r}_${h} - vec4<f32>(mn[${r}])), ok${r}_${h});`,
      );
      soft.push(`ls[${r}] = ls[${r}] + dot(p${r}_${h}, vec4<f32>(1.0));`);
      let pd = `p${r}_${h}`;
      if (s.dropout) {
        const st = `${s.dropout.site}u`;
        soft.push(
          `let di${r}_${h} = ((b * ${s.H}u + h) * ${T}u + q0 + qg * 4u + ${r}u) * ${T}u + kt + ${
            h * 4 * L
          }u + c * 4u;`,
        );
        pd = `p${r}_${h} * vec4<f32>(${range(4).map((e) => `keep(di${r}_${h} + ${e}u, ${st})`).join(", ")})`;
      }
      soft.push(`KP[(qg * 4u + ${r}u) * ${KQ}u + ((${h * L}u + c) ^ px)] = ${pd};`);
    }
  }
  soft.push(`l = l * alpha + ls;`);
  const pv: string[] = [];
  for (let jq = 0; jq < KQ; jq++) {
    for (const r of rows) pv.push(`pv${r} = KP[(qg * 4u + ${r}u) * ${KQ}u + (${jq}u ^ px)];`);
    for (let u = 0; u < 4; u++) {
      for (const g of gs) pv.push(`vv${g} = Vs[${jq * 4 + u}][${g * L}u + c];`);
      for (const r of rows) {
        for (const g of gs) pv.push(`o${r}_${g} = fma(vec4<f32>(pv${r}[${u}]), vv${g}, o${r}_${g});`);
      }
    }
  }
  const decl = [
    ...rows.flatMap((r) => gs.map((g) => `var o${r}_${g} = vec4<f32>(0.0);`)),
    ...rows.flatMap((r) => hs.map((h) => `var s${r}_${h}: vec4<f32>;`)),
    ...range(kvSlots).flatMap((sl) => [`var rk${sl}: vec4<f32>;`, `var rv${sl}: vec4<f32>;`]),
    `var qv: vec4<f32>;`,
    ...hs.map((h) => `var kv${h}: vec4<f32>;`),
    ...rows.map((r) => `var pv${r}: vec4<f32>;`),
    ...gs.map((g) => `var vv${g}: vec4<f32>;`),
  ];
  const out: string[] = [];
  for (const r of rows) {
    const body = gs.map((g) =>
      `y[(base + qi) * ${C4}u + h * ${D4}u + ${g * L}u + c] = o${r}_${g} * inv[${r}];`
    );
    body.push(
      `if (c == 0u) { lse[(b * ${s.H}u + h) * ${T}u + qi] = (m[${r}] + log2(l[${r}])) * ${Math.LN2}; }`,
    );
    out.push(`{ let qi = q0 + qg * 4u + ${r}u; if (qi < ${T}u) { ${body.join(" ")} } }`);
  }
  const ind = (a: string[], n: number) => a.join("\n" + " ".repeat(n));
  const zero = rows.flatMap((r) => hs.map((h) => `s${r}_${h} = vec4<f32>(0.0);`));
  const code = `
${forwardBindings(s)}
var<workgroup> Qs: array<array<vec4<f32>, ${QG}>, ${D}>;
var<workgroup> KP: array<vec4<f32>, ${KPn}>;
var<workgroup> Vs: array<array<vec4<f32>, ${D4}>, ${BKV}>;
${f.reduce === "shared" ? `var<workgroup> red: array<array<vec4<f32>, ${QG}>, ${L}>;` : ""}

@compute @workgroup_size(${NT})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let h = wg.y;
  let b = wg.z;
  let c = tid % ${L}u;
  let qg = tid / ${L}u;
  let px = qg % ${Math.min(32 / L, KQ)}u;
  let q0 = (${nQT - 1}u - wg.x) * ${BQ}u;
  let base = b * ${T}u;
  ${ind(decl, 2)}
  var m = vec4<f32>(-1e30);
  var l = vec4<f32>(0.0);
  ${ind(qLoad, 2)}
  let nkt = (min(${T}u, q0 + ${BQ}u) + ${BKV - 1}u) / ${BKV}u;
  var kt = 0u;
  ${ind(loads, 2)}
  ${ind(stores, 2)}
  workgroupBarrier();
  for (var t = 0u; t < nkt; t = t + 1u) {
    kt = t * ${BKV}u;
    let more = t + 1u < nkt;
    ${
    prefetch
      ? `if (more) {\n      kt = kt + ${BKV}u;\n      ${ind(loads, 6)}\n      kt = t * ${BKV}u;\n    }`
      : ""
  }
    ${ind(zero, 4)}
    ${ind(scoreFma, 4)}
    workgroupBarrier();
    ${ind(soft, 4)}
    workgroupBarrier();
    ${ind(pv, 4)}
    workgroupBarrier();
    if (more) {
      ${prefetch ? "" : `kt = kt + ${BKV}u;\n      ${ind(loads, 6)}`}
      ${ind(stores, 6)}
    }
    workgroupBarrier();
  }
  ${ind(laneReduce(f, "l", "+", "red", "qg", "c"), 2)}
  let inv = 1.0 / l;
  ${ind(out, 2)}
}
`;
  return code;
}

/** A flash kernel's tiling: its BQ, BKV and lanes (merged into an AttentionSpec). */
export type FlashTiles = Pick<AttentionSpec, "BQ" | "BKV" | "flash">;

/** What the flash choosers need to know of the device. */
export interface FlashLimits {
  maxWorkgroupBytes: number;
  maxThreads: number;
  /** The smallest subgroup the device may run (adapter.info.subgroupMinSize); 0 without the subgroups feature. */
  subgroupMinSize: number;
  /** maxStorageBufferBindingSize, for the backward's dS scratch. */
  maxBindingBytes?: number;
}

export const ft = (
  BQ: number,
  BKV: number,
  lanes: 4 | 8 | 16,
  reduce: FlashOptions["reduce"],
  prefetch = true,
) => ({
  BQ,
  BKV,
  flash: { lanes, reduce, ...(prefetch ? {} : { prefetch: false }) },
});

/** Flash forward tilings, preferred first (bench/attention_bench.ts times each on the device). */
export function flashForwardCandidates(): FlashTiles[] {
  return [
    ft(64, 64, 16, "subgroup"),
    ft(64, 64, 8, "subgroup"),
    ft(64, 32, 8, "subgroup"),
    ft(32, 64, 16, "subgroup"),
    ft(32, 32, 8, "subgroup"),
    ft(64, 64, 16, "subgroup", false),
    ft(64, 32, 8, "subgroup", false),
    ft(16, 16, 4, "subgroup"),
    ft(32, 32, 8, "shared"),
    ft(16, 16, 4, "shared"),
  ];
}

/** Whether a flash forward tiling runs on the device for these sizes. */
export function flashForwardFits(
  dims: Pick<AttentionSpec, "T" | "D">,
  t: FlashTiles,
  lim: FlashLimits,
): boolean {
  const f = t.flash!;
  const s = { B: 1, H: 1, ...dims, ...t };
  return flashForwardError(s) === null && flashThreads(t.BQ, f) <= lim.maxThreads &&
    flashForwardBytes(t.BQ, t.BKV, dims.D, f) <= lim.maxWorkgroupBytes &&
    (f.reduce === "shared" || lim.subgroupMinSize >= f.lanes);
}

/**
 * The flash forward tiling for a device (the first candidate that fits), or null: then the split
 * or plain kernels remain. A spec takes it as `{ ...spec, ...chooseFlashForward(…) }`.
 */
export function chooseFlashForward(
  dims: Pick<AttentionSpec, "T" | "D">,
  lim: FlashLimits,
): FlashTiles | null {
  return flashForwardCandidates().find((t) => flashForwardFits(dims, t, lim)) ?? null;
}

/** FLOPs of causal attention forward (QKᵀ and PV over the lower triangle). */
export function attentionFlops(s: Pick<AttentionSpec, "B" | "T" | "H" | "D">): number {
  return 2 * 2 * s.B * s.H * s.D * (s.T * (s.T + 1)) / 2;
}
