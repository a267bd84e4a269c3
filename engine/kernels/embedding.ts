/**
 * Token + position embedding forward (with embedding dropout) and backward. The wte gradient is
 * a scatter-add over token ids: threads own (token partition, column) pairs and scan all positions
 * in order, so it is deterministic without atomics. It adds into dwte, which already holds the
 * LM head's contribution.
 */

import { dropWgsl } from "./common.ts";

/** Sizes of the embedding kernels. */
export interface EmbeddingSpec {
  B: number;
  T: number;
  C: number;
  /** Dropout sites when hidden dropout is on. */
  dropout?: { nSites: number };
  /** Backward: add the wpe gradient to what the buffer holds (gradient accumulation) instead of storing it. */
  accumulate?: boolean;
  /**
   * Vocabulary parallelism: this rank holds wte rows [lo, lo + rows); other tokens look up zeros
   * (forward) and add no gradient here (backward).
   */
  vocab?: { lo: number; rows: number };
  /** Forward: add wpe (default true; one tensor-parallel rank adds it before the allreduce). */
  positions?: boolean;
}

/** x[b,t,:] = wte[tok[b,t]] + wpe[t] (then dropout). tokens are u32 rows of T+1. Grid1d over B·T·C4/64. */
export function embeddingForwardWgsl(s: EmbeddingSpec): string {
  const C4 = s.C / 4, n = s.B * s.T * C4;
  return `
@group(0) @binding(0) var<storage, read> tokens: array<u32>;
@group(0) @binding(1) var<storage, read> wte: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> wpe: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> x: array<vec4<f32>>;
${s.dropout ? dropWgsl() : ""}
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
  let g = (wg.x + wg.y * nwg.x) * 64u + tid;
  if (g >= ${n}u) { return; }
  let c = g % ${C4}u;
  let bt = g / ${C4}u;
  let b = bt / ${s.T}u;
  let t = bt % ${s.T}u;
  let tok = tokens[b * ${s.T + 1}u + t];
  ${
    s.vocab
      ? `var v = vec4<f32>(0.0);
  if (tok >= ${s.vocab.lo}u && tok < ${
        s.vocab.lo + s.vocab.rows
      }u) { v = wte[(tok - ${s.vocab.lo}u) * ${C4}u + c]; }`
      : `var v = wte[tok * ${C4}u + c];`
  }
  ${s.positions ?? true ? `v = v + wpe[t * ${C4}u + c];` : "_ = wpe[0]; // bound on every rank, read on one"}
  ${
    s.dropout
      ? `let e = g * 4u;
  v = v * vec4<f32>(keep(e), keep(e + 1u), keep(e + 2u), keep(e + 3u));`
      : ""
  }
  x[g] = v;
}
`;
}

/** Token partitions of the wte scatter-add. */
export const WTE_PARTITIONS = 64;

/**
 * dwpe[t] = Σ_b dx[b,t] and dwte[tok] += dx, with the embedding dropout mask applied to dx.
 * Grid1d over (T + WTE_PARTITIONS)·C4/64 threads: the first T·C4 do wpe, the rest wte.
 */
export function embeddingBackwardWgsl(s: EmbeddingSpec): string {
  const C4 = s.C / 4, P = WTE_PARTITIONS;
  const mask = (e: string) =>
    s.dropout ? ` * vec4<f32>(keep(${e}), keep(${e} + 1u), keep(${e} + 2u), keep(${e} + 3u))` : "";
  const tokAt = (bt: string) =>
    `tokens[((${bt}) / ${s.T}u) * ${s.T + 1}u + (${bt}) % ${s.T}u]${s.vocab ? ` - ${s.vocab.lo}u` : ""}`;
  const visit = `if (${s.vocab ? `tok < ${s.vocab.rows}u && ` : ""}tok % ${P}u == p) {
      let i = bt * ${C4}u + c;
      dwte[tok * ${C4}u + c] = dwte[tok * ${C4}u + c] + dx[i]${mask("i * 4u")};
    }`;
  return `
@group(0) @binding(0) var<storage, read> tokens: array<u32>;
@group(0) @binding(1) var<storage, read> dx: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> dwte: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> dwpe: array<vec4<f32>>;
${s.dropout ? dropWgsl() : ""}
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
  let g = (wg.x + wg.y * nwg.x) * 64u + tid;
  if (g < ${s.T * C4}u) {
    let t = g / ${C4}u;
    let c = g % ${C4}u;
    var acc = vec4<f32>(0.0);
    for (var b = 0u; b < ${s.B}u; b = b + 1u) {
      let i = (b * ${s.T}u + t) * ${C4}u + c;
      acc = acc + dx[i]${mask("i * 4u")};
    }
    dwpe[g] = ${s.accumulate ? "dwpe[g] + " : ""}acc;
    return;
  }
  let h = g - ${s.T * C4}u;
  if (h >= ${P * C4}u) { return; }
  let p = h / ${C4}u;
  let c = h % ${C4}u;
  // The scan over the tokens reads 8 of them at a time (one at a time, each load waits), then
  // visits them in order: the same additions.
  let BT = ${s.B * s.T}u;
  var bt0 = 0u;
  for (; bt0 + 7u < BT; bt0 = bt0 + 8u) {
    ${[...Array(8).keys()].map((u) => `let tk${u} = ${tokAt(`bt0 + ${u}u`)};`).join("\n    ")}
    ${[...Array(8).keys()].map((u) => `{ let bt = bt0 + ${u}u; let tok = tk${u}; ${visit} }`).join("\n    ")}
  }
  for (var bt = bt0; bt < BT; bt = bt + 1u) { let tok = ${tokAt("bt")}; ${visit} }
}
`;
}
