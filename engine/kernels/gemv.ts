/**
 * Skinny matmul for decoding: out[M,N] = x[M,K] · W[K,N] (+ bias, epilogue), one row per stream.
 * The tiled matmul wastes most of its block and, with few column blocks, leaves the GPU idle;
 * decoding is bound by reading W. Here each workgroup streams a slice of K for 128 columns and up
 * to 8 rows (coalesced vec4 loads, k-groups summed in workgroup memory), split over enough
 * workgroups to fill the GPU; more rows run as row groups along the grid's z (the groups read
 * the same W slices at about the same time, mostly from L2). A second small kernel sums the
 * K-splits and applies the epilogue.
 */

import { GELU_WGSL, UNIFORM_BINDING_BYTES } from "./common.ts";

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
  /**
   * Fuse the preceding gemv's reduce and GELU: x holds that gemv's KS K-split partial sums of
   * this one's input ([KS][M][K]), and binding xb its bias; each staged x value is GELU(Σ + bias),
   * summed in gemvReduceWgsl's order so it equals the value the reduce would have stored. Staged.
   */
  geluOf?: { KS: number };
  /**
   * With `ln`: fuse the preceding gemv's reduce and its residual add. x holds that gemv's KS K-split
   * partial sums ([KS][M][K]); each row this LayerNorm normalises is res + (Σ + xb), summed in
   * gemvReduceWgsl's order, so it equals what that reduce's residual epilogue would have stored.
   * Every workgroup sums its rows once into workgroup memory, and the first of each row group
   * (wg.x = wg.y = 0) also writes them to xo: the residual stream the layers after read.
   * Bindings after lnw, lnb: res, xb, xo.
   */
  lnOf?: { KS: number };
  /**
   * Stage each stretch of the (normalised) x rows in workgroup memory and keep UNROLL weight
   * loads in flight per thread (GPUs: the plain loop waits on one load at a time). The products
   * and their order are the same, so the sums are bit-identical to the plain kernel's.
   */
  staged?: boolean;
  /** Weight loads in flight per thread in the staged loop (default 4); the sums are the same. */
  unroll?: number;
  /** Rows one workgroup serves (default and at most GEMV_MAX_ROWS; 16 where `rows16`). */
  groupRows?: number;
}

/** k values of x staged per pass of the staged gemv. */
const STAGE_K = 128;
/** Default weight loads in flight per thread of the staged gemv. */
export const GEMV_UNROLL = 4;

/** Rows one workgroup serves (the gemv partial's row group, the transposed gemv's M). */
export const GEMV_MAX_ROWS = 8;

/** Most rows one workgroup of the gemv partial can serve (`groupRows`). */
export const GEMV_GROUP_ROWS_MAX = 16;

/** Rows per workgroup of a gemv partial: its `groupRows`, else up to GEMV_MAX_ROWS. */
export function gemvGroupRows(s: Pick<GemvSpec, "M" | "groupRows">): number {
  return Math.min(s.M, s.groupRows ?? GEMV_MAX_ROWS);
}

/** Row groups of the gemv partial for M rows (`groupRows` rows each, default GEMV_MAX_ROWS). */
export function gemvRowGroups(M: number, groupRows = GEMV_MAX_ROWS): number {
  return Math.ceil(M / Math.min(M, groupRows));
}

/** K-splits that give about `target` workgroups (two per SM on an H200), over all row groups. */
export function chooseKSplit(N: number, K: number, target = 264, M = 1, groupRows = GEMV_MAX_ROWS): number {
  const colBlocks = Math.ceil(N / 128) * gemvRowGroups(M, groupRows);
  return Math.max(1, Math.min(Math.ceil(target / colBlocks), Math.floor(K / 32)));
}

/** How the decode gemv of M rows is cut: workgroups aimed at, weight loads in flight, rows per workgroup. */
export interface GemvTuning {
  target: number;
  unroll: number;
  groupRows: number;
  /** Stage x in workgroup memory (a reduced input always is). */
  staged: boolean;
}

/**
 * The decode gemv's tuning for M rows (GPUs). Staging pays from 8 rows (H200: 1.3-1.7x at 16 and
 * 64 rows, 0.75x at one row).
 */
export function gemvTuning(M: number): GemvTuning {
  return { target: 264, unroll: GEMV_UNROLL, groupRows: GEMV_MAX_ROWS, staged: M >= 8 };
}

/** K-splits of the decode gemv of M rows on tuning `t` (default gemvTuning(M)). */
export function gemvKSplit(N: number, K: number, M: number, t: GemvTuning = gemvTuning(M)): number {
  return chooseKSplit(N, K, t.target, M, t.groupRows);
}

function kGroups(M: number): number {
  return M <= 4 ? 8 : 4;
}

/** Bytes of workgroup memory gemvPartialWgsl(s) declares. */
export function gemvWorkgroupBytes(s: GemvSpec): number {
  const G = gemvGroupRows(s), KG = kGroups(G), T = 32 * KG, CH = STAGE_K - (STAGE_K % KG);
  return 16 * KG * G * 32 + 4 * ((s.ln ? G * T : 0) + (s.staged ? G * CH : 0) + (s.lnOf ? G * s.K : 0));
}

/** Partial sums: part[ks, m, n]. Grid (ceil(N/128), KS, gemvRowGroups(M)). */
export function gemvPartialWgsl(s: GemvSpec): string {
  if (!(s.M >= 1)) throw new RangeError(`Gemv needs at least 1 row, got ${s.M}`);
  if (s.N % 4 !== 0) throw new RangeError(`Gemv N ${s.N} must be a multiple of 4`);
  const G = gemvGroupRows(s); // rows per workgroup
  if (!(G >= 1 && G <= GEMV_GROUP_ROWS_MAX)) {
    throw new RangeError(`Gemv groupRows ${s.groupRows} must be 1 to ${GEMV_GROUP_ROWS_MAX}`);
  }
  const UNROLL = s.unroll ?? GEMV_UNROLL;
  if (!(UNROLL >= 1 && UNROLL <= 16 && Number.isInteger(UNROLL))) {
    throw new RangeError(`Gemv unroll ${s.unroll} must be an integer 1 to 16`);
  }
  const KG = kGroups(G), N4 = s.N / 4, Kc = Math.ceil(s.K / s.KS), T = 32 * KG;
  const rows = [...Array(G).keys()];
  // Row m of the group is x row m0 + m (clamped: a partial last group reads a valid row, writes nothing).
  const xr = (m: number) => `xr${m}`;
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
  // The k loops over the row written out (ceil(K/T) trips known here: their loads all in flight),
  // in the loop's order; a trip past K adds 0.
  const trips = [...Array(Math.ceil(s.K / T)).keys()];
  const kAt = (t: number) => `(tid + ${t * T}u)`;
  if (s.lnOf && !s.ln) throw new RangeError("Gemv lnOf needs the LayerNorm prologue");
  // Row m's value at k: x itself, or (lnOf) the row summed into workgroup memory.
  const xOf = (m: number, k: string) => s.lnOf ? `xrow[${m * s.K}u + ${k}]` : `x[${xr(m)} + ${k}]`;
  const xAt = (m: number, t: number) =>
    (t + 1) * T <= s.K
      ? xOf(m, kAt(t))
      : `select(0.0, ${xOf(m, `min(${kAt(t)}, ${s.K - 1}u)`)}, ${kAt(t)} < ${s.K}u)`;
  // lnOf: the previous gemv's reduce, its partial sums in order, then its bias and the residual
  // (res + (Σ + xb), as gemvReduceWgsl's residual epilogue adds them), trips written out.
  const sumParts = (KS: number, i: string) =>
    KS <= 64
      ? [...Array(KS).keys()].map((ks) => `v = v + x[${ks * s.M * s.K}u + ${i}];`).join(" ")
      : `for (var ks = 0u; ks < ${KS}u; ks = ks + 1u) { v = v + x[ks * ${s.M * s.K}u + ${i}]; }`;
  const onTrip = (t: number, body: string) =>
    (t + 1) * T <= s.K ? body : `if (${kAt(t)} < ${s.K}u) { ${body} }`;
  const rowsIn = !s.lnOf ? "" : `
  ${
    trips.map((t) =>
      onTrip(
        t,
        rows.map((m) =>
          `{ var v = 0.0; ${sumParts(s.lnOf!.KS, `${xr(m)} + ${kAt(t)}`)} xrow[${m * s.K}u + ${
            kAt(t)
          }] = res[${xr(m)} + ${kAt(t)}] + (v + xb[${kAt(t)}]); }`
        ).join(" "),
      )
    ).join("\n  ")
  }
  workgroupBarrier();
  if (wg.x == 0u && wg.y == 0u) {
    ${
    trips.map((t) =>
      onTrip(
        t,
        rows.map((m) =>
          `if (m0 + ${m}u < ${s.M}u) { xo[${xr(m)} + ${kAt(t)}] = xrow[${m * s.K}u + ${kAt(t)}]; }`
        ).join(" "),
      )
    ).join("\n    ")
  }
  }`;
  const prologue = !s.ln ? "" : `${rowsIn}
  ${rows.map((m) => `var su${m} = 0.0;`).join(" ")}
  ${trips.map((t) => rows.map((m) => `su${m} = su${m} + ${xAt(m, t)};`).join(" ")).join("\n  ")}
  ${lnReduce("su")}
  ${rows.map((m) => `let mean${m} = lns[${m * T}u] / ${s.K}.0;`).join(" ")}
  workgroupBarrier();
  ${rows.map((m) => `var sq${m} = 0.0;`).join(" ")}
  ${
    trips.map((t) =>
      rows.map((m) => {
        const d = `(${xAt(m, t)} - mean${m})`;
        // Past K the deviation is not 0 (0 - mean): select 0 instead of its square.
        return (t + 1) * T <= s.K
          ? `{ let d = ${d}; sq${m} = sq${m} + d * d; }`
          : `{ let d = ${d}; sq${m} = sq${m} + select(0.0, d * d, ${kAt(t)} < ${s.K}u); }`;
      }).join(" ")
    ).join("\n  ")
  }
  ${lnReduce("sq")}
  ${rows.map((m) => `let rstd${m} = inverseSqrt(lns[${m * T}u] / ${s.K}.0 + 1e-5);`).join(" ")}`;
  if (s.geluOf && (s.ln || !s.staged)) throw new RangeError("Gemv geluOf is staged and has no LayerNorm");
  const xin = (m: number) =>
    s.ln
      ? `(${xOf(m, "k")} - mean${m}) * rstd${m} * lnw[k] + lnb[k]`
      : s.geluOf
      ? `xgelu(${xr(m)} + k, k)`
      : `x[${xr(m)} + k]`;
  // geluOf: the previous gemv's reduce (its partial sums in order, then the bias) and GELU.
  const xgelu = !s.geluOf ? "" : `${GELU_WGSL}
fn xgelu(i: u32, k: u32) -> f32 {
  var v = 0.0;
  ${sumParts(s.geluOf.KS, "i")}
  return gelu4(vec4<f32>(v + xb[k])).x;
}`;
  // The k loop of thread group g: k = k0 + g, k0 + g + KG, … (staged: the same k, in stretches).
  const fmaAt = (w: string, xv: (m: number) => string) =>
    rows.map((m) => `acc${m} = fma(vec4<f32>(${xv(m)}), ${w}, acc${m});`).join(" ");
  const plainLoop = `if (c4 < ${N4}u) {
    for (var k = k0 + g; k < k1; k = k + ${KG}u) {
      let w = W[k * ${N4}u + c4];
      ${fmaAt("w", xin)}
    }
  }`;
  const CH = STAGE_K - (STAGE_K % KG);
  const xs = (m: number, kk: string) => `xs[${m * CH}u + ${kk}]`;
  const stagedLoop = `for (var c0 = k0; c0 < k1; c0 = c0 + ${CH}u) {
    let c1 = min(k1, c0 + ${CH}u);
    for (var kk = tid; kk < c1 - c0; kk = kk + ${T}u) {
      let k = c0 + kk;
      ${rows.map((m) => `${xs(m, "kk")} = ${xin(m)};`).join(" ")}
    }
    workgroupBarrier();
    if (c4 < ${N4}u) {
      var k = c0 + g;
      for (; k + ${(UNROLL - 1) * KG}u < c1; k = k + ${UNROLL * KG}u) {
        ${[...Array(UNROLL).keys()].map((u) => `let w${u} = W[(k + ${u * KG}u) * ${N4}u + c4];`).join(" ")}
        ${[...Array(UNROLL).keys()].map((u) => fmaAt(`w${u}`, (m) => xs(m, `k - c0 + ${u * KG}u`))).join(" ")}
      }
      for (; k < c1; k = k + ${KG}u) {
        let w = W[k * ${N4}u + c4];
        ${fmaAt("w", (m) => xs(m, "k - c0"))}
      }
    }
    workgroupBarrier();
  }`;
  return `
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> W: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> part: array<vec4<f32>>;
${s.ln ? "@group(0) @binding(3) var<storage, read> lnw: array<f32>;" : ""}
${s.ln ? "@group(0) @binding(4) var<storage, read> lnb: array<f32>;" : ""}
${s.geluOf ? "@group(0) @binding(3) var<storage, read> xb: array<f32>;" : ""}${xgelu}${
    s.lnOf
      ? `
@group(0) @binding(5) var<storage, read> res: array<f32>;
@group(0) @binding(6) var<storage, read> xb: array<f32>;
@group(0) @binding(7) var<storage, read_write> xo: array<f32>;
var<workgroup> xrow: array<f32, ${G * s.K}>;`
      : ""
  }
${s.ln ? `var<workgroup> lns: array<f32, ${G * T}>;` : ""}
${s.staged ? `var<workgroup> xs: array<f32, ${G * CH}>;` : ""}
var<workgroup> red: array<vec4<f32>, ${KG * G * 32}>;
@compute @workgroup_size(${T})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let lane = tid % 32u;
  let g = tid / 32u;
  let c4 = wg.x * 32u + lane;
  let k0 = wg.y * ${Kc}u;
  let k1 = min(${s.K}u, k0 + ${Kc}u);
  let m0 = wg.z * ${G}u;
  ${rows.map((m) => `let ${xr(m)} = min(m0 + ${m}u, ${s.M - 1}u) * ${s.K}u;`).join("\n  ")}
  ${prologue}
  ${rows.map((m) => `var acc${m} = vec4<f32>(0.0);`).join("\n  ")}
  ${s.staged ? stagedLoop : plainLoop}
  ${rows.map((m) => `red[(g * ${G}u + ${m}u) * 32u + lane] = acc${m};`).join("\n  ")}
  workgroupBarrier();
  if (g == 0u && c4 < ${N4}u) {
    for (var m = 0u; m < ${G}u && m0 + m < ${s.M}u; m = m + 1u) {
      var t = vec4<f32>(0.0);
      for (var h = 0u; h < ${KG}u; h = h + 1u) { t = t + red[(h * ${G}u + m) * 32u + lane]; }
      part[(wg.y * ${s.M}u + m0 + m) * ${N4}u + c4] = t;
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
  return b;
}

/** Sums the K-splits and applies bias and the epilogue. Grid (ceil(M·N4/64)). */
export function gemvReduceWgsl(s: GemvSpec): string {
  const N4 = s.N / 4;
  const rw = new Set(["out", "out2"]);
  const decl = gemvReduceBindings(s).map((n, i) =>
    `@group(0) @binding(${i}) var<storage, ${rw.has(n) ? "read_write" : "read"}> ${n}: array<vec4<f32>>;`
  );
  return `
${decl.join("\n")}
${s.epilogue === "gelu" ? GELU_WGSL : ""}
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  if (i >= ${s.M * N4}u) { return; }
  var v = vec4<f32>(0.0);
  ${
    s.KS <= 64
      // Unrolled (the loads can all be in flight at once); the same additions in the same order.
      ? [...Array(s.KS).keys()].map((ks) => `v = v + part[${ks * s.M * N4}u + i];`).join(" ")
      : `for (var ks = 0u; ks < ${s.KS}u; ks = ks + 1u) { v = v + part[ks * ${s.M * N4}u + i]; }`
  }
  ${s.bias ? `v = v + bias[i % ${N4}u];` : ""}
  ${
    s.epilogue === "residual"
      ? "out[i] = res[i] + v;"
      : s.epilogue === "gelu"
      ? "out[i] = v;\n  out2[i] = gelu4(v);"
      : "out[i] = v;"
  }
}
`;
}

/** A skinny matmul against a weight stored [N, K] (the tied LM head: logits = x · wteᵀ). */
export interface GemvTSpec {
  /** Rows of x (≤ GEMV_MAX_ROWS, or any number when `perThread`). */
  M: number;
  N: number;
  K: number;
  /**
   * Row m of x is x[sel[m·selStride]] (a batched prefill picks each prompt's last position);
   * bound after out. Absent: row m is x[m].
   */
  gather?: { selStride: number };
  /**
   * One thread per output column, no workgroup memory or barriers: best on CPU adapters
   * (llvmpipe runs barriers as coroutine switches), uncoalesced on GPUs.
   */
  perThread?: boolean;
  /**
   * How W is stored: "f32" (default) as floats; "f16" rounded to halves, 4 per vec2<u32> as
   * pack2x16float packs them (element k of a row in the low half of word k/2; see packF16), half
   * the bytes to read, unpacked and summed in f32. Needs no shader-f16. Not with `perThread`.
   */
  weights?: "f32" | "f16";
  /**
   * Sum across a weight row's lanes by subgroup shuffles instead of workgroup memory (GPUs whose
   * subgroups hold at least gemvTLanes(K) invocations): a butterfly that halves the values each
   * lane holds at every step, so each lane ends with whole sums and there is no barrier. Its
   * additions pair the same lanes in the same order as the workgroup-memory tree: the sums are
   * bit-identical. Not with `perThread`.
   */
  shuffle?: boolean;
}

/**
 * `n` floats of `src` from `offset` rounded to f16 (to nearest, ties to even) and packed two to a
 * u32 word, the first in the low half, as pack2x16float does: the f16 weights of gemvTWgsl.
 */
export function packF16(src: Float32Array, offset: number, n: number): Uint32Array<ArrayBuffer> {
  const h = new Float16Array(n + (n % 2));
  h.set(src.subarray(offset, offset + n));
  return new Uint32Array(h.buffer);
}

/** Most rows {@link gemvTWgsl} serves (the decode LM head up to 16 streams reads wte once). */
export const GEMV_T_MAX_ROWS = 16;

/**
 * Lanes that share one weight row (a power of two, at most 32), and weight rows per lane group:
 * 4, or 2 above 8 rows (rows × weight rows sums live in registers).
 */
function gemvTShape(K4: number, M: number, perThread = false): { lanes: number; rpg: number } {
  if (perThread) return { lanes: 1, rpg: 1 };
  let lanes = 1;
  while (lanes < 32 && lanes < K4) lanes *= 2;
  return { lanes, rpg: M > GEMV_MAX_ROWS ? 2 : 4 };
}

/** Lanes that share one weight row of {@link gemvTWgsl} at this K (the subgroup size `shuffle` needs). */
export function gemvTLanes(K: number): number {
  return gemvTShape(K / 4, 1).lanes;
}

/** Columns of the output (weight rows) per workgroup of {@link gemvTWgsl}. */
export function gemvTColumns(s: Pick<GemvTSpec, "M" | "K" | "perThread">): number {
  if (s.perThread) return 256;
  const { lanes, rpg } = gemvTShape(s.K / 4, s.M);
  return (256 / lanes) * rpg;
}

/**
 * out[m, n] = Σ_k x[m, k] · W[n, k] for M ≤ GEMV_T_MAX_ROWS rows. Each group of lanes reads
 * weight rows with coalesced vec4 loads (each row once for all M rows), keeps RPG rows × M sums
 * in registers, and sums across lanes in workgroup memory; with `weights` "f16" each load is 4
 * halves, unpacked to f32. Grid (ceil(N / gemvTColumns)).
 */
export function gemvTWgsl(s: GemvTSpec): string {
  const f16 = s.weights === "f16";
  if (s.perThread && f16) throw new RangeError("The per-thread gemv reads f32 weights only");
  if (s.perThread) return gemvTPerThreadWgsl(s);
  if (s.M < 1 || s.M > GEMV_T_MAX_ROWS) {
    throw new RangeError(`Gemv serves 1 to ${GEMV_T_MAX_ROWS} rows, got ${s.M}`);
  }
  if (s.K % 4 !== 0) throw new RangeError(`Gemv K ${s.K} must be a multiple of 4`);
  const K4 = s.K / 4, { lanes: LN, rpg: R } = gemvTShape(K4, s.M), G = 256 / LN;
  const rows = [...Array(s.M).keys()], rr = [...Array(R).keys()];
  const xrow = (m: number) => s.gather ? `sel[${m * s.gather.selStride}u]` : `${m}u`;
  // Weight row r's 4 values at k (one 16-byte load, or one 8-byte load of 4 halves).
  const load = (r: number) =>
    f16
      ? `let h${r} = W[w${r} + k]; let v${r} = vec4<f32>(unpack2x16float(h${r}.x), unpack2x16float(h${r}.y));`
      : `let v${r} = W[w${r} + k];`;
  if (s.shuffle) return gemvTShuffleWgsl(s, LN, R, load);
  const tree: string[] = [];
  for (let st = LN / 2; st >= 1; st /= 2) {
    tree.push(
      `if (lane < ${st}u) { ${
        rows.map((m) =>
          `red[(g * ${s.M}u + ${m}u) * ${LN}u + lane] += red[(g * ${s.M}u + ${m}u) * ${LN}u + lane + ${st}u];`
        )
          .join(" ")
      } }
    workgroupBarrier();`,
    );
  }
  return `
@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> W: array<${f16 ? "vec2<u32>" : "vec4<f32>"}>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
${s.gather ? "@group(0) @binding(3) var<storage, read> sel: array<u32>;" : ""}
var<workgroup> red: array<f32, ${G * s.M * LN}>;
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let lane = tid % ${LN}u;
  let g = tid / ${LN}u;
  let n0 = (wg.x * ${G}u + g) * ${R}u;
  ${rows.map((m) => `let xb${m} = ${xrow(m)} * ${K4}u;`).join("\n  ")}
  ${rr.map((r) => `let w${r} = min(n0 + ${r}u, ${s.N - 1}u) * ${K4}u;`).join("\n  ")}
  ${rr.flatMap((r) => rows.map((m) => `var a${r}_${m} = 0.0;`)).join(" ")}
  for (var k = lane; k < ${K4}u; k = k + ${LN}u) {
    ${rows.map((m) => `let x${m} = x[xb${m} + k];`).join(" ")}
    ${
    rr.map((r) => `${load(r)} ${rows.map((m) => `a${r}_${m} += dot(x${m}, v${r});`).join(" ")}`).join(
      "\n    ",
    )
  }
  }
  ${
    rr.map((r) => `
  ${rows.map((m) => `red[(g * ${s.M}u + ${m}u) * ${LN}u + lane] = a${r}_${m};`).join(" ")}
  workgroupBarrier();
  ${tree.join("\n  ")}
  if (lane == 0u && n0 + ${r}u < ${s.N}u) {
    ${rows.map((m) => `out[${m * s.N}u + n0 + ${r}u] = red[(g * ${s.M}u + ${m}u) * ${LN}u];`).join(" ")}
  }
  workgroupBarrier();`).join("")
  }
}
`;
}

/**
 * gemvTWgsl with its lane sums taken by a subgroup butterfly (GemvTSpec.shuffle). The k loop's
 * bounds are the same for every lane (a lane past K skips the body), so the shuffles run in
 * uniform control flow.
 */
function gemvTShuffleWgsl(s: GemvTSpec, LN: number, R: number, load: (r: number) => string): string {
  const K4 = s.K / 4, G = 256 / LN, MR = s.M * R;
  const rows = [...Array(s.M).keys()], rr = [...Array(R).keys()];
  const xrow = (m: number) => s.gather ? `sel[${m * s.gather.selStride}u]` : `${m}u`;
  // Value q = r·M + m, padded with zeros to a power of two.
  let cur: string[] = rr.flatMap((r) => rows.map((m) => `a${r}_${m}`));
  let Qp = 1;
  while (Qp < MR) Qp *= 2;
  while (cur.length < Qp) cur.push("0.0");
  const steps: string[] = [], base: string[] = [];
  let plainMask = 0;
  for (let off = LN / 2; off >= 1; off /= 2) {
    const next: string[] = [];
    if (cur.length > 1) {
      const half = cur.length / 2, hi = `hi${off}`;
      steps.push(`let ${hi} = (lane & ${off}u) != 0u;`);
      for (let i = 0; i < half; i++) {
        steps.push(
          `let b${off}_${i} = select(${cur[i]}, ${cur[i + half]}, ${hi}) + subgroupShuffleXor(select(${
            cur[i + half]
          }, ${cur[i]}, ${hi}), ${off}u);`,
        );
        next.push(`b${off}_${i}`);
      }
      base.push(`select(0u, ${half}u, ${hi})`);
    } else {
      steps.push(`let b${off}_0 = ${cur[0]} + subgroupShuffleXor(${cur[0]}, ${off}u);`);
      next.push(`b${off}_0`);
      plainMask |= off;
    }
    cur = next;
  }
  const body = `${rows.map((m) => `let x${m} = x[xb${m} + k];`).join(" ")}
      ${
    rr.map((r) => `${load(r)} ${rows.map((m) => `a${r}_${m} += dot(x${m}, v${r});`).join(" ")}`).join(
      "\n      ",
    )
  }`;
  const writes = cur.map((v, j) =>
    `{ let q = qb + ${j}u; if (q < ${MR}u) { let r = q / ${s.M}u; if (n0 + r < ${s.N}u) { out[(q % ${s.M}u) * ${s.N}u + n0 + r] = ${v}; } } }`
  );
  return `
@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> W: array<${s.weights === "f16" ? "vec2<u32>" : "vec4<f32>"}>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
${s.gather ? "@group(0) @binding(3) var<storage, read> sel: array<u32>;" : ""}
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let lane = tid % ${LN}u;
  let g = tid / ${LN}u;
  let n0 = (wg.x * ${G}u + g) * ${R}u;
  ${rows.map((m) => `let xb${m} = ${xrow(m)} * ${K4}u;`).join("\n  ")}
  ${rr.map((r) => `let w${r} = min(n0 + ${r}u, ${s.N - 1}u) * ${K4}u;`).join("\n  ")}
  ${rr.flatMap((r) => rows.map((m) => `var a${r}_${m} = 0.0;`)).join(" ")}
  for (var k0 = 0u; k0 < ${K4}u; k0 = k0 + ${LN}u) {
    let k = k0 + lane;
    ${K4 % LN ? `if (k < ${K4}u) {\n      ${body}\n    }` : body}
  }
  ${steps.join("\n  ")}
  let qb = ${base.length ? base.join(" + ") : "0u"};
  if ((lane & ${plainMask}u) == 0u) {
    ${writes.join("\n    ")}
  }
}
`;
}

/** Columns one invocation of {@link gemvTransposedWgsl} computes. */
export const GEMV_TRANSPOSED_COLUMNS = 16;
/** Most rows {@link gemvTransposedWgsl} serves. */
export const GEMV_TRANSPOSED_ROWS = 4;

/**
 * For CPU adapters: out[m, n] = Σ_k x[m, k] · Wt[k, n], the weight given transposed ([K, N], N a
 * multiple of 16), for M ≤ GEMV_TRANSPOSED_ROWS rows kept in workgroup memory. Each invocation
 * computes 16 consecutive columns: llvmpipe runs few long invocations much faster than many short
 * ones. The sums are those of the per-thread {@link gemvTWgsl}, bit for bit (four partial sums
 * by k mod 4, fused multiply-adds in k order, added left to right), so a stream's logits do not
 * depend on which kernel its batch size picks. Grid (ceil(N / 16 / 64)).
 */
export function gemvTransposedWgsl(s: Omit<GemvTSpec, "perThread" | "weights">): string {
  const C4 = GEMV_TRANSPOSED_COLUMNS / 4, N4 = s.N / 4, K4 = s.K / 4, rows = [...Array(s.M).keys()];
  if (s.M < 1 || s.M > GEMV_TRANSPOSED_ROWS) {
    throw new RangeError(`The transposed gemv serves 1 to ${GEMV_TRANSPOSED_ROWS} rows, got ${s.M}`);
  }
  if (s.N % GEMV_TRANSPOSED_COLUMNS !== 0 || s.K % 4 !== 0) {
    throw new RangeError(
      `The transposed gemv needs N a multiple of ${GEMV_TRANSPOSED_COLUMNS} and K of 4, got ${s.N} and ${s.K}`,
    );
  }
  const xrow = (m: number) => s.gather ? `sel[${m * s.gather.selStride}u]` : `${m}u`;
  const cols = [...Array(C4).keys()], parts = [0, 1, 2, 3];
  const acc = (m: number, c: number, j: number) => `a${m}_${c}_${j}`;
  return `
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> Wt: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> out: array<vec4<f32>>;
${s.gather ? "@group(0) @binding(3) var<storage, read> sel: array<u32>;" : ""}
var<workgroup> xs: array<f32, ${s.M * s.K}>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  ${rows.map((m) => `let xb${m} = ${xrow(m)} * ${s.K}u;`).join("\n  ")}
  for (var i = tid; i < ${s.M * s.K}u; i = i + 64u) {
    ${rows.map((m) => `if (i / ${s.K}u == ${m}u) { xs[i] = x[xb${m} + i % ${s.K}u]; }`).join("\n    ")}
  }
  workgroupBarrier();
  let q = gid.x * ${C4}u;
  if (q >= ${N4}u) { return; }
  ${
    rows.flatMap((m) => cols.flatMap((c) => parts.map((j) => `var ${acc(m, c, j)} = vec4<f32>(0.0);`))).join(
      " ",
    )
  }
  for (var k4 = 0u; k4 < ${K4}u; k4 = k4 + 1u) {
    ${
    parts.map((j) =>
      `{
      let r = (k4 * 4u + ${j}u) * ${N4}u + q;
      ${rows.map((m) => `let x${m} = vec4<f32>(xs[${m * s.K}u + k4 * 4u + ${j}u]);`).join(" ")}
      ${
        cols.map((c) =>
          `{ let w = Wt[r + ${c}u]; ${
            rows.map((m) => `${acc(m, c, j)} = fma(w, x${m}, ${acc(m, c, j)});`).join(" ")
          } }`
        ).join("\n      ")
      }
    }`
    ).join("\n    ")
  }
  }
  ${
    rows.flatMap((m) =>
      cols.map((c) =>
        `out[${m * N4}u + q + ${c}u] = ${acc(m, c, 0)} + ${acc(m, c, 1)} + ${acc(m, c, 2)} + ${acc(m, c, 3)};`
      )
    ).join("\n  ")
  }
}
`;
}

/**
 * The per-thread form of {@link gemvTWgsl}: 256 columns per workgroup, rows summed in registers.
 * x is first copied to workgroup memory when it fits: llvmpipe reads a second storage binding in
 * the inner loop many times slower than workgroup memory.
 */
function gemvTPerThreadWgsl(s: GemvTSpec): string {
  if (s.K % 4 !== 0) throw new RangeError(`Gemv K ${s.K} must be a multiple of 4`);
  const K4 = s.K / 4, rows = [...Array(s.M).keys()];
  const xrow = (m: number) => s.gather ? `sel[${m * s.gather.selStride}u]` : `${m}u`;
  const shared = s.M * s.K * 4 <= 16384;
  const xs = (m: number) => shared ? `xs[${m * K4}u + k]` : `x[xb${m} + k]`;
  return `
@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> W: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
${s.gather ? "@group(0) @binding(3) var<storage, read> sel: array<u32>;" : ""}
${shared ? `var<workgroup> xs: array<vec4<f32>, ${s.M * K4}>;` : ""}
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  ${rows.map((m) => `let xb${m} = ${xrow(m)} * ${K4}u;`).join("\n  ")}
  ${
    shared
      ? `for (var i = tid; i < ${s.M * K4}u; i = i + 256u) {
    ${rows.map((m) => `if (i / ${K4}u == ${m}u) { xs[i] = x[xb${m} + i % ${K4}u]; }`).join("\n    ")}
  }
  workgroupBarrier();`
      : ""
  }
  let n = gid.x;
  if (n >= ${s.N}u) { return; }
  ${rows.map((m) => `var a${m} = vec4<f32>(0.0);`).join(" ")}
  for (var k = 0u; k < ${K4}u; k = k + 1u) {
    let w = W[n * ${K4}u + k];
    ${rows.map((m) => `a${m} = fma(w, ${xs(m)}, a${m});`).join(" ")}
  }
  ${rows.map((m) => `out[${m * s.N}u + n] = a${m}.x + a${m}.y + a${m}.z + a${m}.w;`).join(" ")}
}
`;
}

/**
 * The decode LM head on CPU adapters through uniform buffers. Mesa's CPU drivers (lavapipe,
 * llvmpipe) load a storage buffer one invocation at a time but gather a uniform buffer's values
 * for 8 invocations at once, several times faster; a uniform binding holds at most 64 KiB, so the
 * weight is stored in blocks of BC columns ([block][k][column], `gemvUboBlocks`), a dispatch binds
 * NB of them, one workgroup per block, and the LM head is ceil(blocks / NB) dispatches. Each
 * output is the same chain of multiply-adds as {@link gemvTransposedWgsl}'s (four partial sums
 * over k ≡ j mod 4, added in order), so the logits are bit-identical to it.
 */
export interface GemvUboSpec {
  /** Rows of x (in groups of GEMV_TRANSPOSED_ROWS); x is bound as one uniform range of M·K floats. */
  M: number;
  /** Output columns (a multiple of GEMV_TRANSPOSED_COLUMNS). */
  N: number;
  K: number;
  /** Columns per block (a multiple of GEMV_TRANSPOSED_COLUMNS; K·BC·4 ≤ 65536). */
  BC: number;
  /** Blocks bound per dispatch. */
  NB: number;
}

/** Columns per uniform block for K, or 0 when not even GEMV_TRANSPOSED_COLUMNS fit 64 KiB. */
export function gemvUboColumns(K: number): number {
  return Math.floor(UNIFORM_BINDING_BYTES / 4 / K / GEMV_TRANSPOSED_COLUMNS) * GEMV_TRANSPOSED_COLUMNS;
}

/** W[N, K] (row n at n·K) as uniform blocks [block][k][column] of BC columns, zero past N. */
export function gemvUboBlocks(
  W: Float32Array,
  offset: number,
  N: number,
  K: number,
  BC: number,
): Float32Array<ArrayBuffer> {
  const blocks = Math.ceil(N / BC), out = new Float32Array(blocks * K * BC);
  for (let n = 0; n < N; n++) {
    const b = Math.floor(n / BC), j = n % BC, row = offset + n * K;
    for (let k = 0; k < K; k++) out[(b * K + k) * BC + j] = W[row + k];
  }
  return out;
}

/**
 * Bindings: 0 x (uniform, M·K floats), 1 the dispatch's first block (uniform u32 at .x), 2 out
 * [M, N] (storage), 3 … 3+NB−1 the weight blocks (uniform). Grid (NB).
 */
export function gemvUboWgsl(s: GemvUboSpec): string {
  const { M, N, K, BC, NB } = s;
  if (!(M >= 1)) throw new RangeError(`The uniform-buffer gemv needs at least 1 row, got ${M}`);
  if (N % GEMV_TRANSPOSED_COLUMNS !== 0 || K % 4 !== 0 || BC % GEMV_TRANSPOSED_COLUMNS !== 0 || BC < 16) {
    throw new RangeError(`The uniform-buffer gemv needs N and BC multiples of 16 and K of 4`);
  }
  if (K * BC * 4 > UNIFORM_BINDING_BYTES || M * K * 4 > UNIFORM_BINDING_BYTES) {
    throw new RangeError(`The uniform-buffer gemv's blocks and x must fit 64 KiB`);
  }
  // Two column vec4s per invocation: few live sums, so Mesa's compiler stays quick (four took 2-7 s
  // per pipeline on llvmpipe, one hit a 13-18 s case at one row); each column's sums are the same.
  const C4 = 2, N4 = N / 4, K4 = K / 4, B4 = BC / 4, lanes = BC / 4 / C4;
  // Rows in groups of up to GEMV_TRANSPOSED_ROWS (row g0 + m of group g0), each with its own sums.
  const G = Math.min(M, GEMV_TRANSPOSED_ROWS);
  const rows = [...Array(G).keys()], cols = [...Array(C4).keys()], parts = [0, 1, 2, 3];
  const acc = (m: number, c: number, j: number) => `a${m}_${c}_${j}`;
  const body = (b: number) =>
    `for (var k4 = 0u; k4 < ${K4}u; k4 = k4 + 1u) {
      ${
      parts.map((j) =>
        `{
        let r = (k4 * 4u + ${j}u) * ${B4}u + c0;
        ${
          rows.map((m) => `let x${m} = vec4<f32>(xu[min(g0 + ${m}u, ${M - 1}u) * ${K4}u + k4][${j}]);`).join(
            " ",
          )
        }
        ${
          cols.map((c) =>
            `{ let w = W${b}[r + ${c}u]; ${
              rows.map((m) => `${acc(m, c, j)} = fma(w, x${m}, ${acc(m, c, j)});`).join(" ")
            } }`
          ).join("\n        ")
        }
      }`
      ).join("\n      ")
    }
    }`;
  return `
@group(0) @binding(0) var<uniform> xu: array<vec4<f32>, ${(M * K) / 4}>;
@group(0) @binding(1) var<uniform> base: vec4<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<vec4<f32>>;
${
    [...Array(NB).keys()].map((b) =>
      `@group(0) @binding(${3 + b}) var<uniform> W${b}: array<vec4<f32>, ${K * B4}>;`
    )
      .join("\n")
  }
@compute @workgroup_size(${lanes})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
  let c0 = lane * ${C4}u;
  let q = (base.x + wg.x) * ${B4}u + c0;
  if (q >= ${N4}u) { return; }
  for (var g0 = 0u; g0 < ${M}u; g0 = g0 + ${G}u) {
  ${
    rows.flatMap((m) => cols.flatMap((c) => parts.map((j) => `var ${acc(m, c, j)} = vec4<f32>(0.0);`))).join(
      " ",
    )
  }
  switch (wg.x) {
    ${[...Array(NB).keys()].map((b) => `case ${b}u: {\n    ${body(b)}\n    }`).join("\n    ")}
    default: {}
  }
  ${
    rows.map((m) =>
      `if (g0 + ${m}u < ${M}u) { ${
        cols.map((c) =>
          `out[(g0 + ${m}u) * ${N4}u + q + ${c}u] = ${acc(m, c, 0)} + ${acc(m, c, 1)} + ${acc(m, c, 2)} + ${
            acc(m, c, 3)
          };`
        ).join(" ")
      } }`
    ).join("\n  ")
  }
  }
}
`;
}

/**
 * A decode linear layer on CPU adapters through uniform buffers (see gemvUboWgsl for why): the
 * partial sums of gemvPartialWgsl with one K-split, for weights that fit a few 64 KiB uniform
 * bindings. x (M·K floats) is one uniform range; W [K, N] is split into slices of R rows, one
 * binding each; with `ln` the LayerNorm's weight and bias are one more range (2·K floats) and each
 * invocation normalises its rows itself (no barriers). One invocation per 4 columns, all rows (in
 * groups of 4);
 * each output is one chain of multiply-adds over k in order. The reduce kernel (KS = 1) adds the
 * bias and applies the epilogue.
 */
export interface GemvUboLayerSpec {
  M: number;
  N: number;
  K: number;
  /** Rows of W per uniform slice (a multiple of 4, R·N·4 ≤ 65536). */
  R: number;
  ln: boolean;
}

/** Rows of W [K, N] per 64 KiB uniform slice (a multiple of 4), or 0 when not even 4 fit. */
export function gemvUboLayerRows(N: number): number {
  return Math.floor(UNIFORM_BINDING_BYTES / 4 / N / 4) * 4;
}

/**
 * Bindings: 0 x (uniform), 1 part (storage, [M, N]), then with `ln` the LayerNorm weight and bias
 * (uniform, [2, K]), then the ceil(K / R) slices of W (uniform). Grid (ceil(N / 4 / 64)).
 */
export function gemvUboLayerWgsl(s: GemvUboLayerSpec): string {
  const { M, N, K, R } = s;
  if (
    N % 4 !== 0 || K % 4 !== 0 || R % 4 !== 0 || R < 4 || R * N * 4 > UNIFORM_BINDING_BYTES ||
    M * K * 4 > UNIFORM_BINDING_BYTES
  ) {
    throw new RangeError(`The uniform-buffer layer gemv needs N, K, R multiples of 4 within 64 KiB`);
  }
  const N4 = N / 4, K4 = K / 4, S = Math.ceil(K / R), R4 = R / 4;
  const slices = [...Array(S).keys()], first = s.ln ? 3 : 2;
  const rowsOf = (sl: number) => Math.min(R, K - sl * R);
  // Rows in groups of up to 4 (their weights loaded once per group), group g0 in a loop so the
  // code does not grow with M; row g0 + m reads x row min(g0 + m, M − 1).
  const G = Math.min(M, 4), rows = [...Array(G).keys()];
  const xrow = (m: number) => `min(g0 + ${m}u, ${M - 1}u) * ${K4}u`;
  const xin = (m: number) =>
    s.ln
      ? `(xu[${xrow(m)} + k4] - vec4<f32>(mean${m})) * rstd${m} * lnp[k4] + lnp[${K4}u + k4]`
      : `xu[${xrow(m)} + k4]`;
  const stats = (m: number) =>
    s.ln
      ? `var su${m} = 0.0;
    for (var k4 = 0u; k4 < ${K4}u; k4 = k4 + 1u) { let v = xu[${
        xrow(m)
      } + k4]; su${m} = su${m} + v.x + v.y + v.z + v.w; }
    let mean${m} = su${m} / ${K}.0;
    var sq${m} = 0.0;
    for (var k4 = 0u; k4 < ${K4}u; k4 = k4 + 1u) { let d = xu[${
        xrow(m)
      } + k4] - vec4<f32>(mean${m}); sq${m} = sq${m} + dot(d, d); }
    let rstd${m} = inverseSqrt(sq${m} / ${K}.0 + 1e-5);`
      : "";
  const group = `for (var g0 = 0u; g0 < ${M}u; g0 = g0 + ${G}u) {
    ${rows.map(stats).join("\n    ")}
    ${rows.map((m) => `var acc${m} = vec4<f32>(0.0);`).join(" ")}
    ${
    slices.map((sl) =>
      `for (var k4 = ${sl * R4}u; k4 < ${(sl * R + rowsOf(sl)) / 4}u; k4 = k4 + 1u) {
      ${rows.map((m) => `let x${m} = ${xin(m)};`).join(" ")}
      let r = (k4 - ${sl * R4}u) * ${4 * N4}u + c4;
      ${
        [0, 1, 2, 3].map((j) =>
          `{ let w = W${sl}[r + ${j * N4}u]; ${
            rows.map((m) => `acc${m} = fma(vec4<f32>(x${m}[${j}]), w, acc${m});`).join(" ")
          } }`
        ).join("\n      ")
      }
    }`
    ).join("\n    ")
  }
    ${rows.map((m) => `if (g0 + ${m}u < ${M}u) { part[(g0 + ${m}u) * ${N4}u + c4] = acc${m}; }`).join(" ")}
  }`;
  return `
@group(0) @binding(0) var<uniform> xu: array<vec4<f32>, ${(M * K) / 4}>;
@group(0) @binding(1) var<storage, read_write> part: array<vec4<f32>>;
${s.ln ? `@group(0) @binding(2) var<uniform> lnp: array<vec4<f32>, ${K / 2}>;` : ""}
${
    slices.map((sl) =>
      `@group(0) @binding(${first + sl}) var<uniform> W${sl}: array<vec4<f32>, ${rowsOf(sl) * N4}>;`
    ).join("\n")
  }
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let c4 = gid.x;
  if (c4 >= ${N4}u) { return; }
  ${group}
}
`;
}
