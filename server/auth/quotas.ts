/**
 * Each user's quotas (server/settings.ts, {@link Quotas}): the settings' defaults, overridden per
 * user by an admin. Checked where work is admitted: a job submitted past `queued_jobs` or a day's
 * `gpu_seconds_per_day`, a generation stream past `streams`, each a 429 naming the quota and when
 * it frees (QuotaError). `running_gpus` is the scheduler's: the runner skips the waiting jobs of
 * users whose running jobs hold that many GPUs ({@link QuotaBook.atRunningQuota}), and the queue takes users in turn (the store's
 * fair-share order). The bootstrap token and a server with no token configured have no quotas.
 */

import { QuotaError } from "../../job/errors.ts";
import type { JobStore } from "../jobs/job_store.ts";
import { workersOf } from "../jobs/store_schema.ts";
import type { Quotas } from "../settings.ts";
import type { Principal } from "./token_auth.ts";

/** How long the users' own quotas are reused before they are read again (ms). */
const USERS_CACHE_MS = 1000;

/** What a user holds now, against their quotas. */
export interface Usage {
  queued_jobs: number;
  running_gpus: number;
  streams: number;
  gpu_seconds_per_day: number;
}

/** The start of the current UTC day, and seconds until the next. */
function utcDay(nowMs: number): { since: string; left: number } {
  const start = new Date(nowMs);
  start.setUTCHours(0, 0, 0, 0);
  return { since: start.toISOString(), left: Math.ceil((start.getTime() + 86_400_000 - nowMs) / 1000) };
}

/** Quotas of every user, and the streams each holds on this host. */
export class QuotaBook {
  #store: JobStore;
  #defaults: Quotas;
  #own: { at: number; byUser: Map<string, Partial<Quotas>> } | null = null;
  #streams = new Map<string, number>();
  #now: () => number;

  constructor(store: JobStore, defaults: Quotas, now: () => number = Date.now) {
    this.#store = store;
    this.#defaults = defaults;
    this.#now = now;
  }

  /** The settings' defaults. */
  get defaults(): Quotas {
    return { ...this.#defaults };
  }

  /** User `user`'s quotas: their own where an admin set them, else the defaults. */
  of(user: string): Quotas {
    const now = performance.now();
    if (!this.#own || now - this.#own.at > USERS_CACHE_MS) {
      this.#own = {
        at: now,
        byUser: new Map(this.#store.users().map((u) => [u.name, u.quotas as Partial<Quotas>])),
      };
    }
    return { ...this.#defaults, ...this.#own.byUser.get(user) };
  }

  /** Forgets the cached per-user quotas (an admin just changed some). */
  changed(): void {
    this.#own = null;
  }

  /** What `user` holds now. */
  usage(user: string): Usage {
    const counts = this.#store.countByStatus(user);
    return {
      queued_jobs: counts.queued + counts.interrupted,
      running_gpus: this.#runningGpus().get(user) ?? 0,
      streams: this.#streams.get(user) ?? 0,
      gpu_seconds_per_day: Math.round(this.#store.gpuSeconds(user, utcDay(this.#now()).since)),
    };
  }

  /** Throws QuotaError when `p`'s user may not queue another job now. */
  admitJob(p: Principal): void {
    const user = p.user;
    if (user === null) return;
    const q = this.of(user);
    const waiting = this.#store.waitingCount(user);
    if (waiting >= q.queued_jobs) {
      throw new QuotaError(
        "queued_jobs",
        `Quota "queued_jobs" reached: user "${user}" has ${waiting} jobs waiting (limit ${q.queued_jobs}); ` +
          "it frees when one of them starts, is cancelled or deleted",
      );
    }
    const day = utcDay(this.#now());
    const used = this.#store.gpuSeconds(user, day.since);
    if (used >= q.gpu_seconds_per_day) {
      throw new QuotaError(
        "gpu_seconds_per_day",
        `Quota "gpu_seconds_per_day" reached: user "${user}" used ${Math.round(used)} GPU-seconds today ` +
          `(limit ${q.gpu_seconds_per_day}); it frees at ${
            new Date(Date.parse(day.since) + 86_400_000).toISOString()
          }`,
        day.left,
      );
    }
  }

  /** Holds one of `p`'s generation streams (QuotaError past `streams`); call the answer to give it back. */
  openStream(p: Principal, request?: { needs: number; held: number }): () => void {
    const user = p.user;
    if (user === null) return () => {};
    const q = this.of(user);
    const open = this.#streams.get(user) ?? 0;
    if (open >= q.streams) {
      // A request of n choices holds its streams one by one: say what it needs, beside what was open before it.
      const before = open - (request?.held ?? 0);
      const message = request && request.needs > q.streams
        ? `Quota "streams": this request needs ${request.needs} generation streams (n = ${request.needs}), ` +
          `more than user "${user}"'s limit of ${q.streams}: lower n`
        : `Quota "streams" reached: user "${user}" has ${before} generation streams open (limit ${q.streams})` +
          (request && request.needs > 1 ? ` and this request needs ${request.needs}` : "") +
          "; it frees when one of them ends";
      throw new QuotaError("streams", message, 1);
    }
    this.#streams.set(user, open + 1);
    let held = true;
    return () => {
      if (!held) return;
      held = false;
      const left = (this.#streams.get(user) ?? 1) - 1;
      if (left > 0) this.#streams.set(user, left);
      else this.#streams.delete(user);
    };
  }

  /** GPU Workers each user's running jobs hold (data_parallel × tensor_parallel each), on every host. */
  #runningGpus(): Map<string, number> {
    const held = new Map<string, number>();
    for (const job of this.#store.listJobs({ status: "running", limit: 10_000 })) {
      if (job.owner !== undefined) held.set(job.owner, (held.get(job.owner) ?? 0) + workersOf(job.config));
    }
    return held;
  }

  /** Users whose running jobs hold their `running_gpus` quota or more: their waiting jobs wait. */
  atRunningQuota(): string[] {
    return [...this.#runningGpus()].filter(([user, n]) => n >= this.of(user).running_gpus).map(([user]) =>
      user
    );
  }
}
