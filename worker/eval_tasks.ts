/**
 * Evaluations during training (`eval_tasks` of `POST /train`, llm.c's HellaSwag every N steps):
 * at every `eval_interval` and at the end, between steps, each task runs on the trainer's current
 * weights (no second copy of them), as worker/evaluation.ts runs an evaluation job. Perplexity
 * and cloze run in the training plan (batch_size rows of seq_len); multiple choice, whose rows are
 * usually far shorter, in a forward-only plan of its window sharing the weights (engine/scorer.ts)
 * with as many rows as keep batch_size × seq_len tokens, built once per job run (the training plan
 * when that fails or saves little). Inputs are read and tokenized once per job run, at their first
 * use. A task that fails is reported with its error and the training goes on.
 */

import type { GpuContext } from "../engine/device.ts";
import type { Trainer } from "../engine/trainer.ts";
import type { EvalResult, EvalTaskConfig } from "../job/job.ts";
import type { FromWorker } from "../protocol.ts";
import { type ClozeExample, clozeExample } from "../model/perplexity.ts";
import type { ChoiceTokens } from "../model/multiple_choice.ts";
import {
  choiceWindow,
  clozeTokens,
  type EvalHooks,
  EvalModel,
  type EvalStream,
  evalStream,
  multipleChoice,
  perplexity,
  tokenize,
  tokenizeChoices,
  withChoiceExamples,
} from "./evaluation.ts";

/** Milliseconds between signs of life while a task runs. */
const PROGRESS_MS = 30_000;

/** A task's inputs, tokenized. */
type Prepared =
  | { task: "multiple_choice"; examples: ChoiceTokens[] }
  | { task: "cloze"; examples: ClozeExample[] }
  | { task: "perplexity"; stream: EvalStream };

/** The eval tasks of one job run. */
export class EvalTasks {
  #ctx: GpuContext;
  #root: string;
  #tasks: EvalTaskConfig[];
  #prepared = new Map<string, Prepared>();
  /** The training plan, and forward-only plans by window (null: could not be built). */
  #model: EvalModel | null = null;
  #sharing = new Map<number, EvalModel | null>();

  constructor(ctx: GpuContext, root: string, tasks: EvalTaskConfig[]) {
    this.#ctx = ctx;
    this.#root = root;
    this.#tasks = tasks;
  }

  /**
   * Runs every task on `trainer`'s weights at `iteration`, posting an `eval_task` message for each
   * (its result or its error). Stops early, posting nothing more, once `cancelled()` holds.
   */
  async run(
    trainer: Trainer,
    iteration: number,
    jobId: string,
    post: (msg: FromWorker) => void,
    cancelled: () => boolean,
  ): Promise<void> {
    this.#model ??= EvalModel.over(this.#ctx, trainer);
    for (const t of this.#tasks) {
      if (cancelled()) return;
      const base = { type: "eval_task" as const, id: jobId, iteration, name: t.name, task: t.task };
      // A sign of life now and then, so a long evaluation is not taken for a stalled Worker.
      let said = performance.now();
      const progress = ({ done, total }: { done: number; total: number }) => {
        if (performance.now() - said < PROGRESS_MS) return;
        said = performance.now();
        post({ ...base, done, total });
      };
      try {
        const result = await this.#runOne(
          t,
          trainer,
          { cancelled, progress },
          (message) => post({ type: "log", id: jobId, level: "warn", message }),
        );
        post({ ...base, result });
      } catch (e) {
        if ((e as Error).message === "Cancelled" && cancelled()) return;
        post({ ...base, error: (e as Error).message || String(e) });
      }
    }
  }

  async #runOne(
    t: EvalTaskConfig,
    trainer: Trainer,
    hooks: EvalHooks,
    warn: (message: string) => void,
  ): Promise<EvalResult> {
    const model = this.#model!;
    const p = this.#prepared.get(t.name) ?? await this.#prepare(t);
    this.#prepared.set(t.name, p);
    const body = p.task === "multiple_choice"
      ? await multipleChoice(
        await this.#choiceModel(trainer, p.examples, warn),
        p.examples,
        t.scoring ?? "sum",
        hooks,
      )
      : p.task === "cloze"
      ? await clozeTokens(model, p.examples, hooks)
      : await perplexity(model, p.stream, t.stride ?? model.seqLen, hooks);
    return { task: t.task, model: "(training)", ...body };
  }

  /**
   * The plan multiple choice runs in: a forward-only one of the examples' window sharing the
   * weights when that window is at most half the training one, else (or when it cannot be built)
   * the training plan.
   */
  async #choiceModel(
    trainer: Trainer,
    examples: ChoiceTokens[],
    warn: (m: string) => void,
  ): Promise<EvalModel> {
    const over = this.#model!, T = over.seqLen, B = over.batch;
    const window = choiceWindow(examples, T);
    if (window * 2 > T) return over;
    if (!this.#sharing.has(window)) {
      const rows = Math.max(B, Math.floor(B * T / window));
      let model: EvalModel | null = null;
      try {
        model = await EvalModel.sharing(this.#ctx, trainer, rows, window);
      } catch (e) {
        warn(
          `Cannot plan ${rows} rows of ${window} tokens for multiple choice (${(e as Error).message}): ` +
            `scoring in the training plan's ${B} rows of ${T}`,
        );
      }
      this.#sharing.set(window, model);
    }
    return this.#sharing.get(window) ?? over;
  }

  /** Frees the forward-only plans (the trainer stays its owner's). */
  destroy(): void {
    for (const m of this.#sharing.values()) m?.destroy();
    this.#sharing.clear();
  }

  async #prepare(t: EvalTaskConfig): Promise<Prepared> {
    if (t.task === "multiple_choice") {
      return {
        task: t.task,
        examples: tokenizeChoices((await withChoiceExamples(this.#root, t)).examples ?? []),
      };
    }
    if (t.task === "cloze") {
      const examples = (t.texts ?? []).map((line, i) => {
        try {
          return clozeExample(line, t.strict, tokenize);
        } catch (e) {
          throw new RangeError(`Cloze line ${i}: ${(e as Error).message}`);
        }
      });
      return { task: t.task, examples };
    }
    const stream = await evalStream(this.#root, { ...t, model: "", stride: t.stride ?? 1 });
    return { task: t.task, stream };
  }
}
