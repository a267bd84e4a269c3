/**
 * What a caller may see and use. A job (training or evaluation) belongs to the user who made it,
 * and so do its checkpoints and the models they are; a dataset prepared from an upload belongs
 * to whoever prepared it; a resharded copy to whoever made it. A user sees their own and what an
 * admin shared (owner "*": built-in datasets and imported Hugging Face models are shared as
 * they are); an admin sees everything. Anything else answers as if it did not exist (404), so ids
 * do not leak. Lookups are cached for {@link CACHE_MS}: a generation request asks on every call.
 */

import { existsSync } from "node:fs";
import type { Job } from "../../job/job.ts";
import { JobNotFoundError } from "../../job/errors.ts";
import type { JobStore } from "../jobs/job_store.ts";
import type { Principal } from "./token_auth.ts";

/** How long an ownership lookup is reused (ms). */
const CACHE_MS = 2000;

/** Everyone: the owner of what an admin shared. */
export const SHARED = "*";

/** Ownership checks over a store and a data directory. */
export class Access {
  #store: JobStore;
  #checkpointDir: (id: string) => string;
  #owners = new Map<string, { at: number; owners: string[] | null }>();

  /** `checkpointDir(id)`: the folder of job (or copy) `id`'s checkpoints (JobRunner.checkpointDir). */
  constructor(store: JobStore, checkpointDir: (id: string) => string) {
    this.#store = store;
    this.#checkpointDir = checkpointDir;
  }

  /** Whether `p` may see job `job`. */
  canSeeJob(p: Principal, job: Job): boolean {
    return p.admin || (p.user !== null && job.owner === p.user);
  }

  /** Job `id` as `p` may see it; JobNotFoundError (404) when it does not exist or is another user's. */
  job(p: Principal, id: string, get: (id: string) => Job): Job {
    const job = get(id);
    if (!this.canSeeJob(p, job)) throw new JobNotFoundError(id);
    return job;
  }

  /**
   * Whether `p` may use model `id` ("<job id>", "<job id>/iter_N", a resharded copy's name or a
   * models/ folder): its job's owner, or a recorded owner, is `p`'s user or shared. A checkpoint
   * folder nobody owns (made before users existed) is for admins; a models/ folder is shared.
   */
  modelAllowed(p: Principal, id: string): boolean {
    if (p.admin) return true;
    const first = id.split("/")[0];
    const owners = this.#cached(`model:${first}`, () => {
      const job = /^[A-Za-z0-9_-]+$/.test(first) ? this.#store.getJob(first) : null;
      const owners = this.#store.resourceOwners("checkpoint", first);
      if (job) owners.push(job.owner ?? "");
      if (owners.length > 0) return owners;
      // No record: an imported model (shared), a folder from before users existed, or nothing.
      return /^[A-Za-z0-9][A-Za-z0-9._-]*$/.test(first) && existsSync(this.#checkpointDir(first)) ? [] : null;
    });
    return owners === null || allows(owners, p);
  }

  /** Whether `p` may use dataset `id`; `builtin` ones are shared. */
  datasetAllowed(p: Principal, id: string, builtin: boolean): boolean {
    if (p.admin || builtin) return true;
    const owners = this.#cached(`dataset:${id}`, () => this.#store.resourceOwners("dataset", id));
    // A prepared dataset with no recorded owner was made before users existed: admins only.
    return owners !== null && allows(owners, p);
  }

  /** Records that `p`'s user owns `kind`/`id` (nothing for a caller with no user: admins see it). */
  own(p: Principal, kind: "dataset" | "checkpoint", id: string): void {
    if (p.user === null) return;
    this.#store.addResource(kind, id, p.user);
    this.#owners.delete(`${kind === "dataset" ? "dataset" : "model"}:${id}`);
  }

  /** Shares `kind`/`id` with every user (an admin's decision). */
  share(kind: "dataset" | "checkpoint", id: string): void {
    this.#store.addResource(kind, id, SHARED);
    this.#owners.delete(`${kind === "dataset" ? "dataset" : "model"}:${id}`);
  }

  #cached(key: string, look: () => string[] | null): string[] | null {
    const now = performance.now(), hit = this.#owners.get(key);
    if (hit && now - hit.at < CACHE_MS) return hit.owners;
    if (this.#owners.size > 4096) this.#owners.clear();
    const owners = look();
    this.#owners.set(key, { at: now, owners });
    return owners;
  }
}

function allows(owners: string[], p: Principal): boolean {
  return owners.includes(SHARED) || (p.user !== null && owners.includes(p.user));
}
