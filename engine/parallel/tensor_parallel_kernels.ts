/**
 * Kernels of tensor (model) parallelism that the single-GPU graph does not need:
 *  - the tail of a row-parallel matmul after its partial sums were allreduced: bias, dropout and
 *    the residual add (`biasDropResidualWgsl`, the same element indices and masks as the fused
 *    matmul epilogue);
 *  - vocabulary-parallel cross-entropy in two halves around a host exchange: per row, the local
 *    max and sum of exponentials over this rank's real columns and the target's logit when it is
 *    one of them (`ceLocalStatsWgsl`), then, given the global log-sum-exp and target logit, the
 *    loss and the gradient of this rank's columns (`ceFromStatsWgsl`).
 * The embedding's vocabulary-parallel lookup is an option of kernels/embedding.ts.
 */

import { dropWgsl } from "../kernels/common.ts";
import {
  lossScaleBindings,
  ROW_STATS_DECL,
  rowMaxSumWgsl,
  softmaxGradWgsl,
  targetWgsl,
  WG,
} from "../kernels/cross_entropy.ts";

/** out = res + dropout(x + bias) over (rows, C), x the allreduced partial sums. Grid1d(rows·C/4 / 64). */
export function biasDropResidualWgsl(
  rows: number,
  C: number,
  dropout?: { site: number; nSites: number },
): string {
  const C4 = C / 4, n = rows * C4;
  return `
@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> bias: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> res: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<vec4<f32>>;
${dropout ? dropWgsl() : ""}
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
  let q = (wg.x + wg.y * nwg.x) * 64u + tid;
  if (q >= ${n}u) { return; }
  var v = x[q] + bias[q % ${C4}u];
  ${
    dropout
      ? `let e = q * 4u;
  v = v * vec4<f32>(keep(e), keep(e + 1u), keep(e + 2u), keep(e + 3u));`
      : ""
  }
  out[q] = res[q] + v;
}
`;
}

/** Sizes of the vocabulary-parallel loss kernels. */
export interface VocabParallelSpec {
  /** Rows of this chunk of logits. */
  rows: number;
  /** Global row of the chunk's first row. */
  rowBase: number;
  /** Rows the gradient is normalised over (all rows of the global batch). */
  totalRows: number;
  T: number;
  /** Real vocabulary. */
  V: number;
  /** Columns this rank holds (its share of the padded vocabulary). */
  Vl: number;
  /** Global id of this rank's first column. */
  lo: number;
}

/** Real columns of this rank: ids lo … min(V, lo + Vl). */
function realCols(s: VocabParallelSpec): number {
  return Math.max(0, Math.min(s.Vl, s.V - s.lo));
}

/**
 * stats[row] = (local max, Σ exp(x − local max), target logit or 0, 1 if the target is here) over
 * this rank's real columns; one workgroup per row. Grid1d(rows).
 */
export function ceLocalStatsWgsl(s: VocabParallelSpec): string {
  const n = realCols(s);
  return `
@group(0) @binding(0) var<storage, read> logits: array<f32>;
@group(0) @binding(1) var<storage, read> tokens: array<u32>;
@group(0) @binding(2) var<storage, read_write> stats: array<vec4<f32>>;
${ROW_STATS_DECL}
@compute @workgroup_size(${WG})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
  let row = wg.x + wg.y * nwg.x;
  if (row >= ${s.rows}u) { return; }
  let base = row * ${s.Vl}u;
  let grow = row + ${s.rowBase}u;
  ${rowMaxSumWgsl(n)}
  if (tid == 0u) {
    let tgt = ${targetWgsl(s.T)};
    let here = tgt >= ${s.lo}u && tgt < ${s.lo + n}u;
    var t = 0.0;
    if (here) { t = logits[base + tgt - ${s.lo}u]; }
    stats[row] = vec4<f32>(ms[0], ss[0], t, select(0.0, 1.0, here));
  }
}
`;
}

/**
 * Given stats[row] = (global log-sum-exp, target logit, …): losses[grow] = lse − target and, with
 * `grad`, this rank's columns of dloss/dlogits (times the loss scale) in place; padded columns get
 * 0. One workgroup per row. Grid1d(rows).
 */
export function ceFromStatsWgsl(s: VocabParallelSpec, grad: boolean): string {
  const n = realCols(s);
  return `
@group(0) @binding(0) var<storage, read_write> logits: array<f32>;
@group(0) @binding(1) var<storage, read> tokens: array<u32>;
@group(0) @binding(2) var<storage, read_write> losses: array<f32>;
@group(0) @binding(3) var<storage, read> stats: array<vec4<f32>>;
${grad ? lossScaleBindings(4) : ""}
@compute @workgroup_size(${WG})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
  let row = wg.x + wg.y * nwg.x;
  if (row >= ${s.rows}u) { return; }
  let st = stats[row];
  let lse = st.x;
  let grow = row + ${s.rowBase}u;
  if (tid == 0u) { losses[grow] = lse - st.y; }
  // Keep the bindings when only the loss is wanted.
  _ = logits[0];
  _ = tokens[0];
  ${
    grad
      ? `let base = row * ${s.Vl}u;
  let tgt = ${targetWgsl(s.T)};
  ${softmaxGradWgsl(s.totalRows, s.Vl, n, `v + ${s.lo}u`)}`
      : ""
  }
}
`;
}

/**
 * Host side of the exchange: combines every rank's row stats (rank order, the same bits on every
 * rank) into (log-sum-exp, target logit, 0, 0) per row.
 */
export function combineCeStats(perRank: Float32Array[], rows: number, out: Float32Array): void {
  for (let r = 0; r < rows; r++) {
    let m = -Infinity;
    for (const s of perRank) m = Math.max(m, s[4 * r]);
    let sum = 0, tgt = 0;
    for (const s of perRank) {
      sum += s[4 * r + 1] * Math.exp(s[4 * r] - m);
      if (s[4 * r + 3] > 0) tgt = s[4 * r + 2];
    }
    out[4 * r] = m + Math.log(sum);
    out[4 * r + 1] = tgt;
    out[4 * r + 2] = 0;
    out[4 * r + 3] = 0;
  }
}
