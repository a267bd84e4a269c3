/**
 * The fence on checkpoint files (several hosts): before committing a checkpoint, a Worker asks
 * (`commit_check`) and is answered from the lease as the database has it at that moment, not from
 * this host's memory. A refused job is stopped here: nothing more is written for it, and a Worker
 * that has not ended it within the commit check's time is replaced. One host always may commit.
 */

import { COMMIT_CHECK_MS, type FromWorker } from "../../protocol.ts";
import type { GpuPool, GpuSlot } from "../gpus/gpu_pool.ts";
import type { JobRecords } from "./job_records.ts";
import type { LeaseKeeper } from "./leases.ts";
import type { StoreBacklog } from "./store_backlog.ts";

/** Between two asks of an unreachable database whether a checkpoint may be committed, ms. */
const COMMIT_RETRY_MS = 500;

/** What the fence reads and acts on: the job runner's parts. */
export interface CommitFenceDeps {
  /** Several hosts' leases; without them every commit is allowed. */
  leases: LeaseKeeper | undefined;
  pool: GpuPool;
  records: JobRecords;
  backlog: StoreBacklog;
  /** Whether the runner has shut down (its Workers are gone). */
  stopped: () => boolean;
  /** A job stopped here by the fence: its count of crashes is dropped. */
  forgetCrashes: (id: string) => void;
}

/** Answers Workers' `commit_check`s and stops the jobs it refuses. */
export class CommitFence {
  #deps: CommitFenceDeps;
  /** Jobs whose checkpoint was refused at its commit: when their Workers are replaced if they have not ended. */
  #timers = new Map<string, ReturnType<typeof setTimeout>>();

  constructor(deps: CommitFenceDeps) {
    this.#deps = deps;
  }

  /** The runner shuts down: no Worker is replaced any more. */
  stop(): void {
    for (const timer of this.#timers.values()) clearTimeout(timer);
    this.#timers.clear();
  }

  /**
   * A Worker asks whether it may commit a checkpoint of job `msg.id` (the fence on the files).
   * One host always may. With several, the lease is read from the database now, not from this
   * host's memory: only while its epoch is still the job's and it has not expired (it is then
   * renewed for a whole lease, so no other host can claim the job before the rename). Otherwise
   * the answer is no: the Worker removes the checkpoint's temporary folder and ends the job, and
   * nothing more is written for it here. A database that does not answer is a no as well.
   */
  check(
    slot: GpuSlot,
    msg: Extract<FromWorker, { type: "commit_check" }>,
    askedAt?: number,
  ): void {
    const first = askedAt === undefined;
    const asked = askedAt ?? Date.now();
    const answer = (held: boolean, reason: string | null) =>
      slot.worker.postMessage({ type: "commit_answer", id: msg.id, request: msg.request, held, reason });
    const leases = this.#deps.leases;
    if (!leases) return answer(true, null);
    if (this.#deps.stopped()) return; // the Worker is gone with the host
    let reason: string | null = null;
    if (this.#deps.records.lost.has(msg.id)) {
      reason = "another host took the job over";
    } else {
      try {
        if (!leases.confirm(msg.id)) {
          reason = `the database says host "${leases.hostId}" no longer holds its lease ` +
            "(expired, or claimed by another host)";
        }
      } catch (e) {
        // A database that is away: ask again while the Worker waits. Once it answers, the lease holds
        // unless another host claimed the job meanwhile (expired unclaimed, it is renewed).
        const until = asked + COMMIT_CHECK_MS - 2000;
        if (this.#deps.backlog.failed(e) && Date.now() + COMMIT_RETRY_MS < until) {
          if (first) {
            const message = `Checkpoint "${msg.name}" waits for the job store to confirm this host's lease ` +
              `(${(e as Error).message}); at most ${Math.round((until - asked) / 1000)} s`;
            console.error(`Job "${msg.id}": ${message}`);
            this.#deps.records.emit(msg.id, "log", { level: "warn", message });
          }
          setTimeout(() => this.check(slot, msg, asked), COMMIT_RETRY_MS);
          return;
        }
        reason = `its lease cannot be confirmed: ${(e as Error).message}`;
      }
    }
    if (reason === null) return answer(true, null);
    answer(false, reason);
    this.#fenced(msg.id, msg.name, reason);
  }

  /**
   * A checkpoint of job `id` was refused at its commit: the job is stopped here. Its Worker ends
   * the job itself once it has removed the checkpoint's temporary folder (its outcome is not
   * recorded: the job is another host's, or anyone's once its lease runs out); one that has not
   * ended within the commit check's time is replaced.
   */
  #fenced(id: string, name: string, reason: string): void {
    if (!this.#deps.records.lost.has(id)) {
      this.#deps.records.lost.add(id);
      this.#deps.leases?.forget(id);
      this.#deps.forgetCrashes(id);
      console.error(
        `Job "${id}": checkpoint "${name}" not committed, ${reason}: stopped here, nothing more is written for it`,
      );
    }
    if (this.#timers.has(id)) return;
    const workers = new Set(this.#deps.pool.slots.filter((s) => s.job === id).map((s) => s.worker));
    this.#timers.set(
      id,
      setTimeout(() => {
        this.#timers.delete(id);
        // Only the Workers of the fenced run, if they still run it (not a later claim of the job here).
        for (const s of [...this.#deps.pool.slots]) {
          if (s.job !== id || !workers.has(s.worker) || !this.#deps.records.lost.has(id)) continue;
          s.job = null;
          this.#deps.pool.replace(s);
        }
      }, COMMIT_CHECK_MS),
    );
  }

  /** A fenced job's Workers have all ended: no need to replace them. */
  settled(id: string): void {
    const timer = this.#timers.get(id);
    if (timer === undefined || this.#deps.pool.slots.some((s) => s.job === id)) return;
    clearTimeout(timer);
    this.#timers.delete(id);
  }
}
