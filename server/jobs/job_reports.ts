/**
 * What a Worker reports about the job it runs, written down: the job's record and metrics, the
 * events its streams see, and the server log's compile lines. The job runner hands over every
 * report but its scheduling ones (`commit_check`, `done`) and supplies the writes, which it fences
 * on its lease and keeps in order while the store is away (see runner.ts).
 */

import type { JobPatch } from "./job_store.ts";
import type { JobEventType, MetricPoint } from "../../job/job.ts";
import { compileLine } from "../../protocol.ts";
import type { JobReport } from "../gpus/gpu_pool.ts";
import { evalTaskFigures } from "./compare.ts";

/** Least ms between two server log lines of one build's kernel compilation. */
const COMPILE_LOG_MS = 5000;
/** A build's end is logged when it took at least this long (or was logged before). */
const COMPILE_LOG_END_MS = 1000;

/** The writes a {@link ReportRecorder} makes, as the job runner does them. */
export interface ReportSink {
  update(id: string, patch: JobPatch): void;
  metric(id: string, p: Omit<MetricPoint, "at">): void;
  emit(id: string, type: JobEventType, data: Record<string, unknown>): void;
  /** Job `id` got further: its count of crashes without progress starts over. */
  progressed(id: string): void;
}

/** Reports the recorder takes: all but the ones that change where jobs run. */
export type RecordedReport = Exclude<JobReport, { type: "commit_check" | "done" }>;

type Report<T extends RecordedReport["type"]> = Extract<RecordedReport, { type: T }>;

/** Turns a Worker's reports into the job's records, events and log lines. */
export class ReportRecorder {
  #sink: ReportSink;
  /** Builds compiling now (by job id, or GPU and model): when last logged (or begun), and whether at all. */
  #compileLogged = new Map<string, { at: number; logged: boolean }>();

  constructor(sink: ReportSink) {
    this.#sink = sink;
  }

  /** Records `msg`, which GPU `gpu`'s Worker sent. */
  record(gpu: number, msg: RecordedReport): void {
    const sink = this.#sink;
    switch (msg.type) {
      case "started":
        return this.#started(msg);
      case "progress":
        return this.#progress(msg);
      case "eval":
        return this.#eval(msg);
      case "evaluation": {
        const { type: _, id, result, ...progress } = msg;
        sink.emit(id, "progress", { kind: "evaluate", ...progress });
        if (result) {
          sink.update(id, {
            metrics: { evaluation: result, tokens_per_s: result.tokens_per_s, test_loss: result.loss },
          });
          sink.emit(id, "evaluation", { ...result });
        }
        sink.progressed(id);
        return;
      }
      case "eval_task":
        return this.#evalTask(msg);
      case "log":
        sink.emit(msg.id, "log", { level: msg.level, message: msg.message });
        return;
      case "compile":
        return this.#compile(gpu, msg);
      case "checkpoint":
        sink.update(msg.id, { last_checkpoint: msg.name });
        sink.emit(msg.id, "checkpoint", { iteration: msg.iteration, name: msg.name, path: msg.path });
        return;
    }
  }

  #started(msg: Report<"started">): void {
    this.#sink.update(msg.id, {
      iteration: msg.iteration,
      resumed_from: msg.resumed_from,
      metrics: { gpu_memory_bytes: msg.gpu_memory_bytes },
    });
    this.#sink.emit(msg.id, "log", {
      level: "info",
      message: msg.resumed_from
        ? `Resumed from "${msg.resumed_from}" at iteration ${msg.iteration}`
        : `Started at iteration ${msg.iteration}`,
      iteration: msg.iteration,
      resumed_from: msg.resumed_from,
    });
  }

  #progress(msg: Report<"progress">): void {
    const { id, type: _, ...rest } = msg;
    this.#sink.update(id, {
      iteration: msg.iteration,
      metrics: {
        ...(msg.loss !== null ? { loss: msg.loss, grad_norm: msg.grad_norm } : {}),
        lr: msg.lr,
        tokens_per_s: msg.tokens_per_s,
        timings: msg.timings,
        gpu_memory_bytes: msg.gpu_memory_bytes,
        skipped_steps: msg.skipped_steps,
        loss_scale: msg.loss_scale,
        ...(msg.ranks ? { ranks: msg.ranks } : {}),
      },
    });
    if (msg.loss !== null) {
      this.#sink.metric(id, {
        iteration: msg.iteration,
        split: "train",
        loss: msg.loss,
        perplexity: Math.exp(msg.loss),
        lr: msg.lr,
        tokens_per_s: msg.tokens_per_s,
      });
    }
    this.#sink.emit(id, "progress", { kind: "train", ...rest });
    this.#sink.progressed(id);
  }

  #eval(msg: Report<"eval">): void {
    const metrics = msg.split === "valid"
      ? { val_loss: msg.loss, val_perplexity: msg.perplexity, val_tokens: msg.tokens }
      : { test_loss: msg.loss, test_perplexity: msg.perplexity, test_tokens: msg.tokens };
    this.#sink.update(msg.id, { metrics });
    this.#sink.metric(msg.id, {
      iteration: msg.iteration,
      split: msg.split,
      loss: msg.loss,
      perplexity: msg.perplexity,
      lr: null,
      tokens_per_s: null,
    });
    this.#sink.emit(msg.id, "progress", {
      kind: "eval",
      split: msg.split,
      iteration: msg.iteration,
      loss: msg.loss,
      perplexity: msg.perplexity,
      tokens: msg.tokens,
    });
  }

  #evalTask(msg: Report<"eval_task">): void {
    const { id, iteration, name, task, result, error } = msg;
    this.#sink.progressed(id);
    if (!result && error === undefined) return; // progress: the watchdog has heard from the job
    if (result) {
      this.#sink.metric(id, {
        iteration,
        split: `eval:${name}`,
        loss: result.loss,
        perplexity: result.perplexity,
        lr: null,
        tokens_per_s: result.tokens_per_s,
      });
    }
    this.#sink.emit(id, "eval_task", {
      iteration,
      name,
      task,
      ...evalTaskFigures(result),
      ...error ? { error } : {},
    });
  }

  #compile(gpu: number, msg: Report<"compile">): void {
    const { type: _, id, model: __, ...report } = msg;
    if (id) this.#sink.emit(id, "compile", report);
    // The server's log: a line every few seconds while a build compiles, and its end unless it
    // was quick (a generator compiles several such builds, some in the background).
    const key = id ?? `${gpu}:${msg.model}`;
    const now = Date.now(), seen = this.#compileLogged.get(key) ?? { at: now, logged: false };
    const complete = msg.done >= msg.total;
    if (complete ? seen.logged || msg.ms >= COMPILE_LOG_END_MS : now - seen.at >= COMPILE_LOG_MS) {
      console.log(compileLine(msg, id ?? `GPU ${gpu}, model ${msg.model}`));
      Object.assign(seen, { at: now, logged: true });
    }
    if (complete) this.#compileLogged.delete(key);
    else this.#compileLogged.set(key, seen);
  }
}
