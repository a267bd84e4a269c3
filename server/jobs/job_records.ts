/**
 * The job runner's writes: a job's record, metrics and events, and giving its lease back. While
 * the store is away they wait in order (store_backlog.ts). With several hosts each is fenced on
 * the lease this host holds at the time it is made: once another host took the job over
 * (`lost`), nothing more is written for it here, and a write the store refuses for that reason
 * tells the runner (`onLeaseLost`). Events reach the job's live subscribers once stored. A job's
 * outcomes are written here too: finished, interrupted by a shutdown, or its Worker crashed (it
 * resumes, or fails after repeated crashes without progress).
 */

import { isStoreUnavailable, type JobPatch, type JobStore, LeaseLostError } from "./job_store.ts";
import type { StoreBacklog } from "./store_backlog.ts";
import type { LeaseKeeper } from "./leases.ts";
import type { Job, JobEvent, JobEventType, MetricPoint } from "../../job/job.ts";

/** A job whose Worker died this many times without getting further fails instead of resuming again. */
const MAX_CRASHES_WITHOUT_PROGRESS = 3;

/** A live subscriber of a job's events (an SSE stream). */
export type Listener = (e: JobEvent) => void;

/** Writes a host makes for the jobs it runs, fenced and kept in order. */
export class JobRecords {
  #store: JobStore;
  #backlog: StoreBacklog;
  #leases: LeaseKeeper | undefined;
  #onLeaseLost: (id: string) => void;
  #listeners = new Map<string, Set<Listener>>();
  /** Jobs another host took over while they ran here: nothing more is written for them. */
  readonly lost = new Set<string>();
  /** Worker deaths per job since it last got further: id -> [count, iteration]. */
  #crashes = new Map<string, [number, number]>();

  constructor(
    store: JobStore,
    backlog: StoreBacklog,
    leases: LeaseKeeper | undefined,
    onLeaseLost: (id: string) => void,
  ) {
    this.#store = store;
    this.#backlog = backlog;
    this.#leases = leases;
    this.#onLeaseLost = onLeaseLost;
  }

  /** Calls `fn` with every new event of job `id` until the returned function is called. */
  subscribe(id: string, fn: Listener): () => void {
    let set = this.#listeners.get(id);
    if (!set) this.#listeners.set(id, set = new Set());
    set.add(fn);
    return () => {
      set.delete(fn);
      if (set.size === 0) this.#listeners.delete(id);
    };
  }

  /** Job `id` was deleted: its subscribers are dropped. */
  forget(id: string): void {
    this.#listeners.delete(id);
  }

  /** Every open stream gets a last, unstored `shutdown` event carrying `message`. */
  shutdownEvent(message: string): void {
    for (const [id, set] of this.#listeners) {
      const event: JobEvent = {
        id: 0,
        job_id: id,
        type: "shutdown",
        data: { message },
        at: new Date().toISOString(),
      };
      for (const fn of set) fn(event);
    }
  }

  /** Job `id` got further (or is no longer this host's): its count of crashes without progress starts over. */
  progressed(id: string): void {
    this.#crashes.delete(id);
  }

  /** Drops every subscriber (the runner stopped). */
  clear(): void {
    this.#listeners.clear();
  }

  /**
   * Gives job `id`'s lease back (several hosts): it finished, or any host may resume it now. After
   * the job's records (kept in order while the store is away); a store that stays away lets the
   * lease run out by itself.
   */
  release(id: string): void {
    const leases = this.#leases;
    if (this.lost.has(id) || !leases) return;
    this.#backlog.write(() => {
      if (this.lost.has(id)) return;
      try {
        leases.release(id);
      } catch (e) {
        if (isStoreUnavailable(e)) throw e;
        console.error(
          `Cannot give back the lease of job "${id}": ${(e as Error).message} (it runs out by itself)`,
        );
      }
    });
  }

  /**
   * Applies `patch` to job `id`, now or in order once the store is back, then calls `then` with the
   * job as stored. Fenced on the lease this host holds now (several hosts): a lost lease stops the
   * job here.
   */
  update(id: string, patch: JobPatch, then?: (job: Job) => void): void {
    if (this.lost.has(id)) return;
    const lease = this.#leases?.lease(id);
    this.#backlog.write(() => {
      if (this.lost.has(id)) return;
      let job: Job;
      try {
        job = this.#store.updateJob(id, patch, lease);
      } catch (e) {
        if (!(e instanceof LeaseLostError)) throw e;
        this.#onLeaseLost(id);
        return;
      }
      then?.(job);
    });
  }

  /** A metrics point, kept and fenced as {@link update}. */
  metric(id: string, p: Omit<MetricPoint, "at">): void {
    if (this.lost.has(id)) return;
    const lease = this.#leases?.lease(id);
    this.#backlog.write(() => {
      if (this.lost.has(id)) return;
      try {
        this.#store.addMetric(id, p, lease);
      } catch (e) {
        if (!(e instanceof LeaseLostError)) throw e;
        this.#onLeaseLost(id);
      }
    }, "metric");
  }

  /**
   * Stores and fans out an event. `fenced` (the runner's own events): on this host's lease of the
   * job, none once another host took it over; a user's cancel is recorded from any host.
   */
  emit(id: string, type: JobEventType, data: Record<string, unknown>, fenced = true): void {
    if (fenced && this.lost.has(id)) return;
    const lease = fenced ? this.#leases?.lease(id) : undefined;
    // While the store is away, events wait with the other records and reach live streams once written.
    this.#backlog.write(() => {
      if (fenced && this.lost.has(id)) return;
      let event: JobEvent;
      try {
        event = this.#store.addEvent(id, type, data, lease);
      } catch (e) {
        if (!(e instanceof LeaseLostError)) throw e;
        this.#onLeaseLost(id);
        return;
      }
      for (const fn of this.#listeners.get(id) ?? []) fn(event);
    });
  }

  /** A job a dead server (this one, before its restart) left running: logged, and finished if being cancelled. */
  recovered(job: Job): void {
    const cancelled = job.cancel_requested;
    this.emit(job.id, "log", {
      level: "warn",
      message: `Server restarted while job "${job.id}" was running at iteration ${job.iteration}: ` +
        (cancelled ? "it was being cancelled" : "resuming"),
      status: "interrupted",
    });
    if (cancelled) this.finish(job.id, "cancelled", job.iteration, null);
  }

  /** A job stopped by the server's shutdown after saving at `iteration`: it resumes there. */
  interrupted(id: string, iteration: number): void {
    this.update(id, { status: "interrupted", iteration });
    this.emit(id, "log", {
      level: "warn",
      message: `Stopped by server shutdown at iteration ${iteration}; resumes there on restart`,
      status: "interrupted",
      iteration,
    });
    this.release(id);
  }

  finish(
    id: string,
    status: "succeeded" | "failed" | "cancelled",
    iteration: number,
    error: string | null,
  ): void {
    const patch = { status, iteration, error, finished_at: new Date().toISOString() };
    // Not called when another host holds the job now.
    this.update(id, patch, (job) => {
      this.emit(id, "done", {
        status,
        iteration,
        error,
        loss: job.metrics.loss,
        val_loss: job.metrics.val_loss,
        test_loss: job.metrics.test_loss,
      });
      this.release(id);
    });
  }

  /** A job's Worker died: it resumes from its newest checkpoint, unless it keeps crashing without progress. */
  crashed(jobId: string, message: string): void {
    // It reads the job's iteration as stored: in order with the job's other records.
    this.#backlog.write(() => {
      const job = this.#store.getJob(jobId);
      const iteration = job?.iteration ?? 0;
      const [count, at] = this.#crashes.get(jobId) ?? [0, iteration];
      const crashes = at === iteration ? count + 1 : 1;
      this.#crashes.set(jobId, [crashes, iteration]);
      if (crashes >= MAX_CRASHES_WITHOUT_PROGRESS) {
        this.#crashes.delete(jobId);
        this.finish(
          jobId,
          "failed",
          iteration,
          `GPU worker crashed ${crashes} times at iteration ${iteration}: ${message}`,
        );
      } else {
        this.update(jobId, { status: "interrupted" });
        this.emit(jobId, "log", {
          level: "warn",
          message:
            `GPU worker crashed at iteration ${iteration} (${message}): resuming from the newest checkpoint`,
          status: "interrupted",
        });
        this.release(jobId);
      }
    });
  }
}
