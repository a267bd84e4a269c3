/**
 * Zod schemas of the HTTP API's request bodies. `POST /train` mirrors Megatron-LM's training
 * arguments; defaults are filled here so a stored job always shows every value it ran with.
 */

import { z } from "zod";
import { PRESET_NAMES } from "../../model/config.ts";
import { DEFAULT_SPLIT, TASK_FILE_RE } from "../../data/mod.ts";
import { choiceProblem } from "../../model/multiple_choice.ts";

const positiveInt = z.number().int().positive();

/** Explicit model dimensions (GPT-2 vocabulary implied). */
export const ModelDimsSchema = z.strictObject({
  n_layer: positiveInt.max(96),
  n_head: positiveInt.max(128),
  n_embd: positiveInt.max(8192),
  n_positions: positiveInt.max(8192),
});

/** The words of a cloze line (LAMBADA's format: the last one is to be predicted). */
const clozeWords = (text: string) => text.trim().split(/\s+/).filter((w) => w.length > 0);

/** A multiple-choice example: `{context, endings, label}` (checked further by choiceProblem). */
const ChoiceExampleSchema = z.strictObject({
  context: z.string().max(1_000_000),
  endings: z.array(z.string().max(1_000_000)).max(64),
  label: z.number().int(),
});

/** What an evaluation reads and how, shared by `POST /evaluate` and `eval_tasks` of `POST /train`. */
const evalDataFields = {
  task: z.enum(["perplexity", "cloze", "multiple_choice"]).default("perplexity"),
  texts: z.array(z.string().max(10_000_000)).min(1).max(100_000).optional(),
  examples: z.array(ChoiceExampleSchema).min(1).max(1_000_000).optional(),
  examples_file: z.string().regex(TASK_FILE_RE, "expected a task file name: $GPT2_HOME/tasks/<name>.jsonl")
    .optional(),
  scoring: z.enum(["sum", "mean_token"]).default("sum"),
  dataset: z.string().min(1).max(200).optional(),
  split: z.enum(["train", "valid", "test"]).default("test"),
  stride: positiveInt.max(8192).optional(),
  strict: z.boolean().default(false),
  max_tokens: positiveInt.max(1e12).optional(),
};

/** The evaluation fields as parsed. */
type EvalData = {
  task: "perplexity" | "cloze" | "multiple_choice";
  texts?: string[];
  examples?: { context: string; endings: string[]; label: number }[];
  examples_file?: string;
  dataset?: string;
  stride?: number;
  seq_len?: number;
};

/** Reports what is wrong with an evaluation's data through `issue` (paths relative to it). */
function evalDataIssues(r: EvalData, issue: (path: (string | number)[], message: string) => void): void {
  if (r.task === "multiple_choice") {
    const given = (r.examples !== undefined ? 1 : 0) + (r.examples_file !== undefined ? 1 : 0);
    if (given !== 1 || r.texts !== undefined || r.dataset !== undefined) {
      issue(
        [
          given === 0
            ? "examples"
            : given === 2
            ? "examples_file"
            : r.texts !== undefined
            ? "texts"
            : "dataset",
        ],
        'Cannot evaluate multiple choice: give examples ({"context", "endings", "label"}) or examples_file, ' +
          "one of them, and no texts or dataset",
      );
      return;
    }
    for (const [i, ex] of (r.examples ?? []).entries()) {
      const problem = choiceProblem(ex, i);
      if (problem) {
        issue(
          ["examples", i, ...problem.field.split(".").map((k) => /^\d+$/.test(k) ? +k : k)],
          problem.message,
        );
      }
    }
    return;
  }
  if (r.examples !== undefined || r.examples_file !== undefined) {
    issue(
      [r.examples !== undefined ? "examples" : "examples_file"],
      `Cannot evaluate ${r.task} on examples: they are for task "multiple_choice"`,
    );
    return;
  }
  if ((r.texts === undefined) === (r.dataset === undefined)) {
    issue(["texts"], "Cannot evaluate: give exactly one of texts or dataset");
    return;
  }
  if (r.task === "cloze" && r.dataset !== undefined) {
    issue(["dataset"], 'Cannot evaluate a cloze task on a dataset: give texts (LAMBADA\'s {"text"} lines)');
  }
  if (r.stride !== undefined && r.seq_len !== undefined && r.stride > r.seq_len) {
    issue(["stride"], `Cannot evaluate with stride ${r.stride} larger than seq_len ${r.seq_len}`);
  }
  for (const [i, text] of (r.texts ?? []).entries()) {
    if (text.trim() === "") {
      issue(["texts", i], `Cannot evaluate an empty text (texts[${i}])`);
    } else if (r.task === "cloze" && clozeWords(text).length < 2) {
      issue(
        ["texts", i],
        `Cannot evaluate cloze line ${i}: "${text.trim().slice(0, 40)}" has one word, ` +
          "and a context before the last word is needed",
      );
    }
  }
}

/**
 * Body of `POST /evaluate`: a model the server knows, a task, and what to read (texts, or a
 * dataset's split for perplexity; examples for multiple choice). `seq_len` defaults to the model's context capped at
 * DEFAULT_EVAL_MAX_SEQ_LEN (job/job_config.ts) and `stride` to `seq_len` (the non-overlapping
 * evaluation); both are filled and checked against the model by the runner.
 */
export const EvaluateRequestSchema = z.strictObject({
  model: z.string().min(1).max(300),
  ...evalDataFields,
  seq_len: positiveInt.max(8192).optional(),
  batch_size: positiveInt.max(1024).default(8),
}).superRefine((r, ctx) =>
  evalDataIssues(r, (path, message) => ctx.addIssue({ code: "custom", path, message }))
);

/** Evaluations a training job runs at every eval_interval, at most. */
export const MAX_EVAL_TASKS = 8;

/**
 * One of `eval_tasks` in `POST /train`: a name (default: the task; letters, digits, `_.-`),
 * and an evaluation as `POST /evaluate` takes it, run in the job's own window and batch.
 */
export const EvalTaskSchema = z.strictObject({
  name: z.string().regex(/^[A-Za-z0-9_.-]{1,64}$/, "expected 1 to 64 letters, digits, _ . or -").optional(),
  ...evalDataFields,
}).superRefine((r, ctx) =>
  evalDataIssues(r, (path, message) => ctx.addIssue({ code: "custom", path, message }))
)
  .transform(({ name, ...r }) => ({ name: name ?? r.task, ...r }));

/** Body of `POST /train`. `model` omitted: the init_from source's dimensions, else "gpt2-tiny". */
export const TrainRequestSchema = z.strictObject({
  model: z.union([z.string().min(1), ModelDimsSchema]).optional(),
  dataset: z.string().min(1).max(200).default("sotu"),
  split: z.string().regex(/^\d+(,\d+){0,2}$/, 'expected Megatron\'s form, e.g. "949,50,1"').default(
    DEFAULT_SPLIT.join(","),
  ),
  train_iters: positiveInt.max(10_000_000).default(1000),
  batch_size: positiveInt.max(4096).default(4),
  // Filled by completeConfig: the model's context capped at DEFAULT_TRAIN_MAX_SEQ_LEN (job/job_config.ts).
  seq_len: positiveInt.max(8192).optional(),
  lr: z.number().positive().max(1).default(6e-4),
  min_lr: z.number().min(0).max(1).default(6e-5),
  lr_decay_style: z.enum(["cosine", "linear", "constant"]).default("cosine"),
  warmup: z.number().min(0).max(1).default(0.01),
  weight_decay: z.number().min(0).max(10).default(0.1),
  clip_grad: z.number().min(0).default(1.0),
  attention_dropout: z.number().min(0).lt(1).default(0.1),
  hidden_dropout: z.number().min(0).lt(1).default(0.1),
  seed: z.number().int().min(0).max(2 ** 32 - 1).default(1234),
  log_interval: positiveInt.default(10),
  eval_interval: z.number().int().min(0).default(100),
  eval_iters: positiveInt.max(10_000).default(10),
  save_interval: z.number().int().min(0).default(100),
  keep_checkpoints: positiveInt.max(1000).default(3),
  resume_from: z.string().min(1).max(300).optional(),
  init_from: z.string().min(1).max(300).optional(),
  objective: z.enum(["lm", "sft"]).optional(),
  precision: z.enum(["fp32", "fp16"]).default("fp32"),
  checkpoint_activations: z.boolean().default(false),
  checkpoint_num_layers: positiveInt.max(96).default(1),
  data_parallel: positiveInt.max(64).default(1),
  tensor_parallel: positiveInt.max(64).default(1),
  global_batch_size: positiveInt.max(1 << 20).optional(),
  allreduce_dtype: z.enum(["fp32", "fp16", "bf16"]).default("fp32"),
  distributed_optimizer: z.boolean().default(false),
  overlap_grad_reduce: z.boolean().default(true),
  eval_tasks: z.array(EvalTaskSchema).max(MAX_EVAL_TASKS).optional(),
}).refine((r) => r.min_lr <= r.lr, { path: ["min_lr"], message: "min_lr must not exceed lr" })
  .superRefine((r, ctx) => {
    const micro = r.batch_size * r.data_parallel;
    if (r.global_batch_size !== undefined && r.global_batch_size % micro !== 0) {
      ctx.addIssue({
        code: "custom",
        path: ["global_batch_size"],
        message:
          `global_batch_size ${r.global_batch_size} must be a multiple of batch_size × data_parallel = ` +
          `${r.batch_size} × ${r.data_parallel} = ${micro}`,
      });
    }
  })
  .superRefine((r, ctx) => {
    const names = (r.eval_tasks ?? []).map((t) => t.name);
    for (const [i, name] of names.entries()) {
      if (names.indexOf(name) === i) continue;
      ctx.addIssue({
        code: "custom",
        path: ["eval_tasks", i, "name"],
        message: `Cannot run two eval_tasks named "${name}": give each a distinct name`,
      });
    }
  })
  .refine((r) => typeof r.model !== "string" || (PRESET_NAMES as readonly string[]).includes(r.model), {
    path: ["model"],
    message: `Unknown model preset: expected one of ${
      PRESET_NAMES.join(", ")
    } or {n_layer, n_head, n_embd, n_positions}`,
  });

/** A validated `POST /evaluate` body. */
export type EvaluateRequestBody = z.infer<typeof EvaluateRequestSchema>;

/** Query of `GET /jobs`: a status filter and a page (`limit` newest after job `after`). */
export const JobListQuerySchema = z.strictObject({
  status: z.enum(["queued", "running", "succeeded", "failed", "cancelled", "interrupted"]).optional(),
  limit: z.coerce.number().int().min(1).max(1000).default(100),
  after: z.string().min(1).max(100).optional(),
});

/** Jobs a comparison takes at most (the dashboard's compare view draws as many). */
export const MAX_COMPARED_JOBS = 8;

/** Query of `GET /jobs/compare`: `ids`, comma-separated, 1 to MAX_COMPARED_JOBS distinct job ids. */
export const CompareQuerySchema = z.strictObject({
  ids: z.string().max(2000).transform((s, ctx) => {
    const ids = s.split(",").map((x) => x.trim()).filter((x) => x !== "");
    const twice = ids.find((x, i) => ids.indexOf(x) !== i);
    const bad = ids.length === 0
      ? 'Cannot compare no jobs: give ids, e.g. "job_a,job_b"'
      : ids.length > MAX_COMPARED_JOBS
      ? `Cannot compare ${ids.length} jobs: at most ${MAX_COMPARED_JOBS}`
      : twice !== undefined
      ? `Cannot compare job "${twice}" with itself: each id once`
      : null;
    if (bad) {
      ctx.addIssue({ code: "custom", message: bad });
      return z.NEVER;
    }
    return ids;
  }),
});

/** Query of `GET /jobs/:id/metrics`: JSON (default) or CSV. */
export const MetricsQuerySchema = z.strictObject({
  format: z.enum(["json", "csv"]).default("json"),
});

/** Query of `GET /jobs/:id/events` (the `Last-Event-ID` header wins over it). */
export const EventsQuerySchema = z.strictObject({
  last_event_id: z.string().max(30).optional(),
});

/** A validated `POST /train` body. */
export type TrainRequestBody = z.infer<typeof TrainRequestSchema>;
