/**
 * The job store: one interface ({@link JobStoreEngine}), two engines. SQLite
 * (server/jobs/sqlite_store.ts, `node:sqlite`, synchronous) is the embedded default for one host;
 * PostgreSQL (server/jobs/postgres_store.ts, `GPT2_DATABASE_URL`) lets several hosts share jobs,
 * events and metrics. Both run the same migrations (server/jobs/store_schema.ts) and the same
 * statements (server/jobs/store_sql.ts), each engine only executing them in its dialect.
 *
 * Every method of {@link JobStoreEngine} may answer at once (SQLite) or with a promise
 * (PostgreSQL): callers that take any engine `await` each answer. {@link JobStore} is the same
 * interface answering at once, which the runner uses: SQLite is that natively, and PostgreSQL
 * through server/jobs/postgres_bridge.ts (the async engine on its own thread, each call waited
 * for, as SQLite's own calls wait for the disk). `new JobStore(path)` opens SQLite.
 *
 * Several hosts: each has an id. A host claims a waiting job it can place ({@link
 * JobStoreEngine.claimNext}) under a lease it renews ({@link JobStoreEngine.heartbeat}); a claim
 * raises the job's lease epoch, and every write given a {@link Lease} succeeds only while that
 * epoch is still the job's (else {@link LeaseLostError}): a host whose lease another host took
 * can never write to that job again.
 */

import type {
  Job,
  JobEvent,
  JobEventType,
  JobMetrics,
  JobStatus,
  MetricPoint,
  TrainConfig,
} from "../../job/job.ts";

import { SqliteJobStore } from "./sqlite_store.ts";
export {
  isFinished,
  isStoreUnavailable,
  LeaseLostError,
  MIGRATIONS,
  SCHEMA_VERSION,
  StoreUnavailableError,
} from "./store_schema.ts";

/** An answer now (SQLite) or later (PostgreSQL). */
export type Awaitable<T> = T | Promise<T>;

/** Fields of a job the runner updates as it goes (`gpu`: a waiting job moved to another GPU's queue). */
export type JobPatch =
  & Partial<
    Pick<
      Job,
      | "status"
      | "gpu"
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

/** A host's hold on a job: valid while the job's lease epoch is still `epoch`. */
export interface Lease {
  job_id: string;
  host_id: string;
  epoch: number;
}

/** A job a host just claimed, as it was before the claim, with the lease that fences its writes. */
export interface Claim {
  job: Job;
  lease: Lease;
}

/** What a host says about itself when it registers and at every heartbeat. */
export interface HostReport {
  id: string;
  /** GPU Workers it starts (GPT2_GPUS). */
  gpus: number;
  /** Workers free to take a training job now. */
  free: number;
  /** "starting", "ready", "draining", … (the runner's word). */
  state: string;
  /** Anything else worth showing (adapter, address); stored as JSON. */
  info?: Record<string, unknown>;
}

/** A host as the database knows it (`/health` lists them). */
export interface HostRecord extends Required<HostReport> {
  started_at: string;
  /** Seconds since its last heartbeat (by the database's clock). */
  lease_age_s: number;
  /** Jobs it holds a live lease on. */
  jobs: string[];
}

/** What a heartbeat found: leases renewed (with a pending cancel) and leases another host took. */
export interface HeartbeatResult {
  kept: Array<{ job_id: string; cancel_requested: boolean }>;
  lost: string[];
}

/** A token as the store keeps it: the SHA-256 of the token (hex), never the token itself. */
export interface TokenRecord {
  /** Public id (`tok_…`), also the token's prefix: lists and revocations name it. */
  id: string;
  hash: string;
  name: string;
  /** The user it acts as. */
  user: string;
  scopes: string[];
  created_at: string;
  expires_at: string | null;
  last_used_at: string | null;
  revoked_at: string | null;
}

/** A user: made with its first token; quotas an admin set (missing ones take the settings' defaults). */
export interface UserRecord {
  name: string;
  created_at: string;
  quotas: Record<string, number>;
}

/** One audit event: who did what to which target. */
export interface AuditEvent {
  id: number;
  at: string;
  /** The acting user; null for the bootstrap token or a server with no token configured. */
  user: string | null;
  /** "job.create", "job.cancel", "job.delete", "token.create", "token.revoke", "dataset.create", … */
  action: string;
  target: string | null;
  detail: Record<string, unknown>;
}

/** What a job list may be narrowed to. */
export interface JobListOptions {
  status?: JobStatus;
  limit?: number;
  after?: string;
  /** Only this user's jobs. */
  owner?: string;
}

/** The job store, whichever engine holds it. */
export interface JobStoreEngine {
  /** "sqlite" or "postgres". */
  readonly engine: "sqlite" | "postgres";
  /** The schema version of the open database. */
  readonly schemaVersion: number;
  close(): Awaitable<void>;

  /** Inserts a queued job on `gpu`'s queue, owned by `owner` (null: no user). */
  createJob(id: string, gpu: number, config: TrainConfig, owner?: string | null): Awaitable<Job>;
  getJob(id: string): Awaitable<Job | null>;
  /** Jobs newest first, `limit` (100) of them, only those older than job `after` when given. */
  listJobs(opts?: JobListOptions): Awaitable<Job[]>;
  hasJob(id: string): Awaitable<boolean>;
  /** Deletes a job with its metrics history and events. Returns whether it existed. */
  deleteJob(id: string): Awaitable<boolean>;
  /** Applies `patch` (metrics merged); with `lease`, only while it holds (else LeaseLostError). */
  updateJob(id: string, patch: JobPatch, lease?: Lease): Awaitable<Job>;
  /**
   * The next job waiting on `gpu`: interrupted before queued, each in fair-share order (users in
   * turn, FIFO within a user), leaving out the jobs of the owners in `skip`.
   */
  nextQueued(gpu: number, skip?: string[]): Awaitable<Job | null>;
  /** Jobs waiting on `gpu`, in the order they will run. */
  queue(gpu: number): Awaitable<Job[]>;
  queueLength(gpu: number): Awaitable<number>;
  /** Jobs waiting on any GPU of any host (only `owner`'s when given). */
  waitingCount(owner?: string): Awaitable<number>;
  /** Whether the database accepts a write now (the readiness probe): null, or why not. */
  writeError(): Awaitable<string | null>;
  /** Calls `fn` with every event appended from now on (by any host, for PostgreSQL). */
  onEvent(fn: (e: JobEvent) => void): () => void;
  /** Marks every `running` job `interrupted` (one host that restarted); returns them. */
  markInterrupted(): Awaitable<Job[]>;
  /** Moves unfinished jobs queued on GPUs `>= gpus` onto GPU `index % gpus`. */
  requeueBeyond(gpus: number): Awaitable<void>;
  /** Job counts per status (only `owner`'s when given). */
  countByStatus(owner?: string): Awaitable<Record<JobStatus, number>>;
  /** Appends a point to a job's metrics history; with `lease`, only while it holds. */
  addMetric(jobId: string, p: Omit<MetricPoint, "at">, lease?: Lease): Awaitable<void>;
  metrics(jobId: string): Awaitable<MetricPoint[]>;
  /** Appends an event and returns it with its id; with `lease`, only while it holds. */
  addEvent(
    jobId: string,
    type: JobEventType,
    data: Record<string, unknown>,
    lease?: Lease,
  ): Awaitable<JobEvent>;
  /** A job's events with id greater than `afterId`, oldest first, at most `limit`. */
  eventsAfter(jobId: string, afterId?: number, limit?: number): Awaitable<JobEvent[]>;

  /** Records (or refreshes) a host: its GPUs, free Workers and state. */
  registerHost(host: HostReport): Awaitable<void>;
  /** Every host that ever registered, newest heartbeat first. */
  hosts(): Awaitable<HostRecord[]>;
  /**
   * A host (re)starting under `hostId`: the jobs it held are let go at once (a `running` one
   * becomes `interrupted`), so any host may claim them; returns them.
   */
  releaseHost(hostId: string): Awaitable<Job[]>;
  /**
   * Claims the first waiting job (interrupted or lease-expired before queued, each FIFO) that
   * needs at most `capacity` Workers and no live lease holds; the lease lasts `leaseMs`. With
   * `takeover` false, a `running` job whose lease expired (its host may be renewing it any moment,
   * e.g. just after the database came back) is not taken. Fair-share order as nextQueued; the
   * jobs of owners in `skip` are left waiting.
   */
  claimNext(
    hostId: string,
    capacity: number,
    leaseMs: number,
    takeover?: boolean,
    skip?: string[],
  ): Awaitable<Claim | null>;
  /** Renews `leases` for `leaseMs` and the host's row; says which are kept and which were taken. */
  heartbeat(host: HostReport, leases: Lease[], leaseMs: number): Awaitable<HeartbeatResult>;
  /** Ends a lease early (the job finished or was interrupted here): another host may claim it now. */
  release(lease: Lease): Awaitable<void>;
  /**
   * Whether `lease` holds its job right now by the database: its host and epoch are still the
   * job's and it was not given back. A lease that expired without another host claiming it
   * holds (a claim raises the epoch in the same statement that takes the job, so none came in
   * between), as a heartbeat would renew it. When it holds it is renewed for `leaseMs` in the
   * same statement, so no other host can claim the job for that long. Asked before a checkpoint
   * is committed (the fence on the files); after a database outage longer than the lease it lets
   * the host that kept training commit, unless another host took the job meanwhile.
   */
  confirmLease(lease: Lease, leaseMs: number): Awaitable<boolean>;

  /** The user `name`, made now (no quotas of its own) if new. */
  putUser(name: string): Awaitable<UserRecord>;
  /** Every user, by name. */
  users(): Awaitable<UserRecord[]>;
  /** Replaces user `name`'s own quotas; false when there is no such user. */
  setQuotas(name: string, quotas: Record<string, number>): Awaitable<boolean>;
  /** Stores a new token (its hash). */
  createToken(token: TokenRecord): Awaitable<void>;
  /** Every token, revoked and expired ones included, oldest first. */
  tokens(): Awaitable<TokenRecord[]>;
  /** Revokes token `id` at `at`; false when there is no such token or it was revoked already. */
  revokeToken(id: string, at: string): Awaitable<boolean>;
  /** Records when tokens were last used (written in batches, not per request). */
  touchTokens(uses: Array<{ id: string; at: string }>): Awaitable<void>;
  /** Records that `owner` ("*": everyone) owns resource `kind`/`id`; a repeat changes nothing. */
  addResource(kind: string, id: string, owner: string): Awaitable<void>;
  /** Who owns resource `kind`/`id` ("*" for shared); empty when nobody recorded it. */
  resourceOwners(kind: string, id: string): Awaitable<string[]>;
  /** Forgets every owner of resource `kind`/`id`. */
  removeResource(kind: string, id: string): Awaitable<void>;
  /** Appends an audit event. */
  addAudit(e: Omit<AuditEvent, "id" | "at">): Awaitable<AuditEvent>;
  /** Audit events newest first, `limit` (100) of them, older than id `before` when given. */
  audit(opts?: { before?: number; limit?: number; user?: string }): Awaitable<AuditEvent[]>;
  /**
   * GPU-seconds `owner`'s jobs used since `since` (ISO time): each job's time running after it,
   * until it finished or now, times its Workers.
   */
  gpuSeconds(owner: string, since: string): Awaitable<number>;
}

/** The job store answering at once: what the runner calls (SQLite, or PostgreSQL through the bridge). */
export type JobStore = {
  [K in keyof JobStoreEngine]: JobStoreEngine[K] extends (...args: infer A) => infer R
    ? (...args: A) => Exclude<R, Promise<unknown>>
    : JobStoreEngine[K];
};

/** `new JobStore(path)`: the SQLite engine at `path` (":memory:" for tests). */
export const JobStore: new (path: string) => SqliteJobStore = SqliteJobStore;
