/**
 * Claims, leases and fencing on both engines (tests/_stores.ts), with two store handles on one
 * database standing for two hosts: a job is claimed by one host only; a host claims only jobs it
 * can place; interrupted and lease-expired jobs come before queued ones; a host whose lease was
 * taken (it stopped renewing past the lease) gets LeaseLostError on every write and learns it at
 * its next heartbeat, which also carries a cancel sent through another host; a restarted host
 * lets its jobs go; /health's host list; confirmLease (the fence on checkpoint files) answers
 * from the database at that moment. On PostgreSQL, hosts claiming at once never share a job.
 */

import assert from "node:assert/strict";
import type { TrainConfig } from "../../server/jobs/mod.ts";
import { type HostReport, type JobStoreEngine, LeaseLostError } from "../../server/jobs/job_store.ts";
import { storeSuite } from "../_stores.ts";

const config = { model: "gpt2-tiny", dataset: "sotu", train_iters: 10 } as TrainConfig;
const host = (id: string, free = 1): HostReport => ({ id, gpus: 1, free, state: "ready" });
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

async function both(open: () => Promise<JobStoreEngine>): Promise<[JobStoreEngine, JobStoreEngine]> {
  return [await open(), await open()];
}

storeSuite("Job leases", [
  ["a job goes to one host, only to a host that can place it, interrupted ones first", async (db) => {
    const [a, b] = await both(db.open);
    try {
      await a.createJob("j1", 0, config);
      await a.createJob("j2", 0, { ...config, data_parallel: 2 });
      await a.createJob("j3", 0, config);
      await a.updateJob("j3", { status: "interrupted" });
      const first = (await a.claimNext("A", 1, 60_000))!;
      assert.equal(first.job.id, "j3"); // interrupted before queued
      assert.deepEqual(first.lease, { job_id: "j3", host_id: "A", epoch: 1 });
      const second = (await b.claimNext("B", 1, 60_000))!;
      assert.equal(second.job.id, "j1"); // j2 needs 2 Workers: B has 1 free
      assert.equal(await b.claimNext("B", 1, 60_000), null);
      const third = (await b.claimNext("B", 2, 60_000))!;
      assert.equal(third.job.id, "j2");
      assert.equal(await a.claimNext("A", 8, 60_000), null); // every job is held
    } finally {
      await a.close();
      await b.close();
    }
  }],
  ["a host that stops renewing loses the job, and every write it tries after is refused", async (db) => {
    const [a, b] = await both(db.open);
    try {
      await a.registerHost(host("A"));
      await b.registerHost(host("B"));
      await a.createJob("j1", 0, config);
      const { lease: old } = (await a.claimNext("A", 1, 300))!;
      await a.updateJob("j1", { status: "running", iteration: 3 }, old);
      await a.addEvent("j1", "log", { message: "A runs it" }, old);
      assert.deepEqual(await a.heartbeat(host("A", 0), [old], 300), {
        kept: [{ job_id: "j1", cancel_requested: false }],
        lost: [],
      });
      assert.equal(await b.claimNext("B", 1, 60_000), null); // A's lease is live
      await sleep(450); // A stops renewing (SIGSTOP, dead, cut off) past its lease
      const taken = (await b.claimNext("B", 1, 60_000))!;
      assert.equal(taken.job.id, "j1");
      assert.equal(taken.job.status, "running");
      assert.equal(taken.job.iteration, 3);
      assert.deepEqual(taken.lease, { job_id: "j1", host_id: "B", epoch: 2 });
      await b.updateJob("j1", { resumes: 1 }, taken.lease);

      // A comes back: every fenced write fails, naming the lease, and changes nothing.
      const lost = {
        name: "LeaseLostError",
        message: /Job "j1" is no longer held by host "A" \(lease epoch 1\)/,
      };
      await assert.rejects(async () => await a.updateJob("j1", { iteration: 9 }, old), lost);
      await assert.rejects(async () => await a.addEvent("j1", "checkpoint", { name: "iter_9" }, old), lost);
      await assert.rejects(
        async () =>
          await a.addMetric("j1", {
            iteration: 9,
            split: "train",
            loss: 1,
            perplexity: 1,
            lr: 0,
            tokens_per_s: 0,
          }, old),
        (e) => e instanceof LeaseLostError && e.lease.epoch === 1,
      );
      assert.deepEqual(await a.heartbeat(host("A"), [old], 300), { kept: [], lost: ["j1"] });
      const job = (await b.getJob("j1"))!;
      assert.equal(job.iteration, 3);
      assert.equal(job.resumes, 1);
      assert.deepEqual((await b.eventsAfter("j1")).map((e) => e.data.message), ["A runs it"]);
      assert.deepEqual(await b.metrics("j1"), []);
      // A release with the old lease does not free B's hold either.
      await a.release(old);
      assert.equal(await a.claimNext("A", 1, 60_000), null);

      // A cancel sent through A reaches B at its next heartbeat.
      await a.updateJob("j1", { cancel_requested: true });
      assert.deepEqual(await b.heartbeat(host("B", 0), [taken.lease], 60_000), {
        kept: [{ job_id: "j1", cancel_requested: true }],
        lost: [],
      });
      const hosts = await a.hosts();
      assert.deepEqual(hosts.map((h) => [h.id, h.jobs]).sort(), [["A", []], ["B", ["j1"]]]);
      const hb = hosts.find((h) => h.id === "B")!;
      assert.equal(hb.free, 0);
      assert.ok(hb.lease_age_s >= 0 && hb.lease_age_s < 5, String(hb.lease_age_s));
    } finally {
      await a.close();
      await b.close();
    }
  }],
  [
    "confirmLease reads the lease now: held and renewed while live or expired unclaimed, refused once taken or given back",
    async (db) => {
      const [a, b] = await both(db.open);
      try {
        await a.createJob("j1", 0, config);
        const { lease } = (await a.claimNext("A", 1, 600))!;
        assert.equal(await a.confirmLease(lease, 600), true);
        await sleep(400);
        assert.equal(await a.confirmLease(lease, 600), true); // renewed: live past the first 600 ms
        await sleep(400);
        assert.equal(await b.claimNext("B", 1, 60_000), null);
        await sleep(500); // expired, not yet claimed: still A's (no claim raised the epoch), renewed
        assert.equal(await a.confirmLease(lease, 300), true);
        assert.equal(await b.claimNext("B", 1, 60_000), null);
        await sleep(500);
        const taken = (await b.claimNext("B", 1, 60_000))!;
        assert.equal(await a.confirmLease(lease, 60_000), false); // another host's epoch
        assert.equal(await b.confirmLease(taken.lease, 60_000), true);
        assert.equal(await b.confirmLease({ ...taken.lease, host_id: "A" }, 60_000), false);
        await b.release(taken.lease);
        assert.equal(await b.confirmLease(taken.lease, 60_000), false); // given back
      } finally {
        await a.close();
        await b.close();
      }
    },
  ],
  ["a restarted host lets its jobs go at once, and a finished lease frees nothing else", async (db) => {
    const [a, b] = await both(db.open);
    try {
      await a.createJob("j1", 0, config);
      await a.createJob("j2", 0, config);
      const c1 = (await a.claimNext("A", 1, 60_000))!;
      await a.updateJob("j1", { status: "running" }, c1.lease);
      const c2 = (await a.claimNext("A", 1, 60_000))!;
      assert.equal(c2.job.id, "j2");
      const released = await a.releaseHost("A");
      assert.deepEqual(released.map((j) => [j.id, j.status]), [["j1", "interrupted"], ["j2", "queued"]]);
      const again = (await b.claimNext("B", 1, 60_000))!;
      assert.equal(again.job.id, "j1");
      assert.equal(again.lease.epoch, 2);
      await b.updateJob("j1", { status: "succeeded" }, again.lease);
      await b.release(again.lease);
      assert.equal((await b.claimNext("B", 1, 60_000))!.job.id, "j2");
      assert.equal(await b.claimNext("B", 1, 60_000), null); // j1 finished: never claimed again
    } finally {
      await a.close();
      await b.close();
    }
  }],
  ["hosts claiming at once each get different jobs", async (db) => {
    const stores = [await db.open(), await db.open(), await db.open()];
    try {
      for (let i = 0; i < 12; i++) await stores[0].createJob(`j${String(i).padStart(2, "0")}`, 0, config);
      const got = await Promise.all(stores.map(async (s, n) => {
        const mine: string[] = [];
        for (;;) {
          const c = await s.claimNext(`H${n}`, 1, 60_000);
          if (!c) return mine;
          mine.push(c.job.id);
        }
      }));
      const all = got.flat().sort();
      assert.equal(all.length, 12, JSON.stringify(got));
      assert.equal(new Set(all).size, 12, JSON.stringify(got));
    } finally {
      for (const s of stores) await s.close();
    }
  }],
], { bridge: true });
