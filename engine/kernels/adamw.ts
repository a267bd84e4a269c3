/**
 * Global gradient norm (two deterministic reduction stages), the step control kernel and the AdamW
 * update with decoupled weight decay on the decayed prefix of the flat buffer.
 *
 * Nothing is read back inside a step: the control kernel turns the norm into the clipping
 * coefficient, flags a step whose loss or gradient norm is not finite, keeps the skipped-step
 * counters, the optimizer step count (so the learning rate and bias corrections do not advance on
 * a skipped step) and the dynamic loss scale (Megatron's DynamicGradScaler) in a small GPU buffer
 * that AdamW reads and skips on. The counters come back with the loss at log steps.
 */

import { CONTROL_BYTES, NORM_GROUPS, OPT_UNIFORM_BYTES } from "../../model/buffer_layout.ts";

export { CONTROL_BYTES, NORM_GROUPS, OPT_UNIFORM_BYTES };
import type { AdamWConfig, LrSchedule } from "../../model/schedule.ts";
import { treeReduce } from "./common.ts";

const WG = 256;
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

/** Dynamic loss scaling settings, as Megatron's DynamicGradScaler. */
export interface LossScalerConfig {
  initialScale: number;
  /** Clean steps before the scale grows. */
  growthInterval: number;
  growthFactor: number;
  backoffFactor: number;
  /** Overflowing steps tolerated before backing off (reset when the scale grows). */
  hysteresis: number;
  minScale: number;
}

/** Megatron's defaults for fp16: 2^32, ×2 every 1000 clean steps, ×0.5, hysteresis 2, minimum 1. */
export const DEFAULT_LOSS_SCALER: LossScalerConfig = {
  initialScale: 2 ** 32,
  growthInterval: 1000,
  growthFactor: 2,
  backoffFactor: 0.5,
  hysteresis: 2,
  minScale: 1,
};

/** WGSL struct of the optimizer uniform (bound at group 1). */
export const OPT_STRUCT = `struct Opt {
  b1: f32, b2: f32, eps: f32, wd: f32,
  clip: f32, lr: f32, min_lr: f32, warmup: f32,
  decay_iters: f32, style: u32, grad_mul: f32, dynamic: u32,
  growth_interval: u32, hysteresis: i32, backoff: f32, growth: f32,
  min_scale: f32, p0: u32, p1: u32, p2: u32,
}`;

/**
 * Packs the optimizer uniform. `gradMul` multiplies the loss gradient: 1, or NaN to make a step's
 * gradient non-finite on purpose (tests of the guard). Without `scaler` the loss scale stays 1.
 */
export function packOptimizerUniform(
  adamw: AdamWConfig,
  schedule: LrSchedule,
  scaler: LossScalerConfig | undefined,
  gradMul = 1,
): ArrayBuffer {
  const buf = new ArrayBuffer(OPT_UNIFORM_BYTES);
  const f = new Float32Array(buf), u = new Uint32Array(buf), i = new Int32Array(buf);
  f.set([adamw.beta1, adamw.beta2, adamw.eps, adamw.weight_decay, adamw.clip_grad, schedule.lr]);
  f.set([schedule.min_lr, schedule.warmup_iters, schedule.decay_iters], 6);
  u[9] = { cosine: 0, linear: 1, constant: 2 }[schedule.style];
  f[10] = gradMul;
  u[11] = scaler ? 1 : 0;
  u[12] = scaler?.growthInterval ?? 0;
  i[13] = scaler?.hysteresis ?? 0;
  f[14] = scaler?.backoffFactor ?? 1;
  f[15] = scaler?.growthFactor ?? 1;
  f[16] = scaler?.minScale ?? 1;
  return buf;
}

/** The GPU-side step state, one struct of 16 words. */
export const CONTROL_STRUCT = `struct Control {
  opt_step: u32, skipped: u32, consecutive: u32, found_inf: u32,
  scale: f32, growth_tracker: u32, hysteresis_left: i32, lr: f32,
  bc1: f32, bc2: f32, grad_coef: f32, p0: u32,
  p1: u32, p2: u32, p3: u32, p4: u32,
}`;

/** The step state as read back. */
export interface ControlState {
  /** Optimizer steps taken (skipped steps excluded): the schedule's iteration. */
  optimizerStep: number;
  skippedSteps: number;
  /**
   * Steps skipped in a row that count toward the failure limit: those with the loss scale at its
   * floor or without dynamic scaling; steps skipped while the scale backs off are not counted.
   */
  consecutiveSkipped: number;
  /** Whether the last step was skipped. */
  foundInf: boolean;
  lossScale: number;
  growthTracker: number;
  hysteresisLeft: number;
  /** Learning rate of the last step attempted. */
  lr: number;
}

/** Reads the control buffer's bytes. */
export function unpackControl(raw: ArrayBuffer): ControlState {
  const u = new Uint32Array(raw), f = new Float32Array(raw), i = new Int32Array(raw);
  return {
    optimizerStep: u[0],
    skippedSteps: u[1],
    consecutiveSkipped: u[2],
    foundInf: u[3] !== 0,
    lossScale: f[4],
    growthTracker: u[5],
    hysteresisLeft: i[6],
    lr: f[7],
  };
}

/** The control buffer's initial bytes for a trainer that has taken `optimizerStep` steps. */
export function packControl(s: Partial<ControlState>, scaler: LossScalerConfig | undefined): ArrayBuffer {
  const buf = new ArrayBuffer(CONTROL_BYTES);
  const u = new Uint32Array(buf), f = new Float32Array(buf), i = new Int32Array(buf);
  u[0] = s.optimizerStep ?? 0;
  u[1] = s.skippedSteps ?? 0;
  u[2] = s.consecutiveSkipped ?? 0;
  f[4] = s.lossScale ?? (scaler ? scaler.initialScale : 1);
  u[5] = s.growthTracker ?? 0;
  i[6] = s.hysteresisLeft ?? scaler?.hysteresis ?? 0;
  return buf;
}

/**
 * One workgroup after backward: norm = sqrt(Σ part) / scale into stats[normSlot]; a step whose
 * loss (stats[lossSlot]) or norm is not finite is flagged and counted, and does not advance the
 * optimizer step; otherwise the learning rate, bias corrections and clipping coefficient of the
 * step are set. `consecutive` (the failure limit's count) counts only flagged steps that the
 * scaler cannot answer by backing off: its scale already at the floor, or no dynamic scaling
 * (fp32, or a static scale); a clean step resets it, a backoff step leaves it as it was. Then the
 * loss scale is updated (found_inf: growth tracker reset, hysteresis spent, then backoff; clean:
 * growth after growth_interval steps, hysteresis restored).
 */
export function stepControlWgsl(parts: number, lossSlot: number, normSlot: number): string {
  return `
${OPT_STRUCT}
${CONTROL_STRUCT}
@group(0) @binding(0) var<storage, read> part: array<f32>;
@group(0) @binding(1) var<storage, read_write> stats: array<f32>;
@group(0) @binding(2) var<storage, read_write> ctl: Control;
@group(1) @binding(0) var<uniform> hp: Opt;
var<workgroup> ss: array<f32, ${WG}>;
fn finite(x: f32) -> bool { return (bitcast<u32>(x) & 0x7f800000u) != 0x7f800000u; }
fn lr_at(it: f32) -> f32 {
  if (hp.warmup > 0.0 && it < hp.warmup) { return hp.lr * (it + 1.0) / hp.warmup; }
  if (hp.style == 2u) { return hp.lr; }
  let ratio = clamp((it - hp.warmup) / max(1.0, hp.decay_iters - hp.warmup), 0.0, 1.0);
  var coeff = 1.0 - ratio;
  if (hp.style == 0u) { coeff = 0.5 * (1.0 + cos(3.141592653589793 * ratio)); }
  return hp.min_lr + coeff * (hp.lr - hp.min_lr);
}
@compute @workgroup_size(${WG})
fn main(@builtin(local_invocation_index) tid: u32) {
  var acc = 0.0;
  for (var i = tid; i < ${parts}u; i = i + ${WG}u) { acc = acc + part[i]; }
  ss[tid] = acc;
  workgroupBarrier();
  ${treeReduce("ss", WG, "+")}
  if (tid != 0u) { return; }
  let scale = ctl.scale;
  let norm = sqrt(ss[0]) / scale;
  stats[${normSlot}] = norm;
  let found = !finite(stats[${lossSlot}]) || !finite(norm);
  let t = ctl.opt_step + 1u;
  ctl.lr = lr_at(f32(ctl.opt_step));
  // An overflow while the dynamic scale can still back off (above its floor, whatever hysteresis
  // says) is the scaler finding its level, as Megatron's: skipped, but not a failure.
  let backing_off = hp.dynamic != 0u && hp.backoff < 1.0 && scale > hp.min_scale;
  if (found) {
    ctl.found_inf = 1u;
    ctl.skipped = ctl.skipped + 1u;
    if (!backing_off) { ctl.consecutive = ctl.consecutive + 1u; }
  } else {
    ctl.found_inf = 0u;
    ctl.consecutive = 0u;
    ctl.opt_step = t;
    ctl.bc1 = 1.0 / (1.0 - pow(hp.b1, f32(t)));
    ctl.bc2 = 1.0 / (1.0 - pow(hp.b2, f32(t)));
    var coef = 1.0;
    if (hp.clip > 0.0) { coef = min(1.0, hp.clip / (norm + 1e-6)); }
    ctl.grad_coef = coef * (1.0 / scale);
  }
  if (hp.dynamic != 0u) {
    if (found) {
      ctl.growth_tracker = 0u;
      ctl.hysteresis_left = ctl.hysteresis_left - 1;
      if (ctl.hysteresis_left <= 0) { ctl.scale = max(scale * hp.backoff, hp.min_scale); }
    } else {
      ctl.growth_tracker = ctl.growth_tracker + 1u;
      if (ctl.growth_tracker == hp.growth_interval) {
        ctl.growth_tracker = 0u;
        ctl.hysteresis_left = hp.hysteresis;
        ctl.scale = scale * hp.growth;
      }
    }
  }
}
`;
}

/**
 * The AdamW update over n4 vec4s (skipped when the control kernel flagged the step); vec4s below
 * decayEnd4 are decayed. Grid1d(n4 / WG).
 */
export function adamwWgsl(n4: number, decayEnd4: number): string {
  return `
${OPT_STRUCT}
${CONTROL_STRUCT}
@group(0) @binding(0) var<storage, read_write> param: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> grad: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> m: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> v: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> ctl: Control;
@group(1) @binding(0) var<uniform> hp: Opt;
@compute @workgroup_size(${WG})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
  let i = (wg.x + wg.y * nwg.x) * ${WG}u + tid;
  if (i >= ${n4}u || ctl.found_inf != 0u) { return; }
  let g = grad[i] * ctl.grad_coef;
  let mi = hp.b1 * m[i] + (1.0 - hp.b1) * g;
  let vi = hp.b2 * v[i] + (1.0 - hp.b2) * g * g;
  m[i] = mi;
  v[i] = vi;
  let wd = select(0.0, hp.wd, i < ${decayEnd4}u);
  let p = param[i];
  param[i] = p - ctl.lr * ((mi * ctl.bc1) / (sqrt(vi * ctl.bc2) + vec4<f32>(hp.eps)) + wd * p);
}
`;
}

/** out16 = f16(param) over n4 vec4s: the f16 weight copy the fp16 kernels read. Grid1d(n4 / WG). */
export function castF16Wgsl(n4: number): string {
  return `enable f16;
@group(0) @binding(0) var<storage, read> param: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> out16: array<vec4<f16>>;
@compute @workgroup_size(${WG})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
  let i = (wg.x + wg.y * nwg.x) * ${WG}u + tid;
  if (i >= ${n4}u) { return; }
  out16[i] = vec4<f16>(param[i]);
}
`;
}
