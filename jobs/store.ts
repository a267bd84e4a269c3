/**
 * The job store: jobs, their metrics history and their event log in SQLite (`node:sqlite`), so
 * a server restart finds every job, replays missed events to clients (`Last-Event-ID`), and
 * knows which jobs were running when it died. Queues are ordered views of this table: a job
 * waits on one GPU's queue (`gpu` column) in submission order.
 */

import { DatabaseSync } from "node:sqlite";
import {
  emptyMetrics,
  FINISHED_STATUSES,
  type Job,
  type JobEvent,
  type JobEventType,
  type JobMetrics,
  type JobStatus,
  type MetricPoint,
  type TrainConfig,
} from "./types.ts";

const SCHEMA = `
create table if not exists jobs (
  seq integer primary key autoincrement,
  id text not null unique,
  status text not null,
  gpu integer not null,
  config text not null,
  created_at text not null,
  started_at text,
  finished_at text,
  iteration integer not null default 0,
  metrics text not null,
  error text,
  cancel_requested integer not null default 0,
  resumes integer not null default 0,
  resumed_from text,
  last_checkpoint text
);
create index if not exists jobs_queue on jobs(gpu, status, seq);
create table if not exists metrics (
  job_id text not null,
  iteration integer not null,
  split text not null,
  loss real not null,
  perplexity real,
  lr real,
  tokens_per_s real,
  at text not null
);
create index if not exists metrics_job on metrics(job_id, iteration);
create table if not exists events (
  id integer primary key autoincrement,
  job_id text not null,
  type text not null,
  data text not null,
  at text not null
);
create index if not exists events_job on events(job_id, id);
`;

type Row = Record<string, unknown>;

/** Fields of a job the runner updates as it goes. */
export type JobPatch =
  & Partial<
    Pick<
      Job,
      | "status"
      | "started_at"
      | "finished_at"
      | "iteration"
      | "error"
      | "cancel_requested"
      | "resumes"
      | "resumed_from"
      | "last_checkpoint"
    >
  >
  & { metrics?: Partial<JobMetrics> };

/** SQLite-backed jobs, metrics and events. One instance per data directory. */
export class JobStore {
  #db: DatabaseSync;

  /** Opens (creating if needed) the store at `path`; ":memory:" for tests. */
  constructor(path: string) {
    this.#db = new DatabaseSync(path);
    this.#db.exec("pragma journal_mode = wal; pragma synchronous = normal; pragma busy_timeout = 5000;");
    this.#db.exec(SCHEMA);
  }

  close(): void {
    this.#db.close();
  }

  /** Inserts a queued job on `gpu`'s queue. */
  createJob(id: string, gpu: number, config: TrainConfig): Job {
    this.#db.prepare(
      "insert into jobs (id, status, gpu, config, created_at, metrics) values (?, 'queued', ?, ?, ?, ?)",
    ).run(id, gpu, JSON.stringify(config), new Date().toISOString(), JSON.stringify(emptyMetrics()));
    return this.getJob(id)!;
  }

  getJob(id: string): Job | null {
    const row = this.#db.prepare("select * from jobs where id = ?").get(id) as Row | undefined;
    return row ? toJob(row) : null;
  }

  /** All jobs, newest first. */
  listJobs(opts: { status?: JobStatus; limit?: number } = {}): Job[] {
    const limit = opts.limit ?? 1000;
    const rows = opts.status
      ? this.#db.prepare("select * from jobs where status = ? order by seq desc limit ?").all(
        opts.status,
        limit,
      )
      : this.#db.prepare("select * from jobs order by seq desc limit ?").all(limit);
    return (rows as Row[]).map(toJob);
  }

  /** Applies `patch`; metrics are merged into the stored ones. Returns the updated job. */
  updateJob(id: string, patch: JobPatch): Job {
    const job = this.getJob(id);
    if (!job) throw new Error(`Cannot update job "${id}": no such job`);
    const sets: string[] = [];
    const values: Array<string | number | null> = [];
    for (const [key, value] of Object.entries(patch)) {
      if (key === "metrics") continue;
      sets.push(`${key} = ?`);
      values.push(typeof value === "boolean" ? Number(value) : value as string | number | null);
    }
    if (patch.metrics) {
      sets.push("metrics = ?");
      values.push(JSON.stringify({ ...job.metrics, ...patch.metrics }));
    }
    if (sets.length === 0) return job;
    this.#db.prepare(`update jobs set ${sets.join(", ")} where id = ?`).run(...values, id);
    return this.getJob(id)!;
  }

  /** The next job waiting on `gpu`: interrupted jobs (they were running first) before queued ones, each FIFO. */
  nextQueued(gpu: number): Job | null {
    const row = this.#db.prepare(
      `select * from jobs where gpu = ? and status in ('interrupted', 'queued')
       order by case status when 'interrupted' then 0 else 1 end, seq limit 1`,
    ).get(gpu) as Row | undefined;
    return row ? toJob(row) : null;
  }

  /** Jobs waiting on `gpu`, in the order they will run. */
  queue(gpu: number): Job[] {
    const rows = this.#db.prepare(
      `select * from jobs where gpu = ? and status in ('interrupted', 'queued')
       order by case status when 'interrupted' then 0 else 1 end, seq`,
    ).all(gpu) as Row[];
    return rows.map(toJob);
  }

  /** Marks every job left `running` by a dead server as `interrupted`; returns them. */
  markInterrupted(): Job[] {
    const rows = this.#db.prepare("select id from jobs where status = 'running'").all() as Row[];
    return rows.map((r) => this.updateJob(r.id as string, { status: "interrupted" }));
  }

  /** Moves unfinished jobs queued on GPUs `>= gpus` onto GPU `index % gpus`. */
  requeueBeyond(gpus: number): void {
    this.#db.prepare(
      "update jobs set gpu = gpu % ? where gpu >= ? and status in ('queued', 'interrupted', 'running')",
    ).run(gpus, gpus);
  }

  /** Job counts per status. */
  countByStatus(): Record<JobStatus, number> {
    const out: Record<JobStatus, number> = {
      queued: 0,
      running: 0,
      succeeded: 0,
      failed: 0,
      cancelled: 0,
      interrupted: 0,
    };
    for (
      const r of this.#db.prepare("select status, count(*) as n from jobs group by status").all() as Row[]
    ) {
      out[r.status as JobStatus] = Number(r.n);
    }
    return out;
  }

  /** Appends a point to a job's metrics history. */
  addMetric(jobId: string, p: Omit<MetricPoint, "at">): void {
    this.#db.prepare(
      "insert into metrics (job_id, iteration, split, loss, perplexity, lr, tokens_per_s, at) values (?, ?, ?, ?, ?, ?, ?, ?)",
    ).run(jobId, p.iteration, p.split, p.loss, p.perplexity, p.lr, p.tokens_per_s, new Date().toISOString());
  }

  /** A job's metrics history in the order recorded. */
  metrics(jobId: string): MetricPoint[] {
    const rows = this.#db.prepare(
      "select iteration, split, loss, perplexity, lr, tokens_per_s, at from metrics where job_id = ? order by rowid",
    ).all(jobId) as Row[];
    return rows.map((r) => ({ ...r }) as unknown as MetricPoint);
  }

  /** Appends an event and returns it with its id. */
  addEvent(jobId: string, type: JobEventType, data: Record<string, unknown>): JobEvent {
    const at = new Date().toISOString();
    const r = this.#db.prepare("insert into events (job_id, type, data, at) values (?, ?, ?, ?)").run(
      jobId,
      type,
      JSON.stringify(data),
      at,
    );
    return { id: Number(r.lastInsertRowid), job_id: jobId, type, data, at };
  }

  /** A job's events with id greater than `afterId`, oldest first. */
  eventsAfter(jobId: string, afterId = 0): JobEvent[] {
    const rows = this.#db.prepare("select * from events where job_id = ? and id > ? order by id").all(
      jobId,
      afterId,
    ) as Row[];
    return rows.map((r) => ({
      id: Number(r.id),
      job_id: r.job_id as string,
      type: r.type as JobEventType,
      data: JSON.parse(r.data as string),
      at: r.at as string,
    }));
  }
}

/** Whether a job can no longer change. */
export function isFinished(status: JobStatus): boolean {
  return FINISHED_STATUSES.includes(status);
}

function toJob(r: Row): Job {
  return {
    id: r.id as string,
    status: r.status as JobStatus,
    gpu: Number(r.gpu),
    config: JSON.parse(r.config as string),
    created_at: r.created_at as string,
    started_at: (r.started_at as string | null) ?? null,
    finished_at: (r.finished_at as string | null) ?? null,
    iteration: Number(r.iteration),
    metrics: JSON.parse(r.metrics as string),
    error: (r.error as string | null) ?? null,
    cancel_requested: Number(r.cancel_requested) !== 0,
    resumes: Number(r.resumes),
    resumed_from: (r.resumed_from as string | null) ?? null,
    last_checkpoint: (r.last_checkpoint as string | null) ?? null,
  };
}
