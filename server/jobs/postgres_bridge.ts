/**
 * PostgreSQL as a job store that answers at once ({@link JobStore}), the shape the runner and
 * the routes were written for with SQLite. The async engine (server/jobs/postgres_store.ts) runs
 * on its own thread (server/jobs/postgres_thread.ts); each call posts there and waits on a shared
 * counter (`Atomics.wait`) until the answer is posted back, then takes it with
 * `receiveMessageOnPort`. The HTTP thread waits for one database round trip per call, as it
 * waits for the disk on every SQLite call today (about 0.1 ms of overhead per call, measured).
 *
 * Why not make the runner async instead: every runner path that reads the store (dispatch,
 * cancel, the Worker messages in order) would become a chain of awaits that must be serialized
 * per job to keep today's ordering; the bridge keeps those paths as they are and reviewed.
 *
 * A call that gets no answer within `timeoutMs` (10 s) fails naming the method, so an unreachable
 * database shows as errors and a failing readiness probe, never a hung server; its late answer is
 * recognised by its call id and dropped. Once a call has found the database unreachable, calls fail
 * at once (StoreUnavailableError) instead of each waiting on it, while one probe at a time is sent
 * without waiting; the first call after its answer came (the write taken) goes through again.
 * Events from every host arrive as ordinary messages, on a port of their own.
 */

import { MessageChannel, receiveMessageOnPort, Worker } from "node:worker_threads";
import type { Job, JobEvent, JobEventType, JobStatus, MetricPoint, TrainConfig } from "../../job/job.ts";
import type {
  AuditEvent,
  Claim,
  HeartbeatResult,
  HostRecord,
  HostReport,
  JobListOptions,
  JobPatch,
  JobStore,
  Lease,
  TokenRecord,
  UserRecord,
} from "./job_store.ts";
import { LeaseLostError, StoreUnavailableError } from "./store_schema.ts";
import type { BridgeAnswer, BridgeCall, BridgeData } from "./postgres_thread.ts";
import { redact } from "./postgres_store.ts";

/** Longest wait of the readiness probe ({@link PostgresBridgeStore.writeError}). */
const PROBE_TIMEOUT_MS = 2000;

/** The PostgreSQL job store, answering at once. Open with {@link PostgresBridgeStore.open}. */
export class PostgresBridgeStore implements JobStore {
  readonly engine = "postgres" as const;
  #worker: Worker;
  #calls: MessageChannel["port1"];
  #events: MessageChannel["port1"];
  #answered = new Int32Array(new SharedArrayBuffer(4));
  #next = 0;
  #timeoutMs: number;
  #version = 0;
  #closed = false;
  #listeners = new Set<(e: JobEvent) => void>();
  /** Since when the database has been found unreachable (ms), null while it answers. */
  #downSince: number | null = null;
  #downError = "";
  /** The id of the probe in flight while the database is away (answered asynchronously). */
  #probe: number | null = null;

  private constructor(url: string, timeoutMs: number) {
    this.#timeoutMs = timeoutMs;
    const calls = new MessageChannel(), events = new MessageChannel();
    this.#calls = calls.port1;
    this.#events = events.port1;
    const data: BridgeData = { url, calls: calls.port2, events: events.port2, answered: this.#answered };
    this.#worker = new Worker(new URL("./postgres_thread.ts", import.meta.url), {
      workerData: data,
      transferList: [calls.port2, events.port2],
    });
    this.#events.on("message", (e: JobEvent) => {
      for (const fn of this.#listeners) fn(e);
    });
  }

  /** A probe's answer: the database is back when it took the write. */
  #onProbe(a: BridgeAnswer): void {
    if (a.id !== this.#probe) return;
    this.#probe = null;
    if (a.ok && a.value === null) this.#downSince = null;
  }

  /**
   * Connects to `url` and migrates the database (waiting up to `openTimeoutMs`, 60 s). Throws
   * naming the database (without its password) and what failed.
   */
  static open(url: string, opts: { timeoutMs?: number; openTimeoutMs?: number } = {}): PostgresBridgeStore {
    const store = new PostgresBridgeStore(url, opts.timeoutMs ?? 10_000);
    try {
      store.#version = store.#call("open", [], opts.openTimeoutMs ?? 60_000) as number;
    } catch (e) {
      store.#shut();
      const msg = (e as Error).message;
      throw new Error(msg.startsWith("Cannot ") ? msg : `Cannot open job store "${redact(url)}": ${msg}`);
    }
    return store;
  }

  /** The schema version of the open database. */
  get schemaVersion(): number {
    return this.#version;
  }

  /** Closes the pool and ends the thread. */
  close(): void {
    if (this.#closed) return;
    try {
      this.#call("close", []);
    } finally {
      this.#shut();
    }
  }

  createJob(id: string, gpu: number, config: TrainConfig, owner: string | null = null): Job {
    return this.#call("createJob", [id, gpu, config, owner]) as Job;
  }
  getJob(id: string): Job | null {
    return this.#call("getJob", [id]) as Job | null;
  }
  listJobs(opts?: JobListOptions): Job[] {
    return this.#call("listJobs", [opts]) as Job[];
  }
  hasJob(id: string): boolean {
    return this.#call("hasJob", [id]) as boolean;
  }
  deleteJob(id: string): boolean {
    return this.#call("deleteJob", [id]) as boolean;
  }
  updateJob(id: string, patch: JobPatch, lease?: Lease): Job {
    return this.#call("updateJob", [id, patch, lease]) as Job;
  }
  nextQueued(gpu: number, skip?: string[]): Job | null {
    return this.#call("nextQueued", [gpu, skip]) as Job | null;
  }
  queue(gpu: number): Job[] {
    return this.#call("queue", [gpu]) as Job[];
  }
  queueLength(gpu: number): number {
    return this.#call("queueLength", [gpu]) as number;
  }
  waitingCount(owner?: string): number {
    return this.#call("waitingCount", [owner]) as number;
  }
  /**
   * Whether the database accepts a write now: null, or why not (a timeout included). Waits
   * {@link PROBE_TIMEOUT_MS} at most: it is asked often while the database is away, on the thread
   * that serves every request.
   */
  writeError(): string | null {
    try {
      return this.#call("writeError", [], Math.min(this.#timeoutMs, PROBE_TIMEOUT_MS)) as string | null;
    } catch (e) {
      return (e as Error).message;
    }
  }
  /** Calls `fn` with every event any host appends from now on, until the returned function is called. */
  onEvent(fn: (e: JobEvent) => void): () => void {
    this.#listeners.add(fn);
    return () => void this.#listeners.delete(fn);
  }
  markInterrupted(): Job[] {
    return this.#call("markInterrupted", []) as Job[];
  }
  requeueBeyond(gpus: number): void {
    this.#call("requeueBeyond", [gpus]);
  }
  countByStatus(owner?: string): Record<JobStatus, number> {
    return this.#call("countByStatus", [owner]) as Record<JobStatus, number>;
  }
  addMetric(jobId: string, p: Omit<MetricPoint, "at">, lease?: Lease): void {
    this.#call("addMetric", [jobId, p, lease]);
  }
  metrics(jobId: string): MetricPoint[] {
    return this.#call("metrics", [jobId]) as MetricPoint[];
  }
  addEvent(jobId: string, type: JobEventType, data: Record<string, unknown>, lease?: Lease): JobEvent {
    return this.#call("addEvent", [jobId, type, data, lease]) as JobEvent;
  }
  eventsAfter(jobId: string, afterId?: number, limit?: number): JobEvent[] {
    return this.#call("eventsAfter", [jobId, afterId, limit]) as JobEvent[];
  }
  registerHost(host: HostReport): void {
    this.#call("registerHost", [host]);
  }
  hosts(): HostRecord[] {
    return this.#call("hosts", []) as HostRecord[];
  }
  releaseHost(hostId: string): Job[] {
    return this.#call("releaseHost", [hostId]) as Job[];
  }
  claimNext(
    hostId: string,
    capacity: number,
    leaseMs: number,
    takeover = true,
    skip?: string[],
  ): Claim | null {
    return this.#call("claimNext", [hostId, capacity, leaseMs, takeover, skip]) as Claim | null;
  }
  heartbeat(host: HostReport, leases: Lease[], leaseMs: number): HeartbeatResult {
    return this.#call("heartbeat", [host, leases, leaseMs]) as HeartbeatResult;
  }
  release(lease: Lease): void {
    this.#call("release", [lease]);
  }
  confirmLease(lease: Lease, leaseMs: number): boolean {
    return this.#call("confirmLease", [lease, leaseMs]) as boolean;
  }
  putUser(name: string): UserRecord {
    return this.#call("putUser", [name]) as UserRecord;
  }
  users(): UserRecord[] {
    return this.#call("users", []) as UserRecord[];
  }
  setQuotas(name: string, quotas: Record<string, number>): boolean {
    return this.#call("setQuotas", [name, quotas]) as boolean;
  }
  createToken(token: TokenRecord): void {
    this.#call("createToken", [token]);
  }
  tokens(): TokenRecord[] {
    return this.#call("tokens", []) as TokenRecord[];
  }
  revokeToken(id: string, at: string): boolean {
    return this.#call("revokeToken", [id, at]) as boolean;
  }
  touchTokens(uses: Array<{ id: string; at: string }>): void {
    this.#call("touchTokens", [uses]);
  }
  addResource(kind: string, id: string, owner: string): void {
    this.#call("addResource", [kind, id, owner]);
  }
  resourceOwners(kind: string, id: string): string[] {
    return this.#call("resourceOwners", [kind, id]) as string[];
  }
  removeResource(kind: string, id: string): void {
    this.#call("removeResource", [kind, id]);
  }
  addAudit(e: Omit<AuditEvent, "id" | "at">): AuditEvent {
    return this.#call("addAudit", [e]) as AuditEvent;
  }
  audit(opts?: { before?: number; limit?: number; user?: string }): AuditEvent[] {
    return this.#call("audit", [opts]) as AuditEvent[];
  }
  gpuSeconds(owner: string, since: string): number {
    return this.#call("gpuSeconds", [owner, since]) as number;
  }

  /**
   * Posts a call to the thread and waits for its answer. While the database is known to be away
   * (the last call found it unreachable), calls fail at once instead of each waiting on it, and a
   * probe is sent that nobody waits for; its answer (a write taken) lets calls through again.
   */
  #call(method: string, args: unknown[], timeoutMs = this.#timeoutMs): unknown {
    if (this.#closed) throw new Error(`Cannot run "${method}": the PostgreSQL job store is closed`);
    if (this.#downSince !== null && method !== "close") {
      // The probe's answer, if it came (read here, never through a listener on this port: one
      // would take answers that a waiting call then never sees).
      for (let m = receiveMessageOnPort(this.#calls); m; m = receiveMessageOnPort(this.#calls)) {
        this.#onProbe(m.message as BridgeAnswer);
      }
    }
    if (this.#downSince !== null && method !== "close") {
      this.#sendProbe();
      throw new StoreUnavailableError(
        `PostgreSQL is unreachable since ${
          new Date(this.#downSince).toISOString()
        } (${method}): ${this.#downError}`,
      );
    }
    try {
      return this.#wait(method, args, timeoutMs);
    } catch (e) {
      if (e instanceof StoreUnavailableError) {
        this.#downSince ??= Date.now();
        this.#downError = e.message.replace(/^PostgreSQL is unreachable \([^)]*\): /, "");
      }
      throw e;
    }
  }

  #sendProbe(): void {
    if (this.#probe !== null) return;
    const id = this.#probe = ++this.#next;
    this.#calls.postMessage(
      { id, method: "writeError", args: [], timeoutMs: PROBE_TIMEOUT_MS } satisfies BridgeCall,
    );
  }

  #wait(method: string, args: unknown[], timeoutMs: number): unknown {
    const id = ++this.#next;
    const deadline = performance.now() + timeoutMs;
    let seen = Atomics.load(this.#answered, 0);
    this.#calls.postMessage({ id, method, args, timeoutMs } satisfies BridgeCall);
    for (;;) {
      for (let m = receiveMessageOnPort(this.#calls); m; m = receiveMessageOnPort(this.#calls)) {
        const a = m.message as BridgeAnswer;
        if (a.id !== id) {
          this.#onProbe(a); // a probe's answer, or the late answer of a call that timed out
          continue;
        }
        if (a.ok) return a.value;
        if (a.error.name === "LeaseLostError") throw new LeaseLostError(a.error.lease as Lease);
        if (a.error.name === "StoreUnavailableError") {
          throw new StoreUnavailableError(`PostgreSQL is unreachable (${method}): ${a.error.message}`);
        }
        throw new Error(a.error.message);
      }
      const left = deadline - performance.now();
      if (left <= 0) {
        throw new StoreUnavailableError(`PostgreSQL did not answer "${method}" within ${timeoutMs / 1000} s`);
      }
      Atomics.wait(this.#answered, 0, seen, left);
      seen = Atomics.load(this.#answered, 0);
    }
  }

  #shut(): void {
    this.#closed = true;
    this.#calls.close();
    this.#events.close();
    void this.#worker.terminate();
  }
}
