/**
 * One host's side of the shared queue: registers the host, lets go of what it held before a
 * restart, claims jobs it can place, renews their leases on a heartbeat, and tells the runner
 * when a lease was lost (another host claimed the job after this one stopped renewing: stop it at
 * once and write nothing more) or when a cancel for a job it runs came through another host.
 *
 * Every write the runner makes for a job it holds passes {@link LeaseKeeper.lease}: the store
 * refuses it once another host's claim raised the job's epoch (LeaseLostError), so a host that
 * was paused or cut off past its lease cannot write to the job again even before its next
 * heartbeat tells it. The heartbeat runs every third of the lease, so two missed beats still
 * leave the lease alive. Before a checkpoint is committed the runner asks {@link LeaseKeeper.confirm}:
 * the files are fenced on the same lease, read from the database at that moment.
 */

import type { Job } from "../../job/job.ts";
import type { Claim, HeartbeatResult, HostReport, JobStore, Lease } from "./job_store.ts";
import { isStoreUnavailable } from "./store_schema.ts";

/** What the keeper needs from its host. */
export interface LeaseKeeperOptions {
  /** A store answering at once (SQLite, or PostgreSQL through server/jobs/postgres_bridge.ts). */
  store: JobStore;
  hostId: string;
  /** How long a claim lasts without a heartbeat (GPT2_LEASE_S × 1000). */
  leaseMs: number;
  /** Between heartbeats; default a third of the lease. */
  heartbeatMs?: number;
  /** The host's GPUs, free Workers and state, as of now. */
  report: () => Omit<HostReport, "id">;
  /** Another host took `jobId`: stop it now and write nothing more to it. */
  onLost: (jobId: string) => void;
  /** A cancel for `jobId` was sent through another host (called once per job). */
  onCancel: (jobId: string) => void;
  /** A heartbeat failed (the database is unreachable); the leases may run out. */
  onError?: (e: Error) => void;
}

/** Claims, renews and gives back one host's leases. */
export class LeaseKeeper {
  #opts: LeaseKeeperOptions;
  #held = new Map<string, Lease>();
  #cancelled = new Set<string>();
  #timer: ReturnType<typeof setInterval> | null = null;
  /** Before this time (ms), claims take no running job whose lease expired. */
  #takeoversFrom = 0;

  constructor(opts: LeaseKeeperOptions) {
    this.#opts = opts;
  }

  /** This host's id. */
  get hostId(): string {
    return this.#opts.hostId;
  }

  /**
   * Registers the host, lets go of every job it held before (a `running` one becomes
   * `interrupted`, claimable by any host at once; returned) and starts the heartbeat.
   */
  start(): Job[] {
    this.#opts.store.registerHost({ id: this.#opts.hostId, ...this.#opts.report() });
    const released = this.#opts.store.releaseHost(this.#opts.hostId);
    const every = this.#opts.heartbeatMs ?? Math.max(100, Math.floor(this.#opts.leaseMs / 3));
    this.#timer = setInterval(() => {
      try {
        this.beat();
      } catch {
        // reported through onError; the next beat tries again
      }
    }, every);
    return released;
  }

  /**
   * The database is back after an outage: every host's leases ran out meanwhile, though the hosts
   * may all be alive. For two heartbeats from now, claims leave expired running jobs to their hosts,
   * which renew them at their next beat; a host that is really gone loses its jobs after that.
   */
  holdTakeovers(): void {
    const every = this.#opts.heartbeatMs ?? Math.max(100, Math.floor(this.#opts.leaseMs / 3));
    this.#takeoversFrom = Date.now() + 2 * every + 500;
  }

  /** Stops the heartbeat (the leases run out unless released). */
  stop(): void {
    if (this.#timer !== null) clearInterval(this.#timer);
    this.#timer = null;
  }

  /**
   * Claims the next job this host can place on `capacity` free Workers, or null. Until
   * {@link holdTakeovers}'s time, a running job whose lease ran out is left to its host. The waiting
   * jobs of the owners in `skip` (at their running quota) are left waiting.
   */
  claim(capacity: number, skip: string[] = []): Claim | null {
    if (capacity < 1) return null;
    const takeover = Date.now() >= this.#takeoversFrom;
    const claim = this.#opts.store.claimNext(this.#opts.hostId, capacity, this.#opts.leaseMs, takeover, skip);
    if (claim) this.#held.set(claim.job.id, claim.lease);
    return claim;
  }

  /** The lease this host holds on `jobId`, if it still believes it does. */
  lease(jobId: string): Lease | undefined {
    return this.#held.get(jobId);
  }

  /**
   * Whether this host still holds `jobId` by the database now, not by this keeper's memory: the
   * lease's epoch is still the job's and it was not given back (see JobStoreEngine.confirmLease).
   * A lease that holds is renewed for a whole `leaseMs`. False when this host holds no lease on the job; a
   * database that does not answer throws.
   */
  confirm(jobId: string): boolean {
    const lease = this.#held.get(jobId);
    if (!lease) return false;
    return this.#opts.store.confirmLease(lease, this.#opts.leaseMs);
  }

  /** Job ids this host holds. */
  held(): string[] {
    return [...this.#held.keys()];
  }

  /** Gives `jobId` back (it finished, or stopped here to resume elsewhere). */
  release(jobId: string): void {
    const lease = this.#held.get(jobId);
    if (!lease) return;
    try {
      this.#opts.store.release(lease);
    } catch (e) {
      // A database that is away: still held, so the release can be tried again once it is back.
      if (!isStoreUnavailable(e)) this.forget(jobId);
      throw e;
    }
    this.forget(jobId);
  }

  /** Forgets `jobId` without a write (its lease was lost: the job is another host's now). */
  forget(jobId: string): void {
    this.#held.delete(jobId);
    this.#cancelled.delete(jobId);
  }

  /** One heartbeat now: renews every lease, reports lost ones and cancels from elsewhere. */
  beat(): HeartbeatResult {
    const leases = [...this.#held.values()];
    let result: HeartbeatResult;
    try {
      result = this.#opts.store.heartbeat(
        { id: this.#opts.hostId, ...this.#opts.report() },
        leases,
        this.#opts.leaseMs,
      );
    } catch (e) {
      this.#opts.onError?.(e as Error);
      throw e;
    }
    for (const id of result.lost) {
      // Only if it is still the same lease (a release or a new claim may have raced the beat).
      if (leases.some((l) => l.job_id === id && this.#held.get(id) === l)) {
        this.forget(id);
        this.#opts.onLost(id);
      }
    }
    for (const k of result.kept) {
      if (k.cancel_requested && this.#held.has(k.job_id) && !this.#cancelled.has(k.job_id)) {
        this.#cancelled.add(k.job_id);
        this.#opts.onCancel(k.job_id);
      }
    }
    return result;
  }
}
