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

import { DatabaseSync, type StatementResultingChanges } from "node:sqlite";
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
import { LeaseLostError, MIGRATIONS, SCHEMA_VERSION } from "./store_schema.ts";
import { patchSets, read, type Row, SQL, type Sql, sql, sqliteDialect } from "./store_sql.ts";

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
    return read.job(this.#get(SQL.createJob(id, gpu, config, owner))!);
  }

  /** A job, or null. */
  getJob(id: string): Job | null {
    const row = this.#get(SQL.getJob(id));
    return row ? read.job(row) : null;
  }

  /**
   * Jobs newest first, `limit` of them (default 100), only those older than job `after` when
   * given (a page after the last one seen; an unknown `after` gives an empty page).
   */
  listJobs(opts: JobListOptions = {}): Job[] {
    return this.#all(SQL.listJobs(opts)).map(read.job);
  }

  /** Whether a job with this id exists. */
  hasJob(id: string): boolean {
    return this.#get(SQL.hasJob(id)) !== undefined;
  }

  /** Deletes a job with its metrics history and events. Returns whether it existed. */
  deleteJob(id: string): boolean {
    return this.#transaction(() => SQL.deleteJob(id).map((s) => this.#all(s)).at(-1)!.length > 0);
  }

  /**
   * Applies `patch`; metrics are merged into the stored ones. With `lease`, only while that
   * lease still holds the job (else LeaseLostError). Returns the updated job.
   */
  updateJob(id: string, patch: JobPatch, lease?: Lease): Job {
    const job = this.getJob(id);
    if (!job) throw new Error(`Cannot update job "${id}": no such job`);
    const sets = patchSets(id, patch);
    if (patch.metrics) sets.push(sql`metrics = ${JSON.stringify({ ...job.metrics, ...patch.metrics })}`);
    if (sets.length === 0 && !lease) return job;
    const row = this.#get(SQL.updateJob(id, sets, lease));
    if (row) return read.job(row);
    throw lease ? new LeaseLostError(lease) : new Error(`Cannot update job "${id}": no such job`);
  }

  /** The next job waiting on `gpu`: interrupted before queued, each in fair-share order, none of `skip`'s. */
  nextQueued(gpu: number, skip: string[] = []): Job | null {
    const row = this.#get(SQL.nextQueued(gpu, skip));
    return row ? read.job(row) : null;
  }

  /** Jobs waiting on `gpu`, in the order they will run (their owners' running quotas aside). */
  queue(gpu: number): Job[] {
    return this.#all(SQL.queue(gpu)).map(read.job);
  }

  /** Number of jobs waiting on `gpu` (counted in SQL, not loaded). */
  queueLength(gpu: number): number {
    return Number(this.#get(SQL.queueLength(gpu))!.n);
  }

  /** Number of jobs waiting on any GPU (only `owner`'s when given). */
  waitingCount(owner?: string): number {
    return Number(this.#get(SQL.waitingCount(owner))!.n);
  }

  /** Whether the database accepts a write now (the readiness probe): null, or why not. */
  writeError(): string | null {
    try {
      this.#run(SQL.writeError());
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
    return read.jobsBySeq(this.#all(SQL.markInterrupted()));
  }

  /** Moves unfinished jobs queued on GPUs `>= gpus` onto GPU `index % gpus`. */
  requeueBeyond(gpus: number): void {
    this.#run(SQL.requeueBeyond(gpus));
  }

  /** Job counts per status (only `owner`'s when given). */
  countByStatus(owner?: string): Record<JobStatus, number> {
    return read.counts(this.#all(SQL.countByStatus(owner)));
  }

  /** Appends a point to a job's metrics history; with `lease`, only while it holds. */
  addMetric(jobId: string, p: Omit<MetricPoint, "at">, lease?: Lease): void {
    const inserted = this.#all(SQL.addMetric(jobId, p, lease));
    if (lease && inserted.length === 0) throw new LeaseLostError(lease);
  }

  /** A job's metrics history in the order recorded. */
  metrics(jobId: string): MetricPoint[] {
    return this.#all(SQL.metrics(jobId)).map(read.metric);
  }

  /** Appends an event and returns it with its id; with `lease`, only while it holds. */
  addEvent(jobId: string, type: JobEventType, data: Record<string, unknown>, lease?: Lease): JobEvent {
    const at = new Date().toISOString();
    const row = this.#transaction(() => {
      if (lease && !this.#get(SQL.fence(lease))) throw new LeaseLostError(lease);
      return this.#get(SQL.addEvent(jobId, type, data, at))!;
    });
    const event: JobEvent = { id: Number(row.id), job_id: jobId, type, data, at };
    for (const fn of this.#listeners) fn(event);
    return event;
  }

  /** A job's events with id greater than `afterId`, oldest first, at most `limit` (a replay page). */
  eventsAfter(jobId: string, afterId = 0, limit = -1): JobEvent[] {
    return this.#all(SQL.eventsAfter(jobId, afterId, limit)).map(read.event);
  }

  /** Records (or refreshes) a host. */
  registerHost(host: HostReport): void {
    this.#run(SQL.registerHost(host, sqliteDialect()));
  }

  /** Every host that registered, newest heartbeat first, with the jobs it holds a live lease on. */
  hosts(): HostRecord[] {
    const now = Date.now();
    const held = this.#all(SQL.heldLeases(now));
    return this.#all(SQL.hosts()).map((r) => read.host(r, now, held));
  }

  /** Lets go of every job `hostId` held (a running one becomes interrupted); returns them. */
  releaseHost(hostId: string): Job[] {
    return read.jobsBySeq(this.#all(SQL.releaseHost(hostId)));
  }

  /** Claims the first waiting job that fits `capacity` Workers and no live lease holds. */
  claimNext(
    hostId: string,
    capacity: number,
    leaseMs: number,
    takeover = true,
    skip: string[] = [],
  ): Claim | null {
    const claimed = this.#transaction(() =>
      this.#get(SQL.claimNext(hostId, capacity, leaseMs, takeover, skip, sqliteDialect()))
    );
    return read.claim(claimed, hostId);
  }

  /** Renews `leases` and the host's row; says which leases are kept and which were taken. */
  heartbeat(host: HostReport, leases: Lease[], leaseMs: number): HeartbeatResult {
    return this.#transaction(() => {
      const d = sqliteDialect();
      if (!this.#get(SQL.seenHost(host, d))) this.registerHost(host);
      return read.heartbeat(leases, leases.map((l) => this.#get(SQL.renew(l, leaseMs, d))));
    });
  }

  /** Ends a lease early: another host may claim the job now. */
  release(lease: Lease): void {
    this.#run(SQL.release(lease));
  }

  /** See JobStoreEngine.confirmLease: epoch and host still the job's, not given back; renewed. */
  confirmLease(lease: Lease, leaseMs: number): boolean {
    return this.#get(SQL.confirmLease(lease, leaseMs, sqliteDialect())) !== undefined;
  }

  /** The user `name`, made now if new. */
  putUser(name: string): UserRecord {
    this.#run(SQL.putUser(name));
    return read.user(this.#get(SQL.user(name))!);
  }

  /** Every user, by name. */
  users(): UserRecord[] {
    return this.#all(SQL.users()).map(read.user);
  }

  /** Replaces user `name`'s own quotas. */
  setQuotas(name: string, quotas: Record<string, number>): boolean {
    return this.#all(SQL.setQuotas(name, quotas)).length > 0;
  }

  /** Stores a new token (its hash). */
  createToken(t: TokenRecord): void {
    this.#run(SQL.createToken(t));
  }

  /** Every token, oldest first. */
  tokens(): TokenRecord[] {
    return this.#all(SQL.tokens()).map(read.token);
  }

  /** Revokes token `id`; false when there is none or it was revoked already. */
  revokeToken(id: string, at: string): boolean {
    return this.#all(SQL.revokeToken(id, at)).length > 0;
  }

  /** Records when tokens were last used. */
  touchTokens(uses: Array<{ id: string; at: string }>): void {
    if (uses.length === 0) return;
    this.#transaction(() => {
      for (const u of uses) this.#run(SQL.touchToken(u));
    });
  }

  /** Records that `owner` owns resource `kind`/`id`. */
  addResource(kind: string, id: string, owner: string): void {
    this.#run(SQL.addResource(kind, id, owner));
  }

  /** Who owns resource `kind`/`id`. */
  resourceOwners(kind: string, id: string): string[] {
    return this.#all(SQL.resourceOwners(kind, id)).map((r) => r.owner as string);
  }

  /** Forgets every owner of resource `kind`/`id`. */
  removeResource(kind: string, id: string): void {
    this.#run(SQL.removeResource(kind, id));
  }

  /** Appends an audit event. */
  addAudit(e: Omit<AuditEvent, "id" | "at">): AuditEvent {
    const at = new Date().toISOString();
    const row = this.#get(SQL.addAudit(e, at))!;
    return { id: Number(row.id), at, ...e };
  }

  /** Audit events newest first. */
  audit(opts: { before?: number; limit?: number; user?: string } = {}): AuditEvent[] {
    return this.#all(SQL.audit(opts)).map(read.audit);
  }

  /** GPU-seconds `owner`'s jobs used since `since`. */
  gpuSeconds(owner: string, since: string): number {
    return read.gpuSeconds(this.#all(SQL.gpuSeconds(owner, since)), since);
  }

  #run(s: Sql): StatementResultingChanges {
    return this.#db.prepare(s.text).run(...s.args);
  }

  /** The first row `s` answers (all its changes are made by then, `returning` or not). */
  #get(s: Sql): Row | undefined {
    return this.#db.prepare(s.text).get(...s.args) as Row | undefined;
  }

  #all(s: Sql): Row[] {
    return this.#db.prepare(s.text).all(...s.args) as Row[];
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
