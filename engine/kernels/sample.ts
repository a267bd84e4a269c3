/**
 * Token sampling on the GPU, one workgroup per stream: temperature, top-k and top-p (nucleus)
 * over the real vocabulary only (padded ids are never candidates), greedy when temperature is 0.
 * Thresholds for top-k and top-p are found by bisection on the logit value with workgroup
 * reductions, so no sort is needed; the draw walks chunk sums in vocabulary order, which makes it
 * deterministic for a given seed and position. With top-k, the ids that can be kept (logit at
 * least the k-th largest of the threads' maxima) are first compacted in vocabulary order into
 * workgroup memory, so the bisections walk a few thousand values, not the vocabulary, each time;
 * at most one candidate per invocation, the top-k and top-p cuts are found exactly by rank (each
 * candidate counts the candidates, or sums the mass, at or above it) with no bisection at all.
 *
 * Per-row state (u32 words, STATE_WORDS per row): token, position, seed, steps written, cache slot.
 * Per-row parameters (f32/u32 words, PARAM_WORDS per row): temperature, top_k, top_p, logprobs.
 *
 * Logprobs (when a row asks for them) are of the model's own distribution, a log-softmax of the
 * raw logits over the real vocabulary: the chosen token's, and the top N (N ≤ LOGPROBS_MAX) found
 * by N rounds of a workgroup arg-max below the previous pick (ties to the lower id).
 */

import { PCG_WGSL } from "../../model/rng.ts";

/** u32 words of state per row: [token, position, seed, steps written, cache slot, unused ×3]. */
export const STATE_WORDS = 8;
/** Word of a row's state holding its KV-cache slot. */
export const STATE_SLOT = 4;
/**
 * Words of sampling parameters per row: [temperature (f32), top_k (u32, 0 = off), top_p (f32),
 * logprobs + 1 (u32, 0 = none)].
 */
export const PARAM_WORDS = 4;
/** Most top logprobs per token. */
export const LOGPROBS_MAX = 5;
/** f32 words per (row, step) in the logprobs output: [chosen, unused, then LOGPROBS_MAX × (id bits, logprob)]. */
export const LP_WORDS = 2 + 2 * LOGPROBS_MAX;

/**
 * Invocations per workgroup: 256 on GPUs; 64 on CPU adapters (with serialReductions), where every
 * barrier switches all invocations in turn and the sampler's bisections take about a hundred.
 */
const WG_GPU = 256, WG_CPU = 64;
const BISECT = 32;
/** Most top-k candidates compacted into workgroup memory (value and id: 8 bytes each). */
const CAP = 2048;

/** Sizes of the sampling kernel. */
export interface SampleSpec {
  V: number;
  Vp: number;
  /** Streams (workgroups). */
  streams: number;
  /** Tokens each stream can record per submission in `out` (steps of one chunk). */
  chunk: number;
  /**
   * Where each workgroup's logits row and state row are: "stream" uses row wg for both (decode);
   * "prefill" reads logits row wg for the state row `rowSel[wg·4 + 3]` (a batched prefill).
   */
  rows: "stream" | "prefill";
  /** Largest position a stream may reach (its context); positions stop advancing there. */
  maxPos: number;
  /**
   * CPU adapters: 64 invocations instead of 256, and workgroup sums and maxima by one invocation
   * over their partials (three barriers) instead of a tree (ten): llvmpipe runs every barrier as a
   * switch of all invocations. The results differ from the tree's in summation order only (top-k
   * above 64 then takes the passes over the vocabulary).
   */
  serialReductions?: boolean;
  /**
   * GPUs with the "subgroups" feature: workgroup sums, maxima and prefix sums through subgroup
   * operations and one exchange in workgroup memory (two barriers, not ten), the prefix sums in
   * parallel instead of by one invocation, and the draw's owner found by a workgroup minimum.
   * Subgroups must be laid out along the local invocation index (as NVIDIA's and llvmpipe's are).
   */
  subgroups?: boolean;
  /** Logit loads in flight per thread on each pass over the vocabulary (GPUs; default UNROLL_VOCAB). */
  unroll?: number;
  /**
   * GPUs: the rest of each pass (fewer values than its unroll) written out, its loads in flight
   * together and the uses guarded in order, and the candidates' rank loops 4 values a trip,
   * instead of loops that load one value at a time. The same picks, sums and logprobs.
   */
  writtenRest?: boolean;
  /**
   * CPU adapters: one invocation per row, no workgroup memory and no barriers (sampleDirectWgsl).
   * Mesa's OpenGL llvmpipe compiles the workgroup kernel's barriers as coroutines, for minutes;
   * this one compiles in about a second. Same picks as the CPU twin.
   */
  direct?: boolean;
}

/** Values each pass over the candidates loads before using them on GPUs (loads in flight per thread). */
const UNROLL = 8;
/**
 * Logits each pass over the vocabulary loads before using them on GPUs: a thread's ~197 logits
 * in a few round trips to memory (one workgroup per row has few threads to hide latency with).
 */
const UNROLL_VOCAB = 32;

/**
 * WGSL of a pass over `idx` in [from, to): loads U values ahead, then runs `body` on each (as
 * `x`, with `idx` its index) in order, so results are those of the plain loop while the loads
 * overlap (one at a time, a pass over a thread's 197 logits took about 40 µs on an H200).
 */
function pass(
  U: number,
  idx: string,
  from: string,
  to: string,
  load: (i: string) => string,
  body: string,
  writtenRest = false,
): string {
  const b = `${idx}_b`;
  if (U === 1) {
    return `for (var ${b} = ${from}; ${b} < ${to}; ${b} = ${b} + 1u) { let ${idx} = ${b}; let x = ${
      load(b)
    }; ${body} }`;
  }
  const loads = Array.from({ length: U }, (_, u) => `let x${u} = ${load(`${b} + ${u}u`)};`).join(" ");
  const uses = Array.from({ length: U }, (_, u) => `{ let ${idx} = ${b} + ${u}u; let x = x${u}; ${body} }`);
  // The rest: U − 1 loads at clamped indexes (in range: `to` − 1, or 0 for an empty range), then
  // each use in order where its index is below `to`.
  const rest = !writtenRest
    ? `for (; ${b} < ${to}; ${b} = ${b} + 1u) { let ${idx} = ${b}; let x = ${load(b)}; ${body} }`
    : `{
      let ${b}_l = max(${to}, 1u) - 1u;
      ${
      Array.from({ length: U - 1 }, (_, u) => `let r${u} = ${load(`min(${b} + ${u}u, ${b}_l)`)};`).join(" ")
    }
      ${
      Array.from({ length: U - 1 }, (_, u) =>
        `if (${b} + ${u}u < ${to}) { let ${idx} = ${b} + ${u}u; let x = r${u}; ${body} }`).join("\n      ")
    }
    }`;
  return `{
    var ${b} = ${from};
    for (; ${b} + ${U - 1}u < ${to}; ${b} = ${b} + ${U}u) {
      ${loads}
      ${uses.join("\n      ")}
    }
    ${rest}
  }`;
}

/**
 * A loop over the candidates cval[0 … n) with `body` seeing each as y, in order (writtenRest):
 * four loads a trip, then the rest one at a time.
 */
function rankLoop(j: string, n: string, body: string): string {
  const one = `for (; ${j} < ${n}; ${j} = ${j} + 1u) { let y = cval[${j}]; ${body} }`;
  return `var ${j} = 0u;
        for (; ${j} + 3u < ${n}; ${j} = ${j} + 4u) {
          let y0 = cval[${j}]; let y1 = cval[${j} + 1u]; let y2 = cval[${j} + 2u]; let y3 = cval[${j} + 3u];
          ${[0, 1, 2, 3].map((u) => `{ let y = y${u}; ${body} }`).join(" ")}
        }
        ${one}`;
}

const TREE_REDUCTIONS = (WG: number) => `
fn sum_all(v: f32, tid: u32) -> f32 {
  workgroupBarrier();
  red[tid] = v;
  workgroupBarrier();
  for (var k = ${WG / 2}u; k > 0u; k = k >> 1u) {
    if (tid < k) { red[tid] = red[tid] + red[tid + k]; }
    workgroupBarrier();
  }
  return red[0];
}

fn max_all(v: f32, tid: u32) -> f32 {
  workgroupBarrier();
  red[tid] = v;
  workgroupBarrier();
  for (var k = ${WG / 2}u; k > 0u; k = k >> 1u) {
    if (tid < k) { red[tid] = max(red[tid], red[tid + k]); }
    workgroupBarrier();
  }
  return red[0];
}`;

const SERIAL_REDUCTIONS = (WG: number) => `
fn sum_all(v: f32, tid: u32) -> f32 {
  workgroupBarrier();
  red[tid] = v;
  workgroupBarrier();
  if (tid == 0u) {
    var t = 0.0;
    for (var k = 0u; k < ${WG}u; k = k + 1u) { t = t + red[k]; }
    wred = t;
  }
  return workgroupUniformLoad(&wred);
}

fn max_all(v: f32, tid: u32) -> f32 {
  workgroupBarrier();
  red[tid] = v;
  workgroupBarrier();
  if (tid == 0u) {
    var t = -3.0e38;
    for (var k = 0u; k < ${WG}u; k = k + 1u) { t = max(t, red[k]); }
    wred = t;
  }
  return workgroupUniformLoad(&wred);
}`;

/** A workgroup reduction through subgroups (see SUBGROUP_REDUCTIONS): `fn name(v, tid) -> type`. */
function subgroupReduce(
  WG: number,
  name: string,
  type: "f32" | "u32",
  shared: "sgf" | "sgu",
  op: string,
  init: string,
  combine: (a: string, b: string) => string,
): string {
  return `fn ${name}(v: ${type}, tid: u32) -> ${type} {
  let s = ${op}(v);
  workgroupBarrier();
  if (sgl == 0u) { ${shared}[tid / sgs] = s; }
  workgroupBarrier();
  var t = ${init};
  for (var k = 0u; k < ${WG}u / sgs; k = k + 1u) { t = ${combine("t", `${shared}[k]`)}; }
  return t;
}`;
}

/**
 * Workgroup reductions through subgroups: each subgroup reduces in registers, its first lane
 * leaves the result in workgroup memory, and every invocation combines the WG / subgroup-size
 * partials in subgroup order (the same value everywhere). Also the exclusive prefix sums (in
 * local invocation order) the kernel otherwise leaves to one invocation.
 */
const SUBGROUP_REDUCTIONS = (WG: number) => `
var<workgroup> sgf: array<f32, ${WG}>;
var<workgroup> sgu: array<u32, ${WG}>;
var<private> sgs: u32;
var<private> sgl: u32;

${subgroupReduce(WG, "sum_all", "f32", "sgf", "subgroupAdd", "0.0", (a, b) => `${a} + ${b}`)}
${subgroupReduce(WG, "max_all", "f32", "sgf", "subgroupMax", "-3.0e38", (a, b) => `max(${a}, ${b})`)}
${subgroupReduce(WG, "min_all_u", "u32", "sgu", "subgroupMin", "0xffffffffu", (a, b) => `min(${a}, ${b})`)}
${subgroupReduce(WG, "max_all_u", "u32", "sgu", "subgroupMax", "0u", (a, b) => `max(${a}, ${b})`)}

/** Σ v over the invocations before this one; the total lands in wcount. */
fn prefix_u(v: u32, tid: u32) -> u32 {
  let inc = subgroupInclusiveAdd(v);
  workgroupBarrier();
  if (sgl == sgs - 1u) { sgu[tid / sgs] = inc; }
  workgroupBarrier();
  let me = tid / sgs;
  var before = 0u;
  var total = 0u;
  for (var k = 0u; k < ${WG}u / sgs; k = k + 1u) {
    let t = sgu[k];
    before = before + select(0u, t, k < me);
    total = total + t;
  }
  if (tid == 0u) { wcount = total; }
  return before + inc - v;
}

/** Σ v over the invocations before this one (floats). */
fn prefix_f(v: f32, tid: u32) -> f32 {
  let inc = subgroupInclusiveAdd(v);
  workgroupBarrier();
  if (sgl == sgs - 1u) { sgf[tid / sgs] = inc; }
  workgroupBarrier();
  var before = 0.0;
  for (var k = 0u; k < tid / sgs; k = k + 1u) { before = before + sgf[k]; }
  return before + subgroupExclusiveAdd(v);
}`;

/**
 * The draw's owner: the thread whose stretch holds u (a uniform draw in [0, total)), and `rest`,
 * u less the mass before that stretch. Sequential over the workgroup's partial masses by thread
 * 0 (cheap, deterministic).
 */
const DRAW_SERIAL = (WG: number) =>
  `// Exclusive prefix of chunk masses (sequential over ${WG} values by thread 0).
    workgroupBarrier();
    red[tid] = mine;
    workgroupBarrier();
    if (tid == 0u) {
      let st = stream * ${STATE_WORDS}u;
      let r = pcg(pcg(state[st + 2u]) ^ pcg(state[st + 1u] + 0x68e31da4u));
      let u = (f32(r >> 8u) + 0.5) / 16777216.0 * total;
      var acc = 0.0;
      var owner = ${WG - 1}u;
      for (var k = 0u; k < ${WG}u; k = k + 1u) {
        if (u < acc + red[k] && red[k] > 0.0) { owner = k; break; }
        acc = acc + red[k];
      }
      redi[0] = owner;
      red[0] = u - acc;
    }
    workgroupBarrier();
    let owner = redi[0];
    let rest = red[0];
    workgroupBarrier();`;

/**
 * The draw's owner with subgroups: every thread draws u, takes its exclusive prefix of the
 * stretch masses, and the owner is the lowest thread whose stretch ends above u. When rounding
 * leaves u past every stretch, the last thread with mass owns it and picks its last kept id.
 */
const DRAW_SUBGROUPS = `let st = stream * ${STATE_WORDS}u;
    let r = pcg(pcg(state[st + 2u]) ^ pcg(state[st + 1u] + 0x68e31da4u));
    let u = (f32(r >> 8u) + 0.5) / 16777216.0 * total;
    let before = prefix_f(mine, tid);
    let found = min_all_u(select(0xffffffffu, tid, mine > 0.0 && u < before + mine), tid);
    let lastWithMass = max_all_u(select(0u, tid, mine > 0.0), tid);
    let owner = select(found, lastWithMass, found == 0xffffffffu);
    let rest = select(u - before, 3.0e38, found == 0xffffffffu);`;

/**
 * The sampling kernel: writes the next token into state and out[row, steps written], and when the
 * row asks for logprobs, lp[row, steps written] (LP_WORDS each). Grid (rows).
 */
export function sampleWgsl(s: SampleSpec): string {
  if (s.direct) return sampleDirectWgsl(s);
  const WG = s.serialReductions ? WG_CPU : WG_GPU;
  const sg = !!s.subgroups && !s.serialReductions;
  const per = Math.ceil(s.V / WG);
  const LG = (i: string) => `logits[base + ${i}]`, CV = (i: string) => `cval[${i}]`;
  // CPU adapters run each invocation's loop serially anyway: no unrolling there.
  const U = s.serialReductions ? 1 : UNROLL, UV = s.serialReductions ? 1 : s.unroll ?? UNROLL_VOCAB;
  const wr = !!s.writtenRest && !s.serialReductions;
  const P = (U: number, idx: string, from: string, to: string, load: (i: string) => string, body: string) =>
    pass(U, idx, from, to, load, body, wr);
  /** The lowest of the workgroup's u32 values `v` (uniform), through `redi`. */
  const minU = (v: string) => sg ? `min_all_u(${v}, tid)` : `min_tree_u(${v}, tid)`;
  /**
   * A pass over this thread's stretch [j0, j1) of the candidates (workgroup memory, UNROLL loads
   * ahead) or, when there are none, of the vocabulary (UV ahead); `body(id)` sees the value as x.
   */
  const walk = (body: (id: string) => string) =>
    `if (compact) { ${P(U, "j", "j0", "j1", CV, body("cid[j]"))} } else { ${
      P(UV, "j", "j0", "j1", LG, body("j"))
    } }`;
  return `
@group(0) @binding(0) var<storage, read> logits: array<f32>;
@group(0) @binding(1) var<storage, read_write> state: array<u32>;
@group(0) @binding(2) var<storage, read> params: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<u32>;
@group(0) @binding(4) var<storage, read_write> lp: array<f32>;
${s.rows === "prefill" ? "@group(0) @binding(5) var<storage, read> rowSel: array<u32>;" : ""}
${PCG_WGSL}
var<workgroup> red: array<f32, ${WG}>;
var<workgroup> redi: array<u32, ${WG}>;
var<workgroup> cval: array<f32, ${CAP}>;
var<workgroup> cid: array<u32, ${CAP}>;
var<workgroup> wbound: f32;
var<workgroup> wcount: u32;
var<workgroup> wred: f32;

/** The vocabulary id of value j. */
fn idOf(j: u32, compact: bool) -> u32 {
  if (compact) { return cid[j]; }
  return j;
}

${sg ? SUBGROUP_REDUCTIONS(WG) : s.serialReductions ? SERIAL_REDUCTIONS(WG) : TREE_REDUCTIONS(WG)}

fn min_tree_u(v: u32, tid: u32) -> u32 {
  workgroupBarrier();
  redi[tid] = v;
  workgroupBarrier();
  for (var k = ${WG / 2}u; k > 0u; k = k >> 1u) {
    if (tid < k) { redi[tid] = min(redi[tid], redi[tid + k]); }
    workgroupBarrier();
  }
  return redi[0];
}

@compute @workgroup_size(${WG})
fn main(
  @builtin(workgroup_id) wg: vec3<u32>,
  @builtin(local_invocation_index) tid: u32,${
    sg ? "\n  @builtin(subgroup_size) sgsize: u32,\n  @builtin(subgroup_invocation_id) sglane: u32," : ""
  }
) {
  ${sg ? "sgs = sgsize;\n  sgl = sglane;" : ""}
  ${
    s.rows === "prefill"
      ? "let stream = rowSel[wg.x * 4u + 3u];\n  let row = wg.x;"
      : "let stream = wg.x;\n  let row = wg.x;"
  }
  let base = row * ${s.Vp}u;
  let temp = bitcast<f32>(params[stream * ${PARAM_WORDS}u]);
  let topk = params[stream * ${PARAM_WORDS}u + 1u];
  let topp = bitcast<f32>(params[stream * ${PARAM_WORDS}u + 2u]);
  // Each thread owns a contiguous chunk of the vocabulary, so chunk order is vocabulary order.
  let v0 = min(tid * ${per}u, ${s.V}u);
  let v1 = min(v0 + ${per}u, ${s.V}u);
  var tmax = -3.0e38;
  var targ = 0xffffffffu;
  ${P(UV, "v", "v0", "v1", LG, "if (x > tmax) { tmax = x; targ = v; }")}
  let mx = max_all(tmax, tid);
  var choice = 0u;
  if (temp <= 0.0) {
    // Greedy: the lowest id holding the maximum.
    choice = ${minU("select(0xffffffffu, targ, tmax == mx)")};
  } else {
    let inv = 1.0 / temp;
    // With top-k (k ≤ ${WG}) the k-th largest of the threads' maxima, L, bounds the cut from below
    // (k values are ≥ L), so only ids with logit ≥ L can be kept: they are compacted in vocabulary
    // order into workgroup memory and every later pass runs over them instead of the vocabulary.
    // Top-p alone has a bound too when the threads' maxima alone carry top_p of the mass (a
    // peaked distribution, as a trained model's usually is). More than ${CAP} candidates, a larger
    // k, or no bound keeps the passes over the vocabulary.
    var compact = false;
    var bound = -3.0e38;
    var count = 0u;
    // Top-p alone keeps the whole vocabulary first: its mass now, over the vocabulary.
    let nucleusOnly = (topk == 0u || topk >= ${s.V}u) && topp > 0.0 && topp < 1.0;
    var zfull = 0.0;
    if (nucleusOnly) {
      var zf = 0.0;
      ${P(UV, "v", "v0", "v1", LG, "zf = zf + exp((x - mx) * inv);")}
      zfull = sum_all(zf, tid);
    }
    var bounded = false;
    if (topk > 0u && topk <= ${WG}u && topk < ${s.V}u) {
      workgroupBarrier();
      red[tid] = tmax;
      workgroupBarrier();
      var above = 0u;
      ${
    sg
      ? `// Four maxima per load: the threads above this one (larger, or equal at a lower index).
      let tm = vec4<f32>(tmax);
      for (var t = 0u; t < ${WG}u; t = t + 4u) {
        let o = vec4<f32>(red[t], red[t + 1u], red[t + 2u], red[t + 3u]);
        let ti = vec4<u32>(t, t + 1u, t + 2u, t + 3u);
        let a = select(vec4<u32>(0u), vec4<u32>(1u), (o > tm) | ((o == tm) & (ti < vec4<u32>(tid))));
        above = above + a.x + a.y + a.z + a.w;
      }`
      : `for (var t = 0u; t < ${WG}u; t = t + 1u) {
        let o = red[t];
        if (o > tmax || (o == tmax && t < tid)) { above = above + 1u; }
      }`
  }
      if (above == topk - 1u) { wbound = tmax; }
      bound = workgroupUniformLoad(&wbound);
      bounded = true;
    } else if (nucleusOnly) {
      // The largest thread maximum whose mass with the maxima above it reaches top_p: the
      // nucleus then holds no id below it (when none does, the passes run over the vocabulary).
      workgroupBarrier();
      red[tid] = tmax;
      workgroupBarrier();
      var m = 0.0;
      for (var t = 0u; t < ${WG}u; t = t + 1u) {
        let o = red[t];
        if (o >= tmax) { m = m + exp((o - mx) * inv); }
      }
      bound = max_all(select(-3.0e38, tmax, m >= topp * zfull), tid);
      bounded = bound > -3.0e38;
    }
    if (bounded) {
      var cnt = 0u;
      ${P(UV, "v", "v0", "v1", LG, "cnt = cnt + select(0u, 1u, x >= bound);")}
      ${
    sg ? "let first = prefix_u(cnt, tid);" : `redi[tid] = cnt;
      workgroupBarrier();
      if (tid == 0u) {
        var acc = 0u;
        for (var k = 0u; k < ${WG}u; k = k + 1u) { let c = redi[k]; redi[k] = acc; acc = acc + c; }
        wcount = acc;
      }`
  }
      count = workgroupUniformLoad(&wcount);
      if (count <= ${CAP}u) {
        compact = true;
        var at = ${sg ? "first" : "redi[tid]"};
        ${P(UV, "v", "v0", "v1", LG, "if (x >= bound) { cval[at] = x; cid[at] = v; at = at + 1u; }")}
      }
      workgroupBarrier();
    }
    // This thread's stretch of the values the passes below walk: candidates or vocabulary.
    let span = select(${s.V}u, count, compact);
    let per = (span + ${WG - 1}u) / ${WG}u;
    let j0 = min(tid * per, span);
    let j1 = min(j0 + per, span);
    // Cut-off logit: keep ids with logit >= cut. Top-k: the largest cut keeping at least k ids.
    var cut = -3.0e38;
    var lo = mx - 80.0 * temp;
    var hi = mx;
    // Few candidates (one per invocation at most): exact cuts by rank instead of bisection.
    let ranked = compact && count <= ${WG}u;
    if (ranked && topk > 0u && topk < ${s.V}u) {
      // The k-th largest candidate: the largest one with at least k candidates ≥ it.
      var mv = -3.0e38;
      if (tid < count) {
        let c = cval[tid];
        var ge = 0u;
        ${
    wr
      ? rankLoop("j", "count", "ge = ge + select(0u, 1u, y >= c);")
      : "for (var j = 0u; j < count; j = j + 1u) { ge = ge + select(0u, 1u, cval[j] >= c); }"
  }
        if (ge >= topk) { mv = c; }
      }
      cut = max_all(mv, tid);
    } else if (topk > 0u && topk < ${s.V}u) {
      var a = bound;
      if (!compact) {
        var lo2 = lo;
        ${P(UV, "v", "v0", "v1", LG, "lo2 = min(lo2, x);")}
        workgroupBarrier();
        red[tid] = lo2;
        workgroupBarrier();
        for (var k = ${WG / 2}u; k > 0u; k = k >> 1u) {
          if (tid < k) { red[tid] = min(red[tid], red[tid + k]); }
          workgroupBarrier();
        }
        a = red[0];
      }
      var b = mx;
      for (var it = 0u; it < ${BISECT}u; it = it + 1u) {
        let mid = 0.5 * (a + b);
        var cnt = 0.0;
        ${walk(() => "cnt = cnt + select(0.0, 1.0, x >= mid);")}
        if (sum_all(cnt, tid) >= f32(topk)) { a = mid; } else { b = mid; }
      }
      cut = a;
    }
    // The kept mass, which only the nucleus needs (top-p alone keeps the vocabulary: its mass is
    // zfull, taken above). Without top-p no pass: the draw sums the same mass below.
    var zs = zfull;
    if (!nucleusOnly && topp > 0.0 && topp < 1.0) {
      var z = 0.0;
      ${walk(() => "if (x >= cut) { z = z + exp((x - mx) * inv); }")}
      zs = sum_all(z, tid);
    }
    if (ranked && topp > 0.0 && topp < 1.0) {
      // Nucleus: the largest kept candidate whose kept mass at or above it reaches top_p.
      var mv = -3.0e38;
      if (tid < count) {
        let c = cval[tid];
        if (c >= cut) {
          var m = 0.0;
          ${
    wr
      ? rankLoop("j", "count", "if (y >= c && y >= cut) { m = m + exp((y - mx) * inv); }")
      : `for (var j = 0u; j < count; j = j + 1u) {
            let y = cval[j];
            if (y >= c && y >= cut) { m = m + exp((y - mx) * inv); }
          }`
  }
          if (m >= topp * zs) { mv = c; }
        }
      }
      cut = max(cut, max_all(mv, tid));
    } else if (topp > 0.0 && topp < 1.0) {
      // Nucleus: the largest cut whose kept mass is still >= top_p.
      var a = max(cut, lo);
      var b = mx;
      for (var it = 0u; it < ${BISECT}u; it = it + 1u) {
        let mid = 0.5 * (a + b);
        var m = 0.0;
        ${walk(() => "if (x >= mid && x >= cut) { m = m + exp((x - mx) * inv); }")}
        if (sum_all(m, tid) >= topp * zs) { a = mid; } else { b = mid; }
      }
      cut = max(cut, a);
    }
    var mine = 0.0;
    ${walk(() => "if (x >= cut) { mine = mine + exp((x - mx) * inv); }")}
    let total = sum_all(mine, tid);
    ${sg ? DRAW_SUBGROUPS : DRAW_SERIAL(WG)}
    if (tid == owner) {
      var acc = 0.0;
      var pick = 0xffffffffu;
      var last = idOf(j0, compact);
      ${
    walk((id) =>
      `if (x >= cut) { last = ${id}; acc = acc + exp((x - mx) * inv); if (pick == 0xffffffffu && rest < acc) { pick = last; } }`
    )
  }
      redi[0] = select(pick, last, pick == 0xffffffffu);
    }
    workgroupBarrier();
    choice = redi[0];
  }
  let nlp = params[stream * ${PARAM_WORDS}u + 3u];
  if (nlp > 0u) {
    // Log-softmax of the raw logits: lse = mx + log Σ exp(x − mx).
    var z1 = 0.0;
    ${P(UV, "v", "v0", "v1", LG, "z1 = z1 + exp(x - mx);")}
    let lse = mx + log(sum_all(z1, tid));
    let n = state[stream * ${STATE_WORDS}u + 3u];
    let o = (stream * ${s.chunk}u + min(n, ${s.chunk - 1}u)) * ${LP_WORDS}u;
    var pv = 3.0e38;
    var pi = 0u;
    for (var i = 0u; i < min(nlp - 1u, ${LOGPROBS_MAX}u); i = i + 1u) {
      var bv = -3.0e38;
      var bi = 0xffffffffu;
      ${P(UV, "v", "v0", "v1", LG, "if ((x < pv || (x == pv && v > pi)) && x > bv) { bv = x; bi = v; }")}
      let top = max_all(bv, tid);
      let id = ${minU("select(0xffffffffu, bi, bv == top)")};
      if (tid == 0u && n < ${s.chunk}u) {
        lp[o + 2u + 2u * i] = bitcast<f32>(id);
        lp[o + 3u + 2u * i] = top - lse;
      }
      pv = top;
      pi = id;
    }
    if (tid == 0u && n < ${s.chunk}u) { lp[o] = logits[base + choice] - lse; }
  }
  if (tid == 0u) {
    let st = stream * ${STATE_WORDS}u;
    state[st] = choice;
    let n = state[st + 3u];
    if (n < ${s.chunk}u) { out[stream * ${s.chunk}u + n] = choice; }
    state[st + 3u] = n + 1u;
    state[st + 1u] = min(state[st + 1u] + 1u, ${s.maxPos}u);
  }
}
`;
}

/**
 * Values each loop iteration of the direct kernel handles: the fewest (a power of two, code size
 * is compile time) that keep its worst case (about 20 passes over the vocabulary, plus 4,300
 * iterations of histogram work) under llvmpipe's 65,535 loop iterations. 32 for GPT-2's vocabulary.
 */
export function directUnroll(V: number): number {
  let U = 4;
  while (20 * Math.ceil(V / U) + 4300 > 60_000) U *= 2;
  return U;
}

/**
 * The sampling kernel as one invocation per row, with no workgroup memory and no barriers: the
 * same definition as sampleWgsl (keep the top-k ids, ties included, then the nucleus, then draw in
 * vocabulary order). The cuts are found exactly by radix selection on the logits' order-preserving
 * bits (four passes of a 256-bin histogram each): top-k counts ids per bin, the nucleus sums their
 * mass. Mesa's llvmpipe stops every loop of an invocation once it has run 65,535 iterations in all
 * (a silent limit), so each pass walks directUnroll(V) values per iteration. One invocation adds thousands of masses (each at
 * most 1) where the workgroup kernel adds short partials, and llvmpipe's float math defeats
 * compensated sums, so masses are summed in 64-bit fixed point (two u32 words, 31 fraction bits):
 * exact integer adds. Grid (rows), workgroup size 1.
 */
export function sampleDirectWgsl(s: SampleSpec): string {
  const U = directUnroll(s.V);
  const LG = (i: string) => `logits[base + ${i}]`;
  const all = (body: string) => pass(U, "v", "0u", `${s.V}u`, LG, body);
  const W = "exp((x - mx) * inv)";
  /** Radix selection: the key whose rank (`count`) or running mass (`mass`) from the top first reaches the target. */
  const radix = (what: "count" | "mass", keep: string) =>
    `{
      var prefix = 0u;
      var mask = 0u;
      var above = Fx(0u, 0u);
      for (var shift = 24u; ; shift = shift - 8u) {
        for (var i = 0u; i < 256u; i = i + 1u) { hh[i] = 0u; hl[i] = 0u; }
        ${
      all(
        `if (${keep} && (key(x) & mask) == prefix) { let bin = (key(x) >> shift) & 255u; ${
          what === "count"
            ? "hh[bin] = hh[bin] + 1u;"
            : `let f = fxAdd(Fx(hh[bin], hl[bin]), fxOf(${W})); hh[bin] = f.h; hl[bin] = f.l;`
        } }`,
      )
    }
        var bin = 255u;
        for (; bin > 0u; bin = bin - 1u) {
          let next = ${what === "count" ? "Fx(above.h + hh[bin], 0u)" : "fxAdd(above, Fx(hh[bin], hl[bin]))"};
          if (fxGe(next, goal)) { break; }
          above = next;
        }
        prefix = prefix | (bin << shift);
        mask = mask | (255u << shift);
        if (shift == 0u) { break; }
      }
      found = unkey(prefix);
    }`;
  return `
@group(0) @binding(0) var<storage, read> logits: array<f32>;
@group(0) @binding(1) var<storage, read_write> state: array<u32>;
@group(0) @binding(2) var<storage, read> params: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<u32>;
@group(0) @binding(4) var<storage, read_write> lp: array<f32>;
${s.rows === "prefill" ? "@group(0) @binding(5) var<storage, read> rowSel: array<u32>;" : ""}
${PCG_WGSL}

/** Order-preserving bits of a float: larger floats give larger keys. */
fn key(x: f32) -> u32 {
  let b = bitcast<u32>(x);
  return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

fn unkey(k: u32) -> f32 {
  return bitcast<f32>(select(~k, k & 0x7fffffffu, (k & 0x80000000u) != 0u));
}

/** A non-negative number h + l / 2^31 (l < 2^31): masses summed exactly. */
struct Fx { h: u32, l: u32 }

/** A mass in [0, 1] (or any non-negative f32 below 2^32) in fixed point. */
fn fxOf(w: f32) -> Fx {
  let h = floor(w);
  return Fx(u32(h), u32((w - h) * 2147483648.0));
}

fn fxAdd(a: Fx, b: Fx) -> Fx {
  let l = a.l + b.l;
  return Fx(a.h + b.h + select(0u, 1u, l >= 0x80000000u), l & 0x7fffffffu);
}

/** a − b for a ≥ b. */
fn fxSub(a: Fx, b: Fx) -> Fx {
  let borrow = a.l < b.l;
  return Fx(a.h - b.h - select(0u, 1u, borrow), select(a.l - b.l, a.l + 0x80000000u - b.l, borrow));
}

fn fxGe(a: Fx, b: Fx) -> bool {
  return a.h > b.h || (a.h == b.h && a.l >= b.l);
}

fn fxF32(a: Fx) -> f32 {
  return f32(a.h) + f32(a.l) * (1.0 / 2147483648.0);
}

@compute @workgroup_size(1)
fn main(@builtin(workgroup_id) wg: vec3<u32>) {
  ${s.rows === "prefill" ? "let stream = rowSel[wg.x * 4u + 3u];" : "let stream = wg.x;"}
  let base = wg.x * ${s.Vp}u;
  let temp = bitcast<f32>(params[stream * ${PARAM_WORDS}u]);
  let topk = params[stream * ${PARAM_WORDS}u + 1u];
  let topp = bitcast<f32>(params[stream * ${PARAM_WORDS}u + 2u]);
  var mx = -3.0e38;
  var arg = 0u;
  ${all("if (x > mx) { mx = x; arg = v; }")}
  var choice = arg;
  var hh: array<u32, 256>;
  var hl: array<u32, 256>;
  var found = 0.0;
  if (temp > 0.0) {
    let inv = 1.0 / temp;
    var cut = -3.0e38;
    if (topk > 0u && topk < ${s.V}u) {
      // The k-th largest logit (ties counted): the key where the count from the top reaches k.
      let goal = Fx(topk, 0u);
      ${radix("count", "true")}
      cut = found;
    }
    if (topp > 0.0 && topp < 1.0) {
      var z = Fx(0u, 0u);
      ${all(`if (x >= cut) { z = fxAdd(z, fxOf(${W})); }`)}
      // The largest kept logit whose kept mass at or above it reaches top_p.
      let goal = fxOf(topp * fxF32(z));
      ${radix("mass", "x >= cut")}
      cut = max(cut, found);
    }
    var total = Fx(0u, 0u);
    ${all(`if (x >= cut) { total = fxAdd(total, fxOf(${W})); }`)}
    let st = stream * ${STATE_WORDS}u;
    let r = pcg(pcg(state[st + 2u]) ^ pcg(state[st + 1u] + 0x68e31da4u));
    // The draw: u less the mass of the kept ids before; the pick is where that rest falls below a mass.
    var rest = fxOf((f32(r >> 8u) + 0.5) / 16777216.0 * fxF32(total));
    var pick = 0xffffffffu;
    var last = arg;
    ${
    all(
      `if (x >= cut && pick == 0xffffffffu) { last = v; let w = fxOf(${W}); if (fxGe(rest, w)) { rest = fxSub(rest, w); } else { pick = v; } }`,
    )
  }
    choice = select(pick, last, pick == 0xffffffffu);
  }
  let nlp = params[stream * ${PARAM_WORDS}u + 3u];
  let st = stream * ${STATE_WORDS}u;
  let n = state[st + 3u];
  if (nlp > 0u) {
    var z1 = 0.0;
    ${all("z1 = z1 + exp(x - mx);")}
    let lse = mx + log(z1);
    let o = (stream * ${s.chunk}u + min(n, ${s.chunk - 1}u)) * ${LP_WORDS}u;
    var pv = 3.0e38;
    var pi = 0u;
    for (var i = 0u; i < min(nlp - 1u, ${LOGPROBS_MAX}u); i = i + 1u) {
      var bv = -3.0e38;
      var bi = 0xffffffffu;
      ${all("if ((x < pv || (x == pv && v > pi)) && x > bv) { bv = x; bi = v; }")}
      if (n < ${s.chunk}u) {
        lp[o + 2u + 2u * i] = bitcast<f32>(bi);
        lp[o + 3u + 2u * i] = bv - lse;
      }
      pv = bv;
      pi = bi;
    }
    if (n < ${s.chunk}u) { lp[o] = logits[base + choice] - lse; }
  }
  state[st] = choice;
  if (n < ${s.chunk}u) { out[stream * ${s.chunk}u + n] = choice; }
  state[st + 3u] = n + 1u;
  state[st + 1u] = min(state[st + 1u] + 1u, ${s.maxPos}u);
}
`;
}
