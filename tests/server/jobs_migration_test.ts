/**
 * JobStore schema versions: a data directory written by the first release's schema (user_version
 * 0, `create if not exists` only) is migrated in place with its jobs, events and metrics intact;
 * reopening is a no-op; a database from a newer server is refused, not misread. Then the same
 * migrations on both engines (tests/_stores.ts): an empty database reaches the newest version,
 * reopening runs nothing, a newer one is refused, and hosts starting together migrate once.
 */

import assert from "node:assert/strict";
import { DatabaseSync } from "node:sqlite";
import postgres from "postgres";
import { JobStore, SCHEMA_VERSION } from "../../server/jobs/mod.ts";
import { MIGRATIONS, postgresDialect } from "../../server/jobs/store_schema.ts";
import { type FreshDb, storeSuite } from "../_stores.ts";

/** The DDL of the first release (server/jobs/job_store.ts before versioning), copied as it was. */
const FIRST_RELEASE_SCHEMA = `
create table if not exists jobs (
  seq integer primary key autoincrement,
  id text not null unique,
  status text not null,
  gpu integer not null,
  config text not null,
  created_at text not null,
  started_at text,
  finished_at text,
  iteration integer not null default 0,
  metrics text not null,
  error text,
  cancel_requested integer not null default 0,
  resumes integer not null default 0,
  resumed_from text,
  last_checkpoint text
);
create index if not exists jobs_queue on jobs(gpu, status, seq);
create table if not exists metrics (
  job_id text not null,
  iteration integer not null,
  split text not null,
  loss real not null,
  perplexity real,
  lr real,
  tokens_per_s real,
  at text not null
);
create index if not exists metrics_job on metrics(job_id, iteration);
create table if not exists events (
  id integer primary key autoincrement,
  job_id text not null,
  type text not null,
  data text not null,
  at text not null
);
create index if not exists events_job on events(job_id, id);
`;

/** Writes a jobs.sqlite as the first release did: one finished job, one queued, with history. */
function writeFirstRelease(path: string): void {
  const db = new DatabaseSync(path);
  db.exec("pragma journal_mode = wal;");
  db.exec(FIRST_RELEASE_SCHEMA);
  const metrics = JSON.stringify({ loss: 3.5, val_loss: 3.75, lr: 1e-4, timings: null });
  const config = JSON.stringify({
    model: "gpt2-tiny",
    dataset: "sotu",
    train_iters: 10,
    keep_checkpoints: 3,
  });
  db.prepare(
    `insert into jobs (id, status, gpu, config, created_at, finished_at, iteration, metrics, last_checkpoint)
     values (?, 'succeeded', 0, ?, '2025-01-01T00:00:00.000Z', '2025-01-01T01:00:00.000Z', 10, ?, 'iter_0000010')`,
  ).run("job_old000000001", config, metrics);
  db.prepare(
    "insert into jobs (id, status, gpu, config, created_at, metrics) values (?, 'queued', 0, ?, '2025-01-02T00:00:00.000Z', ?)",
  ).run("job_old000000002", config, JSON.stringify({ loss: null }));
  db.prepare("insert into events (job_id, type, data, at) values (?, 'log', ?, '2025-01-01T00:00:01.000Z')")
    .run(
      "job_old000000001",
      JSON.stringify({ level: "info", message: "Queued on GPU 0" }),
    );
  db.prepare(
    "insert into metrics (job_id, iteration, split, loss, perplexity, lr, tokens_per_s, at) values (?, 10, 'train', 3.5, 33.1, 0.0001, 900, 'x')",
  ).run("job_old000000001");
  db.close();
}

Deno.test("JobStore migrates a data directory written by the first release's schema, keeping its jobs", async () => {
  const dir = await Deno.makeTempDir({ prefix: "gpt2_migrate_" });
  const path = `${dir}/jobs.sqlite`;
  try {
    writeFirstRelease(path);
    let store = new JobStore(path);
    assert.equal(store.schemaVersion, SCHEMA_VERSION);
    assert.ok(SCHEMA_VERSION >= 2);
    const old = store.getJob("job_old000000001")!;
    assert.equal(old.status, "succeeded");
    assert.equal(old.iteration, 10);
    assert.equal(old.metrics.val_loss, 3.75);
    assert.equal(old.last_checkpoint, "iter_0000010");
    assert.deepEqual(store.eventsAfter("job_old000000001").map((e) => e.data.message), ["Queued on GPU 0"]);
    assert.equal(store.metrics("job_old000000001")[0].tokens_per_s, 900);
    assert.deepEqual(store.listJobs({ status: "queued" }).map((j) => j.id), ["job_old000000002"]);
    assert.equal(store.waitingCount(), 1);
    assert.equal(store.writeError(), null); // the probe table of version 2 exists and takes writes
    store.createJob("job_new000000003", 0, JSON.parse('{"model":"gpt2-tiny"}'));
    store.close();

    // Reopening runs nothing again; the new index is there.
    store = new JobStore(path);
    assert.equal(store.schemaVersion, SCHEMA_VERSION);
    assert.deepEqual(store.listJobs().map((j) => j.id), [
      "job_new000000003",
      "job_old000000002",
      "job_old000000001",
    ]);
    store.close();
    const db = new DatabaseSync(path);
    const names =
      (db.prepare("select name from sqlite_master where type = 'index'").all() as { name: string }[])
        .map((r) => r.name);
    db.close();
    assert.ok(names.includes("jobs_status"), JSON.stringify(names));
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("JobStore refuses a database written by a newer server", async () => {
  const dir = await Deno.makeTempDir({ prefix: "gpt2_migrate_" });
  const path = `${dir}/jobs.sqlite`;
  try {
    const db = new DatabaseSync(path);
    db.exec(`pragma user_version = ${SCHEMA_VERSION + 1}`);
    db.close();
    assert.throws(() => new JobStore(path), {
      message: `Cannot open job store "${path}": its schema version ${
        SCHEMA_VERSION + 1
      } is newer than this server's ${SCHEMA_VERSION} (upgrade the server)`,
    });
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});

/** Sets the stored schema version of `db` as a newer server would have left it. */
async function writeVersion(db: FreshDb, version: number): Promise<void> {
  if (db.engine === "sqlite") {
    const raw = new DatabaseSync(db.location);
    raw.exec(`pragma user_version = ${version}`);
    raw.close();
    return;
  }
  const sql = postgres(db.location, { max: 1, onnotice: () => {} });
  await sql.unsafe(`update schema_version set version = ${version}`);
  await sql.end({ timeout: 1 });
}

storeSuite("JobStore migrations", [
  [
    "bring an empty database to the newest version; reopening runs nothing; a newer one is refused",
    async (db) => {
      let store = await db.open();
      assert.equal(store.schemaVersion, SCHEMA_VERSION);
      await store.createJob("job_m1", 0, JSON.parse('{"model":"gpt2-tiny","data_parallel":2}'));
      assert.equal(await store.claimNext("H", 1, 1000), null); // version 3's workers column: 2 needed
      await store.close();
      store = await db.open();
      assert.equal(store.schemaVersion, SCHEMA_VERSION);
      assert.deepEqual((await store.listJobs()).map((j) => j.id), ["job_m1"]);
      await store.close();
      await writeVersion(db, SCHEMA_VERSION + 1);
      await assert.rejects(db.open(), {
        message: new RegExp(
          `its schema version ${
            SCHEMA_VERSION + 1
          } is newer than this server's ${SCHEMA_VERSION} \\(upgrade the server\\)`,
        ),
      });
    },
  ],
  ["hosts starting together migrate once", async (db) => {
    const stores = await Promise.all([db.open(), db.open(), db.open()]);
    for (const s of stores) assert.equal(s.schemaVersion, SCHEMA_VERSION);
    for (const s of stores) await s.close();
  }],
]);

Deno.test("postgresDialect() changes only the key, float and metrics-order columns", () => {
  const pg = MIGRATIONS.map(postgresDialect).join("\n");
  assert.ok(!/autoincrement|\breal\b/.test(pg), pg);
  assert.match(pg, /seq bigint generated by default as identity primary key/);
  assert.match(pg, /loss double precision not null/);
  assert.ok(pg.includes("metrics (\n  rowid bigint generated always as identity,"), pg);
});
