/**
 * One training job inside a GPU Worker: build the model from gpu/, pull batches from the data/
 * sampler, run steps (one submission each, no readback between logs), evaluate, checkpoint,
 * and report through `hooks`. Kept apart from the Worker's message plumbing so a test can run a
 * job in-process and compare losses bit for bit.
 */

import type { GpuContext } from "../gpu/device.ts";
import { ConfigError } from "../gpu/config.ts";
import type { LrSchedule } from "../gpu/schedule.ts";
import { Trainer, type TrainerState } from "../gpu/trainer.ts";
import {
  DEFAULT_SPLIT,
  evalBatches,
  getDataset,
  isBuiltinName,
  loadSplit,
  prepareDataset,
  Sampler,
} from "../data/mod.ts";
import { loadCheckpoint, type SamplerState, saveCheckpoint } from "./checkpoint.ts";
import type { FromWorker, WorkerJob } from "./messages.ts";
import type { TrainConfig } from "./types.ts";
import { checkpointLayers, resolveModel } from "./model.ts";

/** Steps submitted without waiting for the GPU, at most. */
const MAX_STEPS_IN_FLIGHT = 4;
/** Consecutive steps skipped for a non-finite loss or gradient after which the job fails. */
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
   * Generation sharing this GPU: while it is busy, at most one training step is in flight, and
   * after each step `turn(stepMs)` hands it the GPU for its share of time.
   */
  generation?: { readonly busy: boolean; turn(trainMs: number): Promise<void> };
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
export async function loadSplits(root: string, dataset: string, split: string, seqLen = 1024) {
  let id = dataset;
  if (isBuiltinName(dataset)) {
    const isDefault = split.replaceAll(" ", "") === DEFAULT_SPLIT.join(",");
    // Another split is checked against the job's sequence length rather than the default 1024.
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

/** Mean loss over the split's non-overlapping windows (up to `eval_iters` batches), and the tokens it averaged. */
async function evaluate(
  trainer: Trainer,
  tokens: Uint16Array,
  c: TrainConfig,
  split: "valid" | "test",
): Promise<{ loss: number; tokens: number }> {
  const e = evalBatches(tokens, c.batch_size, c.seq_len, c.eval_iters, split);
  return { loss: await trainer.evalLoss(e.batches), tokens: e.tokens };
}

/** Runs `job` to the end, cancellation or failure; never throws. */
export async function runTraining(ctx: GpuContext, job: WorkerJob, hooks: TrainHooks): Promise<DoneMessage> {
  let trainer: Trainer | null = null;
  let iteration = 0;
  const done = (status: DoneMessage["status"], error: string | null): DoneMessage => ({
    type: "done",
    id: job.id,
    status,
    iteration,
    error,
  });
  try {
    const c = job.config;
    const model = resolveModel(c);
    const t0 = performance.now();
    const data = await loadSplits(job.root, c.dataset, c.split, c.seq_len);
    const dataLoaderMs = performance.now() - t0;
    // Refuse before training, not at the first evaluation (weights of 0 leave a split empty on purpose).
    for (const split of ["valid", "test"] as const) {
      if (data[split].length > 0) evalBatches(data[split], c.batch_size, c.seq_len, 1, split);
    }

    let state: TrainerState | undefined;
    let samplerState: SamplerState | undefined;
    if (job.resume_path) {
      const ck = await loadCheckpoint(job.resume_path, model);
      state = ck.state;
      samplerState = ck.manifest.sampler;
      iteration = ck.state.step;
    }
    trainer = await Trainer.create(ctx, {
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
      debugNonFiniteAt: hooks.nonFiniteAt,
      checkpointLayers: checkpointLayers(c),
      precision: c.precision ?? "fp32",
    }, state);
    const sampler = new Sampler(
      data.train,
      { seqLen: c.seq_len, batchSize: c.batch_size, seed: c.seed },
      samplerState,
    );
    iteration = trainer.step;
    hooks.post({
      type: "started",
      id: job.id,
      iteration,
      resumed_from: job.resume_path,
      gpu_memory_bytes: trainer.memoryBytes,
    });

    let lastLoss: number | null = null, lastVal: number | null = null, lastSaved = -1;
    const save = async () => {
      const { name, path } = await saveCheckpoint(
        job.checkpoint_dir,
        {
          job_id: job.id,
          model,
          train: c,
          sampler: { ...sampler.state },
          metrics: { loss: lastLoss, val_loss: lastVal },
        },
        await trainer!.exportState(),
        c.keep_checkpoints,
      );
      lastSaved = trainer!.step;
      hooks.post({ type: "checkpoint", id: job.id, iteration: trainer!.step, name, path });
    };
    const evalSplit = async (split: "valid" | "test") => {
      if (data[split].length === 0) return;
      const { loss, tokens } = await evaluate(trainer!, data[split], c, split);
      if (split === "valid") lastVal = loss;
      hooks.post({ type: "eval", id: job.id, iteration, split, loss, perplexity: Math.exp(loss), tokens });
    };

    let windowStart = performance.now(), windowSteps = 0, batchMs = 0;
    let skipped = 0;
    while (trainer.step < c.train_iters) {
      if (hooks.cancelled()) return done("cancelled", null);
      if (hooks.stopRequested?.()) {
        // Shutdown: keep every finished step. The checkpoint is at the step the GPU last finished.
        if (lastSaved !== trainer.step) await save();
        return done("interrupted", null);
      }
      const tb = performance.now();
      const tokens = sampler.nextBatch();
      batchMs += performance.now() - tb;
      const logStep = (trainer.step + 1) % c.log_interval === 0 || trainer.step + 1 === c.train_iters;
      trainer.trainStep(tokens, logStep);
      iteration = trainer.step;
      windowSteps++;
      const last = iteration === c.train_iters;
      if (hooks.generation?.busy) {
        const ts = performance.now();
        await ctx.device.queue.onSubmittedWorkDone();
        await hooks.generation.turn(performance.now() - ts);
      } else if (!logStep && iteration % MAX_STEPS_IN_FLIGHT === 0) {
        // Bound the steps queued on the GPU between loss readbacks (memory, and a prompt cancel).
        await ctx.device.queue.onSubmittedWorkDone();
      }
      if (logStep) {
        const stats = await trainer.lastStats();
        const phases = await trainer.phaseTimes();
        const elapsed = performance.now() - windowStart;
        if (stats.skippedSteps > skipped) {
          hooks.post({
            type: "log",
            id: job.id,
            level: "warn",
            message: `Skipped ${stats.skippedSteps - skipped} step(s) with a non-finite loss or gradient ` +
              `by iteration ${iteration} (${stats.skippedSteps} in all)`,
          });
          skipped = stats.skippedSteps;
        }
        if (stats.consecutiveSkipped >= MAX_CONSECUTIVE_SKIPS) {
          throw new Error(
            `Loss or gradient norm was non-finite for ${stats.consecutiveSkipped} consecutive steps, ` +
              `up to iteration ${iteration}: stopping (no checkpoint of these steps is saved)`,
          );
        }
        if (Number.isFinite(stats.loss)) lastLoss = stats.loss;
        hooks.post({
          type: "progress",
          id: job.id,
          iteration,
          // JSON has no NaN: a skipped step's numbers travel as null.
          loss: Number.isFinite(stats.loss) ? stats.loss : null,
          grad_norm: Number.isFinite(stats.gradNorm) ? stats.gradNorm : null,
          lr: stats.lr,
          tokens_per_s: (windowSteps * c.batch_size * c.seq_len) / (elapsed / 1000),
          timings: {
            forward_ms: phases?.forward_ms ?? null,
            backward_ms: phases?.backward_ms ?? null,
            allreduce_ms: 0,
            optimizer_ms: phases?.optimizer_ms ?? null,
            batch_generator_ms: batchMs / windowSteps,
            data_loader_ms: dataLoaderMs,
            step_ms: elapsed / windowSteps,
          },
          gpu_memory_bytes: trainer.memoryBytes,
          skipped_steps: stats.skippedSteps,
          loss_scale: stats.lossScale,
        });
        windowStart = performance.now();
        windowSteps = 0;
        batchMs = 0;
      }
      const evalNow = !last && c.eval_interval > 0 && iteration % c.eval_interval === 0;
      const saveNow = !last && c.save_interval > 0 && iteration % c.save_interval === 0;
      if (evalNow) await evalSplit("valid");
      if (saveNow) await save();
      if (evalNow || saveNow) {
        // Throughput and step time measure training only: restart the window after the pause.
        await ctx.device.queue.onSubmittedWorkDone();
        windowStart = performance.now();
        windowSteps = 0;
        batchMs = 0;
      }
    }
    await evalSplit("valid");
    await evalSplit("test");
    if (lastSaved !== trainer.step) await save();
    return done("succeeded", null);
  } catch (e) {
    const err = e as Error;
    const message = err instanceof ConfigError
      ? `Cannot train this configuration: ${err.message}`
      : err.message;
    return done("failed", message || String(e));
  } finally {
    trainer?.destroy();
  }
}
