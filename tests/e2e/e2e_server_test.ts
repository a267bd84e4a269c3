/**
 * End to end on the CPU adapter: start the server as a subprocess on a free loopback port, train
 * gpt2-tiny on `sotu` for 100 iterations while following the event stream, SIGKILL the server
 * after a checkpoint, restart it on the same data directory, and check that the job was marked
 * interrupted, resumed from its checkpoint on its own, and finished with a lower loss.
 * Skipped when no WebGPU adapter exists.
 */

import assert from "node:assert/strict";
import { noGpu } from "../_helpers.ts";
import { follow, type SseEvent, startServer } from "../_server.ts";

Deno.test({
  name: "server trains gpt2-tiny on sotu, survives SIGKILL, and resumes the job from its checkpoint",
  ignore: noGpu,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: async () => {
    const home = await Deno.makeTempDir({ prefix: "gpt2_e2e_" });
    let server = await startServer(home);
    try {
      const res = await fetch(`${server.url}/train`, {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({
          model: "gpt2-tiny",
          dataset: "sotu",
          train_iters: 100,
          batch_size: 4,
          seq_len: 32,
          lr: 3e-3,
          min_lr: 3e-4,
          warmup: 0.05,
          log_interval: 5,
          eval_interval: 50,
          eval_iters: 4,
          save_interval: 20,
          keep_checkpoints: 2,
          seed: 7,
        }),
      });
      assert.equal(res.status, 202);
      const { id, status } = await res.json();
      assert.equal(status, "queued");

      // Follow until the second checkpoint, then kill the server without warning.
      const seen: SseEvent[] = [];
      await follow(`${server.url}/jobs/${id}/events`, 0, (e) => {
        seen.push(e);
        if (e.event === "done") throw new Error(`Job ended before the crash: ${JSON.stringify(e.data)}`);
        return !(e.event === "checkpoint" && Number(e.data.iteration) >= 40);
      });
      const lastCheckpoint = seen.filter((e) => e.event === "checkpoint").at(-1)!;
      assert.ok(lastCheckpoint, "no checkpoint event before the crash");
      const losses = seen.filter((e) => e.event === "progress" && e.data.kind === "train").map((e) => e.data);
      assert.ok(losses.length >= 8, `only ${losses.length} progress events`);
      const running = await (await fetch(`${server.url}/jobs/${id}`)).json();
      assert.equal(running.status, "running");
      assert.ok(running.metrics.tokens_per_s > 0);
      assert.ok(running.metrics.timings.step_ms > 0);
      server.child.kill("SIGKILL");
      await server.child.status;

      server = await startServer(home);
      const after = await (await fetch(`${server.url}/jobs/${id}`)).json();
      // Interrupted until the fresh Worker has opened its device and taken the job again.
      assert.ok(
        after.status === "interrupted" || (after.status === "running" && after.resumes === 1),
        after.status,
      );

      const more: SseEvent[] = [];
      await follow(`${server.url}/jobs/${id}/events`, seen.at(-1)!.id, (e) => {
        more.push(e);
      });
      assert.ok(more[0].id > seen.at(-1)!.id);
      const done = more.at(-1)!;
      assert.equal(done.event, "done");
      assert.equal(done.data.status, "succeeded", JSON.stringify(done.data));
      assert.ok(more.some((e) => e.event === "log" && e.data.status === "interrupted"));
      const resumedLog = more.find((e) => String(e.data.message ?? "").startsWith("Resumed from"));
      assert.ok(resumedLog, JSON.stringify(more.map((e) => e.data.message)));
      const resumedAt = Number(resumedLog.data.iteration);
      assert.ok(resumedAt >= Number(lastCheckpoint.data.iteration), `resumed at ${resumedAt}`);
      const firstAfter = more.find((e) => e.event === "progress" && e.data.kind === "train")!;
      assert.ok(
        Number(firstAfter.data.iteration) > resumedAt && Number(firstAfter.data.iteration) <= resumedAt + 5,
      );

      const job = await (await fetch(`${server.url}/jobs/${id}`)).json();
      assert.equal(job.status, "succeeded");
      assert.equal(job.iteration, 100);
      assert.equal(job.resumes, 1);
      assert.equal(job.resumed_from.endsWith(String(lastCheckpoint.data.name)), true);
      const first = Number(losses[0].loss), last = Number(job.metrics.loss);
      assert.ok(last < first - 1, `loss did not fall: ${first} -> ${last}`);
      assert.ok(job.metrics.val_loss > 0 && job.metrics.test_loss > 0);
      assert.equal(job.metrics.val_perplexity, Math.exp(job.metrics.val_loss));
      const ckpts = await (await fetch(`${server.url}/jobs/${id}/checkpoints`)).json();
      assert.deepEqual(ckpts.checkpoints.map((c: { name: string }) => c.name), [
        "iter_0000080",
        "iter_0000100",
      ]);
    } finally {
      server.child.kill("SIGKILL");
      await server.child.status;
      await Deno.remove(home, { recursive: true });
    }
  },
});
