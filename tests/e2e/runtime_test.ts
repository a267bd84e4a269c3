/**
 * The GPU runtime end to end on the CPU adapter, through the real server and its GPU host child:
 * SIGTERM during a job exits 0 within the limit and the restarted server resumes the job at the
 * step it stopped with the same losses as an uninterrupted run; SIGKILL of the GPU host alone
 * leaves the server answering while the host restarts and the job resumes; two Workers sharing
 * one adapter train two jobs at once; a fresh server's start-up warm-up goes through the GPU host
 * and a Worker and counts nothing. Skipped when no WebGPU adapter exists.
 */

import assert from "node:assert/strict";
import { noGpu } from "../_helpers.ts";
import { follow, type SseEvent, startServer, submit } from "../_server.ts";
import { until } from "../_wait.ts";

/**
 * The stop limit: a stop waits for the steps already queued on the GPU (up to four) before it saves, and a
 * gpt2-tiny step can take seconds on a loaded CPU adapter.
 */
const LIMIT_S = "60";

const job = (over: Record<string, unknown> = {}) => ({
  model: "gpt2-tiny",
  dataset: "sotu",
  train_iters: 12,
  batch_size: 2,
  seq_len: 32,
  lr: 3e-3,
  min_lr: 3e-4,
  warmup: 0.1,
  hidden_dropout: 0.1,
  attention_dropout: 0.1,
  log_interval: 1,
  eval_interval: 0,
  eval_iters: 1,
  save_interval: 0,
  keep_checkpoints: 2,
  seed: 11,
  ...over,
});

const getJson = async (url: string) => {
  const res = await fetch(url);
  return { status: res.status, body: await res.json() };
};

/** Train losses by iteration from the metrics history. */
async function trainLosses(url: string, id: string): Promise<Map<number, number>> {
  const { body } = await getJson(`${url}/jobs/${id}/metrics`);
  const out = new Map<number, number>();
  for (const m of body.metrics as { split: string; iteration: number; loss: number }[]) {
    if (m.split !== "train") continue;
    assert.ok(!out.has(m.iteration), `iteration ${m.iteration} recorded twice`);
    out.set(m.iteration, m.loss);
  }
  return out;
}

const serverTest = (name: string, fn: (home: string) => Promise<void>) =>
  Deno.test({
    name,
    ignore: noGpu,
    sanitizeResources: false,
    sanitizeOps: false,
    fn: async () => {
      const home = await Deno.makeTempDir({ prefix: "gpt2_runtime_" });
      try {
        await fn(home);
      } finally {
        await Deno.remove(home, { recursive: true });
      }
    },
  });

serverTest(
  "SIGTERM during a job exits 0 in time; the restart resumes at that step with unchanged losses",
  async (home) => {
    let server = await startServer(home, { GPT2_SHUTDOWN_S: LIMIT_S });
    try {
      const id = await submit(server.url, job());
      const seen: SseEvent[] = [];
      let signalled = 0;
      await follow(`${server.url}/jobs/${id}/events`, 0, (e) => {
        seen.push(e);
        if (e.event === "done") throw new Error(`Job ended before SIGTERM: ${JSON.stringify(e.data)}`);
        if (!signalled && e.event === "progress" && Number(e.data.iteration) >= 4) {
          signalled = Date.now();
          server.child.kill("SIGTERM");
        }
      });
      const status = await server.child.status;
      const seconds = (Date.now() - signalled) / 1000;
      assert.equal(status.code, 0, server.output.join(""));
      assert.ok(seconds < Number(LIMIT_S), `took ${seconds} s`);
      assert.equal(seen.at(-1)!.event, "shutdown", "the stream ends with a shutdown event");
      const saved = seen.filter((e) => e.event === "checkpoint").at(-1);
      assert.ok(saved, "a checkpoint was saved at shutdown");
      const stoppedAt = Number(saved.data.iteration);
      const lastLogged = Math.max(
        ...seen.filter((e) => e.event === "progress").map((e) => Number(e.data.iteration)),
      );
      assert.equal(stoppedAt, lastLogged, "the checkpoint is at the last step done");
      assert.match(server.output.join(""), /Stopped/);

      server = await startServer(home, { GPT2_SHUTDOWN_S: LIMIT_S });
      const more: SseEvent[] = [];
      await follow(`${server.url}/jobs/${id}/events`, seen.filter((e) => e.id > 0).at(-1)!.id, (e) => {
        more.push(e);
      });
      assert.equal(more.at(-1)!.event, "done");
      assert.equal(more.at(-1)!.data.status, "succeeded", JSON.stringify(more.at(-1)!.data));
      const resumed = more.find((e) => String(e.data.message ?? "").startsWith("Resumed from"))!;
      assert.equal(Number(resumed.data.iteration), stoppedAt);
      const firstAfter = more.find((e) => e.event === "progress" && e.data.kind === "train")!;
      assert.equal(Number(firstAfter.data.iteration), stoppedAt + 1, "no step lost or repeated");

      // The same job without the interruption: every loss identical.
      const ref = await submit(server.url, job());
      await until(
        async () => (await getJson(`${server.url}/jobs/${ref}`)).body.status === "succeeded",
        "reference run",
        300_000,
      );
      const [a, b] = [await trainLosses(server.url, id), await trainLosses(server.url, ref)];
      assert.deepEqual([...a.keys()], Array.from({ length: 12 }, (_, i) => i + 1));
      for (const [it, loss] of b) {
        assert.ok(
          Object.is(a.get(it), loss),
          `iteration ${it}: ${a.get(it)} vs ${loss}`,
        );
      }
      const j = (await getJson(`${server.url}/jobs/${id}`)).body;
      assert.ok(Number.isFinite(j.metrics.test_loss) && j.metrics.test_tokens > 0);
    } finally {
      server.child.kill("SIGKILL");
      await server.child.status;
    }
  },
);

serverTest(
  "SIGKILL of the GPU host: the server answers throughout, the host restarts and the job resumes",
  async (home) => {
    const server = await startServer(home, { GPT2_SHUTDOWN_S: LIMIT_S });
    try {
      const id = await submit(server.url, job({ train_iters: 16, save_interval: 5 }));
      await follow(`${server.url}/jobs/${id}/events`, 0, (e) => !(e.event === "checkpoint"));
      const before = (await getJson(`${server.url}/health`)).body;
      assert.equal(before.gpu_host.state, "running");
      Deno.kill(before.gpu_host.pid, "SIGKILL");
      let polls = 0;
      await until(
        async () => {
          const health = await getJson(`${server.url}/health`);
          assert.equal(health.status, 200);
          polls++;
          const j = (await getJson(`${server.url}/jobs/${id}`)).body;
          assert.ok(j.status !== "failed", j.error);
          return j.status === "succeeded";
        },
        "job finished after the host crash",
        300_000,
      );
      assert.ok(polls > 1);
      const after = (await getJson(`${server.url}/health`)).body;
      assert.equal(after.gpu_host.restarts, 1);
      assert.equal(after.gpu_host.last_exit.signal, "SIGKILL");
      assert.notEqual(after.gpu_host.pid, before.gpu_host.pid);
      const j = (await getJson(`${server.url}/jobs/${id}`)).body;
      assert.equal(j.iteration, 16);
      assert.equal(j.resumes, 1);
      assert.match(j.resumed_from, /iter_00000(05|10|15)$/);
    } finally {
      server.child.kill("SIGTERM");
      assert.equal((await server.child.status).code, 0);
    }
  },
);

serverTest("two Workers sharing one adapter train two jobs at once", async (home) => {
  const server = await startServer(home, { GPT2_GPUS: "2" });
  try {
    const ids = [
      await submit(server.url, job({ train_iters: 10 })),
      await submit(server.url, job({ train_iters: 10, seed: 12 })),
    ];
    let together = false;
    await until(
      async () => {
        const jobs = await Promise.all(
          ids.map(async (id) => (await getJson(`${server.url}/jobs/${id}`)).body),
        );
        if (jobs.every((j) => j.status === "running" && j.iteration > 0 && j.iteration < 10)) together = true;
        return jobs.every((j) => j.status === "succeeded");
      },
      "both jobs finished",
      300_000,
      50,
    );
    assert.ok(together, "both jobs were mid-training at the same time");
    const gpus = await Promise.all(
      ids.map(async (id) => (await getJson(`${server.url}/jobs/${id}`)).body.gpu),
    );
    assert.deepEqual(gpus.sort(), [0, 1]);
    const health = (await getJson(`${server.url}/health`)).body;
    assert.equal(health.gpus.length, 2);
  } finally {
    server.child.kill("SIGTERM");
    assert.equal((await server.child.status).code, 0);
  }
});

serverTest(
  "a fresh server rehearses its request path through the GPU host and a Worker before users come, and counts none of it",
  async (home) => {
    const server = await startServer(home);
    try {
      const said = () =>
        server.output.join("").match(
          /Request path warmed up in \d+ ms: (\d+) rehearsals through a GPU's Worker, (\d+) in this process/,
        );
      await until(() => said() !== null, "the warm-up's line", 120_000);
      const [, worker, here] = said()!.map(Number);
      // 24 in-memory rounds of 2, then 6 rounds of 64 over the socket once the Worker was ready.
      assert.equal(worker + here, 24 * 2 + 6 * 64, server.output.join(""));
      assert.ok(worker >= 6 * 64, `only ${worker} rehearsals went through the Worker`);
      const prom = await (await fetch(`${server.url}/metrics`)).text();
      assert.match(prom, /gpt2_generation_requests_total 0\n/);
      assert.match(prom, /vllm:time_to_first_token_seconds_count 0\n/);
    } finally {
      server.child.kill("SIGTERM");
      assert.equal((await server.child.status).code, 0);
    }
  },
);
