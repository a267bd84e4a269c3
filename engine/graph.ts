/**
 * The GPT-2 graph on the GPU: plans every buffer for a given batch and sequence length, then
 * builds the forward, backward and optimizer op lists once. A training step only writes the
 * tokens and per-step scalars and records these ops into one submission.
 *
 * Forward per layer l (residual stream res[l], all (B·T, C) unless noted):
 *   ln1 = LN(res[l]); qkv = ln1·Wqkv + b (B·T, 3C); y = attention(qkv) (+lse);
 *   res2 = res[l] + drop(y·Wproj + b); ln2 = LN(res2); fch = ln2·Wfc + b (B·T, 4C);
 *   res[l+1] = res2 + drop(gelu(fch)·Wfcproj + b), gelu applied as fch is loaded (never stored)
 * then lnf = LN(res[L]), logits = lnf·wteᵀ (B·T, Vp), fused cross-entropy and its gradient.
 *
 * Nothing binds more than the device allows: the flat parameter, gradient and moment arrays are
 * split into segments (engine/flat.ts) that the optimizer walks one by one, and the LM head with its
 * cross-entropy runs over chunks of rows, each chunk's logits computed, turned into their gradient
 * and pushed back through the head before the next (so the logits take one chunk of memory).
 */

import { ConfigError, type ModelConfig, type ParamLayout, validateSeqLen } from "../model/config.ts";
import { createStorage, type GpuContext, isCpuAdapter } from "./device.ts";
import { type FlatBuffer, flatView } from "./flat.ts";
import {
  actPrefix,
  allocationOrder,
  LAYER_ACTS,
  type LayerActName,
  type ModelPlan,
  normRanges,
  planModel,
  type PlanOptions,
  RECOMPUTED_ACTS,
  resLabel,
} from "../model/plan.ts";
import { dropoutSite } from "../model/rng.ts";
import { type CompileListener, type Op, type OpKind, type Phase, PipelineCache, type View } from "./ops.ts";
import {
  chooseTile,
  matmulFlops,
  matmulKernels,
  matmulScratchBytes,
  type MatmulSpec,
} from "./kernels/matmul.ts";
import { MATMUL_TILE_RULES } from "./kernels/matmul_tiles.ts";
import { uboMatmulPlan } from "./kernels/matmul_ubo.ts";
import { matmulDirectError, matmulDirectKernel } from "./kernels/matmul_direct.ts";
import {
  attentionBackwardKVWgsl,
  attentionBackwardQWgsl,
  attentionDeltaWgsl,
  attentionFlops,
  attentionForwardWgsl,
  type AttentionSpec,
  chooseAttentionSplit,
  chooseAttentionTiles,
  chooseFlashForward,
  chooseSplitAttentionTiles,
} from "./kernels/attention.ts";
import {
  colsumPartialWgsl,
  layernormBackwardWgsl,
  layernormForwardWgsl,
  layernormParamPartialWgsl,
  lnBiasPartialOffset,
  reduceRowsWgsl,
  ROW_BLOCK,
} from "./kernels/layernorm.ts";
import { embeddingBackwardWgsl, embeddingForwardWgsl, WTE_PARTITIONS } from "./kernels/embedding.ts";
import { crossEntropyWgsl, meanLossWgsl } from "./kernels/cross_entropy.ts";
import {
  adamwWgsl,
  castF16Wgsl,
  gradNormPartialWgsl,
  NORM_GROUPS,
  stepControlWgsl,
} from "./kernels/adamw.ts";
import { dropoutMaskWgsl, grid1d, type StorageDtype, UNIFORM_BINDING_BYTES } from "./kernels/common.ts";
import {
  biasDropResidualWgsl,
  ceFromStatsWgsl,
  ceLocalStatsWgsl,
} from "./parallel/tensor_parallel_kernels.ts";
import { checksumPartialWgsl } from "./kernels/checksum.ts";

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
  /** MLP pre-activation (B·T, 4C); gelu(fch) is computed where it is read. */
  fch: GPUBuffer;
}

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
   */
  checksum: Op[];
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
  /** The memory plan the buffers were allocated from. */
  plan: ModelPlan;
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
   * "split-k": only the split-K weight-gradient ones; "none": the built-in rules alone), and
   * whether to use the FlashAttention-2 style forward where it fits (default true).
   */
  kernels?: {
    tileRules?: "all" | "split-k" | "none";
    flashAttention?: boolean;
    /** CPU adapters: the uniform-buffer matmul for large matmuls (default true; kernels/matmul_ubo.ts). */
    cpuMatmul?: boolean;
    /**
     * CPU adapters: the kernels Mesa compiles fast (no barriers: kernels/matmul_direct.ts and the
     * direct attention kernels) instead of the tiled ones (default true).
     */
    cpuDirect?: boolean;
  };
  /** Compile into this cache (shared with the caller's other builds) instead of a new one. */
  cache?: PipelineCache;
  /** Hears of each pipeline compiled, with the build's total (see OpBatch.compile). */
  onCompile?: CompileListener;
}

/**
 * Multiply-adds from which a CPU adapter runs a matmul with kernels/matmul_ubo.ts: the LM head's
 * (the kernel compiles for about a second on llvmpipe, more than the smaller matmuls gain).
 */
export const CPU_MATMUL_MIN_MACS = 1 << 24;

/** Checks that every buffer of the plan fits the device; throws ConfigError naming the field. */
export function checkFits(ctx: GpuContext, shape: ModelShape): void {
  const { config: c, B, T } = shape;
  validateSeqLen(c, T);
  if (!Number.isInteger(B) || B <= 0) {
    throw new ConfigError("batch_size", `must be a positive integer, got ${B}`);
  }
  planModel(ctx.limits, shape);
  const D = c.n_embd / c.n_head;
  const tiles = chooseAttentionTiles({ T, D }, ctx.limits.maxComputeWorkgroupStorageSize);
  if (tiles.BKV < 8) {
    throw new ConfigError("n_embd", `head size ${D} needs more workgroup memory than the device has`);
  }
}

/**
 * Allocates all buffers and builds the op lists. With `train: false` only the forward pass and the
 * loss are planned (no gradients or optimizer state); `params` shares an existing parameter buffer.
 */
export async function buildModel(
  ctx: GpuContext,
  shape: ModelShape,
  opts: Omit<PlanOptions, "sharedParams" | "tensorParallel"> & BuildOptions = {},
): Promise<GpuModel> {
  checkFits(ctx, shape);
  const { config: c, B, T } = shape;
  const C = c.n_embd, L = c.n_layer, H = c.n_head, D = C / H, Vp = c.padded_vocab_size, BT = B * T;
  const tpSize = opts.tensorParallel?.size ?? 1, tpRank = opts.tensorParallel?.rank ?? 0, TP = tpSize > 1;
  if (
    !Number.isInteger(tpSize) || tpSize < 1 || !Number.isInteger(tpRank) || tpRank < 0 || tpRank >= tpSize
  ) {
    throw new RangeError(
      `tensorParallel must be {rank, size} with 0 <= rank < size, got ${JSON.stringify(opts.tensorParallel)}`,
    );
  }
  // This rank's share: attention heads, MLP columns, vocabulary rows (global id of the first: vlo).
  const Hl = H / tpSize, Cl = C / tpSize, Vl = Vp / tpSize, vlo = tpRank * Vl;
  const train = opts.train ?? true;
  const micro = opts.microBatches ?? 1, ranks = opts.dataParallel ?? 1;
  for (const [field, v] of [["microBatches", micro], ["dataParallel", ranks]] as const) {
    if (!Number.isInteger(v) || v < 1) throw new RangeError(`${field} must be a positive integer, got ${v}`);
  }
  /** Gradient writers add (accumulation over micro-batches) rather than store. */
  const acc = micro > 1;
  const plan = planModel(ctx.limits, shape, {
    ...opts,
    train,
    sharedParams: !!opts.params,
    tensorParallel: tpSize,
  });
  const { layout, segments, headRows } = plan, k = plan.checkpointLayers;
  const nChunks = Math.ceil(BT / headRows);
  const batch = (opts.cache ?? new PipelineCache(ctx)).batch();
  // Every buffer of the plan, allocated up front; nothing else is allocated. In the order that
  // packs the allocator's 256 MiB blocks (allocationOrder): the code below finds them by label.
  const buffers: GPUBuffer[] = [];
  const byLabel = new Map<string, GPUBuffer>();
  /** Buffers whose elements are f16 (everything else is f32 or u32). */
  const f16Buffers = new Set<GPUBuffer>();
  let memoryBytes = 0;
  // CPU adapters: every buffer can also be bound as a uniform buffer (see kernels/matmul_ubo.ts).
  const cpu = isCpuAdapter(ctx) && opts.kernels?.cpuMatmul !== false;
  const direct = isCpuAdapter(ctx) && opts.kernels?.cpuDirect !== false;
  try {
    for (const p of allocationOrder(plan.buffers).order) {
      const b = p.usage === "uniform"
        ? ctx.device.createBuffer({
          label: p.label,
          size: p.bytes,
          usage: GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST,
        })
        : await createStorage(ctx, p.label, p.bytes, cpu ? GPUBufferUsage.UNIFORM : 0);
      buffers.push(b);
      byLabel.set(p.label, b);
      if (p.dtype === "f16") f16Buffers.add(b);
      memoryBytes += b.size;
    }
  } catch (e) {
    for (const b of buffers) b.destroy();
    throw e;
  }
  const buf = (label: string): GPUBuffer => {
    const b = byLabel.get(label);
    if (!b) throw new Error(`Buffer "${label}" is not in the plan`);
    return b;
  };
  const flat = (label: string): FlatBuffer => ({
    segments: segments.map((r, i) => ({ ...r, buffer: buf(segments.length > 1 ? `${label}.${i}` : label) })),
    totalSize: layout.totalSize,
    bytesPerElement: 4,
  });
  const params: FlatBuffer = opts.params
    ? {
      segments: [{ start: 0, size: layout.totalSize, buffer: opts.params }],
      totalSize: layout.totalSize,
      bytesPerElement: 4,
    }
    : flat("params");
  const half = plan.precision === "fp16";
  if (half && !ctx.hasF16) {
    for (const b of buffers) b.destroy();
    throw new ConfigError("precision", `"fp16" needs a GPU with shader-f16, which this adapter lacks`);
  }
  const params16: FlatBuffer | null = half ? { ...flat("params16"), bytesPerElement: 2 } : null;
  const dtypeOf = (b: GPUBuffer): StorageDtype => f16Buffers.has(b) ? "f16" : "f32";
  // fp16: matmuls whose inputs are both f16 multiply in f16 per k-tile (see kernels/matmul.ts).
  const f16Math = half && (opts.f16Math ?? true);
  const tokens = buf("tokens"), stats = buf("stats"), control = buf("control");
  const dropUniform = buf("dropout"), optUniform = buf("optimizer");
  const nSites = dropoutSite.count(L);
  const res: GPUBuffer[] = [];
  for (let l = 0; l <= L; l++) res.push(buf(resLabel(k, L, l)));
  // The shared LayerNorm output of a training plan (see plan.ts): ln1 and ln2 of every layer.
  const lnw = plan.byLabel.has("lnw") ? buf("lnw") : null;
  const acts: LayerActs[] = [];
  for (let l = 0; l < L; l++) {
    acts.push(
      Object.fromEntries(
        LAYER_ACTS.map((n) => [n, lnw && RECOMPUTED_ACTS.includes(n) ? lnw : buf(actPrefix(k, l) + n)]),
      ) as Record<
        LayerActName,
        GPUBuffer
      >,
    );
  }
  const lnf = buf("lnf"), lnfs = buf("lnfs"), logits = buf("logits"), losses = buf("losses");

  const P = (name: string): View => {
    const t = layout.byName.get(name);
    if (!t) throw new Error(`Unknown parameter "${name}"`);
    return flatView(params, t.offset, t.size);
  };
  /** A weight as the matmuls read it: the f16 copy with fp16, else the parameters. */
  const W = (name: string): View => {
    if (!params16) return P(name);
    const t = layout.byName.get(name)!;
    return flatView(params16, t.offset, t.size);
  };
  /** Rows [r0, r0 + n) of a (B·T, width) activation. */
  const rowsView = (buffer: GPUBuffer, r0: number, n: number, width: number): View => {
    const bpe = dtypeOf(buffer) === "f16" ? 2 : 4;
    return { buffer, offset: r0 * width * bpe, size: n * width * bpe };
  };
  const chunks = Array.from({ length: nChunks }, (_, i) => {
    const r0 = i * headRows;
    return { i, r0, n: Math.min(headRows, BT - r0) };
  });
  const V = (buffer: GPUBuffer): View => ({ buffer });

  const op = (
    phase: Phase,
    kind: OpKind,
    label: string,
    code: string,
    views: View[],
    grid: [number, number, number] | [number, number] | [number],
    o: { uniform?: GPUBuffer; flops?: number } = {},
  ): Op => batch.defer(code, { label, phase, kind, views, grid, ...o });

  const drop = (p: number, site: number) => p > 0 ? { site, nSites } : undefined;
  const ruleSet = opts.kernels?.tileRules ?? "all";
  const tileRules = ruleSet === "all"
    ? undefined
    : ruleSet === "none"
    ? []
    : MATMUL_TILE_RULES.filter((r) => (r.tile.splitK ?? 1) > 1);
  // Split-K partial sums of the backward weight gradients (one matmul at a time, so shared).
  const matmulPart = plan.byLabel.has("matmul_part") ? buf("matmul_part") : null;
  /** A matmul's kernels: one, or with split-K one per slice of K and a reduction applying the epilogue. */
  const matmul = async (
    phase: Phase,
    label: string,
    spec: MatmulSpec,
    views: Record<string, View>,
  ): Promise<Op[]> => {
    // Each binding's element type is its buffer's, as planned.
    const dtypes = Object.fromEntries(Object.entries(views).map(([n, v]) => [n, dtypeOf(v.buffer)]));
    const math = f16Math && dtypes.A === "f16" && dtypes.B === "f16" ? "f16" : "f32";
    const full: MatmulSpec = { ...spec, dtypes, math };
    const ubo = cpu ? await cpuMatmul(phase, label, full, views) : null;
    if (ubo) return ubo;
    if (direct && matmulDirectError(full) === null) {
      const k = matmulDirectKernel(full);
      const kind = phase === "forward" ? "matmul_fwd" : "matmul_bwd";
      const o = { uniform: k.uniform ? dropUniform : undefined, flops: matmulFlops(spec) };
      return [await op(phase, kind, label, k.code, k.bindings.map((n) => views[n]), k.grid, o)];
    }
    const limits = { maxWorkgroupBytes: ctx.limits.maxComputeWorkgroupStorageSize, rules: tileRules };
    // Split-K only in backward (a checkpointed recompute drops a layer's last forward op), and only
    // where its partial sums fit the planned scratch.
    let tile = chooseTile(full, ctx.limits.maxComputeInvocationsPerWorkgroup, {
      ...limits,
      splitK: phase === "backward" && !!matmulPart,
    });
    if (matmulScratchBytes(full, tile) > (matmulPart?.size ?? 0)) {
      tile = chooseTile(full, ctx.limits.maxComputeInvocationsPerWorkgroup, { ...limits, splitK: false });
    }
    const out: Op[] = [];
    for (const k of matmulKernels(full, tile)) {
      out.push(
        await op(
          phase,
          phase === "forward" ? "matmul_fwd" : "matmul_bwd",
          label + k.suffix,
          k.code,
          k.bindings.map((n) => n === "part" ? { buffer: matmulPart! } : views[n]),
          k.grid,
          {
            uniform: k.uniform ? dropUniform : undefined,
            flops: k.suffix === ".sum" ? 0 : matmulFlops(spec),
          },
        ),
      );
    }
    return out;
  };
  /**
   * CPU adapters: the uniform-buffer matmul (kernels/matmul_ubo.ts) for matmuls of at least
   * CPU_MATMUL_MIN_MACS multiply-adds whose uniform operand's buffer allows it; null otherwise.
   */
  async function cpuMatmul(
    phase: Phase,
    label: string,
    spec: MatmulSpec,
    views: Record<string, View>,
  ): Promise<Op[] | null> {
    if (spec.M * spec.N * spec.K < CPU_MATMUL_MIN_MACS) return null;
    const lim = ctx.device.limits;
    const plan = uboMatmulPlan(spec, {
      maxUniformBytes: Math.min(lim.maxUniformBufferBindingSize, UNIFORM_BINDING_BYTES),
      uniformAlign: lim.minUniformBufferOffsetAlignment,
      storageAlign: lim.minStorageBufferOffsetAlignment,
    });
    if (typeof plan === "string") return null;
    if (!(views[plan[0].operand].buffer.usage & GPUBufferUsage.UNIFORM)) return null;
    const out: Op[] = [];
    for (const [i, d] of plan.entries()) {
      out.push(
        await op(
          phase,
          phase === "forward" ? "matmul_fwd" : "matmul_bwd",
          plan.length > 1 ? `${label}.u${i}` : label,
          d.code,
          d.bindings.map((n) => {
            const v = views[n], r = d.ranges[n];
            return r ? { buffer: v.buffer, offset: (v.offset ?? 0) + r.offset, size: r.size } : v;
          }),
          d.grid,
          {
            uniform: d.uniform ? dropUniform : undefined,
            flops: i === 0 ? matmulFlops(spec) : 0,
          },
        ),
      );
    }
    return out;
  }
  const mm = (M: number, N: number, K: number, transA = false, transB = false) => ({
    M,
    N,
    K,
    transA,
    transB,
    bias: false,
    epilogue: "store" as const,
  });
  const rowsGrid = grid1d(BT, ctx.limits.maxComputeWorkgroupsPerDimension);
  const elemGrid = (n4: number) => grid1d(Math.ceil(n4 / 64), ctx.limits.maxComputeWorkgroupsPerDimension);
  const split = chooseAttentionSplit(D, ctx.hasSubgroups);
  const wgBytes = ctx.limits.maxComputeWorkgroupStorageSize;
  const attn: AttentionSpec = {
    B,
    T,
    H: Hl,
    D,
    split,
    dtype: half ? "f16" : "f32",
    gradDtype: plan.byLabel.get("datty")?.dtype === "f16" ? "f16" : "f32",
    direct,
    ...(split > 1
      ? chooseSplitAttentionTiles({ T, D }, wgBytes, split, ctx.limits.maxComputeInvocationsPerWorkgroup)
      : chooseAttentionTiles({ T, D }, wgBytes)),
  };
  const hidden = shape.hiddenDropout, ap = shape.attnDropout;
  // FlashAttention-2 style forward where the device fits it (measured 2.1× today's on an H200;
  // its fused backward measured slower, so the backward keeps today's kernels).
  const flashFwd = opts.kernels?.flashAttention === false || direct ? null : chooseFlashForward({ T, D }, {
    maxWorkgroupBytes: wgBytes,
    maxThreads: ctx.limits.maxComputeInvocationsPerWorkgroup,
    subgroupMinSize: ctx.subgroupMinSize,
    maxBindingBytes: ctx.limits.maxStorageBufferBindingSize,
  });

  // ---------------------------------------------------------------- forward
  const forward: Step[] = [];
  // Tensor parallelism: the scratch of row-parallel partial sums, and the exchanges.
  const partial = TP ? buf("partial") : null;
  const allreduce = (label: string, buffer: GPUBuffer, count: number): Sync => ({
    sync: "allreduce",
    label,
    buffer,
    count,
  });
  const emb = {
    B,
    T,
    C,
    dropout: hidden > 0 && !TP ? { nSites } : undefined,
    accumulate: acc,
    ...(TP ? { vocab: { lo: vlo, rows: Vl }, positions: tpRank === 0 } : {}),
  };
  // Vocabulary-parallel lookup: each rank adds its rows' embeddings (rank 0 the positions), the
  // sum is allreduced, then dropped out as the fused kernel does.
  const embOut = TP && hidden > 0 ? partial! : res[0];
  forward.push(
    await op(
      "forward",
      "embedding",
      "embedding_fwd",
      embeddingForwardWgsl(emb),
      [V(tokens), P("wte.weight"), P("wpe.weight"), V(embOut)],
      elemGrid((BT * C) / 4),
      { uniform: emb.dropout ? dropUniform : undefined },
    ),
  );
  if (TP) {
    forward.push(allreduce("embedding", embOut, BT * C));
    if (hidden > 0) {
      forward.push(
        await op(
          "forward",
          "embedding",
          "embedding_drop",
          dropoutMaskWgsl((BT * C) / 4, dropoutSite.embedding, nSites),
          [V(partial!), V(res[0])],
          elemGrid((BT * C) / 4),
          { uniform: dropUniform },
        ),
      );
    }
  }
  const lnFwd = (x: GPUBuffer, w: string, b: string, out: GPUBuffer, st: GPUBuffer, label: string) =>
    op("forward", "layernorm", label, layernormForwardWgsl(C, dtypeOf(out)), [
      V(x),
      P(w),
      P(b),
      V(out),
      V(st),
    ], rowsGrid);
  /**
   * A row-parallel output projection plus residual: fused into the matmul on one GPU; with
   * tensor parallelism the partial sums are allreduced first, then bias, dropout and residual.
   */
  const rowParallel = async (
    label: string,
    K: number,
    A: GPUBuffer,
    w: string,
    b: string,
    resIn: GPUBuffer,
    out: GPUBuffer,
    site: number,
    prologueA?: "gelu",
  ): Promise<Step[]> => {
    if (!TP) {
      return [
        ...await matmul("forward", label, {
          ...mm(BT, C, K),
          bias: true,
          epilogue: "residual",
          dropout: drop(hidden, site),
          ...(prologueA ? { prologueA } : {}),
        }, { A: V(A), B: W(w), bias: P(b), res: V(resIn), out: V(out) }),
      ];
    }
    const d = drop(hidden, site);
    return [
      ...await matmul("forward", label, { ...mm(BT, C, K), ...(prologueA ? { prologueA } : {}) }, {
        A: V(A),
        B: W(w),
        out: V(partial!),
      }),
      allreduce(label, partial!, BT * C),
      await op(
        "forward",
        "elementwise",
        `${label}.residual`,
        biasDropResidualWgsl(BT, C, d),
        [V(partial!), P(b), V(resIn), V(out)],
        elemGrid((BT * C) / 4),
        { uniform: d ? dropUniform : undefined },
      ),
    ];
  };
  /** Each layer's forward steps, replayed in backward to recompute a checkpointed group. */
  const layerOps: Step[][] = [];
  for (let l = 0; l < L; l++) {
    const a = acts[l], p = `h.${l}.`, first = forward.length;
    forward.push(await lnFwd(res[l], p + "ln_1.weight", p + "ln_1.bias", a.ln1, a.ln1s, `l${l}.ln1`));
    forward.push(
      ...await matmul("forward", `l${l}.qkv`, { ...mm(BT, 3 * Cl, C), bias: true }, {
        A: V(a.ln1),
        B: W(p + "attn.c_attn.weight"),
        bias: P(p + "attn.c_attn.bias"),
        out: V(a.qkv),
      }),
    );
    const as = { ...attn, ...flashFwd, dropout: drop(ap, dropoutSite.attnProbs(l)) };
    forward.push(
      await op(
        "forward",
        "attention_fwd",
        `l${l}.attention`,
        attentionForwardWgsl(as),
        [V(a.qkv), V(a.atty), V(a.lse)],
        [Math.ceil(T / as.BQ), Hl, B],
        { uniform: as.dropout ? dropUniform : undefined, flops: attentionFlops(as) },
      ),
    );
    forward.push(
      ...await rowParallel(
        `l${l}.attn_proj`,
        Cl,
        a.atty,
        p + "attn.c_proj.weight",
        p + "attn.c_proj.bias",
        res[l],
        a.res2,
        dropoutSite.attnProj(l),
      ),
    );
    forward.push(await lnFwd(a.res2, p + "ln_2.weight", p + "ln_2.bias", a.ln2, a.ln2s, `l${l}.ln2`));
    forward.push(
      ...await matmul("forward", `l${l}.fc`, { ...mm(BT, 4 * Cl, C), bias: true }, {
        A: V(a.ln2),
        B: W(p + "mlp.c_fc.weight"),
        bias: P(p + "mlp.c_fc.bias"),
        out: V(a.fch),
      }),
    );
    forward.push(
      ...await rowParallel(
        `l${l}.fc_proj`,
        4 * Cl,
        a.fch,
        p + "mlp.c_proj.weight",
        p + "mlp.c_proj.bias",
        a.res2,
        res[l + 1],
        dropoutSite.mlpProj(l),
        "gelu",
      ),
    );
    layerOps.push(forward.slice(first));
  }
  forward.push(await lnFwd(res[L], "ln_f.weight", "ln_f.bias", lnf, lnfs, "lnf"));
  // The LM head: this rank's Vl columns of the logits (all Vp on one GPU).
  const headFwd = (k: { i: number; r0: number; n: number }) =>
    matmul("forward", nChunks > 1 ? `lm_head.${k.i}` : "lm_head", mm(k.n, Vl, C, false, true), {
      A: rowsView(lnf, k.r0, k.n, C),
      B: W("wte.weight"),
      out: rowsView(logits, 0, k.n, Vl),
    });
  if (nChunks === 1) forward.push(...await headFwd(chunks[0]));

  // ---------------------------------------------------------------- loss
  type Chunk = { i: number; r0: number; n: number };
  const ceStats = TP ? buf("ceStats") : null;
  /** The loss of a chunk (and its gradient in place of the logits with `grad`). */
  const ceOp = async (k: Chunk, grad: boolean): Promise<Step[]> => {
    const sfx = `${grad ? "" : "_eval"}${nChunks > 1 ? `.${k.i}` : ""}`;
    const grid = grid1d(k.n, ctx.limits.maxComputeWorkgroupsPerDimension);
    const gradOpts = grad ? { uniform: optUniform } : {};
    if (!TP) {
      return [
        await op(
          "forward",
          "cross_entropy",
          `cross_entropy${sfx}`,
          crossEntropyWgsl({
            rows: k.n,
            rowBase: k.r0,
            totalRows: BT * micro * ranks,
            T,
            V: c.vocab_size,
            Vp,
            grad,
          }),
          [rowsView(logits, 0, k.n, Vp), V(tokens), V(losses), ...(grad ? [V(control)] : [])],
          grid,
          gradOpts,
        ),
      ];
    }
    const vs = { rows: k.n, rowBase: k.r0, totalRows: BT * micro * ranks, T, V: c.vocab_size, Vl, lo: vlo };
    const lv = rowsView(logits, 0, k.n, Vl);
    return [
      await op("forward", "cross_entropy", `cross_entropy_stats${sfx}`, ceLocalStatsWgsl(vs), [
        lv,
        V(tokens),
        V(ceStats!),
      ], grid),
      { sync: "vocab_ce", label: `cross_entropy${sfx}`, stats: ceStats!, rows: k.n },
      await op(
        "forward",
        "cross_entropy",
        `cross_entropy${sfx}`,
        ceFromStatsWgsl(vs, grad),
        [lv, V(tokens), V(losses), V(ceStats!), ...(grad ? [V(control)] : [])],
        grid,
        gradOpts,
      ),
    ];
  };
  const meanLoss = () =>
    op("forward", "cross_entropy", "mean_loss", meanLossWgsl(BT * micro, STAT.loss, acc), [
      V(losses),
      V(stats),
    ], [
      1,
    ]);
  let loss: Step[] = [];
  if (!train) loss = [...await ceOp(chunks[0], true), await meanLoss()];
  const evalLoss: Step[] = [];
  for (const k of chunks) {
    if (nChunks > 1) evalLoss.push(...await headFwd(k));
    evalLoss.push(...await ceOp(k, false));
  }
  evalLoss.push(
    await op("forward", "cross_entropy", "mean_eval_loss", meanLossWgsl(BT, STAT.evalLoss, true), [
      V(losses),
      V(stats),
    ], [1]),
  );

  // ---------------------------------------------------------------- backward
  const backward: Step[] = [];
  const backwardMarks: { layer: number; at: number }[] = [];
  let optimizer: Step[] = [];
  // fp16: the f16 weight copy, refreshed from the master weights after every update.
  const castWeights: Op[] = [];
  if (params16) {
    for (const [i, seg] of segments.entries()) {
      castWeights.push(
        await op(
          "optimizer",
          "optimizer",
          `cast_f16${segments.length > 1 ? `.${i}` : ""}`,
          castF16Wgsl(seg.size / 4),
          [V(params.segments[i].buffer), V(params16.segments[i].buffer)],
          grid1d(Math.ceil(seg.size / 4 / 256), ctx.limits.maxComputeWorkgroupsPerDimension),
        ),
      );
    }
  }
  let trainBufs: { grads: FlatBuffer; adamM: FlatBuffer | null; adamV: FlatBuffer | null } | null = null;
  const checksum: Op[] = [];
  let checksumParts: GPUBuffer | null = null;
  if (train) {
    const grads = flat("grads");
    const fullState = opts.optimizerState ?? true;
    const adamM = fullState ? flat("adam.m") : null, adamV = fullState ? flat("adam.v") : null;
    // Backward scratch.
    const dres = buf("dres"), dtmp = buf("dtmp"), dln = buf("dln"), datty = buf("datty");
    const d4 = buf("d4c"), dqkv = buf("dqkv"), delta = buf("delta");
    const blocks = Math.ceil(BT / ROW_BLOCK);
    const dwEpilogue = acc ? "accumulate" as const : "store" as const;
    const part = buf("partials"), normPart = buf("normPart");
    const G = (name: string): View => {
      const t = layout.byName.get(name)!;
      return flatView(grads, t.offset, t.size);
    };
    const colsum = async (label: string, src: GPUBuffer, N: number, out: View) => {
      backward.push(
        await op("backward", "reduce", label + ".part", colsumPartialWgsl(N, BT, dtypeOf(src)), [
          V(src),
          V(part),
        ], [
          Math.ceil(N / 4 / 64),
          blocks,
        ]),
      );
      backward.push(
        await op("backward", "reduce", label + ".sum", reduceRowsWgsl(N, blocks, acc), [
          { buffer: part, offset: 0, size: blocks * N * 4 },
          out,
        ], [Math.ceil(N / 4 / 64)]),
      );
    };
    const lnBwd = async (
      label: string,
      dy: GPUBuffer,
      x: GPUBuffer,
      st: GPUBuffer,
      w: string,
      b: string,
      accumulate: boolean,
    ) => {
      backward.push(
        await op("backward", "layernorm", label + ".dx", layernormBackwardWgsl(C, accumulate), [
          V(dy),
          V(x),
          P(w),
          V(st),
          V(dres),
        ], rowsGrid),
      );
      backward.push(
        await op("backward", "layernorm", label + ".dw_part", layernormParamPartialWgsl(C, BT), [
          V(dy),
          V(x),
          V(st),
          V(part),
        ], [Math.ceil(C / 4 / 64), blocks]),
      );
      const half = blocks * C * 4, dbOff = lnBiasPartialOffset(C, BT) * 4;
      backward.push(
        await op("backward", "reduce", label + ".dw", reduceRowsWgsl(C, blocks, acc), [
          { buffer: part, offset: 0, size: half },
          G(w),
        ], [Math.ceil(C / 4 / 64)]),
      );
      backward.push(
        await op("backward", "reduce", label + ".db", reduceRowsWgsl(C, blocks, acc), [
          { buffer: part, offset: dbOff, size: half },
          G(b),
        ], [Math.ceil(C / 4 / 64)]),
      );
    };
    const maskOrSelf = async (label: string, p: number, site: number): Promise<GPUBuffer> => {
      if (p <= 0) return dres;
      backward.push(
        await op(
          "backward",
          "elementwise",
          label,
          dropoutMaskWgsl((BT * C) / 4, site, nSites),
          [V(dres), V(dtmp)],
          elemGrid((BT * C) / 4),
          {
            uniform: dropUniform,
          },
        ),
      );
      return dtmp;
    };

    // LM head: dlnf = dlogits·wte; dwte = dlogitsᵀ·lnf (stored, then accumulated over chunks;
    // the embedding adds to it later). With several chunks each runs right after its loss.
    const sfx = (k: Chunk) => nChunks > 1 ? `.${k.i}` : "";
    const headBwd = async (k: Chunk) => [
      ...await matmul("backward", `lm_head.dx${sfx(k)}`, mm(k.n, C, Vl), {
        A: rowsView(logits, 0, k.n, Vl),
        B: W("wte.weight"),
        out: rowsView(dln, k.r0, k.n, C),
      }),
      ...await matmul("backward", `lm_head.dw${sfx(k)}`, {
        ...mm(Vl, C, k.n, true, false),
        epilogue: k.i === 0 && !acc ? "store" : "accumulate",
      }, {
        A: rowsView(logits, 0, k.n, Vl),
        B: rowsView(lnf, k.r0, k.n, C),
        out: G("wte.weight"),
      }),
    ];
    if (nChunks === 1) {
      loss = [...await ceOp(chunks[0], true), await meanLoss()];
      backward.push(...await headBwd(chunks[0]));
    } else {
      for (const k of chunks) loss.push(...await headFwd(k), ...await ceOp(k, true), ...await headBwd(k));
      loss.push(await meanLoss());
    }
    // Tensor parallelism: each rank's vocabulary columns give a part of dlnf (and each column- or
    // head-parallel matmul below a part of its input's gradient): sum them before the LayerNorm.
    if (TP) backward.push(allreduce("lm_head.dx", dln, BT * C));
    await lnBwd("lnf.bwd", dln, res[L], lnfs, "ln_f.weight", "ln_f.bias", false);
    const lastGroup = k > 0 ? Math.floor((L - 1) / k) : -1;
    for (let l = L - 1; l >= 0; l--) {
      const a = acts[l], p = `h.${l}.`;
      // Checkpointing: entering a group from its top, recompute its layers from the group's input
      // (the last group's activations are still in place). The group's final output projection
      // only rewrites the stored residual, so it is left out.
      const g = k > 0 ? Math.floor(l / k) : -1;
      if (k > 0 && g !== lastGroup && (l % k === k - 1 || l === L - 1)) {
        // The output projection's steps (its exchange and residual kernel with tensor parallelism).
        const tail = TP ? 3 : 1;
        for (let j = g * k; j <= l; j++) {
          backward.push(...(j === l ? layerOps[j].slice(0, -tail) : layerOps[j]));
        }
      }
      // MLP output projection (+ residual): dres is the gradient of res[l+1].
      const dproj = await maskOrSelf(`l${l}.mlp_drop.bwd`, hidden, dropoutSite.mlpProj(l));
      backward.push(
        ...await matmul(
          "backward",
          `l${l}.fc_proj.dw`,
          { ...mm(4 * Cl, C, BT, true, false), prologueA: "gelu", epilogue: dwEpilogue },
          {
            A: V(a.fch),
            B: V(dproj),
            out: G(p + "mlp.c_proj.weight"),
          },
        ),
      );
      await colsum(`l${l}.fc_proj.db`, dproj, C, G(p + "mlp.c_proj.bias"));
      backward.push(
        ...await matmul("backward", `l${l}.fc_proj.dx`, {
          ...mm(BT, 4 * Cl, C, false, true),
          epilogue: "gelu_grad",
        }, {
          A: V(dproj),
          B: W(p + "mlp.c_proj.weight"),
          aux: V(a.fch),
          out: V(d4),
        }),
      );
      // ln2's output, recomputed from res2 and its statistics (not stored).
      if (lnw) {
        backward.push(await lnFwd(a.res2, p + "ln_2.weight", p + "ln_2.bias", lnw, a.ln2s, `l${l}.ln2.re`));
      }
      backward.push(
        ...await matmul("backward", `l${l}.fc.dw`, {
          ...mm(C, 4 * Cl, BT, true, false),
          epilogue: dwEpilogue,
        }, {
          A: V(a.ln2),
          B: V(d4),
          out: G(p + "mlp.c_fc.weight"),
        }),
      );
      await colsum(`l${l}.fc.db`, d4, 4 * Cl, G(p + "mlp.c_fc.bias"));
      backward.push(
        ...await matmul("backward", `l${l}.fc.dx`, mm(BT, C, 4 * Cl, false, true), {
          A: V(d4),
          B: W(p + "mlp.c_fc.weight"),
          out: V(dln),
        }),
      );
      if (TP) backward.push(allreduce(`l${l}.fc.dx`, dln, BT * C));
      await lnBwd(`l${l}.ln2.bwd`, dln, a.res2, a.ln2s, p + "ln_2.weight", p + "ln_2.bias", true);
      // Attention output projection (+ residual): dres is now the gradient of res2.
      const dap = await maskOrSelf(`l${l}.attn_drop.bwd`, hidden, dropoutSite.attnProj(l));
      backward.push(
        ...await matmul(
          "backward",
          `l${l}.attn_proj.dw`,
          { ...mm(Cl, C, BT, true, false), epilogue: dwEpilogue },
          {
            A: V(a.atty),
            B: V(dap),
            out: G(p + "attn.c_proj.weight"),
          },
        ),
      );
      await colsum(`l${l}.attn_proj.db`, dap, C, G(p + "attn.c_proj.bias"));
      backward.push(
        ...await matmul("backward", `l${l}.attn_proj.dx`, mm(BT, Cl, C, false, true), {
          A: V(dap),
          B: W(p + "attn.c_proj.weight"),
          out: V(datty),
        }),
      );
      const as = { ...attn, dropout: drop(ap, dropoutSite.attnProbs(l)) };
      const u = { uniform: as.dropout ? dropUniform : undefined };
      backward.push(
        await op("backward", "attention_bwd", `l${l}.attention.delta`, attentionDeltaWgsl(as), [
          V(a.atty),
          V(datty),
          V(delta),
        ], grid1d(Math.ceil((BT * Hl) / 64), ctx.limits.maxComputeWorkgroupsPerDimension)),
      );
      const av = [V(a.qkv), V(datty), V(a.lse), V(delta), V(dqkv)];
      backward.push(
        await op("backward", "attention_bwd", `l${l}.attention.dkv`, attentionBackwardKVWgsl(as), av, [
          Math.ceil(T / as.BKV),
          Hl,
          B,
        ], { ...u, flops: 2 * attentionFlops(as) }),
      );
      backward.push(
        await op("backward", "attention_bwd", `l${l}.attention.dq`, attentionBackwardQWgsl(as), av, [
          Math.ceil(T / as.BQ),
          Hl,
          B,
        ], { ...u, flops: 1.5 * attentionFlops(as) }),
      );
      // ln1's output, recomputed from res[l] and its statistics (not stored).
      if (lnw) {
        backward.push(await lnFwd(res[l], p + "ln_1.weight", p + "ln_1.bias", lnw, a.ln1s, `l${l}.ln1.re`));
      }
      backward.push(
        ...await matmul(
          "backward",
          `l${l}.qkv.dw`,
          { ...mm(C, 3 * Cl, BT, true, false), epilogue: dwEpilogue },
          {
            A: V(a.ln1),
            B: V(dqkv),
            out: G(p + "attn.c_attn.weight"),
          },
        ),
      );
      await colsum(`l${l}.qkv.db`, dqkv, 3 * Cl, G(p + "attn.c_attn.bias"));
      backward.push(
        ...await matmul("backward", `l${l}.qkv.dx`, mm(BT, C, 3 * Cl, false, true), {
          A: V(dqkv),
          B: W(p + "attn.c_attn.weight"),
          out: V(dln),
        }),
      );
      if (TP) backward.push(allreduce(`l${l}.qkv.dx`, dln, BT * C));
      await lnBwd(`l${l}.ln1.bwd`, dln, res[l], a.ln1s, p + "ln_1.weight", p + "ln_1.bias", true);
      backwardMarks.push({ layer: l, at: backward.filter((x) => !isSync(x)).length });
    }
    backward.push(
      await op(
        "backward",
        "embedding",
        "embedding_bwd",
        // The gradient passes the embedding dropout's mask (applied after the allreduce with TP).
        embeddingBackwardWgsl({ ...emb, dropout: hidden > 0 ? { nSites } : undefined }),
        [
          V(tokens),
          V(dres),
          G("wte.weight"),
          G("wpe.weight"),
        ],
        elemGrid(((T + WTE_PARTITIONS) * C) / 4),
        { uniform: hidden > 0 ? dropUniform : undefined },
      ),
    );

    // ---------------------------------------------------------------- optimizer
    // Per segment: the norm's partial sums (into its own NORM_GROUPS slots), later AdamW.
    const normOps: Op[] = [], adamOps: Op[] = [];
    for (const [i, seg] of (fullState ? segments : []).entries()) {
      const n4 = seg.size / 4, sf = segments.length > 1 ? `.${i}` : "";
      const decayEnd4 = Math.min(Math.max(layout.decayEnd - seg.start, 0), seg.size) / 4;
      const pv = params.segments[i].buffer, gv = grads.segments[i].buffer;
      normOps.push(
        await op("optimizer", "optimizer", `grad_norm.part${sf}`, gradNormPartialWgsl(n4), [
          V(gv),
          { buffer: normPart, offset: i * NORM_GROUPS * 4, size: NORM_GROUPS * 4 },
        ], [NORM_GROUPS]),
      );
      adamOps.push(
        await op(
          "optimizer",
          "optimizer",
          `adamw${sf}`,
          adamwWgsl(n4, decayEnd4),
          [V(pv), V(gv), V(adamM!.segments[i].buffer), V(adamV!.segments[i].buffer), V(control)],
          grid1d(Math.ceil(n4 / 256), ctx.limits.maxComputeWorkgroupsPerDimension),
          { uniform: optUniform },
        ),
      );
    }
    // Tensor parallelism: each rank adds the squares of its shards' gradients (rank 0 also the
    // replicated tensors', which are equal everywhere); the host sums the ranks' parts into one.
    const normSteps: Step[] = normOps;
    let normIn = V(normPart), normParts = NORM_GROUPS * segments.length;
    if (TP && fullState) {
      const tpParts = buf("tpNormParts"), total = buf("normTotal");
      const ranges = normRanges(c, layout, segments, tpSize, tpRank);
      normSteps.length = 0;
      for (const [i, r] of ranges.entries()) {
        normSteps.push(
          await op("optimizer", "optimizer", `grad_norm.range${i}`, gradNormPartialWgsl(r.size / 4), [
            { buffer: grads.segments[r.segment].buffer, offset: r.offset * 4, size: r.size * 4 },
            { buffer: tpParts, offset: i * NORM_GROUPS * 4, size: NORM_GROUPS * 4 },
          ], [NORM_GROUPS]),
        );
      }
      normSteps.push({
        sync: "norm",
        label: "grad_norm",
        parts: tpParts,
        count: ranges.length * NORM_GROUPS,
        total,
      });
      normIn = V(total);
      normParts = 1;
    }
    // Without the moments (distributed optimizer) the update is the caller's.
    optimizer = !fullState ? [] : [
      ...normSteps,
      await op(
        "optimizer",
        "optimizer",
        "step_control",
        stepControlWgsl(normParts, STAT.loss, STAT.gradNorm),
        [normIn, V(stats), V(control)],
        [1],
        { uniform: optUniform },
      ),
      ...adamOps,
      ...castWeights,
    ];
    trainBufs = { grads, adamM, adamV };
    for (const [i, seg] of segments.entries()) {
      checksum.push(
        await op(
          "optimizer",
          "optimizer",
          `checksum${segments.length > 1 ? `.${i}` : ""}`,
          checksumPartialWgsl(seg.size / 4, seg.start),
          [V(params.segments[i].buffer), {
            buffer: normPart,
            offset: i * NORM_GROUPS * 4,
            size: NORM_GROUPS * 4,
          }],
          [NORM_GROUPS],
        ),
      );
    }
    checksumParts = normPart;
  }

  // Every kernel compiled here, against a known total. On a CPU adapter each is also dispatched
  // once, since Mesa compiles at the first dispatch: on buffers that hold nothing yet (a shared
  // parameter buffer only feeds a forward pass, which never writes it), cleared again after.
  const warm = isCpuAdapter(ctx) && (!opts.params || !train);
  try {
    await batch.compile(opts.onCompile, warm);
  } catch (e) {
    for (const b of buffers) b.destroy();
    throw e;
  }
  if (warm) {
    const enc = ctx.device.createCommandEncoder();
    for (const b of buffers) enc.clearBuffer(b);
    ctx.device.queue.submit([enc.finish()]);
  }

  return {
    shape,
    layout,
    params,
    grads: trainBufs?.grads ?? null,
    adamM: trainBufs?.adamM ?? null,
    adamV: trainBufs?.adamV ?? null,
    headRows,
    tokens,
    layers: acts,
    lnf,
    logits,
    stats,
    dropUniform,
    optUniform,
    control,
    nSites,
    forward: forward.filter((x): x is Op => !isSync(x)),
    loss: loss.filter((x): x is Op => !isSync(x)),
    evalLoss: evalLoss.filter((x): x is Op => !isSync(x)),
    backward: backward.filter((x): x is Op => !isSync(x)),
    backwardMarks,
    optimizer: optimizer.filter((x): x is Op => !isSync(x)),
    program: { forward, loss, evalLoss, backward, optimizer },
    tensorParallel: { rank: tpRank, size: tpSize },
    castWeights,
    checksum,
    checksumParts,
    memoryBytes,
    microBatches: micro,
    dataParallel: ranks,
    buffers,
    plan,
  };
}

/** Frees every buffer of the model. */
export function destroyModel(m: GpuModel): void {
  for (const b of m.buffers) b.destroy();
  m.buffers.length = 0;
}
