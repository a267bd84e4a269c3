/**
 * The job store's SQLite engine (`node:sqlite`), the embedded default for one host: jobs, their
 * metrics history and their event log in `$GPT2_HOME/jobs.sqlite`, so a server restart finds
 * every job, replays missed events to clients (`Last-Event-ID`), and knows which jobs were
 * running when it died. Queues are ordered views of the jobs table: a job waits on one GPU's
 * queue (`gpu` column) in submission order. Synchronous: every method answers at once.
 *
 * The schema is versioned with `PRAGMA user_version`: the migrations of
 * server/jobs/store_schema.ts run in order, each in a transaction, from the version a data
 * directory has to the newest; a database newer than this server is refused rather than misread.
 * The lease methods work here too (the same claims and fences as PostgreSQL, with this process's
 * clock), which is how the store tests run one suite on both engines.
 */

import { DatabaseSync } from "node:sqlite";
import {
  emptyMetrics,
  type Job,
  type JobEvent,
  type JobEventType,
  type JobStatus,
  type MetricPoint,
  type TrainConfig,
} from "../../model/job.ts";
import type {
  AuditEvent,
  Claim,
  HeartbeatResult,
  HostRecord,
  HostReport,
  JobListOptions,
  JobPatch,
  JobStoreEngine,
  Lease,
  TokenRecord,
  UserRecord,
} from "./job_store.ts";
import {
  CLAIMABLE,
  FAIR_SHARE,
  GPU_SECONDS_SQL,
  gpuSecondsOf,
  LeaseLostError,
  MIGRATIONS,
  PATCH_COLUMNS,
  SCHEMA_VERSION,
  skipOwners,
  toAudit,
  toJob,
  toToken,
  toUser,
  workersOf,
} from "./store_schema.ts";

type Row = Record<string, unknown>;
type Value = string | number | null;

/** SQLite-backed jobs, metrics and events. One instance per data directory. */
export class SqliteJobStore implements JobStoreEngine {
  readonly engine = "sqlite" as const;
  #db: DatabaseSync;
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

  /** Closes the database. */
  close(): void {
    this.#db.close();
  }

  /** Inserts a queued job on `gpu`'s queue, owned by `owner`. */
  createJob(id: string, gpu: number, config: TrainConfig, owner: string | null = null): Job {
    this.#db.prepare(
      "insert into jobs (id, status, gpu, config, created_at, metrics, workers, owner) values (?, 'queued', ?, ?, ?, ?, ?, ?)",
    ).run(
      id,
      gpu,
      JSON.stringify(config),
      new Date().toISOString(),
      JSON.stringify(emptyMetrics()),
      workersOf(config),
      owner,
    );
    return this.getJob(id)!;
  }

  /** A job, or null. */
  getJob(id: string): Job | null {
    const row = this.#db.prepare("select * from jobs where id = ?").get(id) as Row | undefined;
    return row ? toJob(row) : null;
  }

  /**
   * Jobs newest first, `limit` of them (default 100), only those older than job `after` when
   * given (a page after the last one seen; an unknown `after` gives an empty page).
   */
  listJobs(opts: JobListOptions = {}): Job[] {
    const limit = opts.limit ?? 100;
    const where: string[] = [];
    const args: Array<string | number> = [];
    if (opts.status) {
      where.push("status = ?");
      args.push(opts.status);
    }
    if (opts.owner !== undefined) {
      where.push("owner = ?");
      args.push(opts.owner);
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
    return this.#transaction(() => {
      this.#db.prepare("delete from metrics where job_id = ?").run(id);
      this.#db.prepare("delete from events where job_id = ?").run(id);
      const r = this.#db.prepare("delete from jobs where id = ?").run(id);
      return Number(r.changes) > 0;
    });
  }

  /**
   * Applies `patch`; metrics are merged into the stored ones. With `lease`, only while that
   * lease still holds the job (else LeaseLostError). Returns the updated job.
   */
  updateJob(id: string, patch: JobPatch, lease?: Lease): Job {
    const job = this.getJob(id);
    if (!job) throw new Error(`Cannot update job "${id}": no such job`);
    const sets: string[] = [];
    const values: Value[] = [];
    for (const [key, value] of Object.entries(patch)) {
      if (key === "metrics") continue;
      if (!PATCH_COLUMNS.has(key)) throw new Error(`Cannot update job "${id}": "${key}" is not a job field`);
      sets.push(`${key} = ?`);
      values.push(typeof value === "boolean" ? Number(value) : value as Value);
    }
    if (patch.metrics) {
      sets.push("metrics = ?");
      values.push(JSON.stringify({ ...job.metrics, ...patch.metrics }));
    }
    if (sets.length === 0 && !lease) return job;
    if (sets.length === 0) sets.push("id = id");
    const fence = lease ? " and host_id = ? and lease_epoch = ?" : "";
    const r = this.#db.prepare(`update jobs set ${sets.join(", ")} where id = ?${fence}`).run(
      ...values,
      id,
      ...(lease ? [lease.host_id, lease.epoch] : []),
    );
    if (lease && Number(r.changes) === 0) throw new LeaseLostError(lease);
    return this.getJob(id)!;
  }

  /** The next job waiting on `gpu`: interrupted before queued, each in fair-share order, none of `skip`'s. */
  nextQueued(gpu: number, skip: string[] = []): Job | null {
    const row = this.#db.prepare(
      `select * from jobs where gpu = ? and status in ('interrupted', 'queued')${skipOwners(skip.length)}
       order by case status when 'interrupted' then 0 else 1 end, ${FAIR_SHARE}, seq limit 1`,
    ).get(gpu, ...skip) as Row | undefined;
    return row ? toJob(row) : null;
  }

  /** Jobs waiting on `gpu`, in the order they will run (their owners' running quotas aside). */
  queue(gpu: number): Job[] {
    const rows = this.#db.prepare(
      `select * from jobs where gpu = ? and status in ('interrupted', 'queued')
       order by case status when 'interrupted' then 0 else 1 end, ${FAIR_SHARE}, seq`,
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

  /** Number of jobs waiting on any GPU (only `owner`'s when given). */
  waitingCount(owner?: string): number {
    const mine = owner === undefined ? "" : " and owner = ?";
    const r = this.#db.prepare(
      `select count(*) as n from jobs where status in ('interrupted', 'queued')${mine}`,
    )
      .get(...(owner === undefined ? [] : [owner])) as Row;
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

  /** Job counts per status (only `owner`'s when given). */
  countByStatus(owner?: string): Record<JobStatus, number> {
    const out: Record<JobStatus, number> = {
      queued: 0,
      running: 0,
      succeeded: 0,
      failed: 0,
      cancelled: 0,
      interrupted: 0,
    };
    const mine = owner === undefined ? "" : " where owner = ?";
    const rows = this.#db.prepare(`select status, count(*) as n from jobs${mine} group by status`)
      .all(...(owner === undefined ? [] : [owner])) as Row[];
    for (const r of rows) {
      out[r.status as JobStatus] = Number(r.n);
    }
    return out;
  }

  /** Appends a point to a job's metrics history; with `lease`, only while it holds. */
  addMetric(jobId: string, p: Omit<MetricPoint, "at">, lease?: Lease): void {
    this.#transaction(() => {
      if (lease) this.#fence(lease);
      this.#db.prepare(
        "insert into metrics (job_id, iteration, split, loss, perplexity, lr, tokens_per_s, at) values (?, ?, ?, ?, ?, ?, ?, ?)",
      ).run(
        jobId,
        p.iteration,
        p.split,
        p.loss,
        p.perplexity,
        p.lr,
        p.tokens_per_s,
        new Date().toISOString(),
      );
    });
  }

  /** A job's metrics history in the order recorded. */
  metrics(jobId: string): MetricPoint[] {
    const rows = this.#db.prepare(
      "select iteration, split, loss, perplexity, lr, tokens_per_s, at from metrics where job_id = ? order by rowid",
    ).all(jobId) as Row[];
    return rows.map((r) => ({ ...r }) as unknown as MetricPoint);
  }

  /** Appends an event and returns it with its id; with `lease`, only while it holds. */
  addEvent(jobId: string, type: JobEventType, data: Record<string, unknown>, lease?: Lease): JobEvent {
    const at = new Date().toISOString();
    const id = this.#transaction(() => {
      if (lease) this.#fence(lease);
      return this.#db.prepare("insert into events (job_id, type, data, at) values (?, ?, ?, ?)").run(
        jobId,
        type,
        JSON.stringify(data),
        at,
      ).lastInsertRowid;
    });
    const event: JobEvent = { id: Number(id), job_id: jobId, type, data, at };
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
    return rows.map(toEvent);
  }

  /** Records (or refreshes) a host. */
  registerHost(host: HostReport): void {
    this.#db.prepare(
      `insert into hosts (id, gpus, free, state, started_at, seen_ms, info) values (?, ?, ?, ?, ?, ?, ?)
       on conflict(id) do update set gpus = excluded.gpus, free = excluded.free, state = excluded.state,
         started_at = excluded.started_at, seen_ms = excluded.seen_ms, info = excluded.info`,
    ).run(
      host.id,
      host.gpus,
      host.free,
      host.state,
      new Date().toISOString(),
      Date.now(),
      JSON.stringify(host.info ?? {}),
    );
  }

  /** Every host that registered, newest heartbeat first, with the jobs it holds a live lease on. */
  hosts(): HostRecord[] {
    const now = Date.now();
    const held = this.#db.prepare(
      "select host_id, id from jobs where host_id is not null and lease_until >= ? order by seq",
    ).all(now) as Row[];
    return (this.#db.prepare("select * from hosts order by seen_ms desc, id").all() as Row[]).map((r) =>
      toHost(r, now, held)
    );
  }

  /** Lets go of every job `hostId` held (a running one becomes interrupted); returns them. */
  releaseHost(hostId: string): Job[] {
    return this.#transaction(() => {
      const rows = this.#db.prepare(
        `select id from jobs where host_id = ? and lease_until is not null and status in ${CLAIMABLE} order by seq`,
      ).all(hostId) as Row[];
      this.#db.prepare(
        `update jobs set lease_until = null,
           status = case status when 'running' then 'interrupted' else status end
         where host_id = ? and lease_until is not null and status in ${CLAIMABLE}`,
      ).run(hostId);
      return rows.map((r) => this.getJob(r.id as string)!);
    });
  }

  /** Claims the first waiting job that fits `capacity` Workers and no live lease holds. */
  claimNext(
    hostId: string,
    capacity: number,
    leaseMs: number,
    takeover = true,
    skip: string[] = [],
  ): Claim | null {
    return this.#transaction(() => {
      const now = Date.now();
      const row = this.#db.prepare(
        `select * from jobs where status in ${CLAIMABLE} and workers <= ?
           and (lease_until is null or lease_until < ?) and (? = 1 or status <> 'running')${
          skipOwners(skip.length)
        }
         order by case status when 'queued' then 1 else 0 end, ${FAIR_SHARE}, seq limit 1`,
      ).get(capacity, now, takeover ? 1 : 0, ...skip) as Row | undefined;
      if (!row) return null;
      const epoch = Number(row.lease_epoch) + 1;
      this.#db.prepare("update jobs set host_id = ?, lease_epoch = ?, lease_until = ? where id = ?")
        .run(hostId, epoch, now + leaseMs, row.id as string);
      return { job: toJob(row), lease: { job_id: row.id as string, host_id: hostId, epoch } };
    });
  }

  /** Renews `leases` and the host's row; says which leases are kept and which were taken. */
  heartbeat(host: HostReport, leases: Lease[], leaseMs: number): HeartbeatResult {
    return this.#transaction(() => {
      const now = Date.now();
      const seen = this.#db.prepare(
        "update hosts set gpus = ?, free = ?, state = ?, seen_ms = ?, info = ? where id = ?",
      ).run(host.gpus, host.free, host.state, now, JSON.stringify(host.info ?? {}), host.id);
      if (Number(seen.changes) === 0) this.registerHost(host);
      const out: HeartbeatResult = { kept: [], lost: [] };
      const renew = this.#db.prepare(
        "update jobs set lease_until = ? where id = ? and host_id = ? and lease_epoch = ? returning cancel_requested",
      );
      for (const l of leases) {
        const r = renew.get(now + leaseMs, l.job_id, l.host_id, l.epoch) as Row | undefined;
        if (r) out.kept.push({ job_id: l.job_id, cancel_requested: Number(r.cancel_requested) !== 0 });
        else out.lost.push(l.job_id);
      }
      return out;
    });
  }

  /** Ends a lease early: another host may claim the job now. */
  release(lease: Lease): void {
    this.#db.prepare("update jobs set lease_until = null where id = ? and host_id = ? and lease_epoch = ?")
      .run(lease.job_id, lease.host_id, lease.epoch);
  }

  /** Whether `lease` holds its job now (epoch ours, not expired); renewed for `leaseMs` when it does. */
  /** See JobStoreEngine.confirmLease: epoch and host still the job's, not given back; renewed. */
  confirmLease(lease: Lease, leaseMs: number): boolean {
    const r = this.#db.prepare(
      `update jobs set lease_until = ? where id = ? and host_id = ? and lease_epoch = ? and lease_until is not null
       returning id`,
    ).get(Date.now() + leaseMs, lease.job_id, lease.host_id, lease.epoch);
    return r !== undefined;
  }

  /** The user `name`, made now if new. */
  putUser(name: string): UserRecord {
    this.#db.prepare(
      "insert into users (name, created_at, quotas) values (?, ?, '{}') on conflict(name) do nothing",
    )
      .run(name, new Date().toISOString());
    return toUser(this.#db.prepare("select * from users where name = ?").get(name) as Row);
  }

  /** Every user, by name. */
  users(): UserRecord[] {
    return (this.#db.prepare("select * from users order by name").all() as Row[]).map(toUser);
  }

  /** Replaces user `name`'s own quotas. */
  setQuotas(name: string, quotas: Record<string, number>): boolean {
    const r = this.#db.prepare("update users set quotas = ? where name = ?").run(
      JSON.stringify(quotas),
      name,
    );
    return Number(r.changes) > 0;
  }

  /** Stores a new token (its hash). */
  createToken(t: TokenRecord): void {
    this.#db.prepare(
      `insert into tokens (id, hash, name, user_name, scopes, created_at, expires_at, last_used_at, revoked_at)
       values (?, ?, ?, ?, ?, ?, ?, ?, ?)`,
    ).run(
      t.id,
      t.hash,
      t.name,
      t.user,
      JSON.stringify(t.scopes),
      t.created_at,
      t.expires_at,
      t.last_used_at,
      t.revoked_at,
    );
  }

  /** Every token, oldest first. */
  tokens(): TokenRecord[] {
    return (this.#db.prepare("select * from tokens order by created_at, id").all() as Row[]).map(toToken);
  }

  /** Revokes token `id`; false when there is none or it was revoked already. */
  revokeToken(id: string, at: string): boolean {
    const r = this.#db.prepare("update tokens set revoked_at = ? where id = ? and revoked_at is null").run(
      at,
      id,
    );
    return Number(r.changes) > 0;
  }

  /** Records when tokens were last used. */
  touchTokens(uses: Array<{ id: string; at: string }>): void {
    if (uses.length === 0) return;
    this.#transaction(() => {
      const set = this.#db.prepare("update tokens set last_used_at = ? where id = ?");
      for (const u of uses) set.run(u.at, u.id);
    });
  }

  /** Records that `owner` owns resource `kind`/`id`. */
  addResource(kind: string, id: string, owner: string): void {
    this.#db.prepare(
      "insert into resources (kind, id, owner, created_at) values (?, ?, ?, ?) on conflict do nothing",
    ).run(kind, id, owner, new Date().toISOString());
  }

  /** Who owns resource `kind`/`id`. */
  resourceOwners(kind: string, id: string): string[] {
    return (this.#db.prepare("select owner from resources where kind = ? and id = ? order by owner").all(
      kind,
      id,
    ) as Row[])
      .map((r) => r.owner as string);
  }

  /** Forgets every owner of resource `kind`/`id`. */
  removeResource(kind: string, id: string): void {
    this.#db.prepare("delete from resources where kind = ? and id = ?").run(kind, id);
  }

  /** Appends an audit event. */
  addAudit(e: Omit<AuditEvent, "id" | "at">): AuditEvent {
    const at = new Date().toISOString();
    const r = this.#db.prepare(
      "insert into audit (at, user_name, action, target, detail) values (?, ?, ?, ?, ?)",
    )
      .run(at, e.user, e.action, e.target, JSON.stringify(e.detail));
    return { id: Number(r.lastInsertRowid), at, ...e };
  }

  /** Audit events newest first. */
  audit(opts: { before?: number; limit?: number; user?: string } = {}): AuditEvent[] {
    const where: string[] = [], args: Value[] = [];
    if (opts.before !== undefined) {
      where.push("id < ?");
      args.push(opts.before);
    }
    if (opts.user !== undefined) {
      where.push("user_name = ?");
      args.push(opts.user);
    }
    const sql = `select * from audit ${
      where.length ? `where ${where.join(" and ")}` : ""
    } order by id desc limit ?`;
    return (this.#db.prepare(sql).all(...args, opts.limit ?? 100) as Row[]).map(toAudit);
  }

  /** GPU-seconds `owner`'s jobs used since `since`. */
  gpuSeconds(owner: string, since: string): number {
    return gpuSecondsOf(this.#db.prepare(GPU_SECONDS_SQL).all(owner, since) as Row[], since);
  }

  /** Throws LeaseLostError unless `lease` still holds its job (inside a transaction). */
  #fence(lease: Lease): void {
    const ok = this.#db.prepare("select 1 from jobs where id = ? and host_id = ? and lease_epoch = ?")
      .get(lease.job_id, lease.host_id, lease.epoch);
    if (!ok) throw new LeaseLostError(lease);
  }

  #transaction<T>(fn: () => T): T {
    if (this.#db.isTransaction) return fn();
    this.#db.exec("begin immediate");
    try {
      const out = fn();
      this.#db.exec("commit");
      return out;
    } catch (e) {
      this.#db.exec("rollback");
      throw e;
    }
  }
}

function toEvent(r: Row): JobEvent {
  return {
    id: Number(r.id),
    job_id: r.job_id as string,
    type: r.type as JobEventType,
    data: JSON.parse(r.data as string),
    at: r.at as string,
  };
}

/** A `hosts` row as a HostRecord; `held` are (host_id, id) rows of live leases. */
export function toHost(r: Row, nowMs: number, held: Row[]): HostRecord {
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
}

export { toEvent as eventFromRow };

function userVersion(db: DatabaseSync): number {
  return Number((db.prepare("pragma user_version").get() as Row).user_version);
}

/** Runs the migrations `path`'s database lacks; refuses one newer than SCHEMA_VERSION. */
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
