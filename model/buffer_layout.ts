/**
 * Sizes of the engine's small scratch and state buffers that the memory plan (plan.ts) must
 * count and the kernels must agree on: kept here, in pure code, so the plan never imports a
 * kernel file and the kernels read the same numbers (engine/kernels/adamw.ts, layernorm.ts).
 */

/** Workgroups of the first norm stage (each sums a strided share of the gradient). */
export const NORM_GROUPS = 1024;

/** Bytes of the optimizer uniform (hyperparameters, schedule, scaler settings, gradient multiplier). */
export const OPT_UNIFORM_BYTES = 80;

/** Bytes of the control buffer. */
export const CONTROL_BYTES = 64;

/** Rows summed per block by the partial-sum kernels. */
export const ROW_BLOCK = 32;

/** Float offset of the db partials in the partial buffer (256-byte aligned, after the dw partials). */
export function lnBiasPartialOffset(C: number, rows: number): number {
  return Math.ceil((Math.ceil(rows / ROW_BLOCK) * C) / 64) * 64;
}
