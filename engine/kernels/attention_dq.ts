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

/** Queries per workgroup, and keys per tile of the loop over keys. */
export const DQ_SCORES_BQ = 64;
export const DQ_SCORES_BK = 32;

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

/** Vec4 columns of dq per thread: 2 where D/4 is even, else 1. */
function columnsPerThread(D4: number): number {
  return D4 % 2 === 0 ? 2 : 1;
}

/** Threads of the kernel: (BQ / 4) query groups × (D/4 / columns) column groups. */
export function dqScoresThreads(D: number): number {
  const D4 = D / 4;
  return (DQ_SCORES_BQ / 4) * (D4 / columnsPerThread(D4));
}

/**
 * dQ from stored dS. A workgroup owns BQ queries of one head (heaviest tiles first); thread
 * (qg, cg) holds 4 queries × CP vec4 columns of dq. Per key tile, dS (BQ × BK, queries' rows of
 * vec4 along keys, padded against bank conflicts) and K (BK × D) go through workgroup memory,
 * and each vec4 of dS read serves CP · 4 multiply-adds per query. Grid (ceil(T/BQ), H, B).
 */
export function attentionBackwardQScoresWgsl(s: AttentionSpec): string {
  const err = scoresPathError(s);
  if (err) throw new RangeError(`dQ from stored scores: ${err}`);
  const { D4, C4, R4, scale } = header(s);
  const { T, H } = s, BQ = DQ_SCORES_BQ, BK = DQ_SCORES_BK, BK4 = BK / 4, T4 = T / 4;
  const CP = columnsPerThread(D4), CG = D4 / CP, NT = (BQ / 4) * CG, ROW = BK4 + 1;
  const nQT = Math.ceil(T / BQ);
  const range = (n: number) => [...Array(n).keys()];
  const rs = range(4), cs = range(CP);
  const fmas: string[] = [];
  for (let j4 = 0; j4 < BK4; j4++) {
    for (const r of rs) fmas.push(`s${r} = dSs[(qg * 4u + ${r}u) * ${ROW}u + ${j4}u];`);
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
    `{ let qi = q0 + qg * 4u + ${r}u; if (qi < ${T}u) { ${
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
var<workgroup> dSs: array<vec4<f32>, ${BQ * ROW}>;
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
    for (var e = tid; e < ${BQ * BK4}u; e = e + ${NT}u) {
      let qi = q0 + e / ${BK4}u;
      let j = kt + (e % ${BK4}u) * 4u;
      let ok = (vec4<u32>(j) + vec4<u32>(0u, 1u, 2u, 3u) <= vec4<u32>(qi)) & vec4<bool>(qi < ${T}u);
      let src = (bh * ${T}u + min(qi, ${T - 1}u)) * ${T4}u + min(j, ${T - 4}u) / 4u;
      dSs[(e / ${BK4}u) * ${ROW}u + e % ${BK4}u] = select(vec4<f32>(0.0), dst[src], ok);
    }
    for (var e = tid; e < ${BK * D4}u; e = e + ${NT}u) {
      let kr = b * ${T}u + min(kt + e / ${D4}u, ${T - 1}u);
      Ks[e] = qkv[kr * ${R4}u + ${C4}u + h * ${D4}u + e % ${D4}u];
    }
    workgroupBarrier();
    ${fmas.join("\n    ")}
  }
  ${out.join("\n  ")}
}
`;
  return withStorageDtypes(code, { qkv: s.dtype, dqkv: s.gradDtype });
}
