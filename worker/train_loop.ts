/**
 * One training job inside a GPU Worker: build the model with engine/, pull batches from the data/
 * sampler, run steps (one submission each, no readback between logs), evaluate, checkpoint,
 * and report through `hooks`. Kept apart from the Worker's message plumbing so a test can run a
 * job in-process and compare losses bit for bit. `runTraining` reads as its phases: open the
 * communicators, load the data and the starting state (a checkpoint, fine-tuning's source, or
 * nothing), create the trainer, run the steps (each log step reading back and reporting; every
 * eval_interval the validation loss and the job's eval_tasks, worker/eval_tasks.ts), and finish
 * with evaluations and a checkpoint. An evaluation job goes to worker/evaluation.ts.
 */

import { describeDevice, type GpuContext } from "../engine/device.ts";
import { ConfigError, type ModelConfig } from "../model/config.ts";
import type { LrSchedule } from "../model/schedule.ts";
import {
  type StepStats,
  type TrainBatch,
  Trainer,
  type TrainerOptions,
  type TrainerState,
} from "../engine/trainer.ts";
import {
  DEFAULT_SPLIT,
  evalBatches,
  getDataset,
  isBuiltinName,
  loadSplit,
  packedEvalBatches,
  PackedSampler,
  prepareDataset,
  Sampler,
} from "../data/mod.ts";
import { CHAT_TEMPLATE } from "../data/chat.ts";
import {
  loadUsableCheckpoint,
  readChatTemplate,
  type SamplerState,
  saveCheckpoint,
} from "../checkpoint/checkpoint.ts";
import { loadSftData } from "./sft_data.ts";
import type { FromWorker, JobComm, WorkerJob } from "../protocol.ts";
import { accumulationSteps, type RankTimes, type TrainConfig } from "../job/job.ts";
import {
  DistributedOptimizer,
  GradientReducer,
  joinU32,
  RankControl,
  RingComm,
  splitU32,
  TensorParallelExchange,
} from "../engine/parallel/mod.ts";
import { checkpointLayers, trainingModel } from "../job/job_config.ts";
import { compileReporter } from "./compile_report.ts";
import { runEvaluationJob } from "./evaluation.ts";
import { EvalTasks } from "./eval_tasks.ts";
import { loadWeightsAt } from "../checkpoint/model_source.ts";

/** Steps submitted without waiting for the GPU, at most. */
const MAX_STEPS_IN_FLIGHT = 4;
/**
 * Consecutive steps skipped for a non-finite loss or gradient after which the job fails; in fp16
 * only steps with the loss scale at its floor count (those while it backs off are expected).
 */
export const MAX_CONSECUTIVE_SKIPS = 10;

/** How a running job talks to the outside. */
export interface TrainHooks {
  post(msg: FromWorker): void;
  /** Polled between steps: end the job "cancelled". */
  cancelled(): boolean;
  /** Polled between steps: save a checkpoint at the current step and end "interrupted" (shutdown). */
  stopRequested?(): boolean;
  /** Test hook: make the gradient non-finite on the GPU at these steps (0-based, as Trainer's `debugNonFiniteAt`). */
  nonFiniteAt?: number[];
  /**
   * Generation sharing this GPU: while a model is loaded (`resident`), at most one training step is
   * in flight, so a request's first work waits behind one step at most, and while it is busy, after
   * each step `turn(stepMs)` hands it the GPU for its share of time.
   */
  generation?: {
    readonly busy: boolean;
    readonly resident?: boolean;
    trainingStep?(): void;
    turn(trainMs: number): Promise<void>;
  };
  /** Data-parallel jobs: the run's shared communicators (see `WorkerJob.parallel`). */
  comm?: JobComm;
  /** The driver's shader cache is disabled (MESA_SHADER_CACHE_DISABLE): said in compile reports. */
  driverCacheDisabled?: boolean;
  /**
   * Asked right before a checkpoint is committed (see checkpoint.ts, `beforeCommit`): whether this
   * host still holds the job, which the runner reads from the database (several hosts; one host
   * always holds its jobs). Not held: the checkpoint is not committed, its temporary folder is
   * removed, and the job stops at once. Without this hook every checkpoint commits.
   */
  commitCheck?(iteration: number, name: string): Promise<{ held: boolean; reason: string | null }>;
}

/** A checkpoint refused at its commit: this host no longer holds the job (another host resumed it). */
export class CheckpointFencedError extends Error {
  constructor(jobId: string, name: string, reason: string | null) {
    super(
      `Checkpoint "${name}" of job "${jobId}" was not committed: this host no longer holds the job` +
        `${reason ? ` (${reason})` : ""}; stopping it here`,
    );
    this.name = "CheckpointFencedError";
  }
}

/** How long a gradient exchange waits for a peer before the job fails (a peer may be evaluating). */
const GRAD_TIMEOUT_MS = 600_000;

const clamp01 = (x: number) => Math.min(1, Math.max(0, x));

/** This Worker's place in a data-parallel job; null members on a single-rank job. */
interface Ranks {
  /** Data-parallel rank and size (the replicas that split each global batch). */
  rank: number;
  size: number;
  /** Tensor-parallel rank and size (the shards of each layer), and the group's exchanges. */
  tpRank: number;
  tp: number;
  tpx: TensorParallelExchange | null;
  control: RankControl | null;
  grads: RingComm[];
  /** Weight lanes of the distributed optimizer. */
  weights: RingComm[];
  reducer: GradientReducer | null;
  zero: DistributedOptimizer | null;
  tpLanes: RingComm[];
}

/** Every tensor-parallel rank's state, on the group's rank 0 (null on the others). */
async function gatherShards(tpx: TensorParallelExchange, s: TrainerState): Promise<TrainerState[] | null> {
  const [params, m, v] = [await tpx.gatherAll(s.params), await tpx.gatherAll(s.m), await tpx.gatherAll(s.v)];
  if (tpx.rank !== 0) return null;
  return params.map((p, r) => ({ step: s.step, params: p, m: m[r], v: v[r], control: s.control }));
}

/** The outcome message of a job. */
export type DoneMessage = Extract<FromWorker, { type: "done" }>;

/** The LR schedule of a job: warmup is a fraction of train_iters, decay ends at train_iters. */
export function scheduleOf(c: TrainConfig): LrSchedule {
  return {
    lr: c.lr,
    min_lr: c.min_lr,
    warmup_iters: Math.round(c.warmup * c.train_iters),
    decay_iters: c.train_iters,
    style: c.lr_decay_style,
  };
}

/**
 * Loads the three splits of a job's dataset. A builtin (e.g. "sotu") is prepared on first use;
 * a split other than the data pipeline's default prepares it under its own derived id.
 */
export async function loadSplits(root: string, dataset: string, split: string, seqLen: number) {
  let id = dataset;
  if (isBuiltinName(dataset)) {
    const isDefault = split.replaceAll(" ", "") === DEFAULT_SPLIT.join(",");
    // Another split is checked against the job's sequence length rather than the data pipeline's
    // default (DEFAULT_PREPARE_SEQ_LEN).
    id = (await prepareDataset(root, { builtin: dataset }, isDefault ? {} : { split, seq_len: seqLen })).id;
  } else if (!(await getDataset(root, dataset))) {
    throw new Error(`Unknown dataset "${dataset}"`);
  }
  const [train, valid, test] = await Promise.all([
    loadSplit(root, id, "train"),
    loadSplit(root, id, "valid"),
    loadSplit(root, id, "test"),
  ]);
  return { id, train, valid, test };
}

/**
 * Mean loss over evaluation batches (a split's non-overlapping windows, up to `eval_iters`
 * batches, or SFT's packed rows), and the tokens it averaged. Data-parallel ranks evaluate every
 * size-th batch each and sum their losses.
 */
async function evaluate(
  trainer: Trainer,
  e: { batches: TrainBatch[]; tokens: number },
  ranks: Ranks,
): Promise<{ loss: number; tokens: number }> {
  if (!ranks.control) return { loss: await trainer.evalLoss(e.batches), tokens: e.tokens };
  // Every rank of a tensor-parallel group evaluates the same batches (together), so the sum over
  // all ranks counts each batch tp times.
  const mine = e.batches.filter((_, i) => i % ranks.size === ranks.rank);
  const sum = mine.length > 0 ? (await trainer.evalLoss(mine)) * mine.length : 0;
  const [total] = await ranks.control.sum([sum]);
  return { loss: total / ranks.tp / e.batches.length, tokens: e.tokens };
}

/** What the phases of one running job share. */
interface Run {
  ctx: GpuContext;
  job: WorkerJob;
  c: TrainConfig;
  hooks: TrainHooks;
  ranks: Ranks;
  dp: number;
  tp: number;
  world: number;
  /** Data-parallel with the distributed optimizer. */
  sharded: boolean;
  /** Rank 0 speaks for a parallel job; the other ranks report only their outcome. */
  lead: boolean;
  post(msg: FromWorker): void;
  trainer: Trainer | null;
  iteration: number;
  /** The chat template its checkpoints carry (SFT, or fine-tuned from a model with one). */
  chatTemplate?: string;
}

/** A run of `job` before anything is opened: its sizes and this Worker's ranks. */
function newRun(ctx: GpuContext, job: WorkerJob, hooks: TrainHooks): Run {
  const c = job.config;
  const dp = c.data_parallel ?? 1, tp = c.tensor_parallel ?? 1;
  const globalRank = job.parallel?.rank ?? 0;
  const ranks: Ranks = {
    rank: Math.floor(globalRank / tp),
    size: dp,
    tpRank: globalRank % tp,
    tp,
    tpx: null,
    control: null,
    grads: [],
    weights: [],
    reducer: null,
    zero: null,
    tpLanes: [],
  };
  const lead = globalRank === 0;
  return {
    ctx,
    job,
    c,
    hooks,
    ranks,
    dp,
    tp,
    world: dp * tp,
    sharded: dp > 1 && (c.distributed_optimizer ?? false),
    lead,
    post: (msg) => {
      if (lead) hooks.post(msg);
    },
    trainer: null,
    iteration: 0,
  };
}

/** Opens the run's communicators: gradient and control lanes, weight lanes, the tensor-parallel exchange. */
async function openComms(run: Run): Promise<void> {
  const { job, hooks, ranks, world, tp } = run;
  const globalRank = job.parallel?.rank ?? 0;
  if (world > 1) {
    if (!hooks.comm || job.parallel?.size !== world) {
      throw new Error(`A ${world}-rank job reached a Worker without its ${world}-rank communicators`);
    }
    ranks.grads = hooks.comm.grads.map((sab) =>
      new RingComm(sab, ranks.rank, { timeoutMs: GRAD_TIMEOUT_MS })
    );
    ranks.control = new RankControl(hooks.comm.control, globalRank);
    if (run.sharded) {
      if (!hooks.comm.weights) {
        throw new Error("A distributed_optimizer job reached a Worker without its weight lanes");
      }
      ranks.weights = hooks.comm.weights.map((sab) =>
        new RingComm(sab, ranks.rank, { timeoutMs: GRAD_TIMEOUT_MS })
      );
    }
  }
  if (tp > 1) {
    if (!hooks.comm?.tp) {
      throw new Error("A tensor-parallel job reached a Worker without its group's lanes");
    }
    const lanes = hooks.comm.tp.map((sab) => new RingComm(sab, ranks.tpRank, { timeoutMs: GRAD_TIMEOUT_MS }));
    ranks.tpLanes = lanes;
    ranks.tpx = await TensorParallelExchange.create(run.ctx, lanes);
  }
}

/**
 * Where the run starts: a checkpoint (its own after a crash, or resume_from) with optimizer,
 * sampler and iteration; or fine-tuning's source (init_from), weights only; or nothing. Of the
 * job's own checkpoints the newest that loads and verifies is taken: each one passed over is
 * warned of, with why; none usable fails the job. `resumedFrom` is the checkpoint taken.
 */
async function startingState(
  run: Run,
  model: ModelConfig,
): Promise<{ state?: TrainerState; samplerState?: SamplerState; resumedFrom?: string }> {
  const { job, tp, ranks } = run;
  if (job.resume_path) {
    const candidates = [
      job.resume_path,
      ...(job.resume_candidates ?? []).filter((p) => p !== job.resume_path),
    ];
    // Any checkpoint loads at this job's tensor-parallel size: this rank's shard, resharded in memory.
    const ck = await loadUsableCheckpoint(candidates, model, { tensorParallel: tp, rank: ranks.tpRank });
    for (const bad of ck.skipped) {
      run.post({
        type: "log",
        id: job.id,
        level: "warn",
        message:
          `Checkpoint "${bad.path}" is unusable, resuming from the older "${ck.path}" instead: ${bad.reason}`,
      });
    }
    if (ranks.control) {
      // Every rank read the same files; should one have taken another checkpoint, stop here.
      const rows = await ranks.control.gather([ck.state.step]);
      if (rows.some((r) => r[0] !== ck.state.step)) {
        throw new Error(
          `Ranks resumed from different checkpoints: iterations ${rows.map((r) => r[0]).join(", ")}`,
        );
      }
    }
    run.iteration = ck.state.step;
    return { state: ck.state, samplerState: ck.manifest.sampler, resumedFrom: ck.path };
  }
  if (job.init_source) {
    // Fine-tuning (init_from): weights only, resharded to this rank; fresh moments, iteration 0.
    const params = await loadWeightsAt(job.init_source, model, tp, ranks.tpRank);
    const zeros = new Float32Array(params.length);
    return { state: { step: 0, params, m: zeros, v: zeros } };
  }
  return {};
}

/**
 * The Trainer options a job's config decides on one rank (the parallel places, test hooks and the
 * compile listener are the run's): shared with bench/compile_list.ts, which builds what a job builds.
 */
export function jobTrainerOptions(
  ctx: GpuContext,
  c: TrainConfig,
  model: ModelConfig,
): TrainerOptions {
  return {
    config: model,
    batchSize: c.batch_size,
    seqLen: c.seq_len,
    schedule: scheduleOf(c),
    adamw: { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: c.weight_decay, clip_grad: c.clip_grad },
    attnDropout: c.attention_dropout,
    hiddenDropout: c.hidden_dropout,
    seed: c.seed,
    // Kernel timestamps give the forward/backward/optimizer breakdown; read only at log steps.
    profile: ctx.hasTimestamps,
    checkpointLayers: checkpointLayers(c),
    precision: c.precision ?? "fp32",
    microBatches: accumulationSteps(c),
    lossMask: c.objective === "sft",
  };
}

/** Builds the run's trainer (compile reports on the way) and its gradient reducer or distributed optimizer. */
async function createTrainer(
  run: Run,
  model: ModelConfig,
  state: TrainerState | undefined,
): Promise<Trainer> {
  const { ctx, job, c, hooks, ranks, dp, tp, sharded } = run;
  const accumulation = accumulationSteps(c);
  // Kernels depend on these: a marker per adapter records which ones compiled there before.
  const build = JSON.stringify({
    train: model,
    batch: c.batch_size,
    seq: c.seq_len,
    precision: c.precision ?? "fp32",
    micro: accumulation,
    checkpoint: checkpointLayers(c),
    dp,
    tp,
    sharded,
  });
  const onCompile = await compileReporter({
    root: job.root,
    adapter: ctx.adapterInfo.description || ctx.adapterInfo.vendor,
    description: describeDevice(ctx),
    build,
    cacheDisabled: hooks.driverCacheDisabled ?? false,
    send: (r) => run.post({ type: "compile", id: job.id, ...r }),
  });
  const trainer = run.trainer = await Trainer.create(ctx, {
    ...jobTrainerOptions(ctx, c, model),
    debugNonFiniteAt: hooks.nonFiniteAt,
    dataParallel: dp > 1 ? { rank: ranks.rank, size: dp } : undefined,
    shardedOptimizer: sharded,
    tensorParallel: ranks.tpx ? { rank: ranks.tpRank, size: tp, exchange: ranks.tpx.exchange } : undefined,
    onCompile,
  }, state);
  if (sharded) {
    ranks.zero = await DistributedOptimizer.create(ctx, trainer.zeroModel(), {
      rank: ranks.rank,
      size: dp,
      gradComms: ranks.grads,
      paramComms: ranks.weights,
      control: ranks.control!,
    });
    if (state && job.resume_path) ranks.zero.loadMoments(state.m, state.v);
  } else if (dp > 1) {
    ranks.reducer = await GradientReducer.create(ctx, ranks.grads, {
      overlap: c.overlap_grad_reduce ?? true,
    });
  }
  return trainer;
}

/** Latest figures a checkpoint's manifest records. */
interface LastFigures {
  loss: number | null;
  val: number | null;
  /** Iteration of the last checkpoint saved (-1: none). */
  saved: number;
}

/** Saves a checkpoint of the run at the trainer's step (every rank takes part; rank 0 writes). */
async function saveRun(
  run: Run,
  model: ModelConfig,
  sampler: { readonly state: SamplerState },
  last: LastFigures,
): Promise<void> {
  const { job, c, ranks, hooks } = run, trainer = run.trainer!;
  // Every rank holds the same weights and moments (checked by checksum): rank 0 writes them.
  // Sharded moments are first assembled on rank 0, with every rank taking part.
  const moments = ranks.zero ? await ranks.zero.exportMoments(trainer.model.layout.totalSize) : null;
  // Tensor parallelism: the first replica's shards go to rank 0, which writes one file pair per shard.
  let shards: TrainerState[] | null = null;
  if (ranks.tpx && ranks.rank === 0) shards = await gatherShards(ranks.tpx, await trainer.exportState());
  if (run.lead) {
    const exported = shards ?? await trainer.exportState();
    const { name, path } = await saveCheckpoint(
      job.checkpoint_dir,
      {
        job_id: job.id,
        model,
        train: c,
        sampler: { ...sampler.state },
        metrics: { loss: last.loss, val_loss: last.val },
        ...(run.chatTemplate ? { chat_template: run.chatTemplate } : {}),
      },
      Array.isArray(exported) ? exported : moments ? { ...exported, ...moments } : exported,
      c.keep_checkpoints,
      { beforeCommit: hooks.commitCheck ? (name, iteration) => askCommit(run, name, iteration) : undefined },
    );
    hooks.post({ type: "checkpoint", id: job.id, iteration: trainer.step, name, path });
  }
  last.saved = trainer.step;
}

/** Throws CheckpointFencedError unless the host still holds the job (asked through `hooks.commitCheck`). */
async function askCommit(run: Run, name: string, iteration: number): Promise<void> {
  const answer = await run.hooks.commitCheck!(iteration, name);
  if (!answer.held) throw new CheckpointFencedError(run.job.id, name, answer.reason);
}

/** One log interval's wall time (to the step's readback), steps and batch time, and the job's constants. */
interface LogWindow {
  start: number;
  elapsed: number;
  steps: number;
  batchMs: number;
  dataLoaderMs: number;
  memoryBytes: number;
}

/**
 * Parallel jobs at a log step: every rank's loss, checksum and timings gathered; replicas of the
 * same shard must hold the same weights. Returns the mean loss and each rank's times.
 */
async function gatherRanks(
  run: Run,
  stats: StepStats,
  w: LogWindow,
): Promise<{ loss: number; rankTimes: RankTimes[] }> {
  const { ranks, dp, tp } = run;
  const t = (ranks.zero ?? ranks.reducer)?.take() ?? { steps: 0, ms: 0, exposedMs: 0, bytes: 0 };
  let tpTiming = [0, 0];
  if (ranks.tpx) {
    const x = ranks.tpx.take();
    tpTiming = [(x.allreduceMs + x.otherMs) / Math.max(1, w.steps), x.allreduces / Math.max(1, w.steps)];
  }
  const rows = await ranks.control!.gather([
    stats.loss,
    ...splitU32(stats.checksum!),
    w.elapsed / w.steps,
    t.ms / Math.max(1, t.steps),
    t.ms > 0 ? t.bytes / t.ms / 1e6 : -1,
    t.exposedMs / Math.max(1, t.steps),
    ...tpTiming,
  ]);
  // Replicas of the same shard (equal tensor-parallel rank) must hold the same weights.
  const sums = rows.map((r) => joinU32(r[1], r[2]));
  if (sums.some((x, r) => x !== sums[r % tp])) {
    throw new Error(
      `Weights differ between data-parallel ranks after iteration ${run.iteration}: checksums ` +
        sums.map((x, r) => `rank ${r} ${x.toString(16).padStart(8, "0")}`).join(", "),
    );
  }
  return {
    loss: rows.reduce((a, r) => a + r[0], 0) / rows.length,
    rankTimes: rows.map((r, rank) => ({
      rank,
      step_ms: r[3],
      allreduce_ms: r[4],
      allreduce_gb_per_s: r[5] >= 0 ? r[5] : null,
      ...(dp > 1
        ? { allreduce_exposed_ms: r[6], allreduce_hidden: r[4] > 0 ? clamp01(1 - r[6] / r[4]) : 0 }
        : {}),
      ...(tp > 1 ? { tp_exchange_ms: r[7], tp_allreduces: r[8] } : {}),
    })),
  };
}

/**
 * A log step: reads the step's numbers back, warns of skipped steps (failing after too many in a
 * row) and posts progress. Returns the finite loss, if any, and the skipped-step count.
 */
async function logProgress(
  run: Run,
  w: LogWindow,
  skipped: number,
): Promise<{ loss: number | null; skipped: number }> {
  const { job, c, dp, world } = run, trainer = run.trainer!, iteration = run.iteration;
  const stats = await trainer.lastStats({ checksum: world > 1 });
  const phases = await trainer.phaseTimes();
  w.elapsed = performance.now() - w.start; // the window ends once the GPU has finished its steps
  const gathered = run.ranks.control ? await gatherRanks(run, stats, w) : null;
  const loss = gathered?.loss ?? stats.loss, rankTimes = gathered?.rankTimes;
  if (stats.skippedSteps > skipped) {
    run.post({
      type: "log",
      id: job.id,
      level: "warn",
      message: `Skipped ${stats.skippedSteps - skipped} step(s) with a non-finite loss or gradient ` +
        `by iteration ${iteration} (${stats.skippedSteps} in all)`,
    });
  }
  // Counts only steps the loss scaler cannot answer by backing off (see stepControlWgsl): an fp16
  // job's first steps from 2^32 overflow on purpose and are skipped without counting here.
  if (stats.consecutiveSkipped >= MAX_CONSECUTIVE_SKIPS) {
    const where = (c.precision ?? "fp32") === "fp16"
      ? `with the loss scale at its floor (${stats.lossScale})`
      : "in fp32 (no loss scaling)";
    throw new Error(
      `Loss or gradient norm was non-finite for ${stats.consecutiveSkipped} consecutive steps, ` +
        `up to iteration ${iteration}, ${where}: stopping (no checkpoint of these steps is saved)`,
    );
  }
  const allreduceMs = rankTimes ? rankTimes.reduce((a, r) => a + r.allreduce_ms, 0) / rankTimes.length : 0;
  run.post({
    type: "progress",
    id: job.id,
    iteration,
    // JSON has no NaN: a skipped step's numbers travel as null.
    loss: Number.isFinite(loss) ? loss : null,
    grad_norm: Number.isFinite(stats.gradNorm) ? stats.gradNorm : null,
    lr: stats.lr,
    tokens_per_s: (w.steps * accumulationSteps(c) * dp * c.batch_size * c.seq_len) / (w.elapsed / 1000),
    timings: {
      forward_ms: phases?.forward_ms ?? null,
      backward_ms: phases?.backward_ms ?? null,
      allreduce_ms: allreduceMs,
      optimizer_ms: phases?.optimizer_ms ?? null,
      batch_generator_ms: w.batchMs / w.steps,
      data_loader_ms: w.dataLoaderMs,
      step_ms: w.elapsed / w.steps,
    },
    gpu_memory_bytes: w.memoryBytes,
    skipped_steps: stats.skippedSteps,
    loss_scale: stats.lossScale,
    ...(rankTimes ? { ranks: rankTimes } : {}),
  });
  return { loss: Number.isFinite(loss) ? loss : null, skipped: Math.max(skipped, stats.skippedSteps) };
}

/** Whether any rank raised cancel or stop: all ranks act on the same step. */
async function flags(run: Run): Promise<{ cancel: boolean; stop: boolean }> {
  let cancel = run.hooks.cancelled(), stop = run.hooks.stopRequested?.() ?? false;
  if (run.ranks.control) {
    const [nc, ns] = await run.ranks.control.sum([cancel ? 1 : 0, stop ? 1 : 0]);
    cancel = nc > 0;
    stop = ns > 0;
  }
  return { cancel, stop };
}

/** The step loop to train_iters, with its evaluations and checkpoints; ends at the last step or a flag. */
async function trainSteps(
  run: Run,
  sampler: { nextBatch(): TrainBatch },
  opts: {
    evalSplit(split: "valid" | "test"): Promise<void>;
    /** The job's eval_tasks on the current weights. */
    evalTasks(): Promise<void>;
    save(): Promise<void>;
    last: LastFigures;
    dataLoaderMs: number;
    memoryBytes: number;
  },
): Promise<"done" | "cancelled" | "interrupted"> {
  const { ctx, c, hooks, ranks } = run, trainer = run.trainer!, accumulation = accumulationSteps(c);
  const reduce = ranks.zero?.step ?? ranks.reducer ?? undefined;
  let windowStart = performance.now(), windowSteps = 0, batchMs = 0, skipped = 0;
  while (trainer.step < c.train_iters) {
    const { cancel, stop } = await flags(run);
    if (cancel) return "cancelled";
    if (stop) {
      // Shutdown: keep every finished step. The checkpoint is at the step the GPU last finished.
      if (opts.last.saved !== trainer.step) await opts.save();
      return "interrupted";
    }
    const tb = performance.now();
    const tokens = Array.from({ length: accumulation }, () => sampler.nextBatch());
    batchMs += performance.now() - tb;
    const logStep = (trainer.step + 1) % c.log_interval === 0 || trainer.step + 1 === c.train_iters;
    if (reduce || ranks.tpx) await trainer.trainStepReduced(tokens, reduce, logStep);
    else trainer.trainStep(tokens, logStep);
    const iteration = run.iteration = trainer.step;
    hooks.generation?.trainingStep?.();
    windowSteps++;
    const last = iteration === c.train_iters;
    if (hooks.generation?.busy) {
      const ts = performance.now();
      await ctx.device.queue.onSubmittedWorkDone();
      await hooks.generation.turn(performance.now() - ts);
    } else if (hooks.generation?.resident || (!logStep && iteration % MAX_STEPS_IN_FLIGHT === 0)) {
      // Bound the steps queued on the GPU between loss readbacks (memory, and a prompt cancel); with
      // a model loaded beside training, one: a request's first work waits behind every step queued.
      await ctx.device.queue.onSubmittedWorkDone();
    }
    let restart = false;
    if (logStep) {
      const w: LogWindow = {
        start: windowStart,
        elapsed: 0,
        steps: windowSteps,
        batchMs,
        dataLoaderMs: opts.dataLoaderMs,
        memoryBytes: opts.memoryBytes,
      };
      const logged = await logProgress(run, w, skipped);
      skipped = logged.skipped;
      if (logged.loss !== null) opts.last.loss = logged.loss;
      restart = true;
    }
    const evalNow = !last && c.eval_interval > 0 && iteration % c.eval_interval === 0;
    const saveNow = !last && c.save_interval > 0 && iteration % c.save_interval === 0;
    if (evalNow) {
      await opts.evalSplit("valid");
      await opts.evalTasks();
    }
    if (saveNow) await opts.save();
    if (evalNow || saveNow) {
      // Throughput and step time measure training only: restart the window after the pause.
      await ctx.device.queue.onSubmittedWorkDone();
      restart = true;
    }
    if (restart) {
      windowStart = performance.now();
      windowSteps = 0;
      batchMs = 0;
    }
  }
  return "done";
}

/**
 * A job's training data: packed conversations with loss masks for SFT (worker/sft_data.ts),
 * otherwise token windows of the dataset's splits, with the time it took. Sets the run's chat
 * template, and refuses splits too small to evaluate before training starts.
 */
async function loadTrainingData(run: Run, job: WorkerJob) {
  const c = run.c;
  const t0 = performance.now();
  const chat = c.objective === "sft" ? await loadSftData(job.root, c) : null;
  const data = chat ? null : await loadSplits(job.root, c.dataset, c.split, c.seq_len);
  const dataLoaderMs = performance.now() - t0;
  if (chat) run.post({ type: "log", id: job.id, level: chat.warn ? "warn" : "info", message: chat.report });
  run.chatTemplate = chat ? CHAT_TEMPLATE : job.init_source && await readChatTemplate(job.init_source.path);
  // Refuse before training, not at the first evaluation (weights of 0 leave a split empty on purpose).
  for (const split of ["valid", "test"] as const) {
    if (data && data[split].length > 0) evalBatches(data[split], c.batch_size, c.seq_len, 1, split);
  }
  return { chat, data, dataLoaderMs };
}

/**
 * Runs `job` to the end, cancellation or failure; never throws. An evaluation job (config.evaluate)
 * runs worker/evaluation.ts instead.
 */
export async function runTraining(ctx: GpuContext, job: WorkerJob, hooks: TrainHooks): Promise<DoneMessage> {
  if (job.config.evaluate) return await runEvaluationJob(ctx, job, hooks);
  const run = newRun(ctx, job, hooks), c = run.c, ranks = run.ranks;
  let tasks: EvalTasks | null = null;
  const done = (status: DoneMessage["status"], error: string | null): DoneMessage => ({
    type: "done",
    id: job.id,
    status,
    iteration: run.iteration,
    error,
  });
  try {
    await openComms(run);
    const model = trainingModel(c);
    const { chat, data, dataLoaderMs } = await loadTrainingData(run, job);
    const { state, samplerState, resumedFrom } = await startingState(run, model);
    const trainer = await createTrainer(run, model, state);
    const memoryBytes = trainer.memoryBytes + (ranks.zero?.momentBytes ?? 0);
    const samplerOpts = {
      seqLen: c.seq_len,
      batchSize: c.batch_size,
      seed: c.seed,
      rank: ranks.rank,
      worldSize: run.dp,
      accumulation: accumulationSteps(c),
    };
    const sampler = chat
      ? new PackedSampler(chat.train, samplerOpts, samplerState)
      : new Sampler(data!.train, samplerOpts, samplerState);
    run.iteration = trainer.step;
    run.post({
      type: "started",
      id: job.id,
      iteration: run.iteration,
      resumed_from: resumedFrom ?? null,
      gpu_memory_bytes: memoryBytes,
    });
    const last: LastFigures = { loss: null, val: null, saved: -1 };
    const save = () => saveRun(run, model, sampler, last);
    const evalSplit = async (split: "valid" | "test") => {
      const batches = chat
        ? packedEvalBatches(chat[split], c.seq_len, c.batch_size, c.eval_iters)
        : data![split].length > 0
        ? evalBatches(data![split], c.batch_size, c.seq_len, c.eval_iters, split)
        : null;
      if (!batches || batches.batches.length === 0) return;
      const { loss, tokens } = await evaluate(trainer, batches, ranks);
      if (split === "valid") last.val = loss;
      run.post({
        type: "eval",
        id: job.id,
        iteration: run.iteration,
        split,
        loss,
        perplexity: Math.exp(loss),
        tokens,
      });
    };
    // Evaluations during training run on the lead rank (tensor_parallel 1); the others wait at the next exchange.
    tasks = run.lead && c.eval_tasks?.length ? new EvalTasks(ctx, job.root, c.eval_tasks) : null;
    const evalTasks = async () => {
      await tasks?.run(trainer, run.iteration, job.id, run.post, hooks.cancelled);
    };
    const end = await trainSteps(run, sampler, {
      evalSplit,
      evalTasks,
      save,
      last,
      dataLoaderMs,
      memoryBytes,
    });
    if (end !== "done") return done(end, null);
    await evalSplit("valid");
    await evalSplit("test");
    await evalTasks();
    if (last.saved !== trainer.step) await save();
    return done("succeeded", null);
  } catch (e) {
    const err = e as Error;
    const message = err instanceof ConfigError
      ? `Cannot train this configuration: ${err.message}`
      : err.message;
    // Peers would wait for this rank at their next exchange: fail them now, naming the reason.
    for (const comm of [...ranks.grads, ...ranks.weights, ...ranks.tpLanes]) comm.abort(message);
    ranks.control?.abort(message);
    return done("failed", message || String(e));
  } finally {
    ranks.reducer?.destroy();
    ranks.zero?.destroy();
    ranks.tpx?.destroy();
    tasks?.destroy();
    run.trainer?.destroy();
  }
}
