/**
 * Learning-rate schedules (Megatron's: linear warmup, then cosine, linear or constant decay to
 * min_lr) and the AdamW hyperparameters, shared by the GPU trainer and the CPU reference.
 */

/** How the learning rate decays after warmup. */
export type LrDecayStyle = "cosine" | "linear" | "constant";

/** Learning-rate schedule settings. */
export interface LrSchedule {
  /** Peak learning rate. */
  lr: number;
  /** Floor reached at the end of decay. */
  min_lr: number;
  /** Iterations of linear warmup from 0 to lr. */
  warmup_iters: number;
  /** Iteration at which decay reaches min_lr (usually train_iters). */
  decay_iters: number;
  style: LrDecayStyle;
}

/** Learning rate at 0-based iteration `it`. */
export function learningRate(s: LrSchedule, it: number): number {
  if (s.warmup_iters > 0 && it < s.warmup_iters) return (s.lr * (it + 1)) / s.warmup_iters;
  if (s.style === "constant") return s.lr;
  const span = Math.max(1, s.decay_iters - s.warmup_iters);
  const ratio = Math.min(1, Math.max(0, (it - s.warmup_iters) / span));
  const coeff = s.style === "cosine" ? 0.5 * (1 + Math.cos(Math.PI * ratio)) : 1 - ratio;
  return s.min_lr + coeff * (s.lr - s.min_lr);
}

/** AdamW hyperparameters (decoupled weight decay, as in Loshchilov & Hutter). */
export interface AdamWConfig {
  beta1: number;
  beta2: number;
  eps: number;
  weight_decay: number;
  /** Global gradient-norm clip; 0 disables clipping. */
  clip_grad: number;
}

/** Megatron's defaults for GPT-2. */
export const DEFAULT_ADAMW: AdamWConfig = {
  beta1: 0.9,
  beta2: 0.95,
  eps: 1e-8,
  weight_decay: 0.01,
  clip_grad: 1.0,
};
