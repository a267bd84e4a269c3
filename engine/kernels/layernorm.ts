/**
 * LayerNorm forward and backward over rows of C (eps 1e-5, biased variance).
 *
 * Backward is split for determinism: one workgroup per row computes dx (stored or added into the
 * residual gradient), and the weight/bias gradients are summed over rows in two stages
 * (per-block partials, then `reduceRowsWgsl`), never with atomics.
 */

import { lnBiasPartialOffset, ROW_BLOCK } from "../../model/buffer_layout.ts";

export { lnBiasPartialOffset, ROW_BLOCK };
import { type StorageDtype, treeReduce, withStorageDtypes } from "./common.ts";

const WG = 64;

/** Tree-sums the per-thread value `v` through workgroup array `arr` into `let ${out}`. */
function rowReduce(v: string, arr: string, out: string): string {
  return `
  ${arr}[tid] = ${v};
  workgroupBarrier();
  ${treeReduce(arr, WG, "+")}
  let ${out} = ${arr}[0];
  workgroupBarrier();`;
}

/**
 * A row's trips written out (`written`, PlanOptions kernels.layernormWritten): thread tid's
 * columns c = tid + t·WG, each trip's loads taken once into registers and kept for every pass
 * (at a clamped column where the last trip runs past the row), each use guarded in order, so the
 * loads are in flight together and x is read once, with the loops' arithmetic in the loops' order.
 */
function rowTrips(C4: number): { t: number; c: string; guard: (body: string) => string; at: string }[] {
  return [...Array(Math.ceil(C4 / WG)).keys()].map((t) => {
    const c = `(tid + ${t * WG}u)`, partial = (t + 1) * WG > C4;
    return {
      t,
      c,
      guard: (body: string) => (partial ? `if (${c} < ${C4}u) { ${body} }` : body),
      at: partial ? `min(${c}, ${C4 - 1}u)` : c,
    };
  });
}

/** The forward kernels' bindings and the start of main, one workgroup per row (up to `base`). */
function lnForwardHead(C4: number): string {
  return `
@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> w: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> bias: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> stats: array<vec2<f32>>; // (mean, rstd) per row
var<workgroup> as_: array<f32, ${WG}>;
var<workgroup> bs_: array<f32, ${WG}>;
@compute @workgroup_size(${WG})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
  let row = wg.x + wg.y * nwg.x;
  let base = row * ${C4}u;`;
}

/** The backward dx kernels' bindings and the start of main (up to the row's statistics `st`). */
function lnBackwardHead(C4: number): string {
  return `
@group(0) @binding(0) var<storage, read> dy: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> w: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> stats: array<vec2<f32>>;
@group(0) @binding(4) var<storage, read_write> dx: array<vec4<f32>>;
var<workgroup> as_: array<f32, ${WG}>;
var<workgroup> bs_: array<f32, ${WG}>;
@compute @workgroup_size(${WG})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
  let row = wg.x + wg.y * nwg.x;
  let base = row * ${C4}u;
  let st = stats[row];`;
}

/** out = (x - mean) * rstd * w + b, saving mean and rstd. One workgroup per row; grid1d(rows). */
export function layernormForwardWgsl(C: number, outDtype: StorageDtype = "f32", written = false): string {
  const C4 = C / 4;
  return withStorageDtypes(
    written ? layernormForwardWrittenCode(C, C4) : layernormForwardCode(C, C4),
    { out: outDtype },
  );
}

function layernormForwardWrittenCode(C: number, C4: number): string {
  const trips = rowTrips(C4);
  const each = (f: (r: ReturnType<typeof rowTrips>[number]) => string) => trips.map(f).join("\n  ");
  return `${lnForwardHead(C4)}
  ${each((r) => `let v${r.t} = x[base + ${r.at}];`)}
  var a_ = 0.0;
  ${each((r) => r.guard(`a_ = a_ + v${r.t}.x + v${r.t}.y + v${r.t}.z + v${r.t}.w;`))}
  ${rowReduce("a_", "as_", "a_sum")}
  let mean = a_sum / ${C}.0;
  var b_ = 0.0;
  ${each((r) => r.guard(`{ let d = v${r.t} - vec4<f32>(mean); b_ = b_ + dot(d, d); }`))}
  ${rowReduce("b_", "bs_", "b_sum")}
  let rstd = inverseSqrt(b_sum / ${C}.0 + 1e-5);
  ${
    each((r) =>
      r.guard(`out[base + ${r.c}] = (v${r.t} - vec4<f32>(mean)) * rstd * w[${r.c}] + bias[${r.c}];`)
    )
  }
  if (tid == 0u) { stats[row] = vec2<f32>(mean, rstd); }
}
`;
}

function layernormForwardCode(C: number, C4: number): string {
  return `${lnForwardHead(C4)}
  var a_ = 0.0;
  for (var c = tid; c < ${C4}u; c = c + ${WG}u) { let v = x[base + c]; a_ = a_ + v.x + v.y + v.z + v.w; }
  ${rowReduce("a_", "as_", "a_sum")}
  let mean = a_sum / ${C}.0;
  var b_ = 0.0;
  for (var c = tid; c < ${C4}u; c = c + ${WG}u) { let d = x[base + c] - vec4<f32>(mean); b_ = b_ + dot(d, d); }
  ${rowReduce("b_", "bs_", "b_sum")}
  let rstd = inverseSqrt(b_sum / ${C}.0 + 1e-5);
  for (var c = tid; c < ${C4}u; c = c + ${WG}u) {
    out[base + c] = (x[base + c] - vec4<f32>(mean)) * rstd * w[c] + bias[c];
  }
  if (tid == 0u) { stats[row] = vec2<f32>(mean, rstd); }
}
`;
}

/**
 * dx of LayerNorm: dx = rstd·(g − mean(g) − x̂·mean(g·x̂)) with g = dy·w.
 * `accumulate` adds into dx (the residual stream's gradient) instead of storing.
 */
export function layernormBackwardWgsl(C: number, accumulate: boolean, written = false): string {
  const C4 = C / 4;
  if (written) return layernormBackwardWrittenCode(C, C4, accumulate);
  return `${lnBackwardHead(C4)}
  var a_ = 0.0;
  var b_ = 0.0;
  for (var c = tid; c < ${C4}u; c = c + ${WG}u) {
    let g = dy[base + c] * w[c];
    let xh = (x[base + c] - vec4<f32>(st.x)) * st.y;
    a_ = a_ + g.x + g.y + g.z + g.w;
    b_ = b_ + dot(g, xh);
  }
  ${rowReduce("a_", "as_", "a_sum")}
  ${rowReduce("b_", "bs_", "b_sum")}
  let mg = a_sum / ${C}.0;
  let mgx = b_sum / ${C}.0;
  for (var c = tid; c < ${C4}u; c = c + ${WG}u) {
    let g = dy[base + c] * w[c];
    let xh = (x[base + c] - vec4<f32>(st.x)) * st.y;
    let d = st.y * (g - vec4<f32>(mg) - xh * mgx);
    ${accumulate ? "dx[base + c] = dx[base + c] + d;" : "dx[base + c] = d;"}
  }
}
`;
}

/** layernormBackwardWgsl with the row's trips written out (see rowTrips): dy, x and w read once. */
function layernormBackwardWrittenCode(C: number, C4: number, accumulate: boolean): string {
  const trips = rowTrips(C4);
  const each = (f: (r: ReturnType<typeof rowTrips>[number]) => string) => trips.map(f).join("\n  ");
  return `${lnBackwardHead(C4)}
  ${each((r) => `let g${r.t} = dy[base + ${r.at}] * w[${r.at}];`)}
  ${each((r) => `let xh${r.t} = (x[base + ${r.at}] - vec4<f32>(st.x)) * st.y;`)}
  var a_ = 0.0;
  var b_ = 0.0;
  ${
    each((r) =>
      r.guard(`a_ = a_ + g${r.t}.x + g${r.t}.y + g${r.t}.z + g${r.t}.w; b_ = b_ + dot(g${r.t}, xh${r.t});`)
    )
  }
  ${rowReduce("a_", "as_", "a_sum")}
  ${rowReduce("b_", "bs_", "b_sum")}
  let mg = a_sum / ${C}.0;
  let mgx = b_sum / ${C}.0;
  ${
    each((r) =>
      r.guard(
        `{ let d = st.y * (g${r.t} - vec4<f32>(mg) - xh${r.t} * mgx); ${
          accumulate ? `dx[base + ${r.c}] = dx[base + ${r.c}] + d;` : `dx[base + ${r.c}] = d;`
        } }`,
      )
    )
  }
}
`;
}

/**
 * Partial sums of dw = Σ dy·x̂ and db = Σ dy over blocks of ROW_BLOCK rows: writes dw partials
 * [blocks, C] at 0 and db partials at lnBiasPartialOffset. One thread per column vec4; grid (ceil(C4/64), blocks).
 */
export function layernormParamPartialWgsl(C: number, rows: number, unroll = 4): string {
  const C4 = C / 4, dbBase4 = lnBiasPartialOffset(C, rows) / 4;
  return `
@group(0) @binding(0) var<storage, read> dy: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> stats: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read_write> part: array<vec4<f32>>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let c = gid.x;
  let blk = gid.y;
  if (c >= ${C4}u) { return; }
  var dw = vec4<f32>(0.0);
  var db = vec4<f32>(0.0);
  let r1 = min(${rows}u, (blk + 1u) * ${ROW_BLOCK}u);
  ${
    rowLoop("r", `blk * ${ROW_BLOCK}u`, "r1", unroll, (r, u) => ({
      load:
        `let st${u} = stats[${r}]; let g${u} = dy[(${r}) * ${C4}u + c]; let x${u} = x[(${r}) * ${C4}u + c];`,
      add: `dw = dw + g${u} * (x${u} - vec4<f32>(st${u}.x)) * st${u}.y; db = db + g${u};`,
    }))
  }
  part[blk * ${C4}u + c] = dw;
  part[${dbBase4}u + blk * ${C4}u + c] = db;
}
`;
}

/**
 * A loop over rows [from, to) that issues U rows' loads before it adds them (a WGSL loop gets a
 * counter from the compiler and its loads then wait one at a time), the adds in row order as one
 * row at a time would do them, so the sums are the same; the rest one row at a time.
 */
function rowLoop(
  v: string,
  from: string,
  to: string,
  U: number,
  body: (row: string, u: number) => { load: string; add: string },
): string {
  const us = [...Array(U).keys()].map((u) => body(`${v} + ${u}u`, u));
  const one = body(v, 0);
  return `var ${v} = ${from};
  for (; ${v} + ${U - 1}u < ${to}; ${v} = ${v} + ${U}u) {
    ${us.map((b) => b.load).join("\n    ")}
    ${us.map((b) => b.add).join("\n    ")}
  }
  for (; ${v} < ${to}; ${v} = ${v} + 1u) { ${one.load} ${one.add} }`;
}

/**
 * Partial column sums of src [rows, N] over ROW_BLOCK-row blocks → part [blocks, N], `unroll` rows'
 * loads in flight per thread (the same sums). Grid (ceil(N4/64), blocks).
 */
export function colsumPartialWgsl(
  N: number,
  rows: number,
  srcDtype: StorageDtype = "f32",
  unroll = 8,
): string {
  const N4 = N / 4;
  return withStorageDtypes(colsumPartialCode(N4, rows, unroll), { src: srcDtype });
}

function colsumPartialCode(N4: number, rows: number, unroll: number): string {
  return `
@group(0) @binding(0) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> part: array<vec4<f32>>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let c = gid.x;
  let blk = gid.y;
  if (c >= ${N4}u) { return; }
  var acc = vec4<f32>(0.0);
  let r1 = min(${rows}u, (blk + 1u) * ${ROW_BLOCK}u);
  ${
    rowLoop("r", `blk * ${ROW_BLOCK}u`, "r1", unroll, (r, u) => ({
      load: `let v${u} = src[(${r}) * ${N4}u + c];`,
      add: `acc = acc + v${u};`,
    }))
  }
  part[blk * ${N4}u + c] = acc;
}
`;
}

/** out[c] = Σ_blk part[blk, c] for `blocks` rows of N, `unroll` loads in flight per thread. Grid (ceil(N4/64)). */
export function reduceRowsWgsl(N: number, blocks: number, accumulate = false, unroll = 8): string {
  const N4 = N / 4;
  return `
@group(0) @binding(0) var<storage, read> part: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> out: array<vec4<f32>>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let c = gid.x;
  if (c >= ${N4}u) { return; }
  var acc = vec4<f32>(0.0);
  ${
    rowLoop("r", "0u", `${blocks}u`, unroll, (r, u) => ({
      load: `let v${u} = part[(${r}) * ${N4}u + c];`,
      add: `acc = acc + v${u};`,
    }))
  }
  out[c] = ${accumulate ? "out[c] + " : ""}acc;
}
`;
}
