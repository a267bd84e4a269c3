/**
 * The FlashAttention-2 style forward (`AttentionSpec.flash`): register blocks of 4 query rows ×
 * several keys per thread, one max and rescale per K tile, exp2 with log2 e folded into q, P through
 * workgroup memory to the P·V product. chooseFlashForward picks the tiling that fits a device;
 * bench/attention_bench.ts times every candidate, and bench/experiments/flash_backward.ts builds a
 * fused backward on the helpers exported here.
 */

import { type AttentionSpec, type FlashOptions, forwardBindings, header } from "./attention_spec.ts";

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
export function flashForwardWgsl(s: AttentionSpec): string {
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
        soft.push(
          `let di${r}_${h} = ((b * ${s.H}u + h) * ${T}u + q0 + qg * 4u + ${r}u) * ${T}u + kt + ${
            h * 4 * L
          }u + c * 4u;`,
        );
        pd = `p${r}_${h} * vec4<f32>(${range(4).map((e) => `keep(di${r}_${h} + ${e}u)`).join(", ")})`;
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
