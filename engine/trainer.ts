/**
 * The training engine's public face: one `Trainer` owns a planned GPU model, its AdamW state and
 * learning-rate schedule. `trainStep` writes the batch and per-step scalars, records forward,
 * loss, backward and optimizer into one submission and returns without reading anything back.
 *
 * A step whose loss or gradient norm is not finite is skipped on the GPU (weights, moments, the
 * optimizer step and so the learning rate stay); the skipped-step counters and the loss scale
 * come back with the loss in `lastStats`. Iterations (`step`: data position, dropout keys) always
 * advance; the optimizer step lives on the GPU.
 */

import type { ModelConfig, ParamLayout } from "../model/config.ts";
import { checkDevice, type GpuContext, GpuError, readBuffer, readFloats, type ReadRange } from "./device.ts";
import { initParams } from "../model/init.ts";
import {
  buildModel,
  type BuildOptions,
  destroyModel,
  type GpuModel,
  isSync,
  STAT,
  type Step,
  type Sync,
} from "./graph/mod.ts";
import type { ChunkOptions, Precision } from "../model/plan.ts";
import { type FlatBuffer, readFlat, writeFlat } from "./flat.ts";
import type { ZeroModel } from "./parallel/zero.ts";
import type { StagedRun } from "./parallel/data_parallel.ts";
import { type CompileListener, encodeOps, type Op } from "./ops.ts";
import { createReadback, type Readback } from "./readback.ts";
import { DROPOUT_SLOT_BYTES, dropoutKey, dropoutSite, dropThreshold, pcg } from "../model/rng.ts";
import { splitParams } from "../model/shard.ts";
import { type AdamWConfig, type LrSchedule } from "../model/schedule.ts";
import {
  CONTROL_BYTES,
  type ControlState,
  DEFAULT_LOSS_SCALER,
  type LossScalerConfig,
  NORM_GROUPS,
  packControl,
  packOptimizerUniform,
  unpackControl,
} from "./kernels/adamw.ts";

/** What a trainer is built from. */
export interface TrainerOptions {
  config: ModelConfig;
  batchSize: number;
  seqLen: number;
  schedule: LrSchedule;
  adamw: AdamWConfig;
  attnDropout: number;
  hiddenDropout: number;
  seed: number;
  /** Time every kernel with timestamp queries (one pass per kernel; for benchmarks). */
  profile?: boolean;
  /**
   * "fp16": f16 weights (a copy refreshed after each update) and activations, fp32 master weights,
   * gradients and AdamW, dynamic loss scaling. Default "fp32".
   */
  precision?: Precision;
  /** fp16: multiply f16 matmul inputs in f16 per k-tile (default true; false keeps f32 arithmetic). */
  f16Math?: boolean;
  /** Dynamic loss scaling; default: Megatron's (DEFAULT_LOSS_SCALER) with fp16, none (scale 1) with fp32. */
  lossScaler?: LossScalerConfig;
  /** Test hook: iterations (0-based `step` at submission) whose loss gradient is made NaN on the GPU. */
  debugNonFiniteAt?: number[];
  /** Smaller segments of the flat arrays or LM head chunks than the device needs (tests, benchmarks). */
  chunks?: ChunkOptions;
  /** Activation checkpointing: layers per group recomputed in backward (0 or absent: none). */
  checkpointLayers?: number;
  /**
   * The attention backward's dQ as a matmul over stored dS (PlanOptions.attentionScores); default:
   * on for GPUs that run the split kernels (scoresByDefault in engine/graph/builder.ts).
   */
  attentionScores?: boolean;
  /** Hears of each kernel compiled while the model is built, with their total. */
  onCompile?: CompileListener;
  /** Micro-batches per optimizer step, their gradients accumulated on the GPU (default 1). */
  microBatches?: number;
  /**
   * This trainer is rank `rank` of `size` data-parallel ranks: its gradients are summed with the
   * others' by the `reduce` callback of `trainStepReduced` before every update.
   */
  dataParallel?: { rank: number; size: number };
  /**
   * Distributed optimizer: the trainer plans no AdamW moments and runs no update of its own; the
   * `reduce` callback of `trainStepReduced` does it (engine/parallel/zero.ts, see `zeroModel`).
   */
  shardedOptimizer?: boolean;
  /**
   * Tensor parallelism: this trainer is rank `rank` of `size` (`config` the tensor-parallel
   * config, see model/shard.ts tensorParallelConfig) and `exchange` runs the program's
   * exchanges with its peers (engine/parallel/tensor_parallel.ts). It steps with `trainStepReduced`.
   */
  tensorParallel?: { rank: number; size: number; exchange: (s: Sync) => Promise<void> };
  /** Kernel choices for benchmarks (see BuildOptions.kernels). */
  kernels?: BuildOptions["kernels"];
  /**
   * Read the per-step figures (loss, norm, loss scale: a few bytes a step waits on) through the
   * canvas path (engine/readback.ts: under a millisecond on an H200 instead of mapAsync's 10 ms
   * floor). Default true; false reads through mapAsync (GPT2_FAST_READBACK=0).
   */
  fastReadback?: boolean;
  /**
   * SFT: the loss is the mean over the targets a batch's mask selects (a {@link MaskedBatch}; a
   * plain batch counts every target), per micro-batch. Not with tensor parallelism.
   */
  lossMask?: boolean;
}

/** B·(T+1) tokens with SFT's loss mask: `mask` (B·T) is 1 where the target of row b, position t counts. */
export interface MaskedBatch {
  tokens: Uint16Array | Uint32Array;
  mask: Uint8Array;
}

/** One batch of B·(T+1) tokens. */
export type Batch = Uint16Array | Uint32Array;

/** What a step or an evaluation takes: a batch, or one with a loss mask (a trainer created with `lossMask`). */
export type TrainBatch = Batch | MaskedBatch;

/**
 * Sums the gradients over the data-parallel ranks in place (every rank calls it once per step,
 * after the backward passes are submitted); resolves once the sum is in `grads` or queued to it.
 */
export type GradientReduce = (grads: FlatBuffer) => Promise<void>;

/**
 * A data-parallel reduction that can also run in stages under the backward pass
 * (`GradientReducer`): `begin` plans one step's stages, or returns null for the plain `reduce`.
 */
export interface StagedReduce {
  reduce: GradientReduce;
  begin(grads: FlatBuffer, layout: ParamLayout, layers: number): StagedRun | null;
}

/** What one readback at a log step returns. */
export interface StepStats {
  loss: number;
  /** Global gradient norm before clipping (unscaled; not finite on a skipped step). */
  gradNorm: number;
  /** Learning rate of the last step attempted. */
  lr: number;
  /** Steps skipped since the start (non-finite loss or gradient). */
  skippedSteps: number;
  /**
   * Steps skipped in a row up to the last one that count toward the failure limit (0 when the
   * last step was applied): with the loss scale at its floor, or without dynamic scaling (fp32,
   * static scale). Steps skipped while the dynamic scale backs off are in `skippedSteps` only.
   */
  consecutiveSkipped: number;
  /** Optimizer steps applied. */
  optimizerStep: number;
  lossScale: number;
  /** Checksum of the parameters after the step, when asked for. */
  checksum?: number;
}

/** Everything needed to resume exactly: flat parameters and AdamW moments, and the step count. */
export interface TrainerState {
  step: number;
  params: Float32Array;
  m: Float32Array;
  v: Float32Array;
  /** Optimizer step, skipped-step counters and loss scale; absent: `step` optimizer steps, none skipped. */
  control?: ControlState;
}

/** Options of `lastStats`. */
export interface StatsOptions {
  /** Also compute and read back a checksum of the parameters (see kernels/checksum.ts). */
  checksum?: boolean;
}

/** Timing of one kernel in the last profiled step. */
export interface OpTiming {
  label: string;
  kind: string;
  phase: string;
  ms: number;
  flops: number;
}

/** Trains one GPT-2 model on one GPU. */
export class Trainer {
  readonly opts: TrainerOptions;
  #ctx: GpuContext;
  #model: GpuModel;
  #step: number;
  #stepOps: Op[];
  #querySet?: GPUQuerySet;
  #queryBuf?: GPUBuffer;
  /** Whether the last submitted step was profiled and its timings are not yet read. */
  #profilePending = false;
  #lastProfile: OpTiming[] | null = null;
  /** The plan's per-row loss buffer, once `encodeTokenLosses` looked it up. */
  #losses: GPUBuffer | null | undefined;

  /** Reads the per-step figures back (TrainerOptions.fastReadback). */
  #readback: Readback;

  private constructor(
    ctx: GpuContext,
    opts: TrainerOptions,
    model: GpuModel,
    step: number,
    readback: Readback,
  ) {
    this.#ctx = ctx;
    this.#readback = readback;
    this.opts = opts;
    this.#model = model;
    this.#step = step;
    this.#stepOps = [...model.forward, ...model.loss, ...model.backward, ...model.optimizer];
    if (opts.profile && ctx.hasTimestamps) {
      const count = 2 * this.#stepOps.length;
      this.#querySet = ctx.device.createQuerySet({ type: "timestamp", count });
      this.#queryBuf = ctx.device.createBuffer({
        size: count * 8,
        usage: GPUBufferUsage.QUERY_RESOLVE | GPUBufferUsage.COPY_SRC,
      });
    }
  }

  /** Plans the model on the device and loads `state` or fresh parameters. Throws ConfigError when it can't fit. */
  static async create(ctx: GpuContext, options: TrainerOptions, state?: TrainerState): Promise<Trainer> {
    const opts: TrainerOptions = {
      ...options,
      lossScaler: options.lossScaler ?? (options.precision === "fp16" ? DEFAULT_LOSS_SCALER : undefined),
    };
    const model = await buildModel(ctx, {
      config: opts.config,
      B: opts.batchSize,
      T: opts.seqLen,
      attnDropout: opts.attnDropout,
      hiddenDropout: opts.hiddenDropout,
    }, {
      ...opts.chunks,
      checkpointLayers: opts.checkpointLayers,
      attentionScores: opts.attentionScores,
      precision: opts.precision,
      f16Math: opts.f16Math,
      microBatches: opts.microBatches,
      dataParallel: opts.dataParallel?.size,
      optimizerState: !opts.shardedOptimizer,
      tensorParallel: opts.tensorParallel &&
        { rank: opts.tensorParallel.rank, size: opts.tensorParallel.size },
      kernels: opts.kernels,
      onCompile: opts.onCompile,
      lossMask: opts.lossMask,
    });
    const n = model.layout.totalSize;
    const q = ctx.device.queue;
    if (state) {
      const arrays = [["params", state.params], ["m", state.m], ["v", state.v]] as const;
      for (const [name, arr] of arrays.slice(0, opts.shardedOptimizer ? 1 : 3)) {
        if (arr.length !== n) {
          destroyModel(model);
          throw new GpuError(
            "Cannot load trainer state",
            `${name} has ${arr.length} floats, the model needs ${n}`,
          );
        }
      }
      writeFlat(q, model.params, state.params);
      // A sharded optimizer's moments are loaded into its shards by the caller.
      if (model.adamM) writeFlat(q, model.adamM, state.m);
      if (model.adamV) writeFlat(q, model.adamV, state.v);
    } else {
      // The whole model's initial weights, then this rank's shard of them.
      const full = initParams(opts.config, opts.seed), tp = opts.tensorParallel;
      writeFlat(q, model.params, tp && tp.size > 1 ? splitParams(opts.config, tp.size, full)[tp.rank] : full);
    }
    const control = state?.control ?? { optimizerStep: state?.step ?? 0 };
    q.writeBuffer(model.control, 0, packControl(control, opts.lossScaler));
    if (model.castWeights.length) {
      const enc = ctx.device.createCommandEncoder();
      encodeOps(enc, model.castWeights);
      q.submit([enc.finish()]);
    }
    const readback = await createReadback(ctx, { canvas: opts.fastReadback ?? true });
    return new Trainer(ctx, opts, model, state?.step ?? 0, readback);
  }

  /** Iterations done so far. */
  get step(): number {
    return this.#step;
  }

  /** GPU memory allocated, in bytes. */
  get memoryBytes(): number {
    return this.#model.memoryBytes;
  }

  /** The planned model (buffers and op lists), for tests and benchmarks. */
  get model(): GpuModel {
    return this.#model;
  }

  /** Micro-batches per step. */
  get microBatches(): number {
    return this.#model.microBatches;
  }

  #writeTokens(batch: TrainBatch): void {
    const { batchSize: B, seqLen: T, config } = this.opts;
    const tokens = "mask" in batch ? batch.tokens : batch;
    if (tokens.length !== B * (T + 1)) {
      throw new RangeError(
        `Batch has ${tokens.length} tokens, expected batch_size·(seq_len+1) = ${B * (T + 1)}`,
      );
    }
    const n = B * (T + 1), BT = B * T;
    const u32 = new Uint32Array(n + (this.opts.lossMask ? BT : 0));
    u32.set(tokens);
    for (let i = 0; i < n; i++) {
      if (u32[i] >= config.vocab_size) {
        throw new RangeError(`Token ${u32[i]} at ${i} is outside the vocabulary`);
      }
    }
    if (this.opts.lossMask) {
      // Per-row weights mask × BT / (masked rows): the mean over all rows is the masked mean.
      const w = new Float32Array(u32.buffer, n * 4, BT);
      const mask = "mask" in batch ? batch.mask : undefined;
      if (mask && mask.length !== BT) {
        throw new RangeError(`Loss mask has ${mask.length} entries, expected batch_size·seq_len = ${BT}`);
      }
      let count = 0;
      for (let i = 0; i < BT; i++) count += !mask || mask[i] ? 1 : 0;
      for (let i = 0; i < BT; i++) w[i] = count > 0 && (!mask || mask[i]) ? BT / count : 0;
    } else if ("mask" in batch) {
      throw new RangeError("A batch with a loss mask needs a trainer created with lossMask");
    }
    write(this.#ctx.device.queue, this.#model.tokens, u32);
  }

  /**
   * Dropout keys of micro-batch `micro` of this rank at iteration `step`: each micro-batch of the
   * global batch (micro-batches × ranks) gets its own, and a step of one micro-batch on one rank
   * keeps the keys of `step` itself, so DP=2 draws exactly the masks DP=1 with 2 micro-batches draws.
   */
  #writeDropout(step: number, train: boolean, micro = 0): void {
    const { attnDropout, hiddenDropout, seed, config, dataParallel } = this.opts;
    if (attnDropout <= 0 && hiddenDropout <= 0) return;
    const M = this.#model.microBatches, G = M * (dataParallel?.size ?? 1);
    const tpRank = this.opts.tensorParallel?.rank ?? 0;
    const g = (dataParallel?.rank ?? 0) * M + micro;
    const n = dropoutSite.count(config.n_layer), slot = DROPOUT_SLOT_BYTES / 4;
    // Each site's vec4 at the start of its slot (the slot an op of that site binds).
    const u = new Uint32Array(n * slot);
    const f = new Float32Array(u.buffer);
    for (let s = 0; s < n; s++) {
      const p = train ? (s > 0 && (s - 1) % 3 === 0 ? attnDropout : hiddenDropout) : 0, at = slot * s;
      u[at] = dropoutKey(seed, step * G + g, s);
      // Tensor-parallel ranks hold different heads: their attention masks must differ too.
      if (tpRank > 0 && s > 0 && (s - 1) % 3 === 0) u[at] = (u[at] ^ pcg(0x5eed + tpRank)) >>> 0;
      u[at + 1] = dropThreshold(p);
      f[at + 2] = 1 / (1 - p);
    }
    write(this.#ctx.device.queue, this.#model.dropUniform, u);
  }

  /**
   * Submits one training step on B·(T+1) tokens (rows are windows; targets are inputs shifted by
   * one), or on `microBatches` such batches whose gradients accumulate. With `profile` (and a
   * trainer created with `profile: true`), every kernel of the last micro-batch and the update is
   * timed; see `profile()`. Data-parallel trainers step with `trainStepReduced`.
   */
  trainStep(tokens: TrainBatch | TrainBatch[], profile = false): void {
    if ((this.opts.dataParallel?.size ?? 1) > 1 || this.#tp) {
      throw new Error("A data- or tensor-parallel trainer steps with trainStepReduced");
    }
    this.#submitBackward(Array.isArray(tokens) ? tokens : [tokens], profile, true);
  }

  /**
   * One data-parallel step: submits the forward and backward passes of this rank's micro-batches,
   * awaits `reduce` (which sums the gradients over the ranks), then submits the update.
   */
  async trainStepReduced(
    tokens: TrainBatch[],
    reduce?: GradientReduce | StagedReduce,
    profile = false,
  ): Promise<void> {
    const plain = typeof reduce === "function" ? reduce : reduce?.reduce;
    if (this.#tp) return await this.#tensorParallelStep(tokens, plain);
    if (!plain) throw new Error("trainStepReduced needs a reduce callback without tensor parallelism");
    const m = this.#model;
    const run = typeof reduce === "function"
      ? null
      : reduce!.begin(m.grads!, m.plan.layout, this.opts.config.n_layer);
    let qs: GPUQuerySet | undefined;
    try {
      if (run) qs = await this.#stagedBackward(tokens, run, profile);
      else {
        qs = this.#submitBackward(tokens, profile, false);
        await plain(m.grads!);
      }
    } catch (e) {
      this.#step++; // the data was drawn; a failed reduction ends the job anyway
      throw e;
    }
    const enc = this.#ctx.device.createCommandEncoder();
    const base = 2 * (m.forward.length + m.loss.length + m.backward.length);
    encodeOps(enc, m.optimizer, qs, base);
    if (qs && this.#queryBuf) enc.resolveQuerySet(qs, 0, this.#stepOps.length * 2, this.#queryBuf, 0);
    this.#ctx.device.queue.submit([enc.finish()]);
    this.#step++;
  }

  /**
   * Submits the step's micro-batches like `#submitBackward`, but the last one's pass in pieces cut
   * where `run`'s stages of gradients are final: after each piece, while the next one computes,
   * that stage is read back and exchanged. The sums are queued on the GPU when this resolves.
   */
  async #stagedBackward(
    list: TrainBatch[],
    run: StagedRun,
    profile: boolean,
  ): Promise<GPUQuerySet | undefined> {
    this.#beginStep(list);
    const m = this.#model, M = m.microBatches, device = this.#ctx.device, q = device.queue;
    const qs = profile ? this.#querySet : undefined;
    const passes = [...m.forward, ...m.loss, ...m.backward];
    const head = m.forward.length + m.loss.length;
    const cuts = run.stageLayers.map((layer) => {
      const mark = m.backwardMarks.find((x) => x.layer === layer);
      if (!mark) throw new Error(`No backward mark for layer ${layer}`);
      return head + mark.at;
    });
    const bounds = [0, ...cuts, passes.length];
    for (let i = 0; i < M; i++) {
      const last = i === M - 1;
      const enc = this.#microBatchEncoder(list, i);
      if (!last) {
        encodeOps(enc, passes);
        q.submit([enc.finish()]);
        continue;
      }
      // Piece j ends where stage j is final; the last piece (the embedding's backward) has no stage.
      const piece = (j: number, e: GPUCommandEncoder) => {
        encodeOps(e, passes.slice(bounds[j], bounds[j + 1]), qs, 2 * bounds[j]);
        if (j < cuts.length) run.encode(e, j);
        q.submit([e.finish()]);
      };
      piece(0, enc);
      for (let j = 0; j < cuts.length; j++) {
        await run.mapped(j);
        piece(j + 1, device.createCommandEncoder());
        await run.exchange(j);
      }
      await run.finish();
    }
    this.#profilePending = !!qs;
    return qs;
  }

  /** The tensor-parallel exchange, when this trainer is a rank of a group of more than one. */
  get #tp(): ((s: Sync) => Promise<void>) | null {
    const tp = this.opts.tensorParallel;
    return tp && tp.size > 1 ? tp.exchange : null;
  }

  /**
   * Runs a program: consecutive kernels are recorded into `enc`; at each exchange the encoder is
   * submitted, the exchange awaited and a new encoder begun. Returns the open encoder.
   */
  async #run(steps: Step[], enc: GPUCommandEncoder): Promise<GPUCommandEncoder> {
    const exchange = this.#tp, device = this.#ctx.device;
    let ops: Op[] = [];
    for (const s of steps) {
      if (!isSync(s)) {
        ops.push(s);
        continue;
      }
      encodeOps(enc, ops);
      ops = [];
      device.queue.submit([enc.finish()]);
      if (!exchange) throw new Error(`Exchange "${s.label}" in a program without tensor parallelism`);
      await exchange(s);
      enc = device.createCommandEncoder();
    }
    encodeOps(enc, ops);
    return enc;
  }

  /**
   * Writes micro-batch `i`'s tokens and dropout keys and returns the encoder its passes go into,
   * which first clears the accumulated gradients when it is the first of several.
   */
  #microBatchEncoder(list: TrainBatch[], i: number): GPUCommandEncoder {
    const m = this.#model;
    this.#writeTokens(list[i]);
    this.#writeDropout(this.#step, true, i);
    const enc = this.#ctx.device.createCommandEncoder();
    if (i === 0 && m.microBatches > 1) { for (const seg of m.grads!.segments) enc.clearBuffer(seg.buffer); }
    return enc;
  }

  /** Checks a step's micro-batches and writes its scalars: the optimizer uniform, and a zero loss to accumulate into. */
  #beginStep(list: TrainBatch[]): void {
    checkDevice(this.#ctx);
    const m = this.#model, M = m.microBatches, q = this.#ctx.device.queue;
    if (list.length !== M) throw new RangeError(`A step takes ${M} micro-batch(es), got ${list.length}`);
    const { adamw, schedule, lossScaler, debugNonFiniteAt } = this.opts;
    const gradMul = debugNonFiniteAt?.includes(this.#step) ? NaN : 1;
    q.writeBuffer(m.optUniform, 0, packOptimizerUniform(adamw, schedule, lossScaler, gradMul));
    if (M > 1) q.writeBuffer(m.stats, STAT.loss * 4, new Float32Array([0]));
  }

  /** A tensor-parallel step (no kernel timings: the program is cut at every exchange). */
  async #tensorParallelStep(list: TrainBatch[], reduce?: GradientReduce): Promise<void> {
    this.#beginStep(list);
    const m = this.#model, M = m.microBatches, q = this.#ctx.device.queue, device = this.#ctx.device;
    const p = m.program;
    try {
      for (let i = 0; i < M; i++) {
        let enc = this.#microBatchEncoder(list, i);
        enc = await this.#run([...p.forward, ...p.loss, ...p.backward], enc);
        q.submit([enc.finish()]);
      }
      if (reduce) await reduce(m.grads!);
      const enc = await this.#run(p.optimizer, device.createCommandEncoder());
      q.submit([enc.finish()]);
    } finally {
      this.#step++;
    }
  }

  /**
   * Writes the step's scalars and submits forward, loss and backward of every micro-batch (one
   * submission each), and the update too when `withOptimizer`. Returns the query set when the
   * step is profiled.
   */
  #submitBackward(list: TrainBatch[], profile: boolean, withOptimizer: boolean): GPUQuerySet | undefined {
    this.#beginStep(list);
    const m = this.#model, M = m.microBatches, q = this.#ctx.device.queue;
    const qs = profile ? this.#querySet : undefined;
    const passes = [...m.forward, ...m.loss, ...m.backward];
    for (let i = 0; i < M; i++) {
      const enc = this.#microBatchEncoder(list, i);
      const last = i === M - 1;
      encodeOps(enc, passes, last ? qs : undefined);
      if (last && withOptimizer) {
        encodeOps(enc, m.optimizer, qs, 2 * passes.length);
        if (qs && this.#queryBuf) enc.resolveQuerySet(qs, 0, this.#stepOps.length * 2, this.#queryBuf, 0);
      }
      q.submit([enc.finish()]);
    }
    this.#profilePending = !!qs;
    if (withOptimizer) this.#step++;
    return qs;
  }

  /**
   * Loss, gradient norm (before clipping), learning rate, skipped-step counters and loss scale of
   * the last submitted step. One readback, which also fetches the step's kernel timings when it
   * was profiled.
   */
  async lastStats(opts: StatsOptions = {}): Promise<StepStats> {
    const m = this.#model;
    const ranges: ReadRange[] = [
      { buffer: m.stats, bytes: 16 },
      { buffer: m.control, bytes: CONTROL_BYTES },
    ];
    const sum = opts.checksum && m.checksumParts;
    if (sum) await m.compileChecksum();
    if (sum) ranges.push({ buffer: m.checksumParts!, bytes: m.checksum.length * NORM_GROUPS * 4 });
    const profiled = this.#profilePending && this.#queryBuf;
    if (profiled) ranges.push({ buffer: this.#queryBuf! });
    const checksumOps = (enc: GPUCommandEncoder) => encodeOps(enc, m.checksum);
    const [stats, control, ...rest] = await this.#readback.readRanges(ranges, sum ? checksumOps : undefined);
    // The canvas path waited on this thread without a turn of the event loop: take one (a timer,
    // about 2 ms in Deno, against mapAsync's 10 ms), or messages to a Worker that trains (a
    // generation request beside training) would wait until the job ends.
    if (this.#readback.lastPath === "canvas") await new Promise((r) => setTimeout(r, 0));
    let checksum: number | undefined;
    if (sum) {
      checksum = 0;
      for (const p of new Uint32Array(rest.shift()!)) checksum = (checksum + p) >>> 0;
    }
    if (profiled) this.#takeProfile(rest.shift()!);
    const s = new Float32Array(stats), c = unpackControl(control);
    return {
      ...(checksum !== undefined ? { checksum } : {}),
      loss: s[STAT.loss],
      gradNorm: s[STAT.gradNorm],
      lr: c.lr,
      skippedSteps: c.skippedSteps,
      consecutiveSkipped: c.consecutiveSkipped,
      optimizerStep: c.optimizerStep,
      lossScale: c.lossScale,
    };
  }

  #takeProfile(raw: ArrayBuffer): void {
    const t = new BigInt64Array(raw);
    this.#lastProfile = this.#stepOps.map((op, i) => ({
      label: op.label,
      kind: op.kind,
      phase: op.phase,
      ms: Number(t[2 * i + 1] - t[2 * i]) / 1e6,
      flops: op.flops,
    }));
    this.#profilePending = false;
  }

  /**
   * Mean loss of forward passes without dropout over one or several batches of B·(T+1) tokens:
   * one submission per batch, the losses summed on the GPU, one readback.
   */
  async evalLoss(batches: TrainBatch | TrainBatch[]): Promise<number> {
    const list = Array.isArray(batches) ? batches : [batches];
    if (list.length === 0) throw new RangeError("evalLoss needs at least one batch");
    const q = this.#ctx.device.queue;
    q.writeBuffer(this.#model.stats, STAT.evalLoss * 4, new Float32Array([0]));
    this.#writeDropout(this.#step, false);
    for (const tokens of list) {
      this.#writeTokens(tokens);
      let enc = this.#ctx.device.createCommandEncoder();
      if (this.#tp) {
        enc = await this.#run([...this.#model.program.forward, ...this.#model.program.evalLoss], enc);
      } else encodeOps(enc, [...this.#model.forward, ...this.#model.evalLoss]);
      q.submit([enc.finish()]);
    }
    const s = await readFloats(this.#ctx, this.#model.stats, 0, 4);
    return s[STAT.evalLoss] / list.length;
  }

  /**
   * Per-token losses of a forward pass without dropout on `tokens` (B·(T+1)), copied on the GPU into
   * `out` at byte `offset` (B·T floats, row b·T + t), followed by the logits rows `logitRows` (Vp
   * floats each; only when the LM head runs in one chunk, see `headRows`). One submission, nothing
   * read back: evaluation gathers many batches this way and reads them at once
   * (worker/evaluation.ts). Returns the bytes written.
   */
  async encodeTokenLosses(
    tokens: TrainBatch,
    out: GPUBuffer,
    offset: number,
    logitRows: readonly number[] = [],
  ): Promise<number> {
    const { batchSize: B, seqLen: T, config } = this.opts;
    const m = this.#model, rowBytes = config.padded_vocab_size * 4, lossBytes = B * T * 4;
    if (logitRows.length && m.headRows < B * T) {
      throw new RangeError(`Logits of ${B * T} rows are computed in chunks of ${m.headRows}`);
    }
    // The plan's per-row losses (written by the evalLoss ops), found once by its label.
    this.#losses ??= m.buffers.find((b) => b.label === "losses") ?? null;
    if (!this.#losses) throw new GpuError("Cannot score tokens", 'the plan has no "losses" buffer');
    this.#writeTokens(tokens);
    this.#writeDropout(this.#step, false);
    let enc = this.#ctx.device.createCommandEncoder();
    if (this.#tp) enc = await this.#run([...m.program.forward, ...m.program.evalLoss], enc);
    else encodeOps(enc, [...m.forward, ...m.evalLoss]);
    enc.copyBufferToBuffer(this.#losses, 0, out, offset, lossBytes);
    logitRows.forEach((row, i) => {
      enc.copyBufferToBuffer(m.logits, row * rowBytes, out, offset + lossBytes + i * rowBytes, rowBytes);
    });
    this.#ctx.device.queue.submit([enc.finish()]);
    return lossBytes + logitRows.length * rowBytes;
  }

  /**
   * Logits (B·T·Vp) of a forward pass without dropout on `tokens`. Only when the LM head runs in one
   * chunk (small B·T); a chunked head never holds all logits.
   */
  async logits(tokens: Uint16Array | Uint32Array): Promise<Float32Array> {
    const { batchSize: B, seqLen: T } = this.opts;
    if (this.#model.headRows < B * T) {
      throw new RangeError(`Logits of ${B * T} rows are computed in chunks of ${this.#model.headRows}`);
    }
    this.#writeTokens(tokens);
    this.#writeDropout(this.#step, false);
    const enc = this.#ctx.device.createCommandEncoder();
    encodeOps(enc, this.#model.forward);
    this.#ctx.device.queue.submit([enc.finish()]);
    return await readFloats(this.#ctx, this.#model.logits);
  }

  /** Per-kernel GPU times of the last profiled step (timestamp queries only); reads back only if `lastStats` has not. */
  async profile(): Promise<OpTiming[] | null> {
    if (this.#profilePending && this.#queryBuf) {
      this.#takeProfile(await readBuffer(this.#ctx, this.#queryBuf));
    }
    return this.#lastProfile;
  }

  /** Forward, backward and optimizer GPU time of the last profiled step. */
  async phaseTimes(): Promise<{ forward_ms: number; backward_ms: number; optimizer_ms: number } | null> {
    const p = await this.profile();
    if (!p) return null;
    const sum = (ph: string) => p.filter((o) => o.phase === ph).reduce((a, o) => a + o.ms, 0);
    return { forward_ms: sum("forward"), backward_ms: sum("backward"), optimizer_ms: sum("optimizer") };
  }

  /** The buffers the distributed optimizer drives. */
  zeroModel(): ZeroModel {
    const m = this.#model;
    return {
      layout: m.layout,
      params: m.params,
      grads: m.grads!,
      control: m.control,
      stats: m.stats,
      optUniform: m.optUniform,
      castWeights: m.castWeights,
      lossSlot: STAT.loss,
      normSlot: STAT.gradNorm,
    };
  }

  /**
   * Reads parameters and optimizer moments back (for checkpoints). With a sharded optimizer the
   * moments are empty here (its `exportMoments` has them).
   */
  async exportState(): Promise<TrainerState> {
    const params = await readFlat(this.#ctx, this.#model.params);
    const m = this.#model.adamM ? await readFlat(this.#ctx, this.#model.adamM) : new Float32Array(0);
    const v = this.#model.adamV ? await readFlat(this.#ctx, this.#model.adamV) : new Float32Array(0);
    const control = unpackControl(await readBuffer(this.#ctx, this.#model.control, 0, CONTROL_BYTES));
    return { step: this.#step, params, m, v, control };
  }

  /** Gradients of the last step (flat layout) as computed: multiplied by the step's loss scale. For tests. */
  async gradients(): Promise<Float32Array> {
    return await readFlat(this.#ctx, this.#model.grads!);
  }

  /** Frees the GPU buffers. */
  destroy(): void {
    this.#readback.destroy();
    destroyModel(this.#model);
    this.#querySet?.destroy();
    this.#queryBuf?.destroy();
  }
}

function write(q: GPUQueue, buf: GPUBuffer, data: Uint32Array): void {
  q.writeBuffer(buf, 0, data.buffer as ArrayBuffer, data.byteOffset, data.byteLength);
}
