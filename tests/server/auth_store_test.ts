/**
 * The job store's users, tokens, owned resources, audit trail and fair-share queue (schema
 * version 4) on both engines and through the PostgreSQL bridge (tests/_stores.ts): a version-3
 * database migrates with its jobs kept and unowned; tokens keep their hash only and are revoked
 * once; jobs list and count per owner; the queue takes users in turn and leaves out those at
 * their running quota; GPU-seconds of a day add up per owner.
 */

import assert from "node:assert/strict";
import { DatabaseSync } from "node:sqlite";
import postgres from "postgres";
import type { TrainConfig } from "../../server/jobs/mod.ts";
import type { JobStoreEngine, TokenRecord } from "../../server/jobs/job_store.ts";
import { MIGRATIONS, postgresDialect } from "../../server/jobs/store_schema.ts";
import { hashToken, mintToken } from "../../server/auth/mod.ts";
import { type FreshDb, storeSuite } from "../_stores.ts";

const config = { model: "gpt2-tiny", dataset: "sotu", train_iters: 10 } as TrainConfig;

function token(user: string, over: Partial<TokenRecord> = {}): TokenRecord & { secret: string } {
  const { token, id, hash } = mintToken();
  return {
    secret: token,
    id,
    hash,
    name: "laptop",
    user,
    scopes: ["read", "train"],
    created_at: new Date().toISOString(),
    expires_at: null,
    last_used_at: null,
    revoked_at: null,
    ...over,
  };
}

/** Brings an empty database to schema version 3 with one job, as the previous release left it. */
async function writeVersion3(db: FreshDb): Promise<void> {
  if (db.engine === "sqlite") {
    const raw = new DatabaseSync(db.location);
    for (const m of MIGRATIONS.slice(0, 3)) raw.exec(m);
    raw.exec(
      "insert into jobs (id, status, gpu, config, created_at, metrics) values ('job_old', 'succeeded', 0, '{}', 'x', '{}')",
    );
    raw.exec("pragma user_version = 3");
    raw.close();
    return;
  }
  const sql = postgres(db.location, { onnotice: () => {} });
  for (const m of MIGRATIONS.slice(0, 3)) await sql.unsafe(postgresDialect(m)).simple();
  await sql.unsafe(
    "create table schema_version (version integer not null); insert into schema_version values (3)",
  )
    .simple();
  await sql.unsafe(
    "insert into jobs (id, status, gpu, config, created_at, metrics) values ('job_old', 'succeeded', 0, '{}', 'x', '{}')",
  );
  await sql.end();
}

async function withStore(db: FreshDb, fn: (s: JobStoreEngine) => Promise<void>): Promise<void> {
  const store = await db.open();
  try {
    await fn(store);
  } finally {
    await store.close();
  }
}

storeSuite("Users and tokens in the JobStore", [
  ["a version-3 database migrates to 4 with its jobs kept and owned by nobody", async (db) => {
    await writeVersion3(db);
    await withStore(db, async (store) => {
      assert.equal(store.schemaVersion, 4);
      const old = (await store.getJob("job_old"))!;
      assert.equal(old.status, "succeeded");
      assert.equal("owner" in old, false);
      assert.deepEqual(await store.tokens(), []);
      assert.deepEqual(await store.listJobs({ owner: "alice" }), []);
      assert.equal((await store.listJobs()).length, 1);
    });
  }],
  ["tokens keep their hash only, list oldest first, revoke once, and record their last use", async (db) => {
    await withStore(db, async (store) => {
      const a = token("alice", { created_at: "2026-01-01T00:00:00.000Z" });
      const b = token("bob", {
        created_at: "2026-01-02T00:00:00.000Z",
        expires_at: "2026-02-01T00:00:00.000Z",
      });
      await store.putUser("alice");
      await store.putUser("alice"); // a repeat changes nothing
      await store.putUser("bob");
      const { secret: _a, ...ra } = a, { secret: _b, ...rb } = b;
      await store.createToken(ra);
      await store.createToken(rb);
      const listed = await store.tokens();
      assert.deepEqual(listed, [ra, rb]);
      assert.equal(listed[0].hash, hashToken(a.secret));
      assert.ok(!JSON.stringify(listed).includes(a.secret), "the token itself is never stored");
      assert.equal(await store.revokeToken(a.id, "2026-03-01T00:00:00.000Z"), true);
      assert.equal(await store.revokeToken(a.id, "2026-03-02T00:00:00.000Z"), false);
      assert.equal(await store.revokeToken("tok_000000000000", "2026-03-02T00:00:00.000Z"), false);
      await store.touchTokens([{ id: b.id, at: "2026-01-05T00:00:00.000Z" }]);
      const [ta, tb] = await store.tokens();
      assert.equal(ta.revoked_at, "2026-03-01T00:00:00.000Z");
      assert.equal(tb.last_used_at, "2026-01-05T00:00:00.000Z");
      await assert.rejects(Promise.try(() => store.createToken({ ...rb, id: "tok_111111111111" })));
      assert.deepEqual((await store.users()).map((u) => [u.name, u.quotas]), [["alice", {}], ["bob", {}]]);
      assert.equal(await store.setQuotas("alice", { queued_jobs: 3 }), true);
      assert.equal(await store.setQuotas("carol", { queued_jobs: 3 }), false);
      assert.deepEqual((await store.users())[0].quotas, { queued_jobs: 3 });
    });
  }],
  ["jobs belong to their owner: listed, counted and waiting per owner", async (db) => {
    await withStore(db, async (store) => {
      await store.createJob("job_a1", 0, config, "alice");
      await store.createJob("job_b1", 0, config, "bob");
      await store.createJob("job_a2", 0, config, "alice");
      await store.createJob("job_n", 0, config);
      await store.updateJob("job_a1", { status: "running" });
      assert.equal((await store.getJob("job_a1"))!.owner, "alice");
      assert.equal("owner" in (await store.getJob("job_n"))!, false);
      assert.deepEqual((await store.listJobs({ owner: "alice" })).map((j) => j.id), ["job_a2", "job_a1"]);
      assert.deepEqual((await store.listJobs({ owner: "alice", status: "queued" })).map((j) => j.id), [
        "job_a2",
      ]);
      assert.equal(await store.waitingCount("alice"), 1);
      assert.equal(await store.waitingCount("bob"), 1);
      assert.equal(await store.waitingCount(), 3);
      const counts = await store.countByStatus("alice");
      assert.equal(counts.running, 1);
      assert.equal(counts.queued, 1);
    });
  }],
  [
    "the queue takes users in turn, a user with a job running after one with none, and skips users at quota",
    async (db) => {
      await withStore(db, async (store) => {
        for (const id of ["a1", "a2", "a3", "b1", "b2", "c1"]) {
          await store.createJob(
            `job_${id}`,
            0,
            config,
            id[0] === "a" ? "alice" : id[0] === "b" ? "bob" : "carol",
          );
        }
        assert.deepEqual((await store.queue(0)).map((j) => j.id), [
          "job_a1",
          "job_b1",
          "job_c1",
          "job_a2",
          "job_b2",
          "job_a3",
        ]);
        // Claimed under a lease, as a host starts it: a running job without one would be claimable.
        assert.equal((await store.claimNext("H", 1, 60_000))!.job.id, "job_a1");
        await store.updateJob("job_a1", { status: "running" });
        // alice has one running: bob and carol go first
        assert.equal((await store.nextQueued(0))!.id, "job_b1");
        assert.equal((await store.nextQueued(0, ["bob"]))!.id, "job_c1");
        assert.equal(await store.nextQueued(0, ["bob", "carol", "alice"]), null);
        const claim = await store.claimNext("H", 1, 60_000, true, ["bob"]);
        assert.equal(claim!.job.id, "job_c1");
        // At a tie, the user whose last job started longest ago (or never) goes first.
        await store.updateJob("job_a1", { status: "succeeded", started_at: "2026-01-01T00:00:00.000Z" });
        await store.updateJob("job_c1", { status: "succeeded", started_at: "2026-01-02T00:00:00.000Z" });
        assert.deepEqual((await store.queue(0)).map((j) => j.id), ["job_b1", "job_a2", "job_b2", "job_a3"]);
        await store.createJob("job_c2", 0, config, "carol");
        assert.deepEqual((await store.queue(0)).map((j) => j.id), [
          "job_b1",
          "job_a2",
          "job_c2",
          "job_b2",
          "job_a3",
        ]);
      });
    },
  ],
  [
    "resources record their owners; the audit trail pages newest first; GPU-seconds add up per owner",
    async (db) => {
      await withStore(db, async (store) => {
        await store.addResource("dataset", "d1", "alice");
        await store.addResource("dataset", "d1", "alice");
        await store.addResource("dataset", "d1", "*");
        assert.deepEqual(await store.resourceOwners("dataset", "d1"), ["*", "alice"]);
        assert.deepEqual(await store.resourceOwners("checkpoint", "d1"), []);
        await store.removeResource("dataset", "d1");
        assert.deepEqual(await store.resourceOwners("dataset", "d1"), []);

        const e1 = await store.addAudit({
          user: "alice",
          action: "job.create",
          target: "job_1",
          detail: { kind: "train" },
        });
        const e2 = await store.addAudit({ user: null, action: "token.create", target: "tok_1", detail: {} });
        assert.ok(e2.id > e1.id);
        assert.deepEqual((await store.audit()).map((e) => e.action), ["token.create", "job.create"]);
        assert.deepEqual(await store.audit({ user: "alice" }), [e1]);
        assert.deepEqual(await store.audit({ before: e2.id }), [e1]);
        assert.deepEqual((await store.audit({ limit: 1 })).map((e) => e.id), [e2.id]);

        const day = "2026-05-01T00:00:00.000Z";
        await store.createJob("job_g1", 0, { ...config, data_parallel: 2 } as TrainConfig, "alice");
        await store.updateJob("job_g1", {
          status: "succeeded",
          started_at: "2026-04-30T23:59:00.000Z", // 60 s before the day: not counted
          finished_at: "2026-05-01T00:01:40.000Z",
        });
        await store.createJob("job_g2", 0, config, "bob");
        await store.updateJob("job_g2", {
          status: "succeeded",
          started_at: "2026-05-01T01:00:00.000Z",
          finished_at: "2026-05-01T01:00:10.000Z",
        });
        assert.equal(await store.gpuSeconds("alice", day), 200); // 100 s × 2 Workers
        assert.equal(await store.gpuSeconds("bob", day), 10);
        assert.equal(await store.gpuSeconds("carol", day), 0);
      });
    },
  ],
], { bridge: true });
