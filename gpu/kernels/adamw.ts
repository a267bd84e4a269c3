/**
 * Global gradient norm (two deterministic reduction stages) and the AdamW update with decoupled
 * weight decay on the decayed prefix of the flat buffer, clipping applied on the GPU from the norm
 * so nothing is read back inside a step.
 */

import { treeReduce } from "./common.ts";

const WG = 256;
/** Workgroups of the first norm stage (each sums a strided share of the gradient). */
export const NORM_GROUPS = 1024;

/** part[g] = Σ grad² over a grid-stride share. Grid (NORM_GROUPS). */
export function gradNormPartialWgsl(n4: number): string {
  return `
@group(0) @binding(0) var<storage, read> grad: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> part: array<f32>;
var<workgroup> ss: array<f32, ${WG}>;
@compute @workgroup_size(${WG})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  var acc = 0.0;
  for (var i = wg.x * ${WG}u + tid; i < ${n4}u; i = i + ${
    NORM_GROUPS * WG
  }u) { let g = grad[i]; acc = acc + dot(g, g); }
  ss[tid] = acc;
  workgroupBarrier();
  ${treeReduce("ss", WG, "+")}
  if (tid == 0u) { part[wg.x] = ss[0]; }
}
`;
}

/** stats[slot] = sqrt(Σ part). One workgroup. */
export function gradNormFinalWgsl(slot: number): string {
  return `
@group(0) @binding(0) var<storage, read> part: array<f32>;
@group(0) @binding(1) var<storage, read_write> stats: array<f32>;
var<workgroup> ss: array<f32, ${WG}>;
@compute @workgroup_size(${WG})
fn main(@builtin(local_invocation_index) tid: u32) {
  var acc = 0.0;
  for (var i = tid; i < ${NORM_GROUPS}u; i = i + ${WG}u) { acc = acc + part[i]; }
  ss[tid] = acc;
  workgroupBarrier();
  ${treeReduce("ss", WG, "+")}
  if (tid == 0u) { stats[${slot}] = sqrt(ss[0]); }
}
`;
}

/**
 * Per-step optimizer scalars, written with writeBuffer before each step:
 * lr, beta1, beta2, eps, weight_decay, 1/(1-beta1^t), 1/(1-beta2^t), clip_grad.
 */
export const ADAM_UNIFORM_FLOATS = 8;

/** The AdamW update over n4 vec4s; vec4s below decayEnd4 are decayed. Grid1d(n4 / WG). */
export function adamwWgsl(n4: number, decayEnd4: number, normSlot: number): string {
  return `
struct Adam { lr: f32, b1: f32, b2: f32, eps: f32, wd: f32, bc1: f32, bc2: f32, clip: f32 }
@group(0) @binding(0) var<storage, read_write> param: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> grad: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> m: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> v: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> stats: array<f32>;
@group(1) @binding(0) var<uniform> hp: Adam;
@compute @workgroup_size(${WG})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
  let i = (wg.x + wg.y * nwg.x) * ${WG}u + tid;
  if (i >= ${n4}u) { return; }
  var scale = 1.0;
  if (hp.clip > 0.0) {
    let coef = hp.clip / (stats[${normSlot}] + 1e-6);
    if (coef < 1.0) { scale = coef; }
  }
  let g = grad[i] * scale;
  let mi = hp.b1 * m[i] + (1.0 - hp.b1) * g;
  let vi = hp.b2 * v[i] + (1.0 - hp.b2) * g * g;
  m[i] = mi;
  v[i] = vi;
  let wd = select(0.0, hp.wd, i < ${decayEnd4}u);
  let p = param[i];
  param[i] = p - hp.lr * ((mi * hp.bc1) / (sqrt(vi * hp.bc2) + vec4<f32>(hp.eps)) + wd * p);
}
`;
}
