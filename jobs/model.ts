/**
 * Turning a submitted training request into a complete job config: resolve the model (a preset
 * or explicit dimensions, always GPT-2's vocabulary padded to 128), fill the sequence length the
 * model allows, and reject what cannot work with a message that names the field.
 */

import {
  ConfigError,
  makeConfig,
  type ModelConfig,
  paramLayout,
  presetConfig,
  validateSeqLen,
} from "../gpu/config.ts";
import { InvalidJobError } from "./errors.ts";
import type { TrainConfig } from "./types.ts";

/** A training request before defaults that depend on the model are filled in. */
export type TrainRequest = Omit<TrainConfig, "seq_len"> & { seq_len?: number };

/** Default sequence length: the model's position table, capped at this. */
export const DEFAULT_MAX_SEQ_LEN = 128;

/** Resolves a job's model: a preset name or explicit dimensions. Throws ConfigError naming the field. */
export function resolveModel(config: Pick<TrainConfig, "model" | "seq_len">): ModelConfig {
  const model = typeof config.model === "string" ? presetConfig(config.model) : makeConfig(config.model);
  validateSeqLen(model, config.seq_len);
  return model;
}

/**
 * Completes and checks a request. `maxBindingBytes`, when a device has reported it, refuses
 * models whose flat parameter buffer cannot be bound on the GPU.
 */
export function completeConfig(req: TrainRequest, maxBindingBytes: number | null = null): TrainConfig {
  try {
    const dims = typeof req.model === "string" ? presetConfig(req.model) : makeConfig(req.model);
    const config: TrainConfig = {
      ...req,
      seq_len: req.seq_len ?? Math.min(dims.n_positions, DEFAULT_MAX_SEQ_LEN),
    };
    const model = resolveModel(config);
    const bytes = paramLayout(model).totalSize * 4;
    if (maxBindingBytes !== null && bytes > maxBindingBytes) {
      throw new InvalidJobError(
        "model",
        `Model does not fit the GPU: its ${bytes} bytes of parameters exceed the device's ${maxBindingBytes}-byte buffer binding limit`,
      );
    }
    return config;
  } catch (e) {
    if (e instanceof ConfigError) throw new InvalidJobError(e.field, e.message);
    throw e;
  }
}
