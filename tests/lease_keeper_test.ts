/**
 * LeaseKeeper (server/jobs/leases.ts) on both engines: two keepers stand for two hosts on one
 * database. The heartbeat keeps a running job's lease alive past its length; a keeper whose
 * heartbeat stops (a paused or dead host) loses the job to the other, whose claim sees it, and
 * hears onLost at its next beat; a cancel written through one host reaches the holder once; a
 * restart under the same host id lets the jobs go.
 */

import assert from "node:assert/strict";
import type { TrainConfig } from "../server/jobs/mod.ts";
import type { JobStoreEngine } from "../server/jobs/job_store.ts";
import { LeaseKeeper } from "../server/jobs/leases.ts";
import { storeSuite } from "./_stores.ts";

const config = { model: "gpt2-tiny", dataset: "sotu", train_iters: 10 } as TrainConfig;
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

function keeper(store: JobStoreEngine, hostId: string, events: string[], leaseMs = 400) {
  return new LeaseKeeper({
    store,
    hostId,
    leaseMs,
    report: () => ({ gpus: 1, free: 1, state: "ready" }),
    onLost: (id) => events.push(`${hostId} lost ${id}`),
    onCancel: (id) => events.push(`${hostId} cancel ${id}`),
  });
}

storeSuite("LeaseKeeper", [
  ["keeps a lease alive, loses it once it stops beating, and hears a cancel once", async (db) => {
    const sa = await db.open(), sb = await db.open();
    const events: string[] = [];
    const a = keeper(sa, "A", events), b = keeper(sb, "B", events);
    try {
      assert.deepEqual(await a.start(), []);
      await b.start();
      await sa.createJob("j1", 0, config);
      await sa.createJob("j2", 0, config);
      const c1 = (await a.claim(1))!;
      assert.equal(c1.job.id, "j1");
      await sleep(700); // longer than the lease: A's heartbeat renews it
      assert.equal((await b.claim(1))!.job.id, "j2");
      assert.equal(await b.claim(1), null);
      assert.deepEqual((await sa.hosts()).map((h) => [h.id, h.jobs]).sort(), [["A", ["j1"]], ["B", ["j2"]]]);

      // A cancel through A for B's job reaches B at its next beat, once.
      await sa.updateJob("j2", { cancel_requested: true });
      await b.beat();
      await b.beat();
      assert.deepEqual(events, ["B cancel j2"]);

      a.stop(); // A pauses
      await sleep(600);
      const taken = (await b.claim(1))!;
      assert.equal(taken.job.id, "j1");
      assert.equal(taken.lease.epoch, 2);
      await assert.rejects(async () => await sa.addEvent("j1", "log", { message: "late" }, a.lease("j1")), {
        name: "LeaseLostError",
      });
      await a.beat(); // A resumes: told at once
      assert.deepEqual(events, ["B cancel j2", "A lost j1"]);
      assert.equal(a.lease("j1"), undefined);
      assert.deepEqual(b.held().sort(), ["j1", "j2"]);
      await b.release("j2");
      assert.deepEqual(b.held(), ["j1"]);
    } finally {
      a.stop();
      b.stop();
      await sa.close();
      await sb.close();
    }
  }],
  ["a host restarting under its id lets its jobs go for any host", async (db) => {
    const sa = await db.open(), sb = await db.open();
    const events: string[] = [];
    const a = keeper(sa, "A", events, 60_000), b = keeper(sb, "B", events, 60_000);
    try {
      await a.start();
      await sa.createJob("j1", 0, config);
      const c = (await a.claim(1))!;
      await sa.updateJob("j1", { status: "running" }, c.lease);
      a.stop();
      const again = keeper(sa, "A", events, 60_000);
      assert.deepEqual((await again.start()).map((j) => [j.id, j.status]), [["j1", "interrupted"]]);
      again.stop();
      await b.start();
      assert.equal((await b.claim(1))!.job.id, "j1");
    } finally {
      a.stop();
      b.stop();
      await sa.close();
      await sb.close();
    }
  }],
]);
