/**
 * What the graph takes and gives: the shape and options of a build, the program a step runs
 * (kernels and the tensor-parallel exchanges between them) and the built model's buffers and op
 * lists. Trainer, Generator and the parallel code read these; the blocks that emit the ops are
 * the other files of this folder.
 */

import type { ModelConfig, ParamLayout } from "../../model/config.ts";
import type { ModelPlan, PlanOptions } from "../../model/plan.ts";
import type { FlatBuffer } from "../flat.ts";
import type { CompileListener, Op, PipelineCache } from "../ops.ts";
import type { TileRule } from "../kernels/matmul.ts";
import type { DqScoresTile } from "../kernels/attention_dq.ts";

/**
 * A point of a tensor-parallel step where the ranks exchange data through the host: the ops
 * before it are submitted, the exchange runs, then the ops after it (see Trainer).
 *  - "allreduce": sum `count` f32 of `buffer` over the tensor-parallel group in place;
 *  - "vocab_ce": combine the vocabulary-parallel loss's row statistics (`rows` vec4 in `stats`);
 *  - "norm": add the ranks' squared-gradient partials (`count` f32 in `parts`) into `total[0]`.
 */
export type Sync =
  | { sync: "allreduce"; label: string; buffer: GPUBuffer; count: number }
  | { sync: "vocab_ce"; label: string; stats: GPUBuffer; rows: number }
  | { sync: "norm"; label: string; parts: GPUBuffer; count: number; total: GPUBuffer };

/** One entry of a step's program: a kernel, or an exchange between tensor-parallel ranks. */
export type Step = Op | Sync;

/** Whether a step is an exchange. */
export function isSync(s: Step): s is Sync {
  return "sync" in s;
}

/** The kernels of a program, without its exchanges. */
export function opsOf(steps: Step[]): Op[] {
  return steps.filter((x): x is Op => !isSync(x));
}

/** Buffers shared by plans that never run at once, by label (see BuildOptions.pool and createBufferPool). */
export interface BufferPool {
  byLabel: Map<string, GPUBuffer>;
  /** Bytes the pool holds. */
  bytes: number;
  destroy(): void;
}

/** Slots of the small stats buffer read back for logging. */
export const STAT = { loss: 0, gradNorm: 1, evalLoss: 2 } as const;

/** Shapes of one planned model. */
export interface ModelShape {
  config: ModelConfig;
  B: number;
  T: number;
  attnDropout: number;
  hiddenDropout: number;
}

/** Activations of one transformer block, each (B·T, ·). */
export interface LayerActs {
  ln1: GPUBuffer;
  ln1s: GPUBuffer;
  qkv: GPUBuffer;
  atty: GPUBuffer;
  lse: GPUBuffer;
  res2: GPUBuffer;
  ln2: GPUBuffer;
  ln2s: GPUBuffer;
  /**
   * MLP pre-activation (B·T, 4C); gelu(fch) is computed where it is read, or in training staged
   * in the backward's d4 scratch for the projection (see geluStaging in matmul_steps.ts).
   */
  fch: GPUBuffer;
}

/** What `buildModel` takes beyond the plan's options. */
export interface BuildOptions {
  /** Share an existing parameter buffer (inference plans). */
  params?: GPUBuffer;
  /** fp16: multiply f16 matmul inputs in f16 per k-tile (default true). */
  f16Math?: boolean;
  /**
   * Micro-batches per optimizer step (gradient accumulation, default 1). Above 1 every gradient
   * writer adds to the gradient buffers, which the trainer clears at the start of each step, and
   * the step's loss is the mean over its micro-batches.
   */
  microBatches?: number;
  /**
   * Data-parallel ranks whose gradients are summed before the update (default 1): the loss
   * gradient is divided by all the rows of a global batch, so the sum over ranks and
   * micro-batches is the gradient of the global batch's mean loss.
   */
  dataParallel?: number;
  /**
   * Tensor parallelism (Megatron): this model is rank `rank` of `size`, holding its shard of the
   * parameters (model/shard.ts) with `config` the tensor-parallel config (its padded
   * vocabulary divisible by size). Its program then contains exchanges (`Sync`).
   */
  tensorParallel?: { rank: number; size: number };
  /**
   * Kernel choices, for benchmarks: which measured matmul tile rules to use ("all", default;
   * "split-k": only the split-K weight-gradient ones; "none": the built-in rules alone; or a list
   * of rules of one's own, for tests), and
   * whether to use the FlashAttention-2 style forward where it fits (default true).
   */
  kernels?: {
    tileRules?: "all" | "split-k" | "none" | readonly TileRule[];
    flashAttention?: boolean;
    /**
     * The split attention backward kernels with tilings of their own (chooseBackwardTilings;
     * default true), or false: both on the forward's shared tiling.
     */
    attentionBackwardTiles?: boolean;
    /** Their loops' rows per trip, replacing the tilings' own (BackwardTiling.unroll). */
    attentionUnroll?: 1 | 2 | 4;
    /** The attention backward's tile fills written out (AttentionSpec.writtenFills; default false). */
    attentionFills?: boolean;
    /** The dK/dV kernel's score and dP sums reduce-scattered (AttentionSpec.scatterSums; default false). */
    attentionScatter?: boolean;
    /** The LayerNorm kernels' row trips written out, x read once (layernorm.ts; default false). */
    layernormWritten?: boolean;
    /**
     * Loads in flight per thread of the column sums behind the bias and LayerNorm weight gradients
     * (colsumPartialWgsl, reduceRowsWgsl; the LayerNorm partials take half as many rows, each of
     * three loads): default 8. The same sums in the same order at any count.
     */
    columnSumUnroll?: 8 | 16 | 32;
    /** With PlanOptions.attentionScores: the dQ tilings to choose from (default DQ_SCORES_TILES). */
    dqScoresTiles?: readonly DqScoresTile[];
    /**
     * Which tiled matmuls read their sizes from a uniform where they can (MatmulSpec.uniformDims),
     * so that shapes sharing a tile, layout and epilogue compile one pipeline: "weight-gradients"
     * (default: the matmuls reading A stored [K, M], which ran as fast or faster so on the H100,
     * bench/RESULTS.md, issue 38's eighth session), "all" (the forward ones and the input
     * gradients ran up to 8% slower so) or "none".
     */
    uniformDims?: "weight-gradients" | "all" | "none";
    /** CPU adapters: the uniform-buffer matmul for large matmuls (default true; kernels/matmul_ubo.ts). */
    cpuMatmul?: boolean;
    /**
     * CPU adapters: the kernels Mesa compiles fast (no barriers: kernels/matmul_direct.ts and the
     * direct attention kernels) instead of the tiled ones (default true).
     */
    cpuDirect?: boolean;
  };
  /**
   * Where the plan's buffers come from: a pool shared by plans that never run at the same time
   * (generation's prefill shapes, run one after another in queue order), each of its buffers at
   * least as large as this plan's of the same label. Pooled buffers stay the pool's: destroying
   * the model leaves them. Without it every buffer is allocated for this model.
   */
  pool?: BufferPool;
  /** Compile into this cache (shared with the caller's other builds) instead of a new one. */
  cache?: PipelineCache;
  /** Hears of each pipeline compiled, with the build's total (see OpBatch.compile). */
  onCompile?: CompileListener;
}

/** Everything `buildModel` takes. */
export type GraphOptions = Omit<PlanOptions, "sharedParams" | "tensorParallel"> & BuildOptions;

/** The planned model: buffers and op lists. */
export interface GpuModel {
  shape: ModelShape;
  layout: ParamLayout;
  /** Flat parameters (owned by the model unless passed in). */
  params: FlatBuffer;
  /** Gradients and AdamW moments: null for an inference-only plan. */
  grads: FlatBuffer | null;
  adamM: FlatBuffer | null;
  adamV: FlatBuffer | null;
  /** Rows of one LM head chunk (B·T when the head runs in one piece). */
  headRows: number;
  tokens: GPUBuffer;
  /** Per-layer activations of the last forward pass. */
  layers: LayerActs[];
  /** (B·T, C) final LayerNorm output of the last forward pass (the LM head's input). */
  lnf: GPUBuffer;
  /**
   * (B·T, Vp) logits of the last forward pass (overwritten by their gradient in training) when the
   * head runs in one chunk; with several chunks, one chunk's rows (headRows, Vp).
   */
  logits: GPUBuffer;
  stats: GPUBuffer;
  dropUniform: GPUBuffer;
  /** Optimizer hyperparameters, schedule and loss-scaler settings (see packOptimizerUniform). */
  optUniform: GPUBuffer;
  /** GPU-side step state: optimizer step, skipped-step counters, loss scale (see CONTROL_STRUCT). */
  control: GPUBuffer;
  nSites: number;
  forward: Op[];
  /** Loss (with gradient written into the logits) and the mean into STAT.loss. */
  loss: Op[];
  /** Loss without gradient, added into STAT.evalLoss (zeroed by the caller before a run of batches). */
  evalLoss: Op[];
  backward: Op[];
  /**
   * Where each layer's weight gradients are final in `backward`: layer `layer`'s are written by
   * `backward[0 … at)` (descending layers; the embedding, the LM head's tied weight and the
   * 1-D parameters are final only at the end). Data parallelism starts a layer's exchange there.
   */
  backwardMarks: { layer: number; at: number }[];
  optimizer: Op[];
  /** fp16: refreshes the f16 weight copy from the parameters (run after loading them); else empty. */
  castWeights: Op[];
  /**
   * Training plans: checksum partials of the parameters (NORM_GROUPS u32 per segment) into
   * `checksumParts`, reusing the optimizer's norm scratch (run after the optimizer, read back).
   * Compiled on first use, not with the build (only parallel jobs read a checksum): await
   * `compileChecksum` before recording them.
   */
  checksum: Op[];
  compileChecksum(): Promise<void>;
  checksumParts: GPUBuffer | null;
  /** Bytes of GPU memory allocated (the plan's total). */
  memoryBytes: number;
  /** Micro-batches per step: above 1 the gradients accumulate and must be cleared before each step. */
  microBatches: number;
  /** Data-parallel ranks the loss gradient is normalised over. */
  dataParallel: number;
  /** Tensor-parallel place of this model (size 1 without). */
  tensorParallel: { rank: number; size: number };
  /**
   * The same lists as forward … optimizer with the tensor-parallel exchanges in place; without
   * tensor parallelism they hold only ops and equal those lists.
   */
  program: { forward: Step[]; loss: Step[]; evalLoss: Step[]; backward: Step[]; optimizer: Step[] };
  buffers: GPUBuffer[];
  /** Small uniforms the build made outside the plan (the matmuls' sizes: dimsUniform), freed with it. */
  uniforms: GPUBuffer[];
  /** The memory plan the buffers were allocated from. */
  plan: ModelPlan;
}
