/**
 * Evaluations during training (`eval_tasks` of `POST /train`, llm.c's HellaSwag every N steps):
 * at every `eval_interval` and at the end, between steps, each task runs on the trainer's current
 * weights in its own plan (batch_size rows of seq_len; no second copy of the model), as
 * worker/evaluation.ts runs an evaluation job. Inputs are read and tokenized once per job run, at
 * their first use. A task that fails is reported with its error and the training goes on.
 */

import type { GpuContext } from "../engine/device.ts";
import type { Trainer } from "../engine/trainer.ts";
import type { EvalResult, EvalTaskConfig } from "../model/job.ts";
import type { FromWorker } from "../protocol.ts";
import { type ClozeExample, clozeExample } from "../model/perplexity.ts";
import type { ChoiceTokens } from "../model/multiple_choice.ts";
import {
  clozeTokens,
  EvalModel,
  type EvalStream,
  evalStream,
  multipleChoice,
  perplexity,
  tokenize,
  tokenizeChoices,
} from "./evaluation.ts";

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
  #model: EvalModel | null = null;

  constructor(ctx: GpuContext, root: string, tasks: EvalTaskConfig[]) {
    this.#ctx = ctx;
    this.#root = root;
    this.#tasks = tasks;
  }

  /** Whether there is anything to run. */
  get any(): boolean {
    return this.#tasks.length > 0;
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
      try {
        const result = await this.#runOne(t, { cancelled });
        post({ ...base, result });
      } catch (e) {
        if ((e as Error).message === "Cancelled" && cancelled()) return;
        post({ ...base, error: (e as Error).message || String(e) });
      }
    }
  }

  async #runOne(t: EvalTaskConfig, hooks: { cancelled(): boolean }): Promise<EvalResult> {
    const model = this.#model!;
    const p = this.#prepared.get(t.name) ?? await this.#prepare(t);
    this.#prepared.set(t.name, p);
    const body = p.task === "multiple_choice"
      ? await multipleChoice(model, p.examples, t.scoring ?? "sum", hooks)
      : p.task === "cloze"
      ? await clozeTokens(model, p.examples, hooks)
      : await perplexity(model, p.stream, t.stride ?? model.seqLen, hooks);
    return { task: t.task, model: "(training)", ...body };
  }

  async #prepare(t: EvalTaskConfig): Promise<Prepared> {
    if (t.task === "multiple_choice") return { task: t.task, examples: tokenizeChoices(t.examples ?? []) };
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
