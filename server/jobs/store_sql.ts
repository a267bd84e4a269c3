/**
 * The job store's SQL, written once for both engines: every statement a method of
 * {@link JobStoreEngine} runs is an entry of {@link SQL}, built with the {@link sql} tag (values
 * become `?` placeholders carried beside the text, in order), and every row comes back through
 * one mapper here. An engine only executes: SQLite (server/jobs/sqlite_store.ts) runs the text as
 * it is, PostgreSQL (server/jobs/postgres_store.ts) numbers the placeholders first
 * ({@link numbered}). What differs between the dialects is passed in as a {@link Dialect}: the
 * clock leases are measured by (this process's for SQLite, the database's for PostgreSQL) and
 * the row lock a claim takes (PostgreSQL's `for update skip locked`; SQLite's write transaction
 * already holds the database).
 */

import {
  emptyMetrics,
  type Job,
  type JobEvent,
  type JobEventType,
  type JobStatus,
  type MetricPoint,
  type TrainConfig,
} from "../../job/job.ts";
import type {
  AuditEvent,
  Claim,
  HeartbeatResult,
  HostRecord,
  HostReport,
  JobListOptions,
  JobPatch,
  Lease,
  TokenRecord,
  UserRecord,
} from "./job_store.ts";
import { workersOf } from "./store_schema.ts";

/** A row as a driver returns it (PostgreSQL gives bigints as strings, hence the Number()s below). */
export type Row = Record<string, unknown>;
/** A value bound to a placeholder. */
export type Value = string | number | null;

/** A statement or a piece of one: SQL text with `?` placeholders and their values, in order. */
export interface Sql {
  readonly text: string;
  readonly args: readonly Value[];
}

/** SQL text that takes no values (a constant term, a keyword). */
export function raw(text: string): Sql {
  return { text, args: [] };
}

/**
 * Builds SQL from a template: each interpolated value becomes a `?` placeholder (its value put
 * in `args` at its place), each interpolated {@link Sql} is inlined with its own values.
 */
export function sql(strings: TemplateStringsArray, ...parts: Array<Value | Sql>): Sql {
  let text = strings[0];
  const args: Value[] = [];
  parts.forEach((p, i) => {
    if (p !== null && typeof p === "object") {
      text += p.text;
      args.push(...p.args);
    } else {
      text += "?";
      args.push(p);
    }
    text += strings[i + 1];
  });
  return { text, args };
}

/** `parts` joined by `sep`, their values in order. */
export function join(parts: readonly Sql[], sep: string): Sql {
  return { text: parts.map((p) => p.text).join(sep), args: parts.flatMap((p) => p.args) };
}

/** `where a and b …` of `terms`, or nothing when there are none. */
function where(terms: readonly Sql[]): Sql {
  return terms.length ? sql`where ${join(terms, " and ")} ` : raw("");
}

/** `?` placeholders (as {@link sql} writes them) as PostgreSQL's `$1, $2, …`. */
export function numbered(text: string): string {
  let n = 0;
  return text.replace(/\?/g, () => `$${++n}`);
}

/** What the two dialects say differently. */
export interface Dialect {
  /** Now in milliseconds, as SQL (`plusMs` later when given): the clock that leases are measured by. */
  clock(plusMs?: number): Sql;
  /** The end of a claim's candidate select: the row lock it takes, if any. */
  readonly lockRow: string;
}

/** SQLite's dialect: leases measured by this process's clock, read once (`nowMs`) per call. */
export function sqliteDialect(nowMs = Date.now()): Dialect {
  return { clock: (plusMs) => sql`${plusMs === undefined ? nowMs : nowMs + plusMs}`, lockRow: "" };
}

/** The database's clock in milliseconds (leases never trust a host's clock). */
const NOW_MS = "(extract(epoch from clock_timestamp()) * 1000)::bigint";

/** PostgreSQL's dialect: the database's clock; a claim skips rows another host is claiming. */
export const POSTGRES_DIALECT: Dialect = {
  clock: (plusMs) => plusMs === undefined ? raw(NOW_MS) : sql`${raw(NOW_MS)} + ${Math.round(plusMs)}`,
  lockRow: " for update skip locked",
};

/** Fields of a job the runner updates as it goes (the column names of `jobs`). */
export const PATCH_COLUMNS: ReadonlySet<string> = new Set([
  "status",
  "gpu",
  "started_at",
  "finished_at",
  "iteration",
  "error",
  "cancel_requested",
  "resumes",
  "resumed_from",
  "last_checkpoint",
]);

/** `column = value` of each field of `patch` but its metrics (which each engine merges its way). */
export function patchSets(id: string, patch: JobPatch): Sql[] {
  const sets: Sql[] = [];
  for (const [key, value] of Object.entries(patch)) {
    if (key === "metrics") continue;
    if (!PATCH_COLUMNS.has(key)) throw new Error(`Cannot update job "${id}": "${key}" is not a job field`);
    sets.push(sql`${raw(key)} = ${typeof value === "boolean" ? Number(value) : value as Value}`);
  }
  return sets;
}

/**
 * Fair share, as `order by` terms over `jobs`: a waiting job's place among its owner's, plus the
 * jobs its owner has running, so the queue takes users in turn (A1, B1, A2, B2, …) and a user
 * with a job running goes after one with none; at a tie, the user whose last job started longest
 * ago (or never) first. Jobs with no owner keep their FIFO place.
 */
const FAIR_SHARE = raw(
  "case when owner is null then 0 else " +
    "(select count(*) from jobs r where r.owner = jobs.owner and r.status = 'running') + " +
    "(select count(*) from jobs w where w.owner = jobs.owner and w.status in ('interrupted', 'queued') " +
    "and w.seq < jobs.seq) end, " +
    "case when owner is null then '' else " +
    "coalesce((select max(s.started_at) from jobs s where s.owner = jobs.owner), '') end",
);

/**
 * A `where` term leaving out the waiting jobs of the owners in `skip` (at their running quota);
 * a `running` job a dead host held (claimNext) is never left out.
 */
function skipOwners(skip: readonly string[]): Sql {
  if (skip.length === 0) return raw("");
  return sql` and (status = 'running' or owner is null or owner not in (${
    join(skip.map((s) => sql`${s}`), ", ")
  }))`;
}

/** Statuses a host may claim a job in (an expired `running` one was its dead holder's). */
const CLAIMABLE = raw("('queued', 'interrupted', 'running')");

/** Jobs waiting on `gpu` in the order they will run: interrupted before queued, each in fair share. */
function waitingOn(gpu: number, skip: readonly string[], limit: Sql): Sql {
  return sql`select * from jobs where gpu = ${gpu} and status in ('interrupted', 'queued')${skipOwners(skip)}
       order by case status when 'interrupted' then 0 else 1 end, ${FAIR_SHARE}, seq${limit}`;
}

/** `joiner owner = ?` when `owner` is given, else nothing. */
function ownedBy(owner: string | undefined, joiner = " and"): Sql {
  return owner === undefined ? raw("") : sql`${raw(joiner)} owner = ${owner}`;
}

/** The holder of `lease` as a `where` term: its job, host and epoch. */
function held(lease: Lease): Sql {
  return sql`id = ${lease.job_id} and host_id = ${lease.host_id} and lease_epoch = ${lease.epoch}`;
}

const METRIC_COLUMNS = "iteration, split, loss, perplexity, lr, tokens_per_s, at";

/** Now as the store writes times (ISO 8601, this process's clock). */
function now(): string {
  return new Date().toISOString();
}

/**
 * The statements of the job store, by the method of {@link JobStoreEngine} that runs them. Writes
 * whose caller needs to know what they touched say so with `returning`, which both engines read.
 */
export const SQL = {
  createJob(id: string, gpu: number, config: TrainConfig, owner: string | null): Sql {
    const [json, at, metrics, workers] = [
      JSON.stringify(config),
      now(),
      JSON.stringify(emptyMetrics()),
      workersOf(config),
    ];
    return sql`insert into jobs (id, status, gpu, config, created_at, metrics, workers, owner)
       values (${id}, 'queued', ${gpu}, ${json}, ${at}, ${metrics}, ${workers}, ${owner}) returning *`;
  },
  getJob: (id: string): Sql => sql`select * from jobs where id = ${id}`,
  hasJob: (id: string): Sql => sql`select 1 from jobs where id = ${id}`,
  listJobs(opts: JobListOptions): Sql {
    const terms: Sql[] = [];
    if (opts.status) terms.push(sql`status = ${opts.status}`);
    if (opts.owner !== undefined) terms.push(sql`owner = ${opts.owner}`);
    if (opts.after !== undefined) {
      terms.push(sql`seq < coalesce((select seq from jobs where id = ${opts.after}), -1)`);
    }
    return sql`select * from jobs ${where(terms)}order by seq desc limit ${opts.limit ?? 100}`;
  },
  /** In one transaction, in this order; the last says whether the job existed. */
  deleteJob: (id: string): Sql[] => [
    sql`delete from metrics where job_id = ${id}`,
    sql`delete from events where job_id = ${id}`,
    sql`delete from jobs where id = ${id} returning id`,
  ],
  /** `sets` from {@link patchSets} and the engine's metrics merge; with `lease`, only while it holds. */
  updateJob(id: string, sets: Sql[], lease?: Lease): Sql {
    const fence = lease ? sql` and host_id = ${lease.host_id} and lease_epoch = ${lease.epoch}` : raw("");
    const set = sets.length ? join(sets, ", ") : raw("id = id");
    return sql`update jobs set ${set} where id = ${id}${fence} returning *`;
  },
  nextQueued: (gpu: number, skip: readonly string[]): Sql => waitingOn(gpu, skip, raw(" limit 1")),
  queue: (gpu: number): Sql => waitingOn(gpu, [], raw("")),
  queueLength: (gpu: number): Sql =>
    sql`select count(*) as n from jobs where gpu = ${gpu} and status in ('interrupted', 'queued')`,
  waitingCount: (owner?: string): Sql =>
    sql`select count(*) as n from jobs where status in ('interrupted', 'queued')${ownedBy(owner)}`,
  writeError: (): Sql =>
    sql`insert into probe (id, at) values (1, ${now()}) on conflict(id) do update set at = excluded.at`,
  markInterrupted: (): Sql =>
    raw("update jobs set status = 'interrupted' where status = 'running' returning *"),
  requeueBeyond: (gpus: number): Sql =>
    sql`update jobs set gpu = gpu % ${gpus}
       where gpu >= ${gpus} and status in ('queued', 'interrupted', 'running')`,
  countByStatus: (owner?: string): Sql =>
    sql`select status, count(*) as n from jobs${ownedBy(owner, " where")} group by status`,
  /** With `lease`, inserts nothing unless it holds (then no row comes back). */
  addMetric(jobId: string, p: Omit<MetricPoint, "at">, lease?: Lease): Sql {
    const at = now();
    const values =
      sql`${jobId}, ${p.iteration}, ${p.split}, ${p.loss}, ${p.perplexity}, ${p.lr}, ${p.tokens_per_s}, ${at}`;
    const insert = raw(`insert into metrics (job_id, ${METRIC_COLUMNS})`);
    if (!lease) return sql`${insert} values (${values})`;
    return sql`${insert} select ${values}
       where exists (select 1 from jobs where ${held(lease)}) returning job_id`;
  },
  metrics: (jobId: string): Sql =>
    sql`select ${raw(METRIC_COLUMNS)} from metrics where job_id = ${jobId} order by rowid`,
  /** Whether `lease` still holds its job: a row, or none. */
  fence: (lease: Lease): Sql => sql`select 1 from jobs where ${held(lease)}`,
  addEvent(jobId: string, type: JobEventType, data: Record<string, unknown>, at: string): Sql {
    const json = JSON.stringify(data);
    return sql`insert into events (job_id, type, data, at)
       values (${jobId}, ${type}, ${json}, ${at}) returning id`;
  },
  /** A negative `limit` is no limit. */
  eventsAfter(jobId: string, afterId: number, limit: number): Sql {
    const page = limit >= 0 ? sql` limit ${limit}` : raw("");
    return sql`select * from events where job_id = ${jobId} and id > ${afterId} order by id${page}`;
  },
  event: (id: number): Sql => sql`select * from events where id = ${id}`,
  registerHost(host: HostReport, d: Dialect): Sql {
    const [at, info] = [now(), JSON.stringify(host.info ?? {})];
    return sql`insert into hosts (id, gpus, free, state, started_at, seen_ms, info)
       values (${host.id}, ${host.gpus}, ${host.free}, ${host.state}, ${at}, ${d.clock()}, ${info})
       on conflict(id) do update set gpus = excluded.gpus, free = excluded.free, state = excluded.state,
         started_at = excluded.started_at, seen_ms = excluded.seen_ms, info = excluded.info`;
  },
  /** (host_id, id) of the jobs under a lease live at `nowMs`, for {@link read}.host. */
  heldLeases: (nowMs: number): Sql =>
    sql`select host_id, id from jobs where host_id is not null and lease_until >= ${nowMs} order by seq`,
  hosts: (): Sql => raw("select * from hosts order by seen_ms desc, id"),
  releaseHost: (hostId: string): Sql =>
    sql`update jobs set lease_until = null,
         status = case status when 'running' then 'interrupted' else status end
       where host_id = ${hostId} and lease_until is not null and status in ${CLAIMABLE} returning *`,
  /** The first waiting job that fits `capacity` Workers and no live lease holds, claimed; the row after. */
  claimNext(
    hostId: string,
    capacity: number,
    leaseMs: number,
    takeover: boolean,
    skip: readonly string[],
    d: Dialect,
  ): Sql {
    const [until, now, anyStatus, lock] = [d.clock(leaseMs), d.clock(), takeover ? 1 : 0, raw(d.lockRow)];
    return sql`update jobs set host_id = ${hostId}, lease_epoch = lease_epoch + 1, lease_until = ${until}
       where seq = (
         select seq from jobs where status in ${CLAIMABLE} and workers <= ${capacity}
           and (lease_until is null or lease_until < ${now}) and (${anyStatus} = 1 or status <> 'running')${
      skipOwners(skip)
    }
         order by case status when 'queued' then 1 else 0 end, ${FAIR_SHARE}, seq
         limit 1${lock})
       returning *`;
  },
  /** A heartbeat's refresh of its host's row: no row back when the host is not registered. */
  seenHost(host: HostReport, d: Dialect): Sql {
    const info = JSON.stringify(host.info ?? {});
    return sql`update hosts set gpus = ${host.gpus}, free = ${host.free}, state = ${host.state},
         seen_ms = ${d.clock()}, info = ${info} where id = ${host.id} returning id`;
  },
  /** Renews `lease` for `leaseMs` while it holds (a row with the job's cancel flag), else no row. */
  renew: (lease: Lease, leaseMs: number, d: Dialect): Sql =>
    sql`update jobs set lease_until = ${d.clock(leaseMs)} where ${held(lease)} returning cancel_requested`,
  release: (lease: Lease): Sql => sql`update jobs set lease_until = null where ${held(lease)}`,
  confirmLease: (lease: Lease, leaseMs: number, d: Dialect): Sql =>
    sql`update jobs set lease_until = ${d.clock(leaseMs)}
       where ${held(lease)} and lease_until is not null returning id`,
  putUser: (name: string): Sql =>
    sql`insert into users (name, created_at, quotas) values (${name}, ${now()}, '{}')
       on conflict(name) do nothing`,
  user: (name: string): Sql => sql`select * from users where name = ${name}`,
  users: (): Sql => raw("select * from users order by name"),
  setQuotas: (name: string, quotas: Record<string, number>): Sql =>
    sql`update users set quotas = ${JSON.stringify(quotas)} where name = ${name} returning name`,
  createToken(t: TokenRecord): Sql {
    const scopes = JSON.stringify(t.scopes);
    return sql`insert into tokens
         (id, hash, name, user_name, scopes, created_at, expires_at, last_used_at, revoked_at)
       values (${t.id}, ${t.hash}, ${t.name}, ${t.user}, ${scopes}, ${t.created_at}, ${t.expires_at},
         ${t.last_used_at}, ${t.revoked_at})`;
  },
  tokens: (): Sql => raw("select * from tokens order by created_at, id"),
  revokeToken: (id: string, at: string): Sql =>
    sql`update tokens set revoked_at = ${at} where id = ${id} and revoked_at is null returning id`,
  touchToken: (u: { id: string; at: string }): Sql =>
    sql`update tokens set last_used_at = ${u.at} where id = ${u.id}`,
  addResource: (kind: string, id: string, owner: string): Sql =>
    sql`insert into resources (kind, id, owner, created_at) values (${kind}, ${id}, ${owner}, ${now()})
       on conflict do nothing`,
  resourceOwners: (kind: string, id: string): Sql =>
    sql`select owner from resources where kind = ${kind} and id = ${id} order by owner`,
  removeResource: (kind: string, id: string): Sql =>
    sql`delete from resources where kind = ${kind} and id = ${id}`,
  addAudit(e: Omit<AuditEvent, "id" | "at">, at: string): Sql {
    const detail = JSON.stringify(e.detail);
    return sql`insert into audit (at, user_name, action, target, detail)
       values (${at}, ${e.user}, ${e.action}, ${e.target}, ${detail}) returning id`;
  },
  audit(opts: { before?: number; limit?: number; user?: string }): Sql {
    const terms: Sql[] = [];
    if (opts.before !== undefined) terms.push(sql`id < ${opts.before}`);
    if (opts.user !== undefined) terms.push(sql`user_name = ${opts.user}`);
    return sql`select * from audit ${where(terms)}order by id desc limit ${opts.limit ?? 100}`;
  },
  /** `owner`'s jobs that ran after `since`, for {@link read}.gpuSeconds. */
  gpuSeconds: (owner: string, since: string): Sql =>
    sql`select status, started_at, finished_at, workers from jobs
       where owner = ${owner} and started_at is not null
         and (finished_at is null or finished_at >= ${since})`,
};

/**
 * The row readers, by what they read: a row of the statements above as the store's records (the
 * Number()s because PostgreSQL gives bigints as strings).
 */
export const read = {
  /** A `jobs` row as a Job. */
  job(r: Row): Job {
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
      ...(r.owner ? { owner: r.owner as string } : {}),
    };
  },

  /** The row of {@link SQL}.claimNext (none: nothing to claim) as `hostId`'s claim. */
  claim(row: Row | undefined, hostId: string): Claim | null {
    if (!row) return null;
    return {
      job: read.job(row),
      lease: { job_id: row.id as string, host_id: hostId, epoch: Number(row.lease_epoch) },
    };
  },

  /** What a heartbeat found: `renewed[i]` is {@link SQL}.renew's row for `leases[i]`, none when it was lost. */
  heartbeat(
    leases: readonly Lease[],
    renewed: ReadonlyArray<Row | undefined>,
  ): HeartbeatResult {
    const out: HeartbeatResult = { kept: [], lost: [] };
    leases.forEach((l, i) => {
      const r = renewed[i];
      if (r) out.kept.push({ job_id: l.job_id, cancel_requested: Number(r.cancel_requested) !== 0 });
      else out.lost.push(l.job_id);
    });
    return out;
  },

  /** Rows of `update … returning *` (which come in no set order) as jobs in submission order. */
  jobsBySeq(rows: Row[]): Job[] {
    return rows.sort((a, b) => Number(a.seq) - Number(b.seq)).map(read.job);
  },

  /** Rows of {@link SQL}.countByStatus as a count for every status. */
  counts(rows: Row[]): Record<JobStatus, number> {
    const out: Record<JobStatus, number> = {
      queued: 0,
      running: 0,
      succeeded: 0,
      failed: 0,
      cancelled: 0,
      interrupted: 0,
    };
    for (const r of rows) out[r.status as JobStatus] = Number(r.n);
    return out;
  },

  /** A `metrics` row of {@link SQL}.metrics as a MetricPoint. */
  metric(r: Row): MetricPoint {
    return { ...r } as unknown as MetricPoint;
  },

  /** An `events` row as a JobEvent. */
  event(r: Row): JobEvent {
    return {
      id: Number(r.id),
      job_id: r.job_id as string,
      type: r.type as JobEventType,
      data: JSON.parse(r.data as string),
      at: r.at as string,
    };
  },

  /** A `hosts` row as a HostRecord; `held` are the rows of {@link SQL}.heldLeases at `nowMs`. */
  host(r: Row, nowMs: number, held: Row[]): HostRecord {
    return {
      id: r.id as string,
      gpus: Number(r.gpus),
      free: Number(r.free),
      state: r.state as string,
      info: JSON.parse(r.info as string),
      started_at: r.started_at as string,
      lease_age_s: Math.max(0, (nowMs - Number(r.seen_ms)) / 1000),
      jobs: held.filter((h) => h.host_id === r.id).map((h) => h.id as string),
    };
  },

  /** A `tokens` row as a TokenRecord. */
  token(r: Row): TokenRecord {
    return {
      id: r.id as string,
      hash: r.hash as string,
      name: r.name as string,
      user: r.user_name as string,
      scopes: JSON.parse(r.scopes as string),
      created_at: r.created_at as string,
      expires_at: (r.expires_at as string | null) ?? null,
      last_used_at: (r.last_used_at as string | null) ?? null,
      revoked_at: (r.revoked_at as string | null) ?? null,
    };
  },

  /** A `users` row as a UserRecord. */
  user(r: Row): UserRecord {
    return {
      name: r.name as string,
      created_at: r.created_at as string,
      quotas: JSON.parse(r.quotas as string),
    };
  },

  /** An `audit` row as an AuditEvent. */
  audit(r: Row): AuditEvent {
    return {
      id: Number(r.id),
      at: r.at as string,
      user: (r.user_name as string | null) ?? null,
      action: r.action as string,
      target: (r.target as string | null) ?? null,
      detail: JSON.parse(r.detail as string),
    };
  },

  /** GPU-seconds of {@link SQL}.gpuSeconds's rows after `since`, up to `nowMs` for those still running. */
  gpuSeconds(rows: Row[], since: string, nowMs = Date.now()): number {
    const from = Date.parse(since);
    let total = 0;
    for (const r of rows) {
      const start = Math.max(from, Date.parse(r.started_at as string));
      // A job waiting again (interrupted) since its start is not counted past it: when it stopped is not kept.
      if (!r.finished_at && r.status !== "running") continue;
      const end = r.finished_at ? Date.parse(r.finished_at as string) : nowMs;
      if (end > start) total += (end - start) / 1000 * Number(r.workers);
    }
    return total;
  },
};
