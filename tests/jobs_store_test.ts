/**
 * JobStore on SQLite: persistence across reopen, merged metric updates, the per-GPU queue order
 * (interrupted jobs first, then FIFO), event ids for replay, and the metrics history.
 */

import assert from "node:assert/strict";
import { JobStore, lockDataDir, type TrainConfig } from "../server/jobs/mod.ts";

const config = { model: "gpt2-tiny", dataset: "sotu", train_iters: 10 } as TrainConfig;

Deno.test("JobStore keeps jobs, events and metrics across a reopen", async () => {
  const dir = await Deno.makeTempDir({ prefix: "gpt2_store_" });
  try {
    let store = new JobStore(`${dir}/jobs.sqlite`);
    store.createJob("job_a", 0, config);
    store.updateJob("job_a", { status: "running", iteration: 5, metrics: { loss: 7 } });
    store.updateJob("job_a", { metrics: { val_loss: 7.5 } });
    const e1 = store.addEvent("job_a", "log", { message: "a" });
    const e2 = store.addEvent("job_a", "progress", { iteration: 5 });
    store.addMetric("job_a", {
      iteration: 5,
      split: "train",
      loss: 7,
      perplexity: Math.exp(7),
      lr: 1e-3,
      tokens_per_s: 10,
    });
    store.close();

    store = new JobStore(`${dir}/jobs.sqlite`);
    const job = store.getJob("job_a")!;
    assert.equal(job.status, "running");
    assert.equal(job.iteration, 5);
    assert.equal(job.metrics.loss, 7);
    assert.equal(job.metrics.val_loss, 7.5);
    assert.equal(job.metrics.tokens_per_s, null);
    assert.deepEqual(job.config, config);
    assert.ok(e2.id > e1.id);
    assert.deepEqual(store.eventsAfter("job_a").map((e) => [e.id, e.type, e.data]), [
      [e1.id, "log", { message: "a" }],
      [e2.id, "progress", { iteration: 5 }],
    ]);
    assert.deepEqual(store.eventsAfter("job_a", e1.id).map((e) => e.id), [e2.id]);
    assert.deepEqual(store.metrics("job_a").map((m) => [m.iteration, m.split, m.loss]), [[5, "train", 7]]);
    assert.equal(store.getJob("job_missing"), null);
    assert.throws(() => store.updateJob("job_missing", { iteration: 1 }), {
      message: 'Cannot update job "job_missing": no such job',
    });
    store.close();
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("JobStore.nextQueued() serves interrupted jobs first, then FIFO, per GPU", () => {
  const store = new JobStore(":memory:");
  for (const [id, gpu] of [["a", 0], ["b", 1], ["c", 0], ["d", 0]] as const) store.createJob(id, gpu, config);
  assert.equal(store.nextQueued(0)!.id, "a");
  assert.equal(store.nextQueued(1)!.id, "b");
  store.updateJob("d", { status: "running" });
  assert.deepEqual(store.markInterrupted().map((j) => j.id), ["d"]);
  assert.deepEqual(store.queue(0).map((j) => j.id), ["d", "a", "c"]);
  assert.deepEqual(store.countByStatus(), {
    queued: 3,
    running: 0,
    succeeded: 0,
    failed: 0,
    cancelled: 0,
    interrupted: 1,
  });
  assert.deepEqual(store.listJobs().map((j) => j.id), ["d", "c", "b", "a"]);
  store.requeueBeyond(1); // restarted with one GPU: b moves from GPU 1 to GPU 0
  assert.deepEqual(store.queue(0).map((j) => j.id), ["d", "a", "b", "c"]);
  store.close();
});

Deno.test({
  name: "lockDataDir() lets one server hold a data directory and names the lock when taken",
  sanitizeOps: false,
  sanitizeResources: false,
  fn: async () => {
    const dir = await Deno.makeTempDir({ prefix: "gpt2_lock_" });
    const held = await lockDataDir(dir);
    try {
      assert.equal(await Deno.readTextFile(`${dir}/server.lock`), `${Deno.pid}\n`);
      await assert.rejects(lockDataDir(dir, 100), {
        message: `Cannot use data directory "${dir}": another server holds "${dir}/server.lock"`,
      });
    } finally {
      held.close();
      await Deno.remove(dir, { recursive: true });
    }
  },
});
