/**
 * LeaseKeeper (server/jobs/leases.ts) on both engines (PostgreSQL through the bridge, as the
 * runner holds it): two keepers stand for two hosts on one
 * database. The heartbeat keeps a running job's lease alive past its length; a keeper whose
 * heartbeat stops (a paused or dead host) loses the job to the other, whose claim sees it, and
 * hears onLost at its next beat; a cancel written through one host reaches the holder once; a
 * restart under the same host id lets the jobs go.
 */

import assert from "node:assert/strict";
import type { TrainConfig } from "../../server/jobs/mod.ts";
import type { JobStore } from "../../server/jobs/job_store.ts";
import { LeaseKeeper } from "../../server/jobs/leases.ts";
import { storeSuite } from "../_stores.ts";

const config = { model: "gpt2-tiny", dataset: "sotu", train_iters: 10 } as TrainConfig;
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

function keeper(store: JobStore, hostId: string, events: string[], leaseMs = 400) {
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
    const sa = await db.open() as JobStore, sb = await db.open() as JobStore;
    const events: string[] = [];
    const a = keeper(sa, "A", events), b = keeper(sb, "B", events);
    try {
      assert.deepEqual(a.start(), []);
      b.start();
      await sa.createJob("j1", 0, config);
      await sa.createJob("j2", 0, config);
      const c1 = a.claim(1)!;
      assert.equal(c1.job.id, "j1");
      assert.equal(a.confirm("j1"), true); // read from the database (the fence on checkpoint files)
      assert.equal(a.confirm("j2"), false); // not claimed by A
      await sleep(700); // longer than the lease: A's heartbeat renews it
      assert.equal(b.claim(1)!.job.id, "j2");
      assert.equal(b.claim(1), null);
      assert.deepEqual((await sa.hosts()).map((h) => [h.id, h.jobs]).sort(), [["A", ["j1"]], ["B", ["j2"]]]);

      // A cancel through A for B's job reaches B at its next beat, once.
      await sa.updateJob("j2", { cancel_requested: true });
      b.beat();
      b.beat();
      assert.deepEqual(events, ["B cancel j2"]);

      a.stop(); // A pauses
      await sleep(600);
      const taken = b.claim(1)!;
      assert.equal(taken.job.id, "j1");
      assert.equal(taken.lease.epoch, 2);
      await assert.rejects(async () => await sa.addEvent("j1", "log", { message: "late" }, a.lease("j1")), {
        name: "LeaseLostError",
      });
      a.beat(); // A resumes: told at once
      assert.deepEqual(events, ["B cancel j2", "A lost j1"]);
      assert.equal(a.confirm("j1"), false);
      assert.equal(b.confirm("j1"), true);
      assert.equal(a.lease("j1"), undefined);
      assert.deepEqual(b.held().sort(), ["j1", "j2"]);
      b.release("j2");
      assert.deepEqual(b.held(), ["j1"]);
    } finally {
      a.stop();
      b.stop();
      await sa.close();
      await sb.close();
    }
  }],
  ["a host restarting under its id lets its jobs go for any host", async (db) => {
    const sa = await db.open() as JobStore, sb = await db.open() as JobStore;
    const events: string[] = [];
    const a = keeper(sa, "A", events, 60_000), b = keeper(sb, "B", events, 60_000);
    try {
      a.start();
      await sa.createJob("j1", 0, config);
      const c = a.claim(1)!;
      await sa.updateJob("j1", { status: "running" }, c.lease);
      a.stop();
      const again = keeper(sa, "A", events, 60_000);
      assert.deepEqual((again.start()).map((j) => [j.id, j.status]), [["j1", "interrupted"]]);
      again.stop();
      b.start();
      assert.equal(b.claim(1)!.job.id, "j1");
    } finally {
      a.stop();
      b.stop();
      await sa.close();
      await sb.close();
    }
  }],
], { bridge: true, asyncPostgres: false });
