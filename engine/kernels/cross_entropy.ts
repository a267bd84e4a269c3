/**
 * Softmax cross-entropy over the real vocabulary, fused with its gradient: the logits (B·T, Vp)
 * are overwritten in place by dloss/dlogits = (softmax − onehot) / (B·T). Padded columns
 * (ids ≥ vocab_size) take no part in the softmax and get gradient 0, so they are never learned.
 * In training the gradient is multiplied by the loss scale (and the uniform's test multiplier).
 *
 * SFT's loss mask (`weights`): the tokens buffer carries, after the B·(T + 1) ids, one f32 weight
 * per row (its bits in the u32 array), mask × rows / (masked rows) of the micro-batch, written
 * by the trainer; a row's loss and gradient are multiplied by it, so the mean over all rows is
 * the mean over the masked ones and the others get no gradient. Without `weights` the WGSL is
 * what it always was.
 */

import { treeReduce } from "./common.ts";
import { CONTROL_STRUCT, OPT_STRUCT } from "./adamw.ts";

/** Threads per row of the loss kernels. */
export const WG = 256;

/** Workgroup arrays of `rowMaxSumWgsl`. */
export const ROW_STATS_DECL = `var<workgroup> ms: array<f32, ${WG}>;
var<workgroup> ss: array<f32, ${WG}>;`;

/**
 * WGSL statements of a row's maximum and sum of exp(x − max) over columns [0, n) of `logits`
 * from `base`, one workgroup of WG threads per row (online per thread, then a tree merge): leave
 * them in ms[0] and ss[0]. Needs ROW_STATS_DECL, `tid` and `base`.
 */
export function rowMaxSumWgsl(n: number): string {
  return `// Online max and sum of exponentials per thread, then merged.
  // Four columns' loads at a time (a WGSL loop's loads otherwise wait one by one), taken in order.
  var m = -1e30;
  var sum = 0.0;
  var vm = tid;
  for (; vm + ${3 * WG}u < ${n}u; vm = vm + ${4 * WG}u) {
    ${[0, 1, 2, 3].map((u) => `let x${u} = logits[base + vm + ${u * WG}u];`).join(" ")}
    ${
    [0, 1, 2, 3].map((u) =>
      `if (x${u} > m) { sum = sum * exp(m - x${u}); m = x${u}; } sum = sum + exp(x${u} - m);`
    )
      .join("\n    ")
  }
  }
  for (; vm < ${n}u; vm = vm + ${WG}u) {
    let x = logits[base + vm];
    if (x > m) { sum = sum * exp(m - x); m = x; }
    sum = sum + exp(x - m);
  }
  ms[tid] = m;
  ss[tid] = sum;
  workgroupBarrier();
  for (var k = ${WG / 2}u; k > 0u; k = k >> 1u) {
    if (tid < k) {
      let m2 = max(ms[tid], ms[tid + k]);
      ss[tid] = ss[tid] * exp(ms[tid] - m2) + ss[tid + k] * exp(ms[tid + k] - m2);
      ms[tid] = m2;
    }
    workgroupBarrier();
  }`;
}

/** WGSL expression of the target token of global row `grow` (rows of T inputs in rows of T + 1 tokens). */
export function targetWgsl(T: number): string {
  return `tokens[(grow / ${T}u) * ${T + 1}u + grow % ${T}u + 1u]`;
}

/** The optimizer uniform (group 1) and the control buffer at `binding`, for the loss scale. */
export function lossScaleBindings(binding: number): string {
  return `${OPT_STRUCT}
${CONTROL_STRUCT}
@group(0) @binding(${binding}) var<storage, read> ctl: Control;
@group(1) @binding(0) var<uniform> hp: Opt;`;
}

/**
 * WGSL statements writing dloss/dlogits × loss scale over columns [0, cols) of the row at `base`
 * in place: (softmax − onehot(tgt)) / totalRows for the first `real` columns (whose vocabulary id
 * is the WGSL expression `id` of the column `v`), 0 for the rest. Needs `lse`, `tgt`, `ctl`, `hp`.
 */
export function softmaxGradWgsl(
  totalRows: number,
  cols: number,
  real: number,
  id: string,
  weight?: string,
): string {
  return `let inv = (1.0 / ${totalRows}.0) * ctl.scale * hp.grad_mul${weight ? ` * ${weight}` : ""};
  var vg = tid;
  for (; vg + ${3 * WG}u < ${cols}u; vg = vg + ${4 * WG}u) {
    ${[0, 1, 2, 3].map((u) => `let l${u} = logits[base + vg + ${u * WG}u];`).join(" ")}
    ${
    [0, 1, 2, 3].map((u) =>
      `{ let v = vg + ${
        u * WG
      }u; var d = 0.0; if (v < ${real}u) { d = (exp(l${u} - lse) - select(0.0, 1.0, ${id} == tgt)) * inv; } logits[base + v] = d; }`
    ).join("\n    ")
  }
  }
  for (; vg < ${cols}u; vg = vg + ${WG}u) {
    let v = vg;
    var d = 0.0;
    if (v < ${real}u) { d = (exp(logits[base + v] - lse) - select(0.0, 1.0, ${id} == tgt)) * inv; }
    logits[base + v] = d;
  }`;
}

/** Sizes of the loss kernels. */
export interface CrossEntropySpec {
  /** Rows of this chunk of logits. */
  rows: number;
  /**
   * Global row of the chunk's first row (tokens and losses are indexed globally); "uniform": read
   * at run time from a vec4<u32> uniform bound after the other bindings (its x), so every chunk of
   * the LM head shares one pipeline.
   */
  rowBase: number | "uniform";
  /** All rows (B·T): the loss is their mean. */
  totalRows: number;
  T: number;
  V: number;
  Vp: number;
  /** Write the gradient into the logits (training) or leave them (evaluation). */
  grad: boolean;
  /** Loss mask: the index in the tokens buffer of row 0's weight (B·(T + 1)); absent: no mask. */
  weights?: number;
}

/** WGSL expression of the loss weight of global row `grow`, stored from `at` in the tokens buffer. */
export function weightWgsl(at: number): string {
  return `bitcast<f32>(tokens[${at}u + grow])`;
}

/**
 * One workgroup per row: losses[row] and, if grad, dlogits·scale in place (binding 3 the control
 * buffer, group 1 the optimizer uniform; then the chunk's uniform with rowBase "uniform"). Grid1d(rows).
 */
export function crossEntropyWgsl(s: CrossEntropySpec): string {
  return `
@group(0) @binding(0) var<storage, read_write> logits: array<f32>;
@group(0) @binding(1) var<storage, read> tokens: array<u32>;
@group(0) @binding(2) var<storage, read_write> losses: array<f32>;
${s.grad ? lossScaleBindings(3) : ""}
${s.rowBase === "uniform" ? `@group(0) @binding(${s.grad ? 4 : 3}) var<uniform> chunk: vec4<u32>;` : ""}
${ROW_STATS_DECL}
@compute @workgroup_size(${WG})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
  let row = wg.x + wg.y * nwg.x;
  if (row >= ${s.rows}u) { return; }
  let base = row * ${s.Vp}u;
  let grow = row + ${s.rowBase === "uniform" ? "chunk.x" : `${s.rowBase}u`};
  ${rowMaxSumWgsl(s.V)}
  let mx = ms[0];
  let lse = mx + log(ss[0]);
  let tgt = ${targetWgsl(s.T)};
  ${
    s.weights === undefined
      ? "if (tid == 0u) { losses[grow] = lse - logits[base + tgt]; }"
      : `let w = ${weightWgsl(s.weights)};
  if (tid == 0u) { losses[grow] = w * (lse - logits[base + tgt]); }`
  }
  ${
    s.grad
      ? `workgroupBarrier();
  ${softmaxGradWgsl(s.totalRows, s.Vp, s.V, "v", s.weights === undefined ? undefined : "w")}`
      : ""
  }
}
`;
}

/** out[slot] = mean(losses) (or += with `accumulate`), by one workgroup, deterministically. */
export function meanLossWgsl(rows: number, slot: number, accumulate = false): string {
  return `
@group(0) @binding(0) var<storage, read> losses: array<f32>;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
var<workgroup> ss: array<f32, ${WG}>;
@compute @workgroup_size(${WG})
fn main(@builtin(local_invocation_index) tid: u32) {
  var acc = 0.0;
  for (var i = tid; i < ${rows}u; i = i + ${WG}u) { acc = acc + losses[i]; }
  ss[tid] = acc;
  workgroupBarrier();
  ${treeReduce("ss", WG, "+")}
  if (tid == 0u) { out[${slot}] = ${accumulate ? `out[${slot}] + ` : ""}ss[0] / ${rows}.0; }
}
`;
}
