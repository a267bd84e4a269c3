/**
 * First contact: the server started exactly as README says (`deno task serve`, with the task's own
 * permissions rather than -A) on a host whose environment looks like a CUDA host's
 * (LD_LIBRARY_PATH, which Deno lets a child inherit only under an unscoped --allow-run), and a GPU
 * host that cannot start: the HTTP process stays up, `/health` says why, `/ready` is 503, jobs
 * wait in the queue, and once the cause is gone the host starts and the job runs. The GPU host's
 * Deno is made to fail through GPT2_GPU_HOST_DENO: a missing path (it cannot be spawned), then a
 * script that exits at once (it dies before answering), then a link to this Deno.
 * Tests that train are skipped when no WebGPU adapter exists.
 */

import assert from "node:assert/strict";
import { noGpu } from "../_helpers.ts";
import { submit } from "../_server.ts";
import { until } from "../_wait.ts";

/** A `deno task serve` process and everything it printed. */
interface Task {
  url: string;
  child: Deno.ChildProcess;
  output: string[];
}

/** Runs `deno task serve` on a free loopback port with a CUDA host's variables set. */
async function serveTask(home: string, env: Record<string, string> = {}): Promise<Task> {
  const libs = `${home}/cuda-libs`; // LD_LIBRARY_PATH names a real, harmless directory
  await Deno.mkdir(libs, { recursive: true });
  const child = new Deno.Command(Deno.execPath(), {
    args: ["task", "serve"],
    cwd: new URL("../..", import.meta.url).pathname,
    env: {
      PORT: "0",
      HOST: "127.0.0.1",
      GPT2_HOME: home,
      DENO_WEBGPU_BACKEND: Deno.env.get("DENO_WEBGPU_BACKEND") ?? "vulkan",
      LD_LIBRARY_PATH: libs,
      CUDA_VISIBLE_DEVICES: "0",
      ...env,
    },
    stdout: "piped",
    stderr: "piped",
  }).spawn();
  const output: string[] = [];
  const collect = async (stream: ReadableStream<Uint8Array>) => {
    const decoder = new TextDecoder();
    try {
      for await (const bytes of stream) output.push(decoder.decode(bytes, { stream: true }));
    } catch { /* killed */ }
  };
  collect(child.stdout);
  collect(child.stderr);
  try {
    await until(
      () => /listening on http:\/\/127\.0\.0\.1:\d+\//.test(output.join("")),
      "the listening line",
      60_000,
      20,
    );
  } catch (e) {
    await stopTask({ url: "", child, output });
    throw new Error(`${(e as Error).message}: ${output.join("")}`);
  }
  const url = output.join("").match(/listening on (http:\/\/127\.0\.0\.1:\d+)\//)![1];
  return { url, child, output };
}

/**
 * SIGTERM (`deno task` passes it on to the server) and the exit status; the server and its
 * children are killed if they outlive `ms`.
 */
async function stopTask(task: Task, ms = 60_000): Promise<Deno.CommandStatus> {
  try {
    task.child.kill("SIGTERM");
  } catch { /* exited already */ }
  let timer: ReturnType<typeof setTimeout> | undefined;
  const late = new Promise<null>((r) => timer = setTimeout(() => r(null), ms));
  const status = await Promise.race([task.child.status, late]);
  clearTimeout(timer);
  if (status) return status;
  await new Deno.Command("pkill", { args: ["-KILL", "-P", String(task.child.pid)] }).output().catch(() => {});
  task.child.kill("SIGKILL");
  return await task.child.status;
}

const getJson = async (url: string) => {
  const res = await fetch(url);
  return { status: res.status, body: await res.json() };
};

const tinyJob = {
  model: "gpt2-tiny",
  dataset: "sotu",
  train_iters: 4,
  batch_size: 2,
  seq_len: 16,
  log_interval: 1,
  eval_interval: 0,
  eval_iters: 1,
  save_interval: 0,
  seed: 7,
};

const serverTest = (name: string, gpu: boolean, fn: (home: string) => Promise<void>) =>
  Deno.test({
    name,
    ignore: gpu && noGpu,
    sanitizeResources: false,
    sanitizeOps: false,
    fn: async () => {
      const home = await Deno.makeTempDir({ prefix: "gpt2_start_" });
      try {
        await fn(home);
      } finally {
        await Deno.remove(home, { recursive: true });
      }
    },
  });

serverTest(
  "`deno task serve` with LD_LIBRARY_PATH set trains gpt2-tiny through a narrowly permitted GPU host and exits 0 on SIGTERM",
  true,
  async (home) => {
    const task = await serveTask(home);
    try {
      const id = await submit(task.url, tinyJob);
      await until(
        async () => {
          const job = (await getJson(`${task.url}/jobs/${id}`)).body;
          assert.ok(job.status !== "failed", job.error);
          return job.status === "succeeded";
        },
        "the job to succeed",
        300_000,
        100,
      );
      const job = (await getJson(`${task.url}/jobs/${id}`)).body;
      assert.equal(job.iteration, 4);
      assert.ok(Number.isFinite(job.metrics.loss), JSON.stringify(job.metrics));
      const health = (await getJson(`${task.url}/health`)).body;
      assert.equal(health.gpu_host.state, "running");
      assert.equal(health.gpu_host.restarts, 0);
      assert.equal(health.gpu_host.reason, null);
      // The host runs with the permissions it needs, not -A.
      const cmdline = await Deno.readTextFile(`/proc/${health.gpu_host.pid}/cmdline`).catch(() => null);
      if (cmdline !== null) {
        const args = cmdline.split("\0");
        assert.ok(!args.includes("-A") && !args.includes("--allow-all"), args.join(" "));
        assert.ok(args.some((a) => a.startsWith("--allow-write=") && a.includes(home)), args.join(" "));
        assert.ok(!args.some((a) => a.startsWith("--allow-net")), args.join(" "));
      }
    } finally {
      const status = await stopTask(task);
      const output = task.output.join("");
      assert.equal(status.code, 0, output);
      assert.match(output, /Stopped/);
      assert.doesNotMatch(output, /Uncaught|NotCapable/);
    }
  },
);

serverTest(
  "a GPU host that cannot be spawned: the server stays up, /health says why, /ready is 503, jobs stay queued, SIGTERM exits 0",
  false,
  async (home) => {
    const deno = `${home}/bin/deno`; // missing
    const task = await serveTask(home, { GPT2_GPU_HOST_DENO: deno });
    try {
      const failed = async () => (await getJson(`${task.url}/health`)).body.gpu_host;
      await until(async () => (await failed()).state === "failed", "the host to fail", 30_000, 50);
      const host = await failed();
      assert.match(host.reason, /^Cannot start the GPU host: Failed to spawn .*No such file or directory/);
      assert.equal(host.pid, null);
      assert.ok(Date.parse(host.retry_at) > 0, host.retry_at);
      const ready = await getJson(`${task.url}/ready`);
      assert.equal(ready.status, 503);
      assert.match(ready.body.error.message, /Cannot start the GPU host/);
      const id = await submit(task.url, tinyJob);
      // It is tried again with a back-off, and the job waits meanwhile.
      const restarts = host.restarts;
      await until(async () => (await failed()).restarts > restarts, "a retry", 30_000, 50);
      const job = (await getJson(`${task.url}/jobs/${id}`)).body;
      assert.equal(job.status, "queued");
      assert.equal((await getJson(`${task.url}/health`)).status, 200);
    } finally {
      const t0 = Date.now();
      const status = await stopTask(task);
      const output = task.output.join("");
      assert.equal(status.code, 0, output);
      assert.ok(Date.now() - t0 < 15_000, `stopping took ${Date.now() - t0} ms`);
      assert.match(output, /Cannot start the GPU host: .*; trying again in/);
      assert.doesNotMatch(output, /Uncaught/);
    }
  },
);

serverTest(
  "a GPU host that cannot start, then dies at once, starts once the cause is gone and the queued job runs",
  true,
  async (home) => {
    const deno = `${home}/bin/deno`;
    const task = await serveTask(home, { GPT2_GPU_HOST_DENO: deno });
    try {
      const host = async () => (await getJson(`${task.url}/health`)).body.gpu_host;
      await until(async () => (await host()).state === "failed", "the host to fail", 30_000, 50);
      const id = await submit(task.url, tinyJob);

      // A host that exits before its first answer is failed too, with its last words as the reason.
      await Deno.mkdir(`${home}/bin`);
      await Deno.writeTextFile(deno, '#!/bin/sh\necho "stand-in GPU host: cannot start" >&2\nexit 3\n', {
        mode: 0o755,
      });
      await until(
        async () => /exited with status 3 before it answered/.test((await host()).reason ?? ""),
        "the stand-in to exit",
        60_000,
        50,
      );
      const died = await host();
      assert.equal(died.state, "failed");
      assert.equal(
        died.reason,
        "GPU host exited with status 3 before it answered: stand-in GPU host: cannot start",
      );
      assert.equal(died.last_exit.code, 3);
      assert.equal((await getJson(`${task.url}/ready`)).status, 503);
      assert.equal((await getJson(`${task.url}/jobs/${id}`)).body.status, "queued");

      // The cause goes: the next retry starts the host and the job runs.
      await Deno.remove(deno);
      await Deno.symlink(Deno.execPath(), deno);
      await until(
        async () => {
          const job = (await getJson(`${task.url}/jobs/${id}`)).body;
          assert.ok(job.status !== "failed", job.error);
          return job.status === "succeeded";
        },
        "the queued job to succeed",
        300_000,
        100,
      );
      const after = await host();
      assert.equal(after.state, "running");
      assert.equal(after.reason, null);
      assert.equal(after.retry_at, null);
      assert.ok(after.restarts >= 2, JSON.stringify(after));
      assert.equal((await getJson(`${task.url}/ready`)).status, 200);
    } finally {
      const status = await stopTask(task);
      const output = task.output.join("");
      assert.equal(status.code, 0, output);
      assert.doesNotMatch(output, /Uncaught/);
    }
  },
);
