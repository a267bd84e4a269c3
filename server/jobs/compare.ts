/**
 * Runs side by side (`GET /jobs/compare`) and one run as CSV (`GET /jobs/:id/metrics?format=csv`):
 * the metrics history of several jobs aligned on one iteration axis (the union of their
 * iterations, null where a job has no point, so runs of different lengths line up), their final
 * figures, and the fields where their configs differ. Evaluations during training (`eval_tasks`)
 * come from their stored `eval_task` events: a series per task and figure. Pure over what the
 * store returns.
 */

import type { EvalResult, Job, JobEvent, MetricPoint, TrainConfig } from "../../job/job.ts";

/** One evaluation during training, as its `eval_task` event carries it. */
export interface EvalTaskPoint {
  iteration: number;
  name: string;
  task: string;
  loss?: number;
  perplexity?: number;
  accuracy?: number;
  accuracy_norm?: number;
  error?: string;
  at: string;
}

/** The figures an `eval_task` event keeps of a result (none for a failed evaluation). */
export function evalTaskFigures(r: EvalResult | undefined): Record<string, number | string> {
  if (!r) return {};
  const keep = [
    "loss",
    "perplexity",
    "accuracy",
    "accuracy_norm",
    "correct",
    "correct_norm",
    "examples",
    "endings",
    "tokens",
    "word_perplexity",
    "bits_per_byte",
    "seq_len",
    "tokens_per_s",
    "elapsed_s",
    "scoring",
  ] as const;
  const out: Record<string, number | string> = {};
  for (const k of keep) if (r[k] !== undefined) out[k] = r[k]!;
  return out;
}

/** The evaluations during training of a job's events, in order. */
export function evalTaskPoints(events: JobEvent[]): EvalTaskPoint[] {
  return events.filter((e) => e.type === "eval_task").map((e) => ({
    ...(e.data as Omit<EvalTaskPoint, "at">),
    at: e.at,
  }));
}

/** A job's history for comparison: its metrics and evaluations during training. */
export interface JobHistory {
  job: Job;
  metrics: MetricPoint[];
  evals: EvalTaskPoint[];
}

/** Figures of evaluation tasks drawn as series (`eval:<name>:<figure>`). */
const EVAL_FIGURES = ["accuracy", "accuracy_norm", "loss", "perplexity"] as const;

/** Tokens one optimizer step consumes: global batch × seq_len. */
export function tokensPerIteration(c: TrainConfig): number {
  return (c.global_batch_size ?? c.batch_size * (c.data_parallel ?? 1)) * c.seq_len;
}

/** A comparison of jobs: shared iteration axis, series per job (null-padded), finals, config differences. */
export interface Comparison {
  ids: string[];
  /** The union of every job's iterations, ascending: the x axis all series share. */
  iterations: number[];
  /**
   * Series name → job id → one value per entry of `iterations` (null where that job has none).
   * `train_loss`, `val_loss`, `test_loss`, `val_perplexity`, `lr`, `tokens_per_s`, `tokens` (seen by
   * that iteration), `time_s` (since the job's first point), and `eval:<name>:<figure>`.
   */
  series: Record<string, Record<string, (number | null)[]>>;
  jobs: {
    id: string;
    status: string;
    iteration: number;
    tokens_per_iteration: number;
    final: Record<string, number | null>;
    evaluations: Record<string, EvalTaskPoint>;
  }[];
  /** Config fields whose values differ between the jobs, each job's value in `ids` order. */
  config_differences: { field: string; values: unknown[] }[];
}

/** The config as compared: eval_tasks by name and task (their data could be large). */
function comparable(c: TrainConfig): Record<string, unknown> {
  const out: Record<string, unknown> = { ...c };
  if (c.eval_tasks) out.eval_tasks = c.eval_tasks.map((t) => `${t.name} (${t.task})`);
  return out;
}

/** Compares the histories of jobs (in the order given). */
export function compareJobs(histories: JobHistory[]): Comparison {
  const ids = histories.map((h) => h.job.id);
  const axis = new Set<number>();
  for (const h of histories) {
    for (const p of h.metrics) axis.add(p.iteration);
    for (const e of h.evals) axis.add(e.iteration);
  }
  const iterations = [...axis].sort((a, b) => a - b);
  const index = new Map(iterations.map((it, i) => [it, i]));
  const series: Comparison["series"] = {};
  const put = (name: string, id: string, iteration: number, value: number | null | undefined) => {
    if (value === undefined || value === null || !Number.isFinite(value)) return;
    series[name] ??= Object.fromEntries(ids.map((j) => [j, new Array(iterations.length).fill(null)]));
    series[name][id][index.get(iteration)!] = value;
  };
  const jobs: Comparison["jobs"] = [];
  for (const { job, metrics, evals } of histories) {
    const id = job.id, perIt = tokensPerIteration(job.config);
    const t0 = metrics.length ? Date.parse(metrics[0].at) : 0;
    for (const p of metrics) {
      if (p.split === "train") {
        put("train_loss", id, p.iteration, p.loss);
        put("lr", id, p.iteration, p.lr);
        put("tokens_per_s", id, p.iteration, p.tokens_per_s);
      } else if (p.split === "valid") {
        put("val_loss", id, p.iteration, p.loss);
        put("val_perplexity", id, p.iteration, p.perplexity);
      } else if (p.split === "test") {
        put("test_loss", id, p.iteration, p.loss);
      } else continue;
      put("tokens", id, p.iteration, p.iteration * perIt);
      put("time_s", id, p.iteration, (Date.parse(p.at) - t0) / 1000);
    }
    const latest: Record<string, EvalTaskPoint> = {};
    for (const e of evals) {
      latest[e.name] = e;
      for (const f of EVAL_FIGURES) put(`eval:${e.name}:${f}`, id, e.iteration, e[f]);
    }
    const m = job.metrics;
    jobs.push({
      id,
      status: job.status,
      iteration: job.iteration,
      tokens_per_iteration: perIt,
      final: {
        loss: m.loss,
        val_loss: m.val_loss,
        val_perplexity: m.val_perplexity,
        test_loss: m.test_loss,
        test_perplexity: m.test_perplexity,
        tokens_per_s: m.tokens_per_s,
        tokens: job.iteration * perIt,
        elapsed_s: job.started_at
          ? ((job.finished_at ? Date.parse(job.finished_at) : Date.now()) - Date.parse(job.started_at)) / 1000
          : null,
      },
      evaluations: latest,
    });
  }
  const configs = histories.map((h) => comparable(h.job.config));
  const fields = [...new Set(configs.flatMap((c) => Object.keys(c)))].sort();
  const config_differences = fields
    .map((field) => ({ field, values: configs.map((c) => c[field] ?? null) }))
    .filter(({ values }) => new Set(values.map((v) => JSON.stringify(v))).size > 1);
  return { ids, iterations, series, jobs, config_differences };
}

/** Quotes a CSV field when it needs it (RFC 4180). */
function csvField(v: unknown): string {
  if (v === null || v === undefined) return "";
  const s = String(v);
  return /[",\n\r]/.test(s) ? `"${s.replaceAll('"', '""')}"` : s;
}

/**
 * A run as CSV: one row per metrics point (split `train`, `valid`, `test`) and per evaluation
 * during training (split `eval:<name>`, with its accuracies or its error), in the order recorded.
 */
export function metricsCsv(metrics: MetricPoint[], evals: EvalTaskPoint[]): string {
  const head = [
    "iteration",
    "split",
    "loss",
    "perplexity",
    "lr",
    "tokens_per_s",
    "accuracy",
    "accuracy_norm",
    "error",
    "at",
  ];
  const rows = [
    ...metrics.filter((p) => !p.split.startsWith("eval:")).map((
      p,
    ) => [p.iteration, p.split, p.loss, p.perplexity, p.lr, p.tokens_per_s, null, null, null, p.at]),
    ...evals.map((
      e,
    ) => [
      e.iteration,
      `eval:${e.name}`,
      e.loss,
      e.perplexity,
      null,
      null,
      e.accuracy,
      e.accuracy_norm,
      e.error,
      e.at,
    ]),
  ].sort((a, b) => String(a[9]).localeCompare(String(b[9])));
  return [head, ...rows].map((r) => r.map(csvField).join(",")).join("\n") + "\n";
}
