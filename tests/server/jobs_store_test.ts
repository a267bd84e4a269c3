/**
 * The job store on both engines (SQLite and PostgreSQL, tests/_stores.ts): persistence across
 * reopen, merged metric updates, the per-GPU queue order (interrupted jobs first, then FIFO), a
 * waiting job moved to another GPU's queue, event ids for replay, and the metrics history. Then
 * the data directory's lock.
 */

import assert from "node:assert/strict";
import { lockDataDir } from "../../server/lock.ts";
import { type TrainConfig } from "../../server/jobs/mod.ts";
import { storeSuite } from "../_stores.ts";

const config = { model: "gpt2-tiny", dataset: "sotu", train_iters: 10 } as TrainConfig;

storeSuite("JobStore", [
  ["keeps jobs, events and metrics across a reopen", async (db) => {
    let store = await db.open();
    await store.createJob("job_a", 0, config);
    await store.updateJob("job_a", { status: "running", iteration: 5, metrics: { loss: 7 } });
    await store.updateJob("job_a", { metrics: { val_loss: 7.5 } });
    const e1 = await store.addEvent("job_a", "log", { message: "a" });
    const e2 = await store.addEvent("job_a", "progress", { iteration: 5 });
    await store.addMetric("job_a", {
      iteration: 5,
      split: "train",
      loss: 7,
      perplexity: Math.exp(7),
      lr: 1e-3,
      tokens_per_s: 10,
    });
    await store.close();

    store = await db.open();
    const job = (await store.getJob("job_a"))!;
    assert.equal(job.status, "running");
    assert.equal(job.iteration, 5);
    assert.equal(job.metrics.loss, 7);
    assert.equal(job.metrics.val_loss, 7.5);
    assert.equal(job.metrics.tokens_per_s, null);
    assert.deepEqual(job.config, config);
    assert.ok(e2.id > e1.id);
    assert.deepEqual((await store.eventsAfter("job_a")).map((e) => [e.id, e.type, e.data]), [
      [e1.id, "log", { message: "a" }],
      [e2.id, "progress", { iteration: 5 }],
    ]);
    assert.deepEqual((await store.eventsAfter("job_a", e1.id)).map((e) => e.id), [e2.id]);
    assert.deepEqual((await store.metrics("job_a")).map((m) => [m.iteration, m.split, m.loss]), [[
      5,
      "train",
      7,
    ]]);
    assert.equal(await store.getJob("job_missing"), null);
    await assert.rejects(async () => await store.updateJob("job_missing", { iteration: 1 }), {
      message: 'Cannot update job "job_missing": no such job',
    });
    await store.close();
  }],
  ["nextQueued() serves interrupted jobs first, then FIFO, per GPU", async (db) => {
    const store = await db.open();
    for (const [id, gpu] of [["a", 0], ["b", 1], ["c", 0], ["d", 0]] as const) {
      await store.createJob(id, gpu, config);
    }
    assert.equal((await store.nextQueued(0))!.id, "a");
    assert.equal((await store.nextQueued(1))!.id, "b");
    await store.updateJob("d", { status: "running" });
    assert.deepEqual((await store.markInterrupted()).map((j) => j.id), ["d"]);
    assert.deepEqual((await store.queue(0)).map((j) => j.id), ["d", "a", "c"]);
    assert.deepEqual(await store.countByStatus(), {
      queued: 3,
      running: 0,
      succeeded: 0,
      failed: 0,
      cancelled: 0,
      interrupted: 1,
    });
    assert.deepEqual((await store.listJobs()).map((j) => j.id), ["d", "c", "b", "a"]);
    await store.requeueBeyond(1); // restarted with one GPU: b moves from GPU 1 to GPU 0
    assert.deepEqual((await store.queue(0)).map((j) => j.id), ["d", "a", "b", "c"]);
    // A waiting job moved to another GPU's queue (the runner's free GPU taking it).
    assert.equal((await store.updateJob("c", { gpu: 1 })).gpu, 1);
    assert.deepEqual((await store.queue(0)).map((j) => j.id), ["d", "a", "b"]);
    assert.equal((await store.nextQueued(1))!.id, "c");
    await store.close();
  }],
  ["lists pages, counts waiting jobs, deletes a job with its history and probes writes", async (db) => {
    const store = await db.open();
    for (const id of ["p1", "p2", "p3"]) await store.createJob(id, 0, config);
    await store.addEvent("p2", "log", { message: "x" });
    await store.addMetric("p2", {
      iteration: 1,
      split: "train",
      loss: 1,
      perplexity: null,
      lr: null,
      tokens_per_s: null,
    });
    assert.deepEqual((await store.listJobs({ limit: 2 })).map((j) => j.id), ["p3", "p2"]);
    assert.deepEqual((await store.listJobs({ after: "p2" })).map((j) => j.id), ["p1"]);
    assert.deepEqual(await store.listJobs({ after: "nope" }), []);
    assert.equal(await store.waitingCount(), 3);
    assert.equal(await store.queueLength(0), 3);
    assert.equal(await store.hasJob("p2"), true);
    assert.equal(await store.deleteJob("p2"), true);
    assert.equal(await store.deleteJob("p2"), false);
    assert.deepEqual(await store.eventsAfter("p2"), []);
    assert.deepEqual(await store.metrics("p2"), []);
    assert.equal(await store.writeError(), null);
    // Page size and precision: float64 losses come back exactly.
    for (let i = 0; i < 5; i++) await store.addEvent("p1", "log", { i });
    assert.deepEqual((await store.eventsAfter("p1", 0, 2)).map((e) => e.data.i), [0, 1]);
    await store.addMetric("p1", {
      iteration: 2,
      split: "valid",
      loss: 3.141592653589793,
      perplexity: 23.140692632779267,
      lr: 6e-4,
      tokens_per_s: 1234.5,
    });
    assert.deepEqual((await store.metrics("p1")).map((m) => [m.loss, m.perplexity, m.lr]), [
      [3.141592653589793, 23.140692632779267, 6e-4],
    ]);
    await store.close();
  }],
  ["onEvent() hears appended events", async (db) => {
    const store = await db.open();
    await store.createJob("e1", 0, config);
    const heard: number[] = [];
    const done = Promise.withResolvers<void>();
    const off = store.onEvent((e) => {
      heard.push(e.id);
      if (heard.length === 2) done.resolve();
    });
    const a = await store.addEvent("e1", "log", { message: "a" });
    const b = await store.addEvent("e1", "log", { message: "b" });
    await done.promise;
    off();
    assert.deepEqual(heard, [a.id, b.id]);
    await store.close();
  }],
], { bridge: true });

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
