/**
 * The job store's PostgreSQL engine (`GPT2_DATABASE_URL=postgres://…`), for several hosts that
 * share one queue: jobs, metrics history, events and the hosts table live in one database, so
 * any host answers for any job and a client following a job's events through any host sees them
 * all (with `Last-Event-ID` working across hosts: event ids come from one sequence).
 *
 * Driver: `postgres` (porsager's postgres.js) — no dependencies, pooled, LISTEN/NOTIFY built in.
 * The queue is written here rather than taken from pg-boss or graphile-worker: a job runs for
 * hours under a lease its host renews and every write of its holder is fenced on the lease's
 * epoch, a host claims only jobs whose Worker count it can place, and the job row is also the
 * API's record (metrics, cancel flag); neither library models renewable, fenced, placed leases.
 *
 * The same migrations as SQLite (server/jobs/store_schema.ts, translated by postgresDialect), the
 * version kept in a one-row table and applied under an advisory lock, so hosts starting together
 * migrate once. Times that decide leases come from the database's clock, never a host's. Event
 * inserts hold a per-job advisory lock until commit, so a job's event ids are committed in
 * order and a reader paging by id (`Last-Event-ID`) cannot skip one that commits late. Each
 * event is announced with NOTIFY; every host's listeners get every host's events.
 */

import postgres from "postgres";
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
import { eventFromRow, toHost } from "./sqlite_store.ts";
import {
  CLAIMABLE,
  FAIR_SHARE,
  GPU_SECONDS_SQL,
  gpuSecondsOf,
  LeaseLostError,
  MIGRATIONS,
  PATCH_COLUMNS,
  postgresDialect,
  SCHEMA_VERSION,
  skipOwners,
  toAudit,
  toJob,
  toToken,
  toUser,
  workersOf,
} from "./store_schema.ts";

type Row = Record<string, unknown>;
type Value = string | number | boolean | null;
// deno-lint-ignore no-explicit-any
type Sql = postgres.Sql<any> | postgres.TransactionSql<any>;

/** The database's clock in milliseconds (leases never trust a host's clock). */
const NOW_MS = "(extract(epoch from clock_timestamp()) * 1000)::bigint";
/** The NOTIFY channel of new events. */
const CHANNEL = "gpt2_events";
/** Advisory lock key under which migrations run (any constant; "gpt2" in ASCII). */
const MIGRATION_LOCK = 0x67707432;
/** NOTIFY payloads are limited to 8000 bytes: a larger event is announced by id and read back. */
const MAX_PAYLOAD = 7000;

/** `?` placeholders (the SQLite engine's) as PostgreSQL's `$1, $2, …`. */
function numbered(sql: string): string {
  let n = 0;
  return sql.replace(/\?/g, () => `$${++n}`);
}

async function q(sql: Sql, text: string, args: Value[] = []): Promise<Row[]> {
  // deno-lint-ignore no-explicit-any
  return [...await sql.unsafe(numbered(text), args as any[])] as Row[];
}

/** Jobs, metrics, events and hosts in PostgreSQL. Open with {@link PostgresJobStore.open}. */
export class PostgresJobStore implements JobStoreEngine {
  readonly engine = "postgres" as const;
  // deno-lint-ignore no-explicit-any
  #sql: postgres.Sql<any>;
  #version: number;
  #listeners = new Set<(e: JobEvent) => void>();
  #unlisten: (() => Promise<void>) | null = null;

  // deno-lint-ignore no-explicit-any
  private constructor(sql: postgres.Sql<any>, version: number) {
    this.#sql = sql;
    this.#version = version;
  }

  /**
   * Connects to `url`, runs the migrations the database lacks (refusing one newer than this
   * server) and starts listening for events. The error names the database without its password.
   */
  static async open(url: string, opts: { max?: number } = {}): Promise<PostgresJobStore> {
    const where = redact(url);
    const sql = postgres(url, { max: opts.max ?? 8, onnotice: () => {}, connect_timeout: 5 });
    try {
      const version = await migrate(sql, where);
      const store = new PostgresJobStore(sql, version);
      const listener = await sql.listen(CHANNEL, (payload) => store.#announced(payload));
      store.#unlisten = listener.unlisten;
      return store;
    } catch (e) {
      await sql.end({ timeout: 1 }).catch(() => {});
      const msg = (e as Error).message;
      throw new Error(msg.startsWith("Cannot ") ? msg : `Cannot open job store "${where}": ${msg}`);
    }
  }

  /** The schema version of the open database. */
  get schemaVersion(): number {
    return this.#version;
  }

  /** Stops listening and closes the pool (queries still running get 5 s). */
  async close(): Promise<void> {
    await this.#unlisten?.().catch(() => {});
    await this.#sql.end({ timeout: 5 });
  }

  /** Inserts a queued job on `gpu`'s queue, owned by `owner`. */
  async createJob(id: string, gpu: number, config: TrainConfig, owner: string | null = null): Promise<Job> {
    const [row] = await q(
      this.#sql,
      `insert into jobs (id, status, gpu, config, created_at, metrics, workers, owner)
       values (?, 'queued', ?, ?, ?, ?, ?, ?) returning *`,
      [
        id,
        gpu,
        JSON.stringify(config),
        new Date().toISOString(),
        JSON.stringify(emptyMetrics()),
        workersOf(config),
        owner,
      ],
    );
    return toJob(row);
  }

  /** A job, or null. */
  async getJob(id: string): Promise<Job | null> {
    const [row] = await q(this.#sql, "select * from jobs where id = ?", [id]);
    return row ? toJob(row) : null;
  }

  /** Jobs newest first, `limit` (100) of them, only those older than job `after` when given. */
  async listJobs(opts: JobListOptions = {}): Promise<Job[]> {
    const where: string[] = [];
    const args: Value[] = [];
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
    return (await q(this.#sql, sql, [...args, opts.limit ?? 100])).map(toJob);
  }

  /** Whether a job with this id exists. */
  async hasJob(id: string): Promise<boolean> {
    return (await q(this.#sql, "select 1 from jobs where id = ?", [id])).length > 0;
  }

  /** Deletes a job with its metrics history and events. Returns whether it existed. */
  async deleteJob(id: string): Promise<boolean> {
    return await this.#sql.begin(async (tx) => {
      await q(tx, "delete from metrics where job_id = ?", [id]);
      await q(tx, "delete from events where job_id = ?", [id]);
      return (await q(tx, "delete from jobs where id = ? returning id", [id])).length > 0;
    }) as boolean;
  }

  /**
   * Applies `patch`; metrics are merged in the database (jsonb `||`), so two hosts' patches do
   * not overwrite each other. With `lease`, only while it holds (else LeaseLostError).
   */
  async updateJob(id: string, patch: JobPatch, lease?: Lease): Promise<Job> {
    const sets: string[] = [];
    const values: Value[] = [];
    for (const [key, value] of Object.entries(patch)) {
      if (key === "metrics") continue;
      if (!PATCH_COLUMNS.has(key)) throw new Error(`Cannot update job "${id}": "${key}" is not a job field`);
      sets.push(`${key} = ?`);
      values.push(typeof value === "boolean" ? Number(value) : value as Value);
    }
    if (patch.metrics) {
      sets.push("metrics = (metrics::jsonb || ?::text::jsonb)::text");
      values.push(JSON.stringify(patch.metrics));
    }
    if (sets.length === 0) sets.push("id = id");
    const fence = lease ? " and host_id = ? and lease_epoch = ?" : "";
    const [row] = await q(
      this.#sql,
      `update jobs set ${sets.join(", ")} where id = ?${fence} returning *`,
      [...values, id, ...(lease ? [lease.host_id, lease.epoch] : [])],
    );
    if (row) return toJob(row);
    if (lease && await this.hasJob(id)) throw new LeaseLostError(lease);
    throw new Error(`Cannot update job "${id}": no such job`);
  }

  /** The next job waiting on `gpu`: interrupted before queued, each in fair-share order, none of `skip`'s. */
  async nextQueued(gpu: number, skip: string[] = []): Promise<Job | null> {
    const [row] = await q(
      this.#sql,
      `select * from jobs where gpu = ? and status in ('interrupted', 'queued')${skipOwners(skip.length)}
       order by case status when 'interrupted' then 0 else 1 end, ${FAIR_SHARE}, seq limit 1`,
      [gpu, ...skip],
    );
    return row ? toJob(row) : null;
  }

  /** Jobs waiting on `gpu`, in the order they will run (their owners' running quotas aside). */
  async queue(gpu: number): Promise<Job[]> {
    return (await q(
      this.#sql,
      `select * from jobs where gpu = ? and status in ('interrupted', 'queued')
       order by case status when 'interrupted' then 0 else 1 end, ${FAIR_SHARE}, seq`,
      [gpu],
    )).map(toJob);
  }

  /** Number of jobs waiting on `gpu`. */
  async queueLength(gpu: number): Promise<number> {
    const [r] = await q(
      this.#sql,
      "select count(*) as n from jobs where gpu = ? and status in ('interrupted', 'queued')",
      [gpu],
    );
    return Number(r.n);
  }

  /** Number of jobs waiting, on every host (only `owner`'s when given). */
  async waitingCount(owner?: string): Promise<number> {
    const [r] = await q(
      this.#sql,
      `select count(*) as n from jobs where status in ('interrupted', 'queued')${
        owner === undefined ? "" : " and owner = ?"
      }`,
      owner === undefined ? [] : [owner],
    );
    return Number(r.n);
  }

  /** Whether the database accepts a write now (the readiness probe): null, or why not. */
  async writeError(): Promise<string | null> {
    try {
      await q(
        this.#sql,
        "insert into probe (id, at) values (1, ?) on conflict(id) do update set at = excluded.at",
        [new Date().toISOString()],
      );
      return null;
    } catch (e) {
      return (e as Error).message;
    }
  }

  /** Calls `fn` with every event any host appends from now on, until the returned function is called. */
  onEvent(fn: (e: JobEvent) => void): () => void {
    this.#listeners.add(fn);
    return () => void this.#listeners.delete(fn);
  }

  /** Marks every `running` job `interrupted` (only right for one host; several use releaseHost). */
  async markInterrupted(): Promise<Job[]> {
    return bySeq(
      await q(this.#sql, "update jobs set status = 'interrupted' where status = 'running' returning *"),
    )
      .map(toJob);
  }

  /** Moves unfinished jobs queued on GPUs `>= gpus` onto GPU `index % gpus`. */
  async requeueBeyond(gpus: number): Promise<void> {
    await q(
      this.#sql,
      "update jobs set gpu = gpu % ? where gpu >= ? and status in ('queued', 'interrupted', 'running')",
      [gpus, gpus],
    );
  }

  /** Job counts per status (only `owner`'s when given). */
  async countByStatus(owner?: string): Promise<Record<JobStatus, number>> {
    const out: Record<JobStatus, number> = {
      queued: 0,
      running: 0,
      succeeded: 0,
      failed: 0,
      cancelled: 0,
      interrupted: 0,
    };
    const mine = owner === undefined ? "" : " where owner = ?";
    const rows = await q(
      this.#sql,
      `select status, count(*) as n from jobs${mine} group by status`,
      owner === undefined ? [] : [owner],
    );
    for (const r of rows) {
      out[r.status as JobStatus] = Number(r.n);
    }
    return out;
  }

  /** Appends a point to a job's metrics history; with `lease`, only while it holds. */
  async addMetric(jobId: string, p: Omit<MetricPoint, "at">, lease?: Lease): Promise<void> {
    const values: Value[] = [
      jobId,
      p.iteration,
      p.split,
      p.loss,
      p.perplexity,
      p.lr,
      p.tokens_per_s,
      new Date().toISOString(),
    ];
    const insert = "insert into metrics (job_id, iteration, split, loss, perplexity, lr, tokens_per_s, at)";
    if (!lease) {
      await q(this.#sql, `${insert} values (?, ?, ?, ?, ?, ?, ?, ?)`, values);
      return;
    }
    const rows = await q(
      this.#sql,
      `${insert} select ?, ?, ?, ?, ?, ?, ?, ?
       where exists (select 1 from jobs where id = ? and host_id = ? and lease_epoch = ?) returning job_id`,
      [...values, lease.job_id, lease.host_id, lease.epoch],
    );
    if (rows.length === 0) throw new LeaseLostError(lease);
  }

  /** A job's metrics history in the order recorded. */
  async metrics(jobId: string): Promise<MetricPoint[]> {
    const rows = await q(
      this.#sql,
      "select iteration, split, loss, perplexity, lr, tokens_per_s, at from metrics where job_id = ? order by rowid",
      [jobId],
    );
    return rows.map((r) => ({ ...r }) as unknown as MetricPoint);
  }

  /**
   * Appends an event and returns it with its id; with `lease`, only while it holds. Listeners
   * (on every host, this one included) get it through NOTIFY once it is committed.
   */
  async addEvent(
    jobId: string,
    type: JobEventType,
    data: Record<string, unknown>,
    lease?: Lease,
  ): Promise<JobEvent> {
    const at = new Date().toISOString();
    const text = JSON.stringify(data);
    return await this.#sql.begin(async (tx) => {
      await q(tx, "select pg_advisory_xact_lock(hashtext(?))", [jobId]);
      if (lease) {
        const ok = await q(tx, "select 1 from jobs where id = ? and host_id = ? and lease_epoch = ?", [
          lease.job_id,
          lease.host_id,
          lease.epoch,
        ]);
        if (ok.length === 0) throw new LeaseLostError(lease);
      }
      const [row] = await q(
        tx,
        "insert into events (job_id, type, data, at) values (?, ?, ?, ?) returning id",
        [jobId, type, text, at],
      );
      const event: JobEvent = { id: Number(row.id), job_id: jobId, type, data, at };
      const full = JSON.stringify(event);
      const payload = full.length <= MAX_PAYLOAD ? full : JSON.stringify({ id: event.id, job_id: jobId });
      await q(tx, "select pg_notify(?, ?)", [CHANNEL, payload]);
      return event;
    }) as JobEvent;
  }

  /** A job's events with id greater than `afterId`, oldest first, at most `limit` (a replay page). */
  async eventsAfter(jobId: string, afterId = 0, limit = -1): Promise<JobEvent[]> {
    const rows = await q(
      this.#sql,
      `select * from events where job_id = ? and id > ? order by id${limit >= 0 ? " limit ?" : ""}`,
      limit >= 0 ? [jobId, afterId, limit] : [jobId, afterId],
    );
    return rows.map(eventFromRow);
  }

  /** Records (or refreshes) a host. */
  async registerHost(host: HostReport): Promise<void> {
    await q(
      this.#sql,
      `insert into hosts (id, gpus, free, state, started_at, seen_ms, info) values (?, ?, ?, ?, ?, ${NOW_MS}, ?)
       on conflict(id) do update set gpus = excluded.gpus, free = excluded.free, state = excluded.state,
         started_at = excluded.started_at, seen_ms = excluded.seen_ms, info = excluded.info`,
      [host.id, host.gpus, host.free, host.state, new Date().toISOString(), JSON.stringify(host.info ?? {})],
    );
  }

  /** Every host that registered, newest heartbeat first, with the jobs it holds a live lease on. */
  async hosts(): Promise<HostRecord[]> {
    const [{ now }] = await q(this.#sql, `select ${NOW_MS} as now`);
    const held = await q(
      this.#sql,
      "select host_id, id from jobs where host_id is not null and lease_until >= ? order by seq",
      [Number(now)],
    );
    return (await q(this.#sql, "select * from hosts order by seen_ms desc, id")).map((r) =>
      toHost(r, Number(now), held)
    );
  }

  /** Lets go of every job `hostId` held (a running one becomes interrupted); returns them. */
  async releaseHost(hostId: string): Promise<Job[]> {
    const rows = await q(
      this.#sql,
      `update jobs set lease_until = null,
         status = case status when 'running' then 'interrupted' else status end
       where host_id = ? and lease_until is not null and status in ${CLAIMABLE} returning *`,
      [hostId],
    );
    return bySeq(rows).map(toJob);
  }

  /**
   * Claims the first waiting job that fits `capacity` Workers and no live lease holds
   * (`FOR UPDATE SKIP LOCKED`: hosts claiming together each get a different job, none waits).
   */
  async claimNext(
    hostId: string,
    capacity: number,
    leaseMs: number,
    takeover = true,
    skip: string[] = [],
  ): Promise<Claim | null> {
    const [row] = await q(
      this.#sql,
      `update jobs set host_id = ?, lease_epoch = lease_epoch + 1, lease_until = ${NOW_MS} + ?
       where seq = (
         select seq from jobs where status in ${CLAIMABLE} and workers <= ?
           and (lease_until is null or lease_until < ${NOW_MS}) and (? = 1 or status <> 'running')${
        skipOwners(skip.length)
      }
         order by case status when 'queued' then 1 else 0 end, ${FAIR_SHARE}, seq
         limit 1 for update skip locked)
       returning *`,
      [hostId, Math.round(leaseMs), capacity, takeover ? 1 : 0, ...skip],
    );
    if (!row) return null;
    return {
      job: toJob(row),
      lease: { job_id: row.id as string, host_id: hostId, epoch: Number(row.lease_epoch) },
    };
  }

  /** Renews `leases` and the host's row; says which leases are kept and which were taken. */
  async heartbeat(host: HostReport, leases: Lease[], leaseMs: number): Promise<HeartbeatResult> {
    const seen = await q(
      this.#sql,
      `update hosts set gpus = ?, free = ?, state = ?, seen_ms = ${NOW_MS}, info = ? where id = ? returning id`,
      [host.gpus, host.free, host.state, JSON.stringify(host.info ?? {}), host.id],
    );
    if (seen.length === 0) await this.registerHost(host);
    const out: HeartbeatResult = { kept: [], lost: [] };
    for (const l of leases) {
      const [r] = await q(
        this.#sql,
        `update jobs set lease_until = ${NOW_MS} + ? where id = ? and host_id = ? and lease_epoch = ?
         returning cancel_requested`,
        [Math.round(leaseMs), l.job_id, l.host_id, l.epoch],
      );
      if (r) out.kept.push({ job_id: l.job_id, cancel_requested: Number(r.cancel_requested) !== 0 });
      else out.lost.push(l.job_id);
    }
    return out;
  }

  /** Ends a lease early: another host may claim the job now. */
  async release(lease: Lease): Promise<void> {
    await q(
      this.#sql,
      "update jobs set lease_until = null where id = ? and host_id = ? and lease_epoch = ?",
      [
        lease.job_id,
        lease.host_id,
        lease.epoch,
      ],
    );
  }

  /**
   * Whether `lease` holds its job now: host and epoch still the job's and not given back (an
   * expired lease no other host claimed still holds, as a heartbeat would renew it); renewed for
   * `leaseMs` in the same statement when it does.
   */
  async confirmLease(lease: Lease, leaseMs: number): Promise<boolean> {
    const rows = await q(
      this.#sql,
      `update jobs set lease_until = ${NOW_MS} + ?
       where id = ? and host_id = ? and lease_epoch = ? and lease_until is not null returning id`,
      [Math.round(leaseMs), lease.job_id, lease.host_id, lease.epoch],
    );
    return rows.length > 0;
  }

  /** The user `name`, made now if new. */
  async putUser(name: string): Promise<UserRecord> {
    await q(
      this.#sql,
      "insert into users (name, created_at, quotas) values (?, ?, '{}') on conflict(name) do nothing",
      [name, new Date().toISOString()],
    );
    const [row] = await q(this.#sql, "select * from users where name = ?", [name]);
    return toUser(row);
  }

  /** Every user, by name. */
  async users(): Promise<UserRecord[]> {
    return (await q(this.#sql, "select * from users order by name")).map(toUser);
  }

  /** Replaces user `name`'s own quotas. */
  async setQuotas(name: string, quotas: Record<string, number>): Promise<boolean> {
    const rows = await q(this.#sql, "update users set quotas = ? where name = ? returning name", [
      JSON.stringify(quotas),
      name,
    ]);
    return rows.length > 0;
  }

  /** Stores a new token (its hash). */
  async createToken(t: TokenRecord): Promise<void> {
    await q(
      this.#sql,
      `insert into tokens (id, hash, name, user_name, scopes, created_at, expires_at, last_used_at, revoked_at)
       values (?, ?, ?, ?, ?, ?, ?, ?, ?)`,
      [
        t.id,
        t.hash,
        t.name,
        t.user,
        JSON.stringify(t.scopes),
        t.created_at,
        t.expires_at,
        t.last_used_at,
        t.revoked_at,
      ],
    );
  }

  /** Every token, oldest first. */
  async tokens(): Promise<TokenRecord[]> {
    return (await q(this.#sql, "select * from tokens order by created_at, id")).map(toToken);
  }

  /** Revokes token `id`; false when there is none or it was revoked already. */
  async revokeToken(id: string, at: string): Promise<boolean> {
    const rows = await q(
      this.#sql,
      "update tokens set revoked_at = ? where id = ? and revoked_at is null returning id",
      [at, id],
    );
    return rows.length > 0;
  }

  /** Records when tokens were last used. */
  async touchTokens(uses: Array<{ id: string; at: string }>): Promise<void> {
    for (const u of uses) {
      await q(this.#sql, "update tokens set last_used_at = ? where id = ?", [u.at, u.id]);
    }
  }

  /** Records that `owner` owns resource `kind`/`id`. */
  async addResource(kind: string, id: string, owner: string): Promise<void> {
    await q(
      this.#sql,
      "insert into resources (kind, id, owner, created_at) values (?, ?, ?, ?) on conflict do nothing",
      [kind, id, owner, new Date().toISOString()],
    );
  }

  /** Who owns resource `kind`/`id`. */
  async resourceOwners(kind: string, id: string): Promise<string[]> {
    const rows = await q(this.#sql, "select owner from resources where kind = ? and id = ? order by owner", [
      kind,
      id,
    ]);
    return rows.map((r) => r.owner as string);
  }

  /** Forgets every owner of resource `kind`/`id`. */
  async removeResource(kind: string, id: string): Promise<void> {
    await q(this.#sql, "delete from resources where kind = ? and id = ?", [kind, id]);
  }

  /** Appends an audit event. */
  async addAudit(e: Omit<AuditEvent, "id" | "at">): Promise<AuditEvent> {
    const at = new Date().toISOString();
    const [row] = await q(
      this.#sql,
      "insert into audit (at, user_name, action, target, detail) values (?, ?, ?, ?, ?) returning id",
      [at, e.user, e.action, e.target, JSON.stringify(e.detail)],
    );
    return { id: Number(row.id), at, ...e };
  }

  /** Audit events newest first. */
  async audit(opts: { before?: number; limit?: number; user?: string } = {}): Promise<AuditEvent[]> {
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
    return (await q(this.#sql, sql, [...args, opts.limit ?? 100])).map(toAudit);
  }

  /** GPU-seconds `owner`'s jobs used since `since`. */
  async gpuSeconds(owner: string, since: string): Promise<number> {
    return gpuSecondsOf(await q(this.#sql, GPU_SECONDS_SQL, [owner, since]), since);
  }

  /** A NOTIFY of a new event: hand it to the listeners (read back when it was too large to carry). */
  async #announced(payload: string): Promise<void> {
    if (this.#listeners.size === 0) return;
    let event = JSON.parse(payload) as JobEvent;
    if (event.data === undefined) {
      const [row] = await q(this.#sql, "select * from events where id = ?", [event.id]).catch(() => []);
      if (!row) return;
      event = eventFromRow(row);
    }
    for (const fn of this.#listeners) fn(event);
  }
}

/** Rows of `update … returning *` (which come in no set order) in submission order. */
function bySeq(rows: Row[]): Row[] {
  return rows.sort((a, b) => Number(a.seq) - Number(b.seq));
}

/** `url` without its password, for messages. */
export function redact(url: string): string {
  try {
    const u = new URL(url);
    if (u.password) u.password = "***";
    return u.toString();
  } catch {
    return "(unparseable GPT2_DATABASE_URL)";
  }
}

/** Runs the migrations the database lacks, once across hosts (advisory lock); returns the version. */
async function migrate(
  // deno-lint-ignore no-explicit-any
  sql: postgres.Sql<any>,
  where: string,
): Promise<number> {
  return await sql.begin(async (tx) => {
    await q(tx, "select pg_advisory_xact_lock(?)", [MIGRATION_LOCK]);
    await tx.unsafe("create table if not exists schema_version (version integer not null)");
    const [row] = await q(tx, "select version from schema_version");
    const from = row ? Number(row.version) : 0;
    if (!row) await q(tx, "insert into schema_version (version) values (0)");
    if (from > SCHEMA_VERSION) {
      throw new Error(
        `Cannot open job store "${where}": its schema version ${from} is newer than this server's ${SCHEMA_VERSION} (upgrade the server)`,
      );
    }
    for (let v = from; v < SCHEMA_VERSION; v++) {
      try {
        await tx.unsafe(postgresDialect(MIGRATIONS[v])).simple();
        await q(tx, "update schema_version set version = ?", [v + 1]);
      } catch (e) {
        throw new Error(
          `Cannot migrate job store "${where}" to schema version ${v + 1}: ${(e as Error).message}`,
        );
      }
    }
    return SCHEMA_VERSION;
  }) as number;
}
