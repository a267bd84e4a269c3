/**
 * Two servers (main.ts) on one machine sharing one PostgreSQL database (a throwaway cluster,
 * tests/_postgres.ts) and one GPT2_SHARED_DIR, one GPU Worker each on the CPU adapter, leases of
 * 3 s. Every job is followed through host A only.
 * - 4 identical gpt2-tiny jobs submitted to A run on both hosts. Host B is SIGKILLed (server and
 *   GPU host) after its job's first checkpoint; after the lease A resumes that job from the
 *   checkpoint, and it ends with the losses of the jobs that ran uninterrupted.
 * - B restarted under its id: a cancel sent to A stops a job running on B, whose events A streams.
 * - B paused (SIGSTOP, server and GPU host) past its lease: A takes its job over; resumed, B stops
 *   the job and writes nothing more to it (its iterations never go back, it finishes on A).
 * Skipped without PostgreSQL or a WebGPU adapter.
 */

import assert from "node:assert/strict";
import { noGpu } from "../_helpers.ts";
import { POSTGRES_BIN, startPostgres } from "../_postgres.ts";
import { follow, type Server, type SseEvent, startServer, submit } from "../_server.ts";
import { until } from "../_wait.ts";

const JOB = {
  model: "gpt2-tiny",
  dataset: "sotu",
  train_iters: 20,
  batch_size: 2,
  seq_len: 16,
  log_interval: 5,
  eval_interval: 0,
  eval_iters: 1,
  save_interval: 10,
  keep_checkpoints: 3,
  seed: 11,
};

const json = async (url: string, init?: RequestInit) => await (await fetch(url, init)).json();
const onHost = (events: SseEvent[], host: string) =>
  events.some((e) => e.event === "log" && String(e.data.message).includes(`of host "${host}"`));

/** The server's and its GPU host's process ids. */
async function pids(s: Server): Promise<number[]> {
  const health = await json(`${s.url}/health`);
  return [s.child.pid, health.gpu_host.pid].filter((p) => typeof p === "number");
}

/** Train losses by iteration (the last recorded wins: a resumed job records some iterations twice). */
async function losses(url: string, id: string): Promise<Record<number, number>> {
  const { metrics } = await json(`${url}/jobs/${id}/metrics`);
  const out: Record<number, number> = {};
  for (const m of metrics) if (m.split === "train") out[m.iteration] = m.loss;
  return out;
}

Deno.test({
  name:
    "two hosts on one database: jobs run on both, a killed host's job resumes elsewhere, cancel and events across hosts, a paused host is fenced",
  ignore: noGpu || !POSTGRES_BIN,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: async () => {
    const pg = await startPostgres();
    const root = await Deno.makeTempDir({ prefix: "gpt2_failover_" });
    const children: Deno.ChildProcess[] = [];
    try {
      const db = await pg.database();
      const env = (host: string) => ({
        GPT2_DATABASE_URL: db,
        GPT2_SHARED_DIR: `${root}/shared`,
        GPT2_HOST_ID: host,
        GPT2_LEASE_S: "3",
        GPT2_GPUS: "1",
      });
      const start = async (host: string, home: string) => {
        const s = await startServer(home, env(host));
        children.push(s.child);
        await until(async () => (await fetch(`${s.url}/ready`)).status === 200, `${host} ready`, 60_000, 100);
        return s;
      };
      const a = await start("host-a", `${root}/a`);
      let b = await start("host-b", `${root}/b`);

      // The builtin dataset is prepared into the shared folder by a first job (two hosts preparing
      // it at once is not coordinated: one of them fails).
      const warm = await submit(a.url, { ...JOB, train_iters: 1, save_interval: 0 });
      await follow(`${a.url}/jobs/${warm}/events`, 0, () => {});
      assert.equal((await json(`${a.url}/jobs/${warm}`)).status, "succeeded");

      // 1. Four jobs through A run on both hosts; B dies after its job's first checkpoint.
      const ids: string[] = [];
      for (let i = 0; i < 4; i++) ids.push(await submit(a.url, JOB));
      const seen = new Map<string, SseEvent[]>(ids.map((id) => [id, []]));
      let killed: string | null = null;
      const killB = Promise.withResolvers<void>();
      const followers = ids.map((id) =>
        follow(`${a.url}/jobs/${id}/events`, 0, (e) => {
          const events = seen.get(id)!;
          events.push(e);
          if (!killed && e.event === "checkpoint" && onHost(events, "host-b")) {
            killed = id;
            killB.resolve();
          }
        })
      );
      await Promise.race([killB.promise, Promise.all(followers)]);
      assert.ok(killed, `no job ran on B: ${JSON.stringify([...seen.values()].map((e) => e.at(-1)?.data))}`);
      for (const pid of await pids(b)) Deno.kill(pid, "SIGKILL");
      await b.child.status;
      await Promise.all(followers);
      for (const id of ids) {
        const done = seen.get(id)!.at(-1)!;
        assert.equal(done.event, "done", id);
        assert.equal(done.data.status, "succeeded", JSON.stringify(done.data));
      }
      const resumed = seen.get(killed!)!;
      const messages = resumed.filter((e) => e.event === "log").map((e) => String(e.data.message));
      assert.ok(messages.some((m) => m.includes("stopped renewing its lease")), messages.join("\n"));
      assert.ok(
        messages.some((m) => m.includes(`of host "host-a" from checkpoint`)),
        messages.join("\n"),
      );
      const onA = ids.filter((id) => id !== killed && !onHost(seen.get(id)!, "host-b"));
      assert.ok(onA.length > 0, "no job ran on A alone");
      const reference = await losses(a.url, onA[0]);
      assert.deepEqual(Object.keys(reference).map(Number), [5, 10, 15, 20]);
      assert.deepEqual(await losses(a.url, killed!), reference);
      const health = await json(`${a.url}/health`);
      assert.deepEqual(health.hosts.map((h: { id: string }) => h.id).sort(), ["host-a", "host-b"]);
      assert.equal(health.jobs.succeeded, 5); // with the first job

      // 2. B back under its id: a cancel sent to A stops B's job; A streams B's events. A long job
      // keeps A busy meanwhile (submitted while B is down), so B's jobs can only run on B.
      const cancel = (id: string) =>
        fetch(`${a.url}/jobs/${id}/cancel`, {
          method: "POST",
          headers: { "Content-Type": "application/json" },
          body: "{}",
        }).then((r) => r.body?.cancel());
      const blocker = await submit(a.url, { ...JOB, train_iters: 100_000, save_interval: 0 });
      await until(
        async () => (await json(`${a.url}/jobs/${blocker}`)).status === "running",
        "the job that keeps A busy",
        30_000,
        100,
      );
      b = await start("host-b", `${root}/b`);
      const long = await submit(b.url, { ...JOB, train_iters: 2000, save_interval: 0 });
      const longEvents: SseEvent[] = [];
      let cancelled = false;
      await follow(`${a.url}/jobs/${long}/events`, 0, (e) => {
        longEvents.push(e);
        if (!cancelled && e.event === "progress") {
          cancelled = true;
          void cancel(long);
        }
      });
      assert.ok(onHost(longEvents, "host-b"), JSON.stringify(longEvents.map((e) => e.data.message)));
      assert.equal(longEvents.at(-1)!.event, "done");
      assert.equal(longEvents.at(-1)!.data.status, "cancelled");
      assert.ok(longEvents.some((e) => e.data.message === "Cancel requested through another host"));
      assert.ok(Number(longEvents.at(-1)!.data.iteration) < 2000);

      // 3. B paused past its lease: A (freed) takes the job over; B, resumed, never writes to it again.
      const paused = await submit(b.url, { ...JOB, train_iters: 20, save_interval: 5 });
      const pausedEvents: SseEvent[] = [];
      const onB = Promise.withResolvers<void>();
      const takenOver = Promise.withResolvers<void>();
      const following = follow(`${a.url}/jobs/${paused}/events`, 0, (e) => {
        pausedEvents.push(e);
        if (e.event === "checkpoint" && onHost(pausedEvents, "host-b")) onB.resolve();
        if (e.event === "log" && String(e.data.message).includes(`of host "host-a" from checkpoint`)) {
          takenOver.resolve();
        }
      });
      await Promise.race([onB.promise, following]);
      assert.ok(onHost(pausedEvents, "host-b"), JSON.stringify(pausedEvents.map((e) => e.data.message)));
      const bPids = await pids(b);
      for (const pid of bPids) Deno.kill(pid, "SIGSTOP");
      await cancel(blocker);
      await Promise.race([takenOver.promise, new Promise((r) => setTimeout(r, 30_000))]);
      for (const pid of bPids) Deno.kill(pid, "SIGCONT");
      await following;
      assert.equal(pausedEvents.at(-1)!.data.status, "succeeded", JSON.stringify(pausedEvents.at(-1)!.data));
      const takeover = pausedEvents.findIndex((e) =>
        String(e.data.message ?? "").includes("stopped renewing")
      );
      assert.ok(takeover > 0);
      const after = pausedEvents.slice(takeover).filter((e) =>
        e.event === "progress" && e.data.kind === "train"
      ).map((e) => Number(e.data.iteration));
      for (let i = 1; i < after.length; i++) assert.ok(after[i] > after[i - 1], after.join(","));
      assert.equal(after.at(-1), 20);
      await until(
        () => b.output.join("").includes(`Job "${paused}" was taken over by another host`),
        "host B's word that it stopped the job",
        10_000,
        100,
      );
      assert.equal((await json(`${a.url}/jobs/${paused}`)).iteration, 20);
    } finally {
      for (const c of children) {
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
