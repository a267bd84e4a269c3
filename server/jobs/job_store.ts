/**
 * The job store: jobs, their metrics history and their event log in SQLite (`node:sqlite`), so
 * a server restart finds every job, replays missed events to clients (`Last-Event-ID`), and
 * knows which jobs were running when it died. Queues are ordered views of this table: a job
 * waits on one GPU's queue (`gpu` column) in submission order.
 *
 * The schema is versioned with `PRAGMA user_version`: {@link MIGRATIONS} run in order, each in
 * a transaction, from the version a data directory has to the newest. Version 1 is the schema of
 * the first release (`create if not exists`, so a directory it wrote, still at version 0, is
 * adopted as it is); a database newer than this server is refused rather than misread.
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
} from "../../model/job.ts";

const SCHEMA_V1 = `
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

/** Ordered migrations: entry i brings the schema from version i to i + 1. */
export const MIGRATIONS: readonly string[] = [
  SCHEMA_V1,
  // 2: listing by status pages on (status, seq); a one-row table the readiness probe writes.
  `create index if not exists jobs_status on jobs(status, seq);
   create table if not exists probe (id integer primary key check (id = 1), at text not null);`,
];

/** The schema version this server writes. */
export const SCHEMA_VERSION = MIGRATIONS.length;

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
  #listeners = new Set<(e: JobEvent) => void>();

  /** Opens (creating if needed) the store at `path` and migrates it; ":memory:" for tests. */
  constructor(path: string) {
    this.#db = new DatabaseSync(path);
    this.#db.exec("pragma journal_mode = wal; pragma synchronous = normal; pragma busy_timeout = 5000;");
    try {
      migrate(this.#db, path);
    } catch (e) {
      this.#db.close();
      throw e;
    }
  }

  /** The schema version of the open database. */
  get schemaVersion(): number {
    return userVersion(this.#db);
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

  /**
   * Jobs newest first, `limit` of them (default 100), only those older than job `after` when
   * given (a page after the last one seen; an unknown `after` gives an empty page).
   */
  listJobs(opts: { status?: JobStatus; limit?: number; after?: string } = {}): Job[] {
    const limit = opts.limit ?? 100;
    const where: string[] = [];
    const args: Array<string | number> = [];
    if (opts.status) {
      where.push("status = ?");
      args.push(opts.status);
    }
    if (opts.after !== undefined) {
      where.push("seq < coalesce((select seq from jobs where id = ?), -1)");
      args.push(opts.after);
    }
    const sql = `select * from jobs ${
      where.length ? `where ${where.join(" and ")}` : ""
    } order by seq desc limit ?`;
    return (this.#db.prepare(sql).all(...args, limit) as Row[]).map(toJob);
  }

  /** Whether a job with this id exists. */
  hasJob(id: string): boolean {
    return this.#db.prepare("select 1 from jobs where id = ?").get(id) !== undefined;
  }

  /** Deletes a job with its metrics history and events. Returns whether it existed. */
  deleteJob(id: string): boolean {
    this.#db.exec("begin");
    try {
      this.#db.prepare("delete from metrics where job_id = ?").run(id);
      this.#db.prepare("delete from events where job_id = ?").run(id);
      const r = this.#db.prepare("delete from jobs where id = ?").run(id);
      this.#db.exec("commit");
      return Number(r.changes) > 0;
    } catch (e) {
      this.#db.exec("rollback");
      throw e;
    }
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

  /** Number of jobs waiting on `gpu` (counted in SQL, not loaded). */
  queueLength(gpu: number): number {
    const r = this.#db.prepare(
      "select count(*) as n from jobs where gpu = ? and status in ('interrupted', 'queued')",
    ).get(gpu) as Row;
    return Number(r.n);
  }

  /** Number of jobs waiting on any GPU. */
  waitingCount(): number {
    const r = this.#db.prepare("select count(*) as n from jobs where status in ('interrupted', 'queued')")
      .get() as Row;
    return Number(r.n);
  }

  /** Whether the database accepts a write now (the readiness probe): null, or why not. */
  writeError(): string | null {
    try {
      this.#db.prepare(
        "insert into probe (id, at) values (1, ?) on conflict(id) do update set at = excluded.at",
      ).run(new Date().toISOString());
      return null;
    } catch (e) {
      return (e as Error).message;
    }
  }

  /** Calls `fn` with every event appended from now on, until the returned function is called. */
  onEvent(fn: (e: JobEvent) => void): () => void {
    this.#listeners.add(fn);
    return () => void this.#listeners.delete(fn);
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
    const event: JobEvent = { id: Number(r.lastInsertRowid), job_id: jobId, type, data, at };
    for (const fn of this.#listeners) fn(event);
    return event;
  }

  /** A job's events with id greater than `afterId`, oldest first, at most `limit` (a replay page). */
  eventsAfter(jobId: string, afterId = 0, limit = -1): JobEvent[] {
    const rows = this.#db.prepare("select * from events where job_id = ? and id > ? order by id limit ?").all(
      jobId,
      afterId,
      limit,
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

function userVersion(db: DatabaseSync): number {
  return Number((db.prepare("pragma user_version").get() as Row).user_version);
}

/** Runs the migrations `path`'s database lacks; refuses one newer than {@link SCHEMA_VERSION}. */
function migrate(db: DatabaseSync, path: string): void {
  const from = userVersion(db);
  if (from > SCHEMA_VERSION) {
    throw new Error(
      `Cannot open job store "${path}": its schema version ${from} is newer than this server's ${SCHEMA_VERSION} (upgrade the server)`,
    );
  }
  for (let v = from; v < SCHEMA_VERSION; v++) {
    db.exec("begin immediate");
    try {
      db.exec(MIGRATIONS[v]);
      db.exec(`pragma user_version = ${v + 1}`);
      db.exec("commit");
    } catch (e) {
      db.exec("rollback");
      throw new Error(
        `Cannot migrate job store "${path}" to schema version ${v + 1}: ${(e as Error).message}`,
      );
    }
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
