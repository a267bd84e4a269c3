/**
 * The stops users make, made the way they make them: `deno task serve` exactly as README says, in
 * a process group of its own as a terminal or a supervisor starts it, with LD_LIBRARY_PATH set as
 * on a GPU host; a gpt2-tiny job trains with no periodic checkpoint; then the whole group gets
 * SIGINT (Ctrl-C) or SIGTERM (systemd's default stop, `kill -TERM -PGID`). The server must save
 * the job at its current iteration and exit 0, and the job resumes there on the next start.
 * Also: the signal counting (a forwarded copy is the same request) as a unit.
 */

import assert from "node:assert/strict";
import { noGpu } from "./_helpers.ts";
import { until } from "./_wait.ts";
import { listCheckpoints } from "../checkpoint/checkpoint.ts";
import { JobStore } from "../server/jobs/job_store.ts";
import { DUPLICATE_SIGNAL_MS, StopSignals } from "../server/stop_signals.ts";

const ROOT = new URL("..", import.meta.url).pathname;

Deno.test("a signal's copies within the window are one stop request; a later one exits", () => {
  const s = new StopSignals(1000);
  assert.equal(s.stopping, false);
  assert.equal(s.receive(5000), "stop");
  assert.equal(s.stopping, true);
  assert.equal(s.receive(5001), "duplicate"); // deno task's forward
  assert.equal(s.receive(5999), "duplicate");
  assert.equal(s.receive(6000), "exit"); // pressed again, on purpose
  assert.ok(DUPLICATE_SIGNAL_MS >= 500 && DUPLICATE_SIGNAL_MS <= 2000);
});

/** `deno task serve` in its own session and process group, as a terminal or systemd starts it. */
function startTask(home: string): { child: Deno.ChildProcess; output: () => string; url: Promise<string> } {
  const child = new Deno.Command(Deno.execPath(), {
    args: ["task", "serve"],
    cwd: ROOT,
    env: {
      PORT: "0",
      HOST: "127.0.0.1",
      GPT2_HOME: home,
      DENO_WEBGPU_BACKEND: Deno.env.get("DENO_WEBGPU_BACKEND") ?? "vulkan",
      // What CUDA hosts and their containers set; Deno's scoped --allow-run refuses it.
      LD_LIBRARY_PATH: Deno.env.get("LD_LIBRARY_PATH") ?? "/usr/local/lib",
      NO_COLOR: "1",
    },
    stdin: "null",
    stdout: "piped",
    stderr: "piped",
    detached: true,
  }).spawn();
  let text = "";
  const url = Promise.withResolvers<string>();
  const pump = async (stream: ReadableStream<Uint8Array>) => {
    const decoder = new TextDecoder();
    for await (const chunk of stream) {
      text += decoder.decode(chunk, { stream: true });
      const m = text.match(/listening on (http:\/\/127\.0\.0\.1:\d+)\//);
      if (m) url.resolve(m[1]);
    }
  };
  pump(child.stdout).catch(() => {});
  pump(child.stderr).catch(() => {});
  child.status.then(() => url.reject(new Error(`server exited before listening:\n${text}`)));
  return { child, output: () => text, url: url.promise };
}

/** Sends `signal` to every process of the group led by `pgid` (what Ctrl-C and systemd do). */
async function signalGroup(pgid: number, signal: "SIGINT" | "SIGTERM"): Promise<void> {
  const out = await new Deno.Command("kill", { args: [`-${signal.slice(3)}`, "--", `-${pgid}`] }).output();
  assert.ok(out.success, new TextDecoder().decode(out.stderr));
}

for (const signal of ["SIGINT", "SIGTERM"] as const) {
  Deno.test({
    name:
      `deno task serve: ${signal} to the process group saves the running job at its current step and exits 0`,
    ignore: noGpu,
    sanitizeResources: false,
    sanitizeOps: false,
    fn: async () => {
      const home = await Deno.makeTempDir({ prefix: `gpt2_stop_${signal}_` });
      const { child, output, url: listening } = startTask(home);
      let exited = false;
      child.status.then(() => exited = true);
      try {
        const url = await listening;
        const res = await fetch(`${url}/train`, {
          method: "POST",
          headers: { "Content-Type": "application/json" },
          body: JSON.stringify({
            model: "gpt2-tiny",
            train_iters: 100_000,
            batch_size: 2,
            seq_len: 32,
            log_interval: 1,
            eval_interval: 100_000,
            save_interval: 100_000,
          }),
        });
        const { id } = await res.json();
        assert.equal(res.status, 202);
        let seen = 0;
        await until(
          async () => {
            const job = await (await fetch(`${url}/jobs/${id}`)).json();
            seen = job.iteration;
            return job.status === "running" && job.iteration >= 5;
          },
          "the job to reach iteration 5",
          240_000,
          200,
        );

        await signalGroup(child.pid, signal);
        const status = await child.status;
        const log = output();
        assert.equal(status.code, 0, `exit ${status.code} (signal ${status.signal}):\n${log}`);
        assert.match(log, /Stopped/);
        assert.doesNotMatch(log, /exiting now/, "a forwarded copy of the signal was taken for a second one");
        assert.doesNotMatch(log, /GPU host \(pid \d+\) exited/, "the GPU host died of the signal");

        const store = new JobStore(`${home}/jobs.sqlite`);
        const job = store.getJob(id)!;
        store.close();
        assert.equal(job.status, "interrupted", JSON.stringify(job));
        assert.ok(
          job.iteration >= seen,
          `stored iteration ${job.iteration} < ${seen} seen before the signal`,
        );
        const checkpoints = await listCheckpoints(`${home}/checkpoints/${id}`);
        assert.deepEqual(
          checkpoints.map((c) => c.iteration),
          [job.iteration],
          `checkpoints ${
            JSON.stringify(checkpoints.map((c) => c.name))
          } for a job stopped at ${job.iteration}`,
        );
        // No process of the group is left (the GPU host ended with the server).
        await until(
          async () => {
            const ps = await new Deno.Command("ps", { args: ["-eo", "args"] }).output();
            return !new TextDecoder().decode(ps.stdout).includes(home);
          },
          "the GPU host to exit",
          10_000,
          100,
        );
      } finally {
        if (!exited) {
          try {
            Deno.kill(-child.pid, "SIGKILL");
          } catch { /* gone */ }
        }
        await child.status;
        await Deno.remove(home, { recursive: true }).catch(() => {});
      }
    },
  });
}
