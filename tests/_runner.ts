/**
 * Shared setup of the tests that drive the job runner with real GPU Workers: a runner with `gpus`
 * Worker threads on the test adapter and the built-in dataset prepared, a job run to its end with
 * its training losses, and the loss comparison the parallelism tests make.
 */

import { spawnGpuWorker } from "../host/local_port.ts";
import assert from "node:assert/strict";
import { isBuiltinName, prepareDataset } from "../data/mod.ts";
import { type Job, JobRunner, JobStore, type TrainRequest } from "../server/jobs/mod.ts";

/** Runs `fn` with a started runner of `gpus` Workers over a fresh data directory, then tears both down. */
export async function withWorkerRunner(
  prefix: string,
  gpus: number,
  fn: (runner: JobRunner, root: string) => Promise<void>,
): Promise<void> {
  const root = await Deno.makeTempDir({ prefix });
  const store = new JobStore(":memory:");
  const runner = new JobRunner(store, {
    root,
    gpus,
    spawn: spawnGpuWorker,
    datasetExists: (id) => Promise.resolve(isBuiltinName(id)),
  });
  try {
    await prepareDataset(root, { builtin: "sotu" });
    runner.start();
    await fn(runner, root);
  } finally {
    runner.shutdown();
    store.close();
    await Deno.remove(root, { recursive: true });
  }
}

/** Submits a job and waits for its end; returns it with the training loss of every logged iteration. */
export async function trainJob(
  runner: JobRunner,
  req: TrainRequest,
): Promise<{ job: Job; losses: Map<number, number> }> {
  const losses = new Map<number, number>();
  const submitted = await runner.submit(req);
  const job = await new Promise<Job>((resolve) => {
    const off = runner.subscribe(submitted.id, (e) => {
      if (e.type === "progress" && e.data.kind === "train") {
        losses.set(e.data.iteration as number, e.data.loss as number);
      }
      if (e.type === "done") {
        off();
        resolve(runner.get(submitted.id));
      }
    });
  });
  return { job, losses };
}

/** Asserts that two runs logged the same losses (within 1e-5 relative) at `iterations`. */
export function assertSameLosses(
  a: Map<number, number>,
  b: Map<number, number>,
  iterations: number[],
  what: string,
): void {
  for (const i of iterations) {
    const x = a.get(i), y = b.get(i);
    assert.ok(x !== undefined && y !== undefined, `${what}: no loss at iteration ${i}`);
    const rel = Math.abs(x - y) / Math.abs(y);
    assert.ok(rel <= 1e-5, `${what}: iteration ${i} loss ${x} vs ${y} (relative ${rel.toExponential(2)})`);
  }
}
