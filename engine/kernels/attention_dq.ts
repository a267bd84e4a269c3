/**
 * The attention backward's dQ from stored scores: dQ = scale · dS·K per head, a causal
 * (T × T)·(T × D) matmul over the dS that the split dK/dV kernel wrote (`writeDS`, see
 * attention.ts) instead of the dQ kernel that recomputes S, P and dP for every (query, key) pair.
 * That recompute is two of the dQ kernel's three products and all of its subgroup shuffles;
 * here what is left is register-tiled multiply-adds, like the tiled matmuls.
 *
 * dS is f32, query-major: dS[((b·H + h)·T + i)·T + j] for key j ≤ i (entries above the diagonal
 * are masked as they are loaded, so whatever the buffer held there is never read as a value).
 */

import { withStorageDtypes } from "./common.ts";
import { type AttentionSpec, header } from "./attention_spec.ts";
import { tileFill } from "./attention.ts";

/**
 * The dQ kernel's tiling: BQ queries per workgroup, BK keys per tile of the loop over keys, and
 * CP vec4 columns of dq per thread (each thread holds RQ queries × CP vec4; RQ 4 by default, or 8:
 * each vec4 of K read from workgroup memory then serves twice the multiply-adds).
 */
export interface DqScoresTile {
  BQ: number;
  BK: number;
  CP: number;
  RQ?: 4 | 8;
}

/** Tilings to choose from, preferred first (the first that fits is used; see chooseDqScoresTile). */
export const DQ_SCORES_TILES: readonly DqScoresTile[] = [
  // Fastest alone on the H200 (bench attention --quick, 2026-12-05): 0.361 ms a 124M layer, 0.454 ms for 345M.
  { BQ: 32, BK: 16, CP: 1 },
  { BQ: 64, BK: 16, CP: 2 },
  { BQ: 128, BK: 16, CP: 4 },
  { BQ: 64, BK: 32, CP: 2 },
  { BQ: 32, BK: 32, CP: 2 },
  { BQ: 64, BK: 32, CP: 4 },
  { BQ: 64, BK: 64, CP: 2 },
  // 8 queries a thread (an 8 × 8 register tile at CP 2, as the tiled matmuls'), unmeasured yet.
  { BQ: 64, BK: 16, CP: 2, RQ: 8 },
  { BQ: 64, BK: 32, CP: 2, RQ: 8 },
  { BQ: 128, BK: 16, CP: 2, RQ: 8 },
  { BQ: 32, BK: 16, CP: 1, RQ: 8 },
];

/** Threads of a tiling at head size D: (BQ / RQ) query groups × (D/4 / CP) column groups. */
export function dqScoresThreads(t: DqScoresTile, D: number): number {
  return (t.BQ / (t.RQ ?? 4)) * (D / 4 / t.CP);
}

/**
 * Workgroup bytes of a tiling: the padded dS tile (one vec4 more per row, and at RQ 8 one more per
 * query group: see attentionBackwardQScoresWgsl) and the K tile.
 */
export function dqScoresBytes(t: DqScoresTile, D: number): number {
  const groupPad = (t.RQ ?? 4) === 8 ? t.BQ / 8 : 0;
  return (t.BQ * (t.BK / 4 + 1) + groupPad) * 16 + t.BK * D * 4;
}

/** Why a tiling does not fit head size D and the device's limits, or null. */
export function dqScoresTileError(
  t: DqScoresTile,
  D: number,
  lim: { maxWorkgroupBytes: number; maxThreads: number },
): string | null {
  const RQ = t.RQ ?? 4;
  if (RQ !== 4 && RQ !== 8) return `RQ ${RQ} must be 4 or 8`;
  if (t.BQ % RQ || t.BK % 4 || (D / 4) % t.CP) {
    return `BQ ${t.BQ} a multiple of RQ ${RQ}, BK ${t.BK} of 4, CP ${t.CP} divides D/4`;
  }
  if (dqScoresThreads(t, D) > lim.maxThreads) return `${dqScoresThreads(t, D)} threads`;
  if (dqScoresBytes(t, D) > lim.maxWorkgroupBytes) return `${dqScoresBytes(t, D)} bytes of workgroup memory`;
  return null;
}

/** The first tiling of `candidates` that fits, or null. */
export function chooseDqScoresTile(
  D: number,
  lim: { maxWorkgroupBytes: number; maxThreads: number },
  candidates: readonly DqScoresTile[] = DQ_SCORES_TILES,
): DqScoresTile | null {
  return candidates.find((t) => dqScoresTileError(t, D, lim) === null) ?? null;
}

/** Bytes of the dS scratch: B·H·T² f32 (only the causal blocks are written and read). */
export function scoresScratchBytes(s: Pick<AttentionSpec, "B" | "H" | "T">): number {
  return s.B * s.H * s.T * s.T * 4;
}

/** Why this spec cannot take the stored-scores path, or null (T and D/4 shapes the kernels need). */
export function scoresPathError(s: Pick<AttentionSpec, "T" | "D" | "split" | "direct">): string | null {
  if (s.direct || (s.split ?? 1) < 2) return "it follows the split dK/dV kernel (subgroups, no CPU kernels)";
  if (s.T % 4) return `T ${s.T} must be a multiple of 4`;
  if (s.D % 4) return `D ${s.D} must be a multiple of 4`;
  return null;
}

/**
 * dQ from stored dS on tiling `t`. A workgroup owns BQ queries of one head (heaviest tiles
 * first); thread (qg, cg) holds RQ queries × CP vec4 columns of dq. Per key tile, dS (BQ × BK,
 * queries' rows of vec4 along keys, padded against bank conflicts) and K (BK × D) go through
 * workgroup memory, and each vec4 of dS read serves CP · 4 multiply-adds per query, each vec4 of
 * K RQ. At RQ 8 the query groups of one warp are 8 rows apart, a multiple of 32 banks whatever
 * the row's padding, so each group's rows start one vec4 further (row i at i·ROW + i/8).
 * Grid (ceil(T/BQ), H, B).
 */
export function attentionBackwardQScoresWgsl(s: AttentionSpec, t: DqScoresTile = DQ_SCORES_TILES[0]): string {
  const RQ = t.RQ ?? 4;
  const err = scoresPathError(s) ??
    ((s.D / 4) % t.CP || t.BQ % RQ || t.BK % 4 || (RQ !== 4 && RQ !== 8) ? "bad tiling" : null);
  if (err) throw new RangeError(`dQ from stored scores: ${err} (${JSON.stringify(t)})`);
  const { D4, C4, R4, scale } = header(s);
  const { T, H } = s, { BQ, BK, CP } = t, BK4 = BK / 4, T4 = T / 4;
  const CG = D4 / CP, NT = (BQ / RQ) * CG, ROW = BK4 + 1;
  // Row i of the dS tile starts at i·ROW (RQ 4, as before) or i·ROW + i/8 (RQ 8).
  const rowAt = (i: string) => (RQ === 8 ? `(${i}) * ${ROW}u + (${i}) / 8u` : `(${i}) * ${ROW}u`);
  const nQT = Math.ceil(T / BQ);
  const range = (n: number) => [...Array(n).keys()];
  const rs = range(RQ), cs = range(CP);
  const fmas: string[] = [];
  for (let j4 = 0; j4 < BK4; j4++) {
    for (const r of rs) {
      fmas.push(
        RQ === 8
          ? `s${r} = dSs[qg * ${8 * ROW + 1}u + ${r * ROW + j4}u];`
          : `s${r} = dSs[(qg * 4u + ${r}u) * ${ROW}u + ${j4}u];`,
      );
    }
    for (let c = 0; c < 4; c++) {
      for (const p of cs) fmas.push(`k${p} = Ks[${(j4 * 4 + c) * D4}u + cg * ${CP}u + ${p}u];`);
      for (const r of rs) {
        for (const p of cs) {
          fmas.push(`dq${r}_${p} = fma(vec4<f32>(s${r}.${"xyzw"[c]}), k${p}, dq${r}_${p});`);
        }
      }
    }
  }
  const out = rs.map((r) =>
    `{ let qi = q0 + qg * ${RQ}u + ${r}u; if (qi < ${T}u) { ${
      cs.map((p) =>
        `dqkv[(b * ${T}u + qi) * ${R4}u + h * ${D4}u + cg * ${CP}u + ${p}u] = dq${r}_${p} * ${scale};`
      )
        .join(" ")
    } } }`
  );
  const code = `
@group(0) @binding(0) var<storage, read> qkv: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> dst: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> dqkv: array<vec4<f32>>;
var<workgroup> dSs: array<vec4<f32>, ${BQ * ROW + (RQ === 8 ? BQ / 8 : 0)}>;
var<workgroup> Ks: array<vec4<f32>, ${BK * D4}>;

@compute @workgroup_size(${NT})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let h = wg.y;
  let b = wg.z;
  let bh = b * ${H}u + h;
  let cg = tid % ${CG}u;
  let qg = tid / ${CG}u;
  let q0 = (${nQT - 1}u - wg.x) * ${BQ}u;
  ${rs.flatMap((r) => cs.map((p) => `var dq${r}_${p} = vec4<f32>(0.0);`)).join("\n  ")}
  ${rs.map((r) => `var s${r}: vec4<f32>;`).join(" ")}
  ${cs.map((p) => `var k${p}: vec4<f32>;`).join(" ")}
  let qLast = min(q0 + ${BQ - 1}u, ${T - 1}u);
  for (var kt = 0u; kt <= qLast; kt = kt + ${BK}u) {
    workgroupBarrier();
    ${
    tileFill(
      BQ * BK4,
      NT,
      !!s.writtenFills,
      `
      let qi = q0 + e / ${BK4}u;
      let j = kt + (e % ${BK4}u) * 4u;
      let ok = (vec4<u32>(j) + vec4<u32>(0u, 1u, 2u, 3u) <= vec4<u32>(qi)) & vec4<bool>(qi < ${T}u);
      let src = (bh * ${T}u + min(qi, ${T - 1}u)) * ${T4}u + min(j, ${T - 4}u) / 4u;
      dSs[${rowAt(`e / ${BK4}u`)} + e % ${BK4}u] = select(vec4<f32>(0.0), dst[src], ok);`,
    )
  }
    ${
    tileFill(
      BK * D4,
      NT,
      !!s.writtenFills,
      `
      let kr = b * ${T}u + min(kt + e / ${D4}u, ${T - 1}u);
      Ks[e] = qkv[kr * ${R4}u + ${C4}u + h * ${D4}u + e % ${D4}u];`,
    )
  }
    workgroupBarrier();
    ${fmas.join("\n    ")}
  }
  ${out.join("\n  ")}
}
`;
  return withStorageDtypes(code, { qkv: s.dtype, dqkv: s.gradDtype });
}
