/**
 * The FlashAttention-2 style attention backward: a dK/dV kernel that computes each score block
 * once and writes dS to a scratch buffer, and a dQ kernel that reads it. It is correct (checked
 * against the CPU reference in tests/engine/attention_test.ts) but the product does not run it: on the
 * GPUs measured, the plain backward kernels of engine/kernels/attention.ts were as fast without its
 * B·H·T² scratch. It stays here, beside bench/attention_bench.ts, as an experiment to re-measure.
 */

import { withStorageDtypes } from "../../engine/kernels/common.ts";
import {
  type AttentionSpec,
  backwardBindings,
  type FlashLimits,
  flashThreads,
  type FlashTiles,
  ft,
  header,
} from "../../engine/kernels/attention.ts";

/**
 * Bytes of the flash backward's dS scratch: dS[b, h, key, query] in f32 for every (b, h) (only the
 * causal blocks are written and read). The dK/dV kernel writes it, the dQ kernel reads it.
 */
export function flashScratchBytes(s: Pick<AttentionSpec, "B" | "H" | "T">): number {
  return s.B * s.H * s.T * s.T * 4;
}

/** Workgroup bytes of the flash dK/dV kernel (padded K, V, Q, dO rows; the P/dS tile; lse, delta). */
export function flashKVBytes(BQ: number, BKV: number, D: number): number {
  const row = (D / 4 + 1) * 16;
  return 2 * BKV * row + 2 * BQ * row + BQ * (BKV / 4 + 1) * 16 + 2 * BQ * 4;
}

/** Workgroup bytes of the flash dQ kernel (the dS tile and the K tile). */
export function flashQBytes(BQ: number, BKV: number, D: number): number {
  return 4 * (BKV * BQ + BKV * D);
}

/**
 * Why a spec's flash backward tiling is not valid, or null. The dK/dV kernel runs BKV/4 · lanes
 * threads over BQ-query tiles; the dQ kernel, chooseFlashBackward's second spec, BQ/4 · lanes
 * threads over BKV-key tiles.
 */
export function flashBackwardError(s: AttentionSpec): string | null {
  const f = s.flash;
  if (!f) return "no flash options";
  const L = f.lanes;
  if (![4, 8, 16].includes(L)) return `lanes ${L} must be 4, 8 or 16`;
  if (s.D % (4 * L)) return `D ${s.D} must be a multiple of ${4 * L}`;
  if (s.BQ % (4 * L) || s.BKV % 4) return `BQ ${s.BQ} must be a multiple of ${4 * L} and BKV ${s.BKV} of 4`;
  if (s.T % 4) return `T ${s.T} must be a multiple of 4`;
  return null;
}

/** Bindings of the flash dK/dV kernel: the plain backward's, then the dS scratch. */
export const FLASH_KV_BINDINGS = ["qkv", "dy", "lse", "delta", "dqkv", "dst"] as const;
/** Bindings of the flash dQ kernel. */
export const FLASH_Q_BINDINGS = ["qkv", "dst", "dqkv"] as const;

/**
 * dK and dV, FlashAttention-2 style, computing each score block once: a workgroup owns BKV keys
 * and walks the query tiles from the diagonal on. Thread (kg, c) holds keys kg + r·BKV/4 (r < 4)
 * against queries h·4L + u·L + c (h < BQ/4L, u < 4) of the tile, L = lanes (consecutive threads
 * on consecutive rows of the padded K and Q tiles: no bank conflicts): it forms their scores and
 * dP = dO·Vᵀ as dot products of padded rows (consecutive lanes on consecutive rows), then P and
 * dS = P ∘ (dP − delta), sends P and dS through one workgroup tile to the dV += Pᵀ·dO and
 * dK += dSᵀ·Q products (its 4 keys × columns g·4L + c·4…+3), and writes dS to `dst` for the dQ
 * kernel. Grid (ceil(T/BKV), H, B).
 */
export function flashBackwardKVWgsl(s: AttentionSpec): string {
  const err = flashBackwardError(s);
  if (err) throw new RangeError(`Flash attention backward: ${err}`);
  return withStorageDtypes(flashKVPlain(s), { qkv: s.dtype, dy: s.gradDtype, dqkv: s.gradDtype });
}

/**
 * dQ = scale · dS·K from the dS the dK/dV kernel wrote: a workgroup owns BQ queries, thread
 * (qg, c) queries qg·4…+3 × columns g·4L + c·4…+3, over key tiles of BKV (query tiles run last
 * first). Grid (ceil(T/BQ), H, B).
 */
export function flashBackwardQWgsl(s: AttentionSpec): string {
  const f = s.flash;
  if (!f) throw new RangeError(`Flash attention dQ: no flash options`);
  const L = f.lanes, NT = flashThreads(s.BQ, f);
  if (s.D % (4 * L) || s.BQ % 4 || s.BKV % 4 || s.T % 4) {
    throw new RangeError(`Flash attention dQ: D ${s.D} must be a multiple of ${4 * L}; BQ, BKV and T of 4`);
  }
  if (((s.BKV * s.D) / 4) % NT || ((s.BKV * s.BQ) / 4) % NT) {
    throw new RangeError(`Flash attention dQ: tile ${s.BQ}x${s.BKV} does not divide among ${NT} threads`);
  }
  return withStorageDtypes(flashQPlain(s), { qkv: s.dtype, dqkv: s.gradDtype });
}

function flashKVPlain(s: AttentionSpec): string {
  const f = s.flash!, L = f.lanes;
  const { D4, C4, R4, scale } = header(s);
  const { T, BQ, BKV, D, H } = s;
  const NT = flashThreads(BKV, f), KQ = BKV / 4, DP = D4 + 1;
  const gq = BQ / (4 * L), gd = D / (4 * L);
  const range = (n: number) => [...Array(n).keys()];
  const rs = range(4), hs = range(gq), gs = range(gd), us = range(4);
  const qi = (h: number, u: number) => `${h * 4 * L + u * L}u + c`;
  // Scores and dP of 4 keys × 4·gq queries, as vec4 over u: s{r}_{h}, dp{r}_{h}.
  const dots: string[] = [];
  // Scores first, then dP: fewer rows live in registers at once.
  for (const [acc, keys, queries] of [["s", "Kr", "Qr"], ["dp", "Vr", "dOr"]]) {
    for (let dq = 0; dq < D4; dq++) {
      for (const r of rs) dots.push(`kr${r} = ${keys}[kg + ${r * KQ}u][${dq}];`);
      for (const h of hs) for (const u of us) dots.push(`qr${h}_${u} = ${queries}[${qi(h, u)}][${dq}];`);
      for (const r of rs) {
        for (const h of hs) {
          const sum = us.map((u) => `dot(kr${r}, qr${h}_${u})`).join(", ");
          dots.push(`${acc}${r}_${h} = ${acc}${r}_${h} + vec4<f32>(${sum});`);
        }
      }
    }
  }
  const soft: string[] = [];
  for (const h of hs) {
    soft.push(`let iv${h} = vec4<u32>(${us.map((u) => `qt + ${qi(h, u)}`).join(", ")});`);
    soft.push(`let lv${h} = vec4<f32>(${us.map((u) => `Ls[${qi(h, u)}]`).join(", ")});`);
    soft.push(`let dv${h} = vec4<f32>(${us.map((u) => `Ds[${qi(h, u)}]`).join(", ")});`);
    for (const r of rs) {
      const j = `k0 + kg + ${r * KQ}u`;
      soft.push(`let ok${r}_${h} = (iv${h} >= vec4<u32>(${j})) & (iv${h} < vec4<u32>(${T}u));`);
      soft.push(`let p${r}_${h} = select(vec4<f32>(0.0), exp2(s${r}_${h} - lv${h}), ok${r}_${h});`);
      if (s.dropout) {
        soft.push(
          `let kp${r}_${h} = vec4<f32>(${
            us.map((u) => `keep(((b * ${H}u + h) * ${T}u + iv${h}[${u}]) * ${T}u + ${j})`).join(", ")
          });`,
        );
        soft.push(`let pd${r}_${h} = p${r}_${h} * kp${r}_${h};`);
        soft.push(`let ds${r}_${h} = p${r}_${h} * (dp${r}_${h} * kp${r}_${h} - dv${h});`);
      } else {
        soft.push(`let pd${r}_${h} = p${r}_${h};`);
        soft.push(`let ds${r}_${h} = p${r}_${h} * (dp${r}_${h} - dv${h});`);
      }
    }
  }
  const toTile = (name: string) =>
    rs.flatMap((r) =>
      hs.flatMap((h) => us.map((u) => `PS[${qi(h, u)}][kg][${r}] = ${name}${r}_${h}[${u}];`))
    );
  const dsOut: string[] = [];
  for (const r of rs) {
    for (const h of hs) {
      for (const u of us) {
        dsOut.push(
          `if (k0 + kg + ${r * KQ}u < ${T}u && iv${h}[${u}] < ${T}u) { dst[(bh * ${T}u + k0 + kg + ${
            r * KQ
          }u) * ${T}u + iv${h}[${u}]] = ds${r}_${h}[${u}]; }`,
        );
      }
    }
  }
  const product = (acc: string, rowsTile: string) => {
    const out: string[] = [];
    for (let i = 0; i < BQ; i++) {
      out.push(`pv = PS[${i}][kg];`);
      for (const g of gs) out.push(`xv${g} = ${rowsTile}[${i}][${g * L}u + c];`);
      for (const r of rs) {
        for (const g of gs) {
          out.push(`${acc}${r}_${g} = fma(vec4<f32>(pv[${r}]), xv${g}, ${acc}${r}_${g});`);
        }
      }
    }
    return out;
  };
  const decl = [
    ...rs.flatMap((r) =>
      gs.flatMap((g) => [`var dk${r}_${g} = vec4<f32>(0.0);`, `var dvv${r}_${g} = vec4<f32>(0.0);`])
    ),
    ...rs.flatMap((r) => hs.flatMap((h) => [`var s${r}_${h}: vec4<f32>;`, `var dp${r}_${h}: vec4<f32>;`])),
    ...rs.map((r) => `var kr${r}: vec4<f32>;`),
    ...hs.flatMap((h) => us.map((u) => `var qr${h}_${u}: vec4<f32>;`)),
    `var pv: vec4<f32>;`,
    ...gs.map((g) => `var xv${g}: vec4<f32>;`),
  ];
  const zero = rs.flatMap((r) =>
    hs.flatMap((h) => [`s${r}_${h} = vec4<f32>(0.0);`, `dp${r}_${h} = vec4<f32>(0.0);`])
  );
  const out: string[] = [];
  for (const r of rs) {
    const body = gs.flatMap((g) => [
      `dqkv[row + ${C4}u + ${g * L}u + c] = dk${r}_${g} * ${Math.LN2};`,
      `dqkv[row + ${2 * C4}u + ${g * L}u + c] = dvv${r}_${g};`,
    ]);
    out.push(
      `{ let j = k0 + kg + ${r * KQ}u; if (j < ${T}u) { let row = (base + j) * ${R4}u + h * ${D4}u; ${
        body.join(" ")
      } } }`,
    );
  }
  const ind = (a: string[], n: number) => a.join("\n" + " ".repeat(n));
  return `
${backwardBindings(s)}
@group(0) @binding(5) var<storage, read_write> dst: array<f32>;
var<workgroup> Kr: array<array<vec4<f32>, ${DP}>, ${BKV}>;
var<workgroup> Vr: array<array<vec4<f32>, ${DP}>, ${BKV}>;
var<workgroup> Qr: array<array<vec4<f32>, ${DP}>, ${BQ}>;
var<workgroup> dOr: array<array<vec4<f32>, ${DP}>, ${BQ}>;
var<workgroup> PS: array<array<vec4<f32>, ${KQ + 1}>, ${BQ}>;
var<workgroup> Ls: array<f32, ${BQ}>;
var<workgroup> Ds: array<f32, ${BQ}>;

@compute @workgroup_size(${NT})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let h = wg.y;
  let b = wg.z;
  let bh = b * ${H}u + h;
  let c = tid % ${L}u;
  let kg = tid / ${L}u;
  let k0 = wg.x * ${BKV}u;
  let base = b * ${T}u;
  ${ind(decl, 2)}
  for (var e = tid; e < ${BKV * D4}u; e = e + ${NT}u) {
    let src = (base + min(k0 + e / ${D4}u, ${T - 1}u)) * ${R4}u + h * ${D4}u + e % ${D4}u;
    Kr[e / ${D4}u][e % ${D4}u] = qkv[src + ${C4}u];
    Vr[e / ${D4}u][e % ${D4}u] = qkv[src + ${2 * C4}u];
  }
  for (var qt = (k0 / ${BQ}u) * ${BQ}u; qt < ${T}u; qt = qt + ${BQ}u) {
    workgroupBarrier();
    for (var e = tid; e < ${BQ * D4}u; e = e + ${NT}u) {
      let qr = base + min(qt + e / ${D4}u, ${T - 1}u);
      Qr[e / ${D4}u][e % ${D4}u] = qkv[qr * ${R4}u + h * ${D4}u + e % ${D4}u] * ${scale * Math.LOG2E};
      dOr[e / ${D4}u][e % ${D4}u] = dy[qr * ${C4}u + h * ${D4}u + e % ${D4}u];
    }
    for (var e = tid; e < ${BQ}u; e = e + ${NT}u) {
      let qr = min(qt + e, ${T - 1}u);
      Ls[e] = lse[bh * ${T}u + qr] * ${Math.LOG2E};
      Ds[e] = delta[bh * ${T}u + qr];
    }
    workgroupBarrier();
    ${ind(zero, 4)}
    ${ind(dots, 4)}
    ${ind(soft, 4)}
    ${ind(toTile("pd"), 4)}
    workgroupBarrier();
    ${ind(product("dvv", "dOr"), 4)}
    workgroupBarrier();
    ${ind(toTile("ds"), 4)}
    ${ind(dsOut, 4)}
    workgroupBarrier();
    ${ind(product("dk", "Qr"), 4)}
  }
  ${ind(out, 2)}
}
`;
}

function flashQPlain(s: AttentionSpec): string {
  const f = s.flash!, L = f.lanes;
  const { D4, C4, R4, scale } = header(s);
  const { T, BQ, BKV, D, H } = s;
  const NT = flashThreads(BQ, f), QG = BQ / 4, T4 = T / 4;
  const gd = D / (4 * L), nQT = Math.ceil(T / BQ);
  const range = (n: number) => [...Array(n).keys()];
  const rs = range(4), gs = range(gd);
  const fmas: string[] = [];
  for (let j = 0; j < BKV; j++) {
    fmas.push(`sv = dSs[${j}][qg];`);
    for (const g of gs) fmas.push(`kv${g} = Ks[${j}][${g * L}u + c];`);
    for (const r of rs) {
      for (const g of gs) fmas.push(`dq${r}_${g} = fma(vec4<f32>(sv[${r}]), kv${g}, dq${r}_${g});`);
    }
  }
  const out: string[] = [];
  for (const r of rs) {
    const body = gs.map((g) =>
      `dqkv[(base + qi) * ${R4}u + h * ${D4}u + ${g * L}u + c] = dq${r}_${g} * ${scale};`
    );
    out.push(`{ let qi = q0 + qg * 4u + ${r}u; if (qi < ${T}u) { ${body.join(" ")} } }`);
  }
  const ind = (a: string[], n: number) => a.join("\n" + " ".repeat(n));
  return `
@group(0) @binding(0) var<storage, read> qkv: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> dst: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> dqkv: array<vec4<f32>>;
var<workgroup> dSs: array<array<vec4<f32>, ${QG}>, ${BKV}>;
var<workgroup> Ks: array<array<vec4<f32>, ${D4}>, ${BKV}>;

@compute @workgroup_size(${NT})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let h = wg.y;
  let b = wg.z;
  let bh = b * ${H}u + h;
  let c = tid % ${L}u;
  let qg = tid / ${L}u;
  let q0 = (${nQT - 1}u - wg.x) * ${BQ}u;
  let base = b * ${T}u;
  ${rs.flatMap((r) => gs.map((g) => `var dq${r}_${g} = vec4<f32>(0.0);`)).join("\n  ")}
  var sv: vec4<f32>;
  ${gs.map((g) => `var kv${g}: vec4<f32>;`).join("\n  ")}
  let qLast = min(q0 + ${BQ - 1}u, ${T - 1}u);
  for (var kt = 0u; kt <= qLast; kt = kt + ${BKV}u) {
    workgroupBarrier();
    for (var e = tid; e < ${BKV * QG}u; e = e + ${NT}u) {
      let j = kt + e / ${QG}u;
      let iq = q0 / 4u + e % ${QG}u;
      let i = vec4<u32>(iq * 4u) + vec4<u32>(0u, 1u, 2u, 3u);
      let ok = (i >= vec4<u32>(j)) & (i < vec4<u32>(${T}u)) & vec4<bool>(j < ${T}u);
      dSs[e / ${QG}u][e % ${QG}u] = select(vec4<f32>(0.0), dst[(bh * ${T}u + min(j, ${
    T - 1
  }u)) * ${T4}u + min(iq, ${T4 - 1}u)], ok);
    }
    for (var e = tid; e < ${BKV * D4}u; e = e + ${NT}u) {
      let kr = base + min(kt + e / ${D4}u, ${T - 1}u);
      Ks[e / ${D4}u][e % ${D4}u] = qkv[kr * ${R4}u + ${C4}u + h * ${D4}u + e % ${D4}u];
    }
    workgroupBarrier();
    ${ind(fmas, 4)}
  }
  ${ind(out, 2)}
}
`;
}

/** Flash backward tilings of the dK/dV kernel and of the dQ kernel, preferred first. */
export function flashBackwardCandidates(): { kv: FlashTiles[]; q: FlashTiles[] } {
  return {
    kv: [ft(32, 32, 8, "shared"), ft(32, 16, 8, "shared"), ft(16, 32, 4, "shared"), ft(16, 16, 4, "shared")],
    q: [ft(64, 64, 16, "shared"), ft(64, 32, 16, "shared"), ft(32, 32, 8, "shared"), ft(16, 16, 4, "shared")],
  };
}

/** Whether a flash backward pair of tilings runs on the device for these sizes. */
export function flashBackwardFits(
  dims: Pick<AttentionSpec, "B" | "H" | "T" | "D">,
  kv: FlashTiles,
  q: FlashTiles,
  lim: FlashLimits,
): boolean {
  const sk = { ...dims, ...kv }, sq = { ...dims, ...q };
  const qThreads = flashThreads(q.BQ, q.flash!);
  return flashBackwardError(sk) === null && flashThreads(kv.BKV, kv.flash!) <= lim.maxThreads &&
    flashKVBytes(kv.BQ, kv.BKV, dims.D) <= lim.maxWorkgroupBytes &&
    dims.D % (4 * q.flash!.lanes) === 0 && q.BQ % 4 === 0 && q.BKV % 4 === 0 && qThreads <= lim.maxThreads &&
    ((q.BKV * dims.D) / 4) % qThreads === 0 && ((q.BKV * q.BQ) / 4) % qThreads === 0 &&
    flashQBytes(q.BQ, q.BKV, dims.D) <= lim.maxWorkgroupBytes &&
    flashScratchBytes(sq) <= (lim.maxBindingBytes ?? Infinity);
}

/** The flash backward tilings (dK/dV kernel, dQ kernel) for a device, or null when none fits. */
export function chooseFlashBackward(
  dims: Pick<AttentionSpec, "B" | "H" | "T" | "D">,
  lim: FlashLimits,
): { kv: FlashTiles; q: FlashTiles } | null {
  const c = flashBackwardCandidates();
  for (const kv of c.kv) for (const q of c.q) if (flashBackwardFits(dims, kv, q, lim)) return { kv, q };
  return null;
}
