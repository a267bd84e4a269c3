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
import type { Job, JobEvent, JobEventType, JobStatus, MetricPoint, TrainConfig } from "../../job/job.ts";
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
import { LeaseLostError, MIGRATIONS, postgresDialect, SCHEMA_VERSION } from "./store_schema.ts";
import { numbered, patchSets, POSTGRES_DIALECT, read, type Row, SQL, type Sql, sql } from "./store_sql.ts";

// deno-lint-ignore no-explicit-any
type Conn = postgres.Sql<any> | postgres.TransactionSql<any>;

/** The NOTIFY channel of new events. */
const CHANNEL = "gpt2_events";
/** Advisory lock key under which migrations run (any constant; "gpt2" in ASCII). */
const MIGRATION_LOCK = 0x67707432;
/** NOTIFY payloads are limited to 8000 bytes: a larger event is announced by id and read back. */
const MAX_PAYLOAD = 7000;

/** Runs `s` (its `?` placeholders numbered) on `conn`; its rows. */
async function q(conn: Conn, s: Sql): Promise<Row[]> {
  // deno-lint-ignore no-explicit-any
  return [...await conn.unsafe(numbered(s.text), s.args as any[])] as Row[];
}

/** Jobs, metrics, events and hosts in PostgreSQL. Open with {@link PostgresJobStore.open}. */
export class PostgresJobStore implements JobStoreEngine {
  readonly engine = "postgres" as const;
  // deno-lint-ignore no-explicit-any
  #pool: postgres.Sql<any>;
  #version: number;
  #listeners = new Set<(e: JobEvent) => void>();
  #unlisten: (() => Promise<void>) | null = null;

  // deno-lint-ignore no-explicit-any
  private constructor(pool: postgres.Sql<any>, version: number) {
    this.#pool = pool;
    this.#version = version;
  }

  /**
   * Connects to `url`, runs the migrations the database lacks (refusing one newer than this
   * server) and starts listening for events. The error names the database without its password.
   */
  static async open(url: string, opts: { max?: number } = {}): Promise<PostgresJobStore> {
    const where = redact(url);
    const pool = postgres(url, { max: opts.max ?? 8, onnotice: () => {}, connect_timeout: 5 });
    try {
      const version = await migrate(pool, where);
      const store = new PostgresJobStore(pool, version);
      const listener = await pool.listen(CHANNEL, (payload) => store.#announced(payload));
      store.#unlisten = listener.unlisten;
      return store;
    } catch (e) {
      await pool.end({ timeout: 1 }).catch(() => {});
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
    await this.#pool.end({ timeout: 5 });
  }

  /** Inserts a queued job on `gpu`'s queue, owned by `owner`. */
  async createJob(id: string, gpu: number, config: TrainConfig, owner: string | null = null): Promise<Job> {
    const [row] = await this.#q(SQL.createJob(id, gpu, config, owner));
    return read.job(row);
  }

  /** A job, or null. */
  async getJob(id: string): Promise<Job | null> {
    const [row] = await this.#q(SQL.getJob(id));
    return row ? read.job(row) : null;
  }

  /** Jobs newest first, `limit` (100) of them, only those older than job `after` when given. */
  async listJobs(opts: JobListOptions = {}): Promise<Job[]> {
    return (await this.#q(SQL.listJobs(opts))).map(read.job);
  }

  /** Whether a job with this id exists. */
  async hasJob(id: string): Promise<boolean> {
    return (await this.#q(SQL.hasJob(id))).length > 0;
  }

  /** Deletes a job with its metrics history and events. Returns whether it existed. */
  async deleteJob(id: string): Promise<boolean> {
    return await this.#pool.begin(async (tx) => {
      let rows: Row[] = [];
      for (const s of SQL.deleteJob(id)) rows = await q(tx, s);
      return rows.length > 0;
    }) as boolean;
  }

  /**
   * Applies `patch`; metrics are merged in the database (jsonb `||`), so two hosts' patches do
   * not overwrite each other. With `lease`, only while it holds (else LeaseLostError).
   */
  async updateJob(id: string, patch: JobPatch, lease?: Lease): Promise<Job> {
    const sets = patchSets(id, patch);
    if (patch.metrics) {
      sets.push(sql`metrics = (metrics::jsonb || ${JSON.stringify(patch.metrics)}::text::jsonb)::text`);
    }
    const [row] = await this.#q(SQL.updateJob(id, sets, lease));
    if (row) return read.job(row);
    if (lease && await this.hasJob(id)) throw new LeaseLostError(lease);
    throw new Error(`Cannot update job "${id}": no such job`);
  }

  /** The next job waiting on `gpu`: interrupted before queued, each in fair-share order, none of `skip`'s. */
  async nextQueued(gpu: number, skip: string[] = []): Promise<Job | null> {
    const [row] = await this.#q(SQL.nextQueued(gpu, skip));
    return row ? read.job(row) : null;
  }

  /** Jobs waiting on `gpu`, in the order they will run (their owners' running quotas aside). */
  async queue(gpu: number): Promise<Job[]> {
    return (await this.#q(SQL.queue(gpu))).map(read.job);
  }

  /** Number of jobs waiting on `gpu`. */
  async queueLength(gpu: number): Promise<number> {
    const [r] = await this.#q(SQL.queueLength(gpu));
    return Number(r.n);
  }

  /** Number of jobs waiting, on every host (only `owner`'s when given). */
  async waitingCount(owner?: string): Promise<number> {
    const [r] = await this.#q(SQL.waitingCount(owner));
    return Number(r.n);
  }

  /** Whether the database accepts a write now (the readiness probe): null, or why not. */
  async writeError(): Promise<string | null> {
    try {
      await this.#q(SQL.writeError());
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
    return read.jobsBySeq(await this.#q(SQL.markInterrupted()));
  }

  /** Moves unfinished jobs queued on GPUs `>= gpus` onto GPU `index % gpus`. */
  async requeueBeyond(gpus: number): Promise<void> {
    await this.#q(SQL.requeueBeyond(gpus));
  }

  /** Job counts per status (only `owner`'s when given). */
  async countByStatus(owner?: string): Promise<Record<JobStatus, number>> {
    return read.counts(await this.#q(SQL.countByStatus(owner)));
  }

  /** Appends a point to a job's metrics history; with `lease`, only while it holds. */
  async addMetric(jobId: string, p: Omit<MetricPoint, "at">, lease?: Lease): Promise<void> {
    const inserted = await this.#q(SQL.addMetric(jobId, p, lease));
    if (lease && inserted.length === 0) throw new LeaseLostError(lease);
  }

  /** A job's metrics history in the order recorded. */
  async metrics(jobId: string): Promise<MetricPoint[]> {
    return (await this.#q(SQL.metrics(jobId))).map(read.metric);
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
    return await this.#pool.begin(async (tx) => {
      await q(tx, sql`select pg_advisory_xact_lock(hashtext(${jobId}))`);
      if (lease && (await q(tx, SQL.fence(lease))).length === 0) throw new LeaseLostError(lease);
      const [row] = await q(tx, SQL.addEvent(jobId, type, data, at));
      const event: JobEvent = { id: Number(row.id), job_id: jobId, type, data, at };
      const full = JSON.stringify(event);
      const payload = full.length <= MAX_PAYLOAD ? full : JSON.stringify({ id: event.id, job_id: jobId });
      await q(tx, sql`select pg_notify(${CHANNEL}, ${payload})`);
      return event;
    }) as JobEvent;
  }

  /** A job's events with id greater than `afterId`, oldest first, at most `limit` (a replay page). */
  async eventsAfter(jobId: string, afterId = 0, limit = -1): Promise<JobEvent[]> {
    return (await this.#q(SQL.eventsAfter(jobId, afterId, limit))).map(read.event);
  }

  /** Records (or refreshes) a host. */
  async registerHost(host: HostReport): Promise<void> {
    await this.#q(SQL.registerHost(host, POSTGRES_DIALECT));
  }

  /** Every host that registered, newest heartbeat first, with the jobs it holds a live lease on. */
  async hosts(): Promise<HostRecord[]> {
    const [{ now }] = await this.#q(sql`select ${POSTGRES_DIALECT.clock()} as now`);
    const held = await this.#q(SQL.heldLeases(Number(now)));
    return (await this.#q(SQL.hosts())).map((r) => read.host(r, Number(now), held));
  }

  /** Lets go of every job `hostId` held (a running one becomes interrupted); returns them. */
  async releaseHost(hostId: string): Promise<Job[]> {
    return read.jobsBySeq(await this.#q(SQL.releaseHost(hostId)));
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
    const [claimed] = await this.#q(
      SQL.claimNext(hostId, capacity, leaseMs, takeover, skip, POSTGRES_DIALECT),
    );
    return read.claim(claimed, hostId);
  }

  /** Renews `leases` and the host's row; says which leases are kept and which were taken. */
  async heartbeat(host: HostReport, leases: Lease[], leaseMs: number): Promise<HeartbeatResult> {
    const seen = await this.#q(SQL.seenHost(host, POSTGRES_DIALECT));
    if (seen.length === 0) await this.registerHost(host);
    const renewed: Array<Row | undefined> = [];
    for (const l of leases) renewed.push((await this.#q(SQL.renew(l, leaseMs, POSTGRES_DIALECT)))[0]);
    return read.heartbeat(leases, renewed);
  }

  /** Ends a lease early: another host may claim the job now. */
  async release(lease: Lease): Promise<void> {
    await this.#q(SQL.release(lease));
  }

  /**
   * Whether `lease` holds its job now: host and epoch still the job's and not given back (an
   * expired lease no other host claimed still holds, as a heartbeat would renew it); renewed for
   * `leaseMs` in the same statement when it does.
   */
  async confirmLease(lease: Lease, leaseMs: number): Promise<boolean> {
    return (await this.#q(SQL.confirmLease(lease, leaseMs, POSTGRES_DIALECT))).length > 0;
  }

  /** The user `name`, made now if new. */
  async putUser(name: string): Promise<UserRecord> {
    await this.#q(SQL.putUser(name));
    const [row] = await this.#q(SQL.user(name));
    return read.user(row);
  }

  /** Every user, by name. */
  async users(): Promise<UserRecord[]> {
    return (await this.#q(SQL.users())).map(read.user);
  }

  /** Replaces user `name`'s own quotas. */
  async setQuotas(name: string, quotas: Record<string, number>): Promise<boolean> {
    return (await this.#q(SQL.setQuotas(name, quotas))).length > 0;
  }

  /** Stores a new token (its hash). */
  async createToken(t: TokenRecord): Promise<void> {
    await this.#q(SQL.createToken(t));
  }

  /** Every token, oldest first. */
  async tokens(): Promise<TokenRecord[]> {
    return (await this.#q(SQL.tokens())).map(read.token);
  }

  /** Revokes token `id`; false when there is none or it was revoked already. */
  async revokeToken(id: string, at: string): Promise<boolean> {
    return (await this.#q(SQL.revokeToken(id, at))).length > 0;
  }

  /** Records when tokens were last used. */
  async touchTokens(uses: Array<{ id: string; at: string }>): Promise<void> {
    for (const u of uses) await this.#q(SQL.touchToken(u));
  }

  /** Records that `owner` owns resource `kind`/`id`. */
  async addResource(kind: string, id: string, owner: string): Promise<void> {
    await this.#q(SQL.addResource(kind, id, owner));
  }

  /** Who owns resource `kind`/`id`. */
  async resourceOwners(kind: string, id: string): Promise<string[]> {
    return (await this.#q(SQL.resourceOwners(kind, id))).map((r) => r.owner as string);
  }

  /** Forgets every owner of resource `kind`/`id`. */
  async removeResource(kind: string, id: string): Promise<void> {
    await this.#q(SQL.removeResource(kind, id));
  }

  /** Appends an audit event. */
  async addAudit(e: Omit<AuditEvent, "id" | "at">): Promise<AuditEvent> {
    const at = new Date().toISOString();
    const [row] = await this.#q(SQL.addAudit(e, at));
    return { id: Number(row.id), at, ...e };
  }

  /** Audit events newest first. */
  async audit(opts: { before?: number; limit?: number; user?: string } = {}): Promise<AuditEvent[]> {
    return (await this.#q(SQL.audit(opts))).map(read.audit);
  }

  /** GPU-seconds `owner`'s jobs used since `since`. */
  async gpuSeconds(owner: string, since: string): Promise<number> {
    return read.gpuSeconds(await this.#q(SQL.gpuSeconds(owner, since)), since);
  }

  #q(s: Sql): Promise<Row[]> {
    return q(this.#pool, s);
  }

  /** A NOTIFY of a new event: hand it to the listeners (read back when it was too large to carry). */
  async #announced(payload: string): Promise<void> {
    if (this.#listeners.size === 0) return;
    let event = JSON.parse(payload) as JobEvent;
    if (event.data === undefined) {
      const [row] = await this.#q(SQL.event(event.id)).catch(() => []);
      if (!row) return;
      event = read.event(row);
    }
    for (const fn of this.#listeners) fn(event);
  }
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
  pool: postgres.Sql<any>,
  where: string,
): Promise<number> {
  return await pool.begin(async (tx) => {
    await q(tx, sql`select pg_advisory_xact_lock(${MIGRATION_LOCK})`);
    await tx.unsafe("create table if not exists schema_version (version integer not null)");
    const [row] = await q(tx, sql`select version from schema_version`);
    const from = row ? Number(row.version) : 0;
    if (!row) await q(tx, sql`insert into schema_version (version) values (0)`);
    if (from > SCHEMA_VERSION) {
      throw new Error(
        `Cannot open job store "${where}": its schema version ${from} is newer than this server's ${SCHEMA_VERSION} (upgrade the server)`,
      );
    }
    for (let v = from; v < SCHEMA_VERSION; v++) {
      try {
        await tx.unsafe(postgresDialect(MIGRATIONS[v])).simple();
        await q(tx, sql`update schema_version set version = ${v + 1}`);
      } catch (e) {
        throw new Error(
          `Cannot migrate job store "${where}" to schema version ${v + 1}: ${(e as Error).message}`,
        );
      }
    }
    return SCHEMA_VERSION;
  }) as number;
}
