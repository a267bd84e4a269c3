/**
 * A PostgreSQL restart as operations make one: two servers (main.ts, one GPU Worker each on the
 * CPU adapter) share a throwaway cluster and one GPT2_SHARED_DIR with 3 s leases; while a job
 * trains on each, the database stops (`pg_ctl stop -m immediate`) for longer than two leases and
 * starts again. During the outage `/health` and `/ready` answer 503 naming the store, never 500,
 * and training goes on. After it, every job runs to `succeeded` (resumed by whichever host holds
 * it once its lease is settled) with the losses of an uninterrupted run of the same job, and no
 * record written during the outage is lost. Skipped without PostgreSQL or a WebGPU adapter.
 */

import assert from "node:assert/strict";
import { noGpu } from "../_helpers.ts";
import { POSTGRES_BIN, startPostgres } from "../_postgres.ts";
import { type Server, startServer, submit } from "../_server.ts";
import { until } from "../_wait.ts";

const JOB = {
  model: "gpt2-tiny",
  dataset: "sotu",
  train_iters: 60,
  batch_size: 2,
  seq_len: 16,
  log_interval: 5,
  eval_interval: 0,
  eval_iters: 1,
  save_interval: 10,
  keep_checkpoints: 10,
  seed: 5,
};

const json = async (url: string) => await (await fetch(url)).json();

/** Train losses by iteration (the last recorded wins: a resumed job records some iterations twice). */
async function losses(url: string, id: string): Promise<Record<number, number>> {
  const { metrics } = await json(`${url}/jobs/${id}/metrics`);
  const out: Record<number, number> = {};
  for (const m of metrics) if (m.split === "train") out[m.iteration] = m.loss;
  return out;
}

Deno.test({
  name:
    "a PostgreSQL restart longer than a lease: 503 meanwhile, training goes on, every job succeeds as if uninterrupted",
  ignore: noGpu || !POSTGRES_BIN,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: async () => {
    const pg = await startPostgres({ durable: true });
    const root = await Deno.makeTempDir({ prefix: "gpt2_outage_" });
    const servers: Server[] = [];
    try {
      const db = await pg.database();
      const start = async (host: string) => {
        const s = await startServer(`${root}/${host}`, {
          GPT2_DATABASE_URL: db,
          GPT2_SHARED_DIR: `${root}/shared`,
          GPT2_HOST_ID: host,
          GPT2_LEASE_S: "3",
          GPT2_GPUS: "1",
        });
        servers.push(s);
        await until(async () => (await fetch(`${s.url}/ready`)).status === 200, `${host} ready`, 60_000, 100);
        return s;
      };
      const a = await start("host-a");
      const b = await start("host-b");

      // The reference: one job alone, uninterrupted (it also prepares the builtin dataset once).
      const reference = await submit(a.url, JOB);
      await until(
        async () => (await json(`${a.url}/jobs/${reference}`)).status === "succeeded",
        "the reference job",
        180_000,
        200,
      );

      // One job per host, then the outage while both train.
      const jobs = [await submit(a.url, JOB), await submit(a.url, JOB)];
      await until(
        async () => {
          const all = await Promise.all(jobs.map((id) => json(`${a.url}/jobs/${id}`)));
          return all.every((j) => j.status === "running" && j.iteration >= 5);
        },
        "both jobs to train",
        120_000,
        100,
      );
      const before = await Promise.all(jobs.map((id) => json(`${a.url}/jobs/${id}`)));

      await pg.halt();
      const downAt = Date.now();
      const outage: { status: number; body: Record<string, unknown>; ms: number }[] = [];
      const health = async (s: Server) => {
        const t0 = performance.now();
        const res = await fetch(`${s.url}/health`);
        outage.push({ status: res.status, body: await res.json(), ms: performance.now() - t0 });
      };
      await until(
        async () => {
          for (const s of [a, b]) await health(s);
          return outage.filter((h) => h.status === 503).length >= 2;
        },
        "/health to report the store unreachable",
        15_000,
        200,
      );
      // Stay down for more than two leases.
      while (Date.now() - downAt < 7000) {
        await health(a);
        await health(b);
        const ready = await fetch(`${b.url}/ready`);
        assert.equal(ready.status, 503);
        await ready.body?.cancel();
        await new Promise((r) => setTimeout(r, 500));
      }
      await pg.resume();

      assert.ok(
        outage.every((h) => h.status === 200 || h.status === 503),
        JSON.stringify(outage.map((h) => h.status)),
      );
      // No request waits on the database: the servers answer at once, whatever the store's state.
      const slowest = Math.max(...outage.map((h) => h.ms));
      assert.ok(slowest < 2000, `a /health took ${slowest.toFixed(0)} ms during the outage`);
      const unreachable = outage.filter((h) => h.status === 503);
      assert.ok(unreachable.length >= 2);
      for (const h of unreachable) {
        const store = h.body.store as Record<string, unknown>;
        assert.equal(store.state, "unreachable", JSON.stringify(h.body));
        assert.equal(store.engine, "postgres");
        assert.ok(typeof store.since === "string" && typeof store.error === "string", JSON.stringify(store));
      }

      for (const id of jobs) {
        await until(
          async () => (await json(`${a.url}/jobs/${id}`)).status === "succeeded",
          `job ${id} to succeed after the outage`,
          180_000,
          250,
        );
      }
      const expected = await losses(a.url, reference);
      assert.deepEqual(Object.keys(expected).map(Number), [5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60]);
      for (const [i, id] of jobs.entries()) {
        assert.deepEqual(
          await losses(a.url, id),
          expected,
          `job ${id} (at iteration ${before[i].iteration} when the store went away)`,
        );
      }
      for (const s of [a, b]) {
        const health = await fetch(`${s.url}/health`);
        const body = await health.json();
        assert.equal(health.status, 200, JSON.stringify(body.store));
        assert.equal(body.store.state, "ok");
        assert.equal(body.store.pending, 0);
      }
      const log = servers.map((s) => s.output.join("")).join("");
      assert.match(log, /Job store unreachable/);
      assert.match(log, /Job store reachable again/);
      assert.doesNotMatch(log, /Job runner: handling .* failed/);
    } finally {
      for (const s of servers) {
        try {
          s.child.kill("SIGKILL");
        } catch { /* gone */ }
        await s.child.status;
      }
      await pg.stop().catch(() => {});
      await Deno.remove(root, { recursive: true }).catch(() => {});
    }
  },
});
