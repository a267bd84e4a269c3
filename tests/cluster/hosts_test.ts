/**
 * The real server (main.ts) on PostgreSQL (a throwaway cluster, tests/_postgres.ts) with
 * checkpoints and datasets in GPT2_SHARED_DIR, one GPU Worker on the CPU adapter: a gpt2-tiny
 * job trains to the end with its checkpoints in the shared folder, its events and metrics come
 * from the database, and `/health` lists the host with its heartbeat. After it stopped, a second
 * host on the same database sees the job and replays its events from a Last-Event-ID it never
 * issued. (Two live hosts: tests/cluster/hosts_failover_test.ts.) Skipped without PostgreSQL or a WebGPU
 * adapter.
 */

import assert from "node:assert/strict";
import { noGpu } from "../_helpers.ts";
import { POSTGRES_BIN, startPostgres } from "../_postgres.ts";
import { follow, type SseEvent, startServer, submit } from "../_server.ts";

Deno.test({
  name:
    "a server on PostgreSQL and a shared folder trains a job, lists its host, and another host replays its events",
  ignore: noGpu || !POSTGRES_BIN,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: async () => {
    const pg = await startPostgres();
    const root = await Deno.makeTempDir({ prefix: "gpt2_hosts_" });
    const shared = `${root}/shared`;
    const env = (host: string) => ({
      GPT2_DATABASE_URL: "",
      GPT2_SHARED_DIR: shared,
      GPT2_HOST_ID: host,
      GPT2_LEASE_S: "3",
      GPT2_GPUS: "1",
    });
    const servers: Deno.ChildProcess[] = [];
    try {
      const url = await pg.database();
      const a = await startServer(`${root}/a`, { ...env("host-a"), GPT2_DATABASE_URL: url });
      servers.push(a.child);
      const id = await submit(a.url, {
        model: "gpt2-tiny",
        dataset: "sotu",
        train_iters: 20,
        batch_size: 2,
        seq_len: 16,
        log_interval: 5,
        eval_interval: 0,
        eval_iters: 2,
        save_interval: 10,
        keep_checkpoints: 2,
        seed: 3,
      });
      const seen: SseEvent[] = [];
      await follow(`${a.url}/jobs/${id}/events`, 0, (e) => {
        seen.push(e);
      });
      assert.equal(seen.at(-1)!.event, "done");
      assert.equal(seen.at(-1)!.data.status, "succeeded", JSON.stringify(seen.at(-1)!.data));
      const job = await (await fetch(`${a.url}/jobs/${id}`)).json();
      assert.equal(job.iteration, 20);
      const names = [...Deno.readDirSync(`${shared}/checkpoints/${id}`)].map((e) => e.name).sort();
      assert.deepEqual(names, ["iter_0000010", "iter_0000020"]);
      const metrics = await (await fetch(`${a.url}/jobs/${id}/metrics`)).json();
      assert.deepEqual(
        metrics.metrics.filter((m: { split: string }) => m.split === "train").map((
          m: { iteration: number },
        ) => m.iteration),
        [5, 10, 15, 20],
      );
      const health = await (await fetch(`${a.url}/health`)).json();
      assert.deepEqual(health.hosts.map((h: { id: string; gpus: number }) => [h.id, h.gpus]), [[
        "host-a",
        1,
      ]]);
      assert.ok(health.hosts[0].lease_age_s < 3, JSON.stringify(health.hosts));
      assert.equal(health.jobs.succeeded, 1);

      // Once A has stopped, B (another host) sees A's job and replays its events.
      a.child.kill("SIGTERM");
      await a.child.status;
      const b2 = await startServer(`${root}/b`, { ...env("host-b"), GPT2_DATABASE_URL: url });
      servers.push(b2.child);
      const again = await (await fetch(`${b2.url}/jobs/${id}`)).json();
      assert.equal(again.status, "succeeded");
      const replay: SseEvent[] = [];
      await follow(`${b2.url}/jobs/${id}/events`, seen[2].id, (e) => {
        replay.push(e);
      });
      assert.deepEqual(replay.map((e) => e.id), seen.slice(3).map((e) => e.id));
    } finally {
      for (const c of servers) {
        try {
          c.kill("SIGKILL");
        } catch {
          // already gone
        }
        await c.status;
      }
      await pg.stop();
      await Deno.remove(root, { recursive: true });
    }
  },
});
