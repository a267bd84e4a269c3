/**
 * Where a job waits on one host (per-GPU queues; with several hosts the queue is shared and
 * leases place jobs instead): the GPU a new job is queued on, a free GPU taking the next job of
 * another GPU's queue when its own has nothing it may run, and the jobs of a GPU with no device
 * moving to one that works. The job runner asks; the records are written through its JobRecords.
 */

import type { JobStore } from "./job_store.ts";
import { workersOf } from "./store_schema.ts";
import type { JobRecords } from "./job_records.ts";
import type { GpuSlot } from "../gpus/gpu_pool.ts";
import type { Job } from "../../job/job.ts";

/** What placement reads and does through the runner. */
export interface PlacementDeps {
  store: JobStore;
  records: JobRecords;
  /** The slots that take training jobs. */
  trainSlots: () => GpuSlot[];
  /** Owners at their running quota (their waiting jobs wait), or none. */
  skipOwners?: () => string[];
  /** Starts the next waiting job on `gpu` if its Worker is free. */
  dispatch: (gpu: number) => void;
}

/** Whether waiting job `a` goes before `b` from another GPU's queue: interrupted first, then the older. */
function waitedLonger(a: Job, b: Job): boolean {
  const ai = a.status === "interrupted", bi = b.status === "interrupted";
  return ai !== bi ? ai : a.created_at < b.created_at;
}

/** The GPU queues of one host. */
export class Placement {
  #d: PlacementDeps;

  constructor(deps: PlacementDeps) {
    this.#d = deps;
  }

  /**
   * The training GPU a new job is queued on: the least loaded (jobs waiting plus the one running)
   * of those that work. Jobs held by their owner's running quota do not load a GPU: another user's
   * job goes past them.
   */
  pickGpu(): number {
    const { store } = this.#d, candidates = this.#d.trainSlots();
    const held = this.#d.skipOwners?.() ?? [];
    const waiting = (gpu: number) =>
      held.length === 0
        ? store.queueLength(gpu)
        : store.queue(gpu).filter((j) => j.owner === undefined || !held.includes(j.owner)).length;
    let best = candidates[0]?.index ?? 0, bestLoad = Infinity;
    for (const s of candidates) {
      if (s.state === "unavailable" && candidates.some((o) => o.state !== "unavailable")) continue;
      const load = waiting(s.index) + (s.job ? 1 : 0);
      if (load < bestLoad) [best, bestLoad] = [s.index, load];
    }
    return best;
  }

  /**
   * `slot`, a free training GPU, has nothing it may run in its own queue. It takes the job another
   * training GPU's queue would run next (fair-share order, owners at their running quota passed
   * over) when that job needs one GPU; of several such queues, the job waiting longest
   * (interrupted ones first). The job's recorded GPU becomes this one. A data-parallel job next in
   * its queue is not passed over (it gathers GPUs from its own queue's turn, as ever), and a queue
   * whose GPU is free keeps its job (that GPU takes it).
   */
  steal(slot: GpuSlot): Job | null {
    const train = this.#d.trainSlots();
    if (!train.includes(slot)) return null;
    const skip = this.#d.skipOwners?.() ?? [];
    let best: Job | null = null;
    for (const s of train) {
      if (s === slot || (s.state === "idle" && !s.job && !s.reserved)) continue;
      const job = this.#d.store.nextQueued(s.index, skip);
      if (!job || workersOf(job.config) > 1) continue;
      if (!best || waitedLonger(job, best)) best = job;
    }
    if (!best) return null;
    this.#d.records.update(best.id, { gpu: slot.index });
    this.#d.records.emit(best.id, "log", {
      level: "info",
      message: `Moved from GPU ${best.gpu}'s queue to GPU ${slot.index}, free first`,
    });
    return { ...best, gpu: slot.index };
  }

  /**
   * GPU `slot` has no device. What waits in its queue moves to the training GPU with the shortest
   * queue among those that work (a data-parallel job only if they are enough for its ranks); what
   * none can take fails with the reason instead of queueing forever.
   */
  rehome(slot: GpuSlot): void {
    const { records } = this.#d;
    const working = this.#d.trainSlots().filter((s) => s.state !== "unavailable").length;
    const moved = new Set<number>();
    for (const job of this.#d.store.queue(slot.index)) {
      if (workersOf(job.config) > working) {
        records.finish(job.id, "failed", job.iteration, slot.error);
        continue;
      }
      const gpu = this.pickGpu(); // a working one: some is
      records.update(job.id, { gpu });
      records.emit(job.id, "log", {
        level: "warn",
        message: `GPU ${slot.index} is unavailable (${slot.error}): moved to GPU ${gpu}'s queue`,
      });
      moved.add(gpu);
    }
    for (const gpu of moved) this.#d.dispatch(gpu);
  }
}
