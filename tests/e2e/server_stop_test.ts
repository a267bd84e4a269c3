/**
 * The stops users make, made the way they make them: `deno task serve` exactly as README says, in
 * a process group of its own as a terminal or a supervisor starts it, with LD_LIBRARY_PATH set as
 * on a GPU host; a gpt2-tiny job trains with no periodic checkpoint; then the whole group gets
 * SIGINT (Ctrl-C) or SIGTERM (systemd's default stop, `kill -TERM -PGID`). The server must save
 * the job at its current iteration and exit 0, and the job resumes there on the next start.
 * Also: the signal counting (a forwarded copy is the same request) as a unit.
 */

import assert from "node:assert/strict";
import { noGpu } from "../_helpers.ts";
import { until } from "../_wait.ts";
import { listCheckpoints } from "../../checkpoint/checkpoint.ts";
import { JobStore } from "../../server/jobs/job_store.ts";
import { DUPLICATE_SIGNAL_MS, StopSignals } from "../../server/stop_signals.ts";

const ROOT = new URL("../..", import.meta.url).pathname;

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

/** How a user stops the server: what is signalled, and how the server was started. */
const STOPS = {
  "Ctrl-C (SIGINT to the terminal's process group)": { signal: "SIGINT", host: false, pid1: false },
  "kill -TERM -PGID": { signal: "SIGTERM", host: false, pid1: false },
  // KillMode=control-group: every process of the service's cgroup, the GPU host's session too.
  "systemd's default stop (SIGTERM to every process of the service)": {
    signal: "SIGTERM",
    host: true,
    pid1: false,
  },
  // `deno task serve` as PID 1 of its own PID namespace, the signal to it alone.
  "docker stop (SIGTERM to PID 1)": { signal: "SIGTERM", host: false, pid1: true },
} as const;

/** Whether this machine can start a process in a PID namespace of its own (root, util-linux's unshare). */
const canUnshare = await new Deno.Command("unshare", { args: ["--pid", "--fork", "--mount-proc", "true"] })
  .output().then((o) => o.success, () => false);

/**
 * `deno task serve` in its own session and process group, as a terminal or systemd starts it; with
 * `pid1`, as PID 1 of a PID namespace, as a container's entry point.
 */
function startTask(
  home: string,
  pid1: boolean,
): { child: Deno.ChildProcess; output: () => string; url: Promise<string> } {
  const task = [Deno.execPath(), "task", "serve"];
  const argv = pid1 ? ["unshare", "--pid", "--fork", "--mount-proc", ...task] : task;
  const child = new Deno.Command(argv[0], {
    args: argv.slice(1),
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

/** Sends `signal` to process `pid`, or with a negative `pid` to every process of group -pid. */
async function kill(pid: number, signal: "SIGINT" | "SIGTERM"): Promise<void> {
  const out = await new Deno.Command("kill", { args: [`-${signal.slice(3)}`, "--", `${pid}`] }).output();
  assert.ok(out.success, new TextDecoder().decode(out.stderr));
}

for (const [how, { signal, host, pid1 }] of Object.entries(STOPS)) {
  Deno.test({
    name: `deno task serve: ${how} saves the running job at its current step and exits 0`,
    ignore: noGpu || (pid1 && !canUnshare),
    sanitizeResources: false,
    sanitizeOps: false,
    fn: async () => {
      const home = await Deno.makeTempDir({ prefix: `gpt2_stop_${signal}_` });
      const { child, output, url: listening } = startTask(home, pid1);
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

        if (pid1) {
          // The container's PID 1 is `deno task`, unshare's child.
          const ps = await new Deno.Command("pgrep", { args: ["-P", String(child.pid)] }).output();
          await kill(Number(new TextDecoder().decode(ps.stdout).trim().split("\n")[0]), signal);
        } else {
          const hostPid = host ? (await (await fetch(`${url}/health`)).json()).gpu_host.pid : null;
          await kill(-child.pid, signal);
          if (hostPid) await kill(hostPid, signal);
        }
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
