/**
 * The training-memory and compute estimator: parameters by formula, GPU bytes per category summed
 * from the same plan the engine allocates (model/plan.ts), and the FLOPs of one step as Megatron's
 * `num_floating_point_operations` counts them. Pure, so the HTTP process can answer
 * `GET /estimate` and refuse a `POST /train` that cannot fit before any GPU work starts.
 *
 * Tensor parallelism is estimated, not run by this engine: each planned buffer is divided by how
 * much of it Megatron's column/row/vocab-parallel layers shard (attention and MLP matrices, their
 * column-parallel biases, the embedding's vocabulary, the attention and MLP activations, the
 * logits); LayerNorm, position embedding and the residual stream are replicated.
 *
 * Beside the buffers' bytes the estimate counts what the driver-side allocator wastes of its
 * 256 MiB blocks under the order the engine allocates them in (`allocator`, see allocatorWaste()
 * in model/plan.ts), so its total predicts what nvidia-smi shows and is what the fit check compares.
 *
 * A GPU is planned for as a description (name, memory, binding and buffer limits), never a device:
 * presets describe common GPUs, and estimateForGpu() picks the server's own GPU, a named preset or
 * the default one, so an estimate does not depend on the machine that answers it.
 */

import { tensorParallelConfig } from "./shard.ts";
import { type ModelConfig, paramLayout } from "./config.ts";
import {
  allocationOrder,
  CATEGORIES,
  type Category,
  type ModelPlan,
  type PlanLimits,
  planModel,
  type PlanOptions,
  type Precision,
} from "./plan.ts";

/**
 * An NVIDIA GPU's limits under Deno's WebGPU on Vulkan, as bench/RESULTS.md records the H200's
 * ("storage binding 2.00 GiB, buffer 4.00 GiB", to two decimals): wgpu caps the binding at the
 * i32 range, taken as 2^31 − 4 as this module always has. Their last bytes are not recorded; a
 * plan would change only for a tensor within a few bytes of 2 GiB (segments are cut below the
 * binding limit, the smaller). The H100 and A100 presets assume the same driver and caps: not
 * measured.
 */
const NVIDIA_VULKAN_LIMITS: PlanLimits = {
  maxStorageBufferBindingSize: 2 ** 31 - 4,
  maxBufferSize: 2 ** 32,
};

/** Limits assumed when no device has reported its own: the default GPU's (the H200's). */
export const DEFAULT_PLAN_LIMITS: PlanLimits = NVIDIA_VULKAN_LIMITS;

/** A GPU to plan for: plain numbers, so an estimate never needs the GPU itself. */
export interface GpuDescription extends PlanLimits {
  /** The adapter's description, or how a preset's adapter describes itself. */
  name: string;
  /** Device memory; null when unknown (the fit check then applies only the limits). */
  memoryBytes: number | null;
}

const GiB = 2 ** 30;

/**
 * GPUs `GET /estimate` can plan for by name. Memory is knownDeviceMemory()'s figure for each (the
 * fit check at `POST /train` uses the same); "webgpu-default" has the WebGPU spec's default limits
 * (128 MiB binding, 256 MiB buffer), what a browser grants without asking, and no stated memory.
 */
export const GPU_PRESETS = {
  /** NVIDIA's "141 GB", counted as 140 GiB as the fit check always has. */
  h200: { name: "NVIDIA H200", memoryBytes: 140 * GiB, ...NVIDIA_VULKAN_LIMITS },
  h100: { name: "NVIDIA H100 80GB", memoryBytes: 80 * GiB, ...NVIDIA_VULKAN_LIMITS },
  "a100-80gb": { name: "NVIDIA A100 80GB", memoryBytes: 80 * GiB, ...NVIDIA_VULKAN_LIMITS },
  "a100-40gb": { name: "NVIDIA A100 40GB", memoryBytes: 40 * GiB, ...NVIDIA_VULKAN_LIMITS },
  "webgpu-default": {
    name: "WebGPU default limits",
    memoryBytes: null,
    maxStorageBufferBindingSize: 128 * 2 ** 20,
    maxBufferSize: 256 * 2 ** 20,
  },
} as const satisfies Record<string, GpuDescription>;

/** Names of the GPU presets. */
export type GpuPresetName = keyof typeof GPU_PRESETS;

/** Preset names in the order they are listed. */
export const GPU_PRESET_NAMES = Object.keys(GPU_PRESETS) as GpuPresetName[];

/** The GPU an estimate plans for when the server's own cannot hold the model: the walkthrough's. */
export const DEFAULT_GPU: GpuPresetName = "h200";

/**
 * Parts of an estimate: the buffer categories, then `allocator`, the bytes the allocator's blocks
 * waste beyond the buffers (no buffer has that category).
 */
export type EstimatePart = Category | "allocator";

/** Parts in report order. */
export const ESTIMATE_PARTS: readonly EstimatePart[] = [...CATEGORIES, "allocator"];

/** What to estimate. */
export interface EstimateRequest {
  config: ModelConfig;
  /** Micro-batch per GPU. */
  batchSize: number;
  seqLen: number;
  precision?: Precision;
  /** Layers per recomputed group, 0 for none. */
  checkpointLayers?: number;
  tensorParallel?: number;
  dataParallel?: number;
  /** AdamW moments sharded over the data-parallel ranks (each holds 1/dp of them). */
  distributedOptimizer?: boolean;
  limits?: PlanLimits;
  chunks?: PlanOptions;
}

/** The estimate. */
export interface Estimate {
  /** 12·L·h² + 13·L·h + (V + P)·h + 2h, V the padded vocabulary. */
  parameters: number;
  /** What one GPU holds with tensor parallelism. */
  parameters_per_gpu: number;
  /**
   * Bytes per GPU by category, the allocator's modelled waste, and their total (what the fit check
   * compares with the GPU's memory).
   */
  bytes_per_gpu: Record<EstimatePart, number> & { total: number };
  /** Bytes of the buffers alone (what the engine reports as allocated): total less allocator. */
  buffer_bytes: number;
  /** The largest category of buffers (what a refusal names; the allocator's waste is never named). */
  biggest: { category: Category; bytes: number };
  /** Model FLOPs of one optimizer step over all data-parallel ranks (recomputation not counted). */
  flops_per_step: number;
  /** Buffers planned on one GPU. */
  buffers: number;
}

/** Parameter count on one of `tp` tensor-parallel ranks (tp = 1: the whole model). */
export function parametersPerGpu(c: ModelConfig, tp = 1): number {
  const h = c.n_embd, L = c.n_layer;
  return (L * (12 * h * h + 7 * h)) / tp + 6 * L * h + (c.padded_vocab_size * h) / tp + c.n_positions * h +
    2 * h;
}

/**
 * Megatron's num_floating_point_operations for GPT (no GQA, no gating, FFN 4h):
 * 72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h)), i.e. forward and backward (×3) of every matmul (×2).
 */
export function megatronFlops(c: ModelConfig, batch: number, seq: number): number {
  const h = c.n_embd, L = c.n_layer;
  return 72 * batch * seq * L * h * h * (1 + seq / (6 * h) + c.padded_vocab_size / (12 * L * h));
}

const SHARDED_ACTS = /(^|\.)(qkv|atty|lse|fch)$|^(logits|d4c|dqkv|datty|delta)$/;

/** The fraction of a flat parameter-shaped array one tensor-parallel rank holds. */
function flatShare(c: ModelConfig, tp: number): number {
  const layout = paramLayout(c);
  let sharded = 0;
  for (const t of layout.tensors) {
    if (/c_attn\.|c_fc\.|c_proj\.weight$|^wte\./.test(t.name)) sharded += t.size;
  }
  return (layout.numParams - sharded + sharded / tp) / layout.numParams;
}

/** Bytes of one planned buffer on one tensor-parallel rank. */
function shardBytes(label: string, bytes: number, flat: number, tp: number): number {
  if (tp === 1) return bytes;
  if (/^(params|grads|adam\.m|adam\.v)(\.\d+)?$/.test(label)) return Math.ceil(bytes * flat);
  return SHARDED_ACTS.test(label) ? Math.ceil(bytes / tp) : bytes;
}

/** Sums a plan into the estimate. */
export function estimateFromPlan(plan: ModelPlan, tp = 1, dp = 1, distributedOptimizer = false): Estimate {
  const c = plan.config;
  const flat = flatShare(c, tp);
  const bytes = Object.fromEntries(ESTIMATE_PARTS.map((k) => [k, 0])) as Record<EstimatePart, number>;
  const sized = plan.buffers.map((b) => {
    const moments = distributedOptimizer && /^adam\.[mv](\.\d+)?$/.test(b.label);
    return { ...b, bytes: shardBytes(b.label, moments ? Math.ceil(b.bytes / dp) : b.bytes, flat, tp) };
  });
  for (const b of sized) bytes[b.category] += b.bytes;
  const bufferBytes = CATEGORIES.reduce((a, k) => a + bytes[k], 0);
  // The buffers as sized here, in the order the engine allocates them.
  bytes.allocator = allocationOrder(sized).wasteBytes;
  const total = bufferBytes + bytes.allocator;
  const biggest =
    CATEGORIES.map((k) => ({ category: k, bytes: bytes[k] })).sort((a, b) => b.bytes - a.bytes)[0];
  return {
    parameters: parametersPerGpu(c, 1),
    parameters_per_gpu: Math.round(parametersPerGpu(c, tp)),
    bytes_per_gpu: { ...bytes, total },
    buffer_bytes: bufferBytes,
    biggest,
    flops_per_step: megatronFlops(c, plan.B * dp, plan.T),
    buffers: plan.buffers.length,
  };
}

/** Plans the model and estimates it. Throws ConfigError naming the field for a shape that cannot be planned. */
export function estimateTraining(r: EstimateRequest): Estimate {
  const tp = r.tensorParallel ?? 1, dp = r.dataParallel ?? 1;
  for (const [field, v] of [["tensor_parallel", tp], ["data_parallel", dp]] as const) {
    if (!Number.isInteger(v) || v < 1) throw new RangeError(`${field} must be a positive integer, got ${v}`);
  }
  // One tensor-parallel rank's own plan (its shard of the weights, its heads' activations), the
  // one the engine allocates: nothing is scaled by a guess.
  const config = tp > 1 ? tensorParallelConfig(r.config, tp) : r.config;
  const plan = planModel(r.limits ?? DEFAULT_PLAN_LIMITS, { config, B: r.batchSize, T: r.seqLen }, {
    ...r.chunks,
    checkpointLayers: r.checkpointLayers ?? 0,
    precision: r.precision,
    tensorParallel: tp,
  });
  const est = estimateFromPlan(plan, 1, dp, r.distributedOptimizer ?? false);
  return {
    ...est,
    parameters: parametersPerGpu(r.config, 1),
    parameters_per_gpu: Math.round(parametersPerGpu(config, tp)),
  };
}

const KNOWN_MEMORY: Array<[RegExp, number]> = [
  [/H200/i, 140 * 2 ** 30],
  [/H100.*94|H100 NVL/i, 94 * 2 ** 30],
  [/H100/i, 80 * 2 ** 30],
  [/A100.*40/i, 40 * 2 ** 30],
  [/A100/i, 80 * 2 ** 30],
];

/**
 * GPU memory of a known adapter (WebGPU does not report it), by its description; null when
 * unknown (the fit check then only applies the binding limits).
 */
export function knownDeviceMemory(adapter: string | null): number | null {
  if (!adapter) return null;
  for (const [re, bytes] of KNOWN_MEMORY) if (re.test(adapter)) return bytes;
  return null;
}

/** Whether an estimate fits a GPU's memory; null when its memory is unknown. */
export function fitsMemory(est: Estimate, gpu: GpuDescription): boolean | null {
  return gpu.memoryBytes === null ? null : est.bytes_per_gpu.total <= gpu.memoryBytes;
}

/** The GPU an estimate was planned for, as `GET /estimate` reports it. */
export interface PlannedFor {
  /** The preset planned for, or null for the server's own GPU. */
  preset: GpuPresetName | null;
  name: string;
  memory_bytes: number | null;
  max_storage_buffer_binding_size: number;
  max_buffer_size: number;
  /** "server", "query", or "default because the server's GPU cannot hold it: <reason>". */
  why: string;
}

/** An estimate with the GPU it was planned for and whether the server's own GPU holds the model. */
export interface GpuEstimate<E extends Estimate> {
  estimate: E;
  planned_for: PlannedFor;
  /** False when the server's GPU cannot bind or hold the model; null without one or when its memory is unknown. */
  fits_server_gpu: boolean | null;
}

const gib = (n: number) => `${(n / GiB).toFixed(2)} GiB`;

/**
 * Plans for the preset the query names, else for the server's GPU when it holds the model (its
 * binding limits plan it and, when its memory is known, the estimate fits), else for DEFAULT_GPU.
 * `estimate` plans for one GPU and throws when it cannot; only the GPU differs between the calls,
 * so an error that is not the server's limits recurs for the GPU planned for and is thrown.
 */
export function estimateForGpu<E extends Estimate>(
  estimate: (gpu: GpuDescription) => E,
  server: GpuDescription | null,
  preset?: GpuPresetName,
): GpuEstimate<E> {
  let onServer: E | null = null, fitsServer: boolean | null = null, refusal = "the server has no GPU ready";
  if (server) {
    try {
      onServer = estimate(server);
      fitsServer = fitsMemory(onServer, server);
      if (fitsServer === false) {
        const total = onServer.bytes_per_gpu.total;
        refusal = `the estimate of ${gib(total)} exceeds its ${gib(server.memoryBytes!)}`;
      }
    } catch (e) {
      fitsServer = false;
      refusal = (e as Error).message;
    }
  }
  if (preset === undefined && server && onServer && fitsServer !== false) {
    const planned_for = plannedFor(server, null, "server");
    return { estimate: onServer, planned_for, fits_server_gpu: fitsServer };
  }
  const name = preset ?? DEFAULT_GPU, gpu = GPU_PRESETS[name];
  const why = preset ? "query" : `default because the server's GPU cannot hold it: ${refusal}`;
  return { estimate: estimate(gpu), planned_for: plannedFor(gpu, name, why), fits_server_gpu: fitsServer };
}

function plannedFor(gpu: GpuDescription, preset: GpuPresetName | null, why: string): PlannedFor {
  return {
    preset,
    name: gpu.name,
    memory_bytes: gpu.memoryBytes,
    max_storage_buffer_binding_size: gpu.maxStorageBufferBindingSize,
    max_buffer_size: gpu.maxBufferSize,
    why,
  };
}
