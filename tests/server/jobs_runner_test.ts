/**
 * The runner and store without a GPU (the Worker is the scripted double in tests/fakes/fake_worker.ts):
 * FIFO order per GPU, spreading over several GPUs, a free GPU taking the next job waiting on
 * another GPU's queue (or on one with no device), crash recovery from the store on disk, a
 * Worker crash interrupting its job (resumed, or failed when it keeps crashing), and the
 * graceful stop.
 */

import assert from "node:assert/strict";
import { paramLayout, presetConfig } from "../../model/config.ts";
import { completeConfig } from "../../job/job_config.ts";
import { JobRunner, JobStore, type TrainConfig, type TrainRequest } from "../../server/jobs/mod.ts";
import { saveCheckpoint } from "../../checkpoint/checkpoint.ts";
import { ScriptedWorker } from "../fakes/fake_worker.ts";
import { until } from "../_wait.ts";

const tick = () => new Promise((r) => setTimeout(r, 5));
/** Waits until `cond()` holds (the runner works asynchronously; CI machines can be slow). */
const req = (over: Partial<TrainRequest> = {}): TrainRequest => ({
  model: "gpt2-tiny",
  dataset: "sotu",
  split: "949,50,1",
  train_iters: 20,
  batch_size: 2,
  lr: 1e-3,
  min_lr: 1e-4,
  lr_decay_style: "cosine",
  warmup: 0,
  weight_decay: 0.1,
  clip_grad: 1,
  attention_dropout: 0,
  hidden_dropout: 0,
  seed: 1,
  log_interval: 5,
  eval_interval: 0,
  eval_iters: 1,
  save_interval: 10,
  keep_checkpoints: 2,
  ...over,
});

/** A runner over `gpus` scripted Workers (none for the GPUs in `unavailable`), not started. */
function makeRunner(
  store: JobStore,
  root: string,
  gpus = 1,
  opts: { skipOwners?: () => string[]; unavailable?: number[] } = {},
) {
  const workers: ScriptedWorker[] = [];
  const runner = new JobRunner(store, {
    root,
    gpus,
    spawn: (gpu) => {
      const w = new ScriptedWorker(
        opts.unavailable?.includes(gpu) ? { unavailable: "No WebGPU adapter found" } : {},
      );
      workers.push(w);
      return w;
    },
    datasetExists: (id) => Promise.resolve(id === "sotu"),
    skipOwners: opts.skipOwners,
  });
  return { runner, workers };
}

/** A runner over a scripted Worker on one GPU, started; cleaned up after `fn`. */
function runnerTest(
  name: string,
  fn: (t: ReturnType<typeof makeRunner> & { store: JobStore }) => Promise<void>,
) {
  Deno.test(name, async () => {
    const root = await Deno.makeTempDir({ prefix: "gpt2_runner_" });
    const store = new JobStore(":memory:");
    const t = makeRunner(store, root);
    try {
      t.runner.start();
      await tick();
      await fn({ ...t, store });
    } finally {
      t.runner.shutdown();
      store.close();
      await Deno.remove(root, { recursive: true });
    }
  });
}

Deno.test("JobRunner runs one job per GPU in FIFO order and spreads jobs over GPUs", async () => {
  const root = await Deno.makeTempDir({ prefix: "gpt2_runner_" });
  const store = new JobStore(":memory:");
  const { runner, workers } = makeRunner(store, root, 2);
  try {
    runner.start();
    await tick();
    const ids = [];
    for (let i = 0; i < 4; i++) ids.push((await runner.submit(req({ seed: i }))).id);
    await until(() => workers.every((w) => w.jobs.length === 1), "a job on each worker");
    assert.deepEqual(ids.map((id) => store.getJob(id)!.gpu), [0, 1, 0, 1]);
    assert.deepEqual(workers.map((w) => w.jobs.map((j) => j.id)), [[ids[0]], [ids[1]]]);
    assert.deepEqual(store.queue(0).map((j) => j.id), [ids[2]]);
    workers[0].send({ type: "done", id: ids[0], status: "succeeded", iteration: 20, error: null });
    await until(() => workers[0].jobs.length === 2, "the next job on GPU 0");
    assert.deepEqual(workers[0].jobs.map((j) => j.id), [ids[0], ids[2]]);
    assert.equal(store.getJob(ids[0])!.status, "succeeded");
    assert.equal(store.getJob(ids[2])!.status, "running");
  } finally {
    runner.shutdown();
    store.close();
    await Deno.remove(root, { recursive: true });
  }
});

/** Puts a waiting job straight into GPU `gpu`'s queue (as one submitted earlier would be), owned by `owner`. */
function enqueue(
  store: JobStore,
  id: string,
  gpu: number,
  owner: string | null,
  over: Partial<TrainRequest> = {},
) {
  store.createJob(id, gpu, completeConfig(req(over)), owner);
  return id;
}

Deno.test("a free GPU with nothing of its own to run takes the next job waiting on another GPU: owners at quota passed over, data-parallel jobs left to gather", async () => {
  const root = await Deno.makeTempDir({ prefix: "gpt2_runner_" });
  const store = new JobStore(":memory:");
  let held: string[] = [];
  const { runner, workers } = makeRunner(store, root, 3, { skipOwners: () => held });
  try {
    runner.start();
    await until(() => runner.gpus().every((g) => g.state === "idle"), "three GPUs");
    const busy = [];
    for (let i = 0; i < 3; i++) busy.push((await runner.submit(req({ seed: i }))).id);
    await until(() => workers.every((w) => w.jobs.length === 1), "a job on each GPU");
    // GPU 1's queue: alice's job (she is at her quota), then bob's; GPU 2's: carol's job on two GPUs, then hers on one.
    held = ["alice"];
    const a = enqueue(store, "job_alice", 1, "alice");
    const b = enqueue(store, "job_bob", 1, "bob");
    const gang = enqueue(store, "job_gang", 2, "carol", { data_parallel: 2, batch_size: 4 });
    const c = enqueue(store, "job_carol", 2, "carol");
    workers[0].send({ type: "done", id: busy[0], status: "succeeded", iteration: 20, error: null });
    await until(() => workers[0].jobs.length === 2, "the next job on GPU 0");
    assert.equal(workers[0].jobs[1].id, b, "bob's job, past alice's held one");
    assert.deepEqual([store.getJob(b)!.status, store.getJob(b)!.gpu], ["running", 0]);
    assert.deepEqual(store.queue(1).map((j) => j.id), [a]);
    assert.deepEqual(store.queue(2).map((j) => j.id), [gang, c], "the data-parallel job keeps its place");
    assert.ok(
      store.eventsAfter(b).some((e) => e.data.message === "Moved from GPU 1's queue to GPU 0, free first"),
    );
    // GPU 0 frees again: alice is still held and GPU 2's next job needs two GPUs: nothing moves.
    workers[0].send({ type: "done", id: b, status: "succeeded", iteration: 20, error: null });
    await tick();
    assert.equal(workers[0].jobs.length, 2);
    assert.deepEqual(runner.gpus().map((g) => g.state), ["idle", "busy", "busy"]);
    // GPU 2 frees: its data-parallel job gathers GPU 2 and the free GPU 0, as it did before.
    workers[2].send({ type: "done", id: busy[2], status: "succeeded", iteration: 20, error: null });
    await until(
      () => workers[0].jobs.length === 3 && workers[2].jobs.length === 2,
      "the data-parallel job's ranks",
    );
    assert.deepEqual([workers[0].jobs[2].id, workers[2].jobs[1].id], [gang, gang]);
    assert.equal(store.getJob(gang)!.gpu, 2);
    assert.deepEqual(store.getJob(gang)!.metrics.gpus, [2, 0]);
    // alice is under quota again: her job goes on the first GPU that frees, GPU 1 its own.
    held = [];
    workers[1].send({ type: "done", id: busy[1], status: "succeeded", iteration: 20, error: null });
    await until(() => workers[1].jobs.length === 2, "alice's job on GPU 1");
    assert.equal(workers[1].jobs[1].id, a);
    assert.equal(store.getJob(a)!.gpu, 1);
    assert.deepEqual(store.queue(2).map((j) => j.id), [c]);
  } finally {
    runner.shutdown();
    store.close();
    await Deno.remove(root, { recursive: true });
  }
});

Deno.test("a data-parallel job ending frees its owner's quota: her job held on a free GPU's queue goes", async () => {
  const root = await Deno.makeTempDir({ prefix: "gpt2_runner_" });
  const store = new JobStore(":memory:");
  let held: string[] = [];
  const { runner, workers } = makeRunner(store, root, 3, { skipOwners: () => held });
  try {
    runner.start();
    await until(() => runner.gpus().every((g) => g.state === "idle"), "three GPUs");
    const gang = (await runner.submit(req({ data_parallel: 2, batch_size: 4 }), "alice")).id;
    await until(() => workers[0].jobs.length === 1 && workers[1].jobs.length === 1, "both ranks");
    held = ["alice"]; // her quota: two GPUs
    const next = (await runner.submit(req(), "alice")).id;
    await tick();
    assert.deepEqual([store.getJob(next)!.status, store.getJob(next)!.gpu], ["queued", 2]);
    assert.equal(runner.gpus()[2].state, "idle");
    held = [];
    for (const w of [0, 1]) {
      workers[w].send({ type: "done", id: gang, status: "succeeded", iteration: 20, error: null });
    }
    await until(() => store.getJob(next)!.status === "running", "her next job");
    assert.equal(store.getJob(gang)!.status, "succeeded");
  } finally {
    runner.shutdown();
    store.close();
    await Deno.remove(root, { recursive: true });
  }
});

Deno.test("of several other GPUs' queues, a free GPU takes the job waiting longest, an interrupted one first", async () => {
  const root = await Deno.makeTempDir({ prefix: "gpt2_runner_" });
  const store = new JobStore(":memory:");
  const { runner, workers } = makeRunner(store, root, 3);
  try {
    runner.start();
    await until(() => runner.gpus().every((g) => g.state === "idle"), "three GPUs");
    const busy = [];
    for (let i = 0; i < 3; i++) busy.push((await runner.submit(req({ seed: i }))).id);
    await until(() => workers.every((w) => w.jobs.length === 1), "a job on each GPU");
    const older = enqueue(store, "job_older", 2, null);
    await new Promise((r) => setTimeout(r, 5)); // a later created_at
    const newer = enqueue(store, "job_newer", 1, null);
    const done = (gpu: number, id: string) =>
      workers[gpu].send({ type: "done", id, status: "succeeded", iteration: 20, error: null });
    done(0, busy[0]);
    await until(() => workers[0].jobs.length === 2, "the next job on GPU 0");
    assert.equal(workers[0].jobs[1].id, older);
    assert.equal(store.getJob(older)!.gpu, 0);
    // An interrupted job (its Worker crashed) goes before one queued earlier.
    const interrupted = enqueue(store, "job_interrupted", 2, null);
    store.updateJob(interrupted, { status: "interrupted" });
    done(0, older);
    await until(() => workers[0].jobs.length === 3, "the next job on GPU 0");
    assert.equal(workers[0].jobs[2].id, interrupted);
    assert.deepEqual([store.getJob(interrupted)!.status, store.getJob(interrupted)!.resumes], ["running", 1]);
    assert.deepEqual(store.queue(1).map((j) => j.id), [newer]);
  } finally {
    runner.shutdown();
    store.close();
    await Deno.remove(root, { recursive: true });
  }
});

Deno.test("jobs waiting on a GPU with no device move to one that works; one needing more GPUs than work fails with the reason", async () => {
  const root = await Deno.makeTempDir({ prefix: "gpt2_runner_" });
  const store = new JobStore(":memory:");
  const { runner, workers } = makeRunner(store, root, 3, { unavailable: [1] });
  try {
    // Left on GPU 1's queue by the last run.
    const first = enqueue(store, "job_first", 1, null);
    const second = enqueue(store, "job_second", 1, null);
    const third = enqueue(store, "job_third", 1, null);
    const wide = enqueue(store, "job_wide", 1, null, { data_parallel: 3, batch_size: 6 });
    runner.start();
    await until(() => runner.gpus().every((g) => g.state !== "starting"), "the GPUs");
    await until(
      () => workers[0].jobs.length === 1 && workers[2].jobs.length === 1,
      "a job on each working GPU",
    );
    const ran = [workers[0].jobs[0].id, workers[2].jobs[0].id];
    assert.deepEqual([...ran].sort(), [first, second].sort());
    assert.deepEqual(ran.map((id) => store.getJob(id)!.gpu), [0, 2]);
    const waiting = store.getJob(third)!;
    assert.equal(waiting.status, "queued");
    assert.notEqual(waiting.gpu, 1);
    assert.deepEqual(store.queue(1), []);
    const failed = store.getJob(wide)!;
    assert.deepEqual([failed.status, failed.error], ["failed", "No WebGPU adapter found"]);
    assert.deepEqual(workers[1].jobs, []);
  } finally {
    runner.shutdown();
    store.close();
    await Deno.remove(root, { recursive: true });
  }
});

Deno.test("JobRunner.start() marks jobs a dead server left running as interrupted and resumes them from their newest checkpoint first", async () => {
  const root = await Deno.makeTempDir({ prefix: "gpt2_runner_" });
  const path = `${root}/jobs.sqlite`;
  try {
    // First server: two jobs, the first running with a checkpoint at 10, then the process "dies".
    let store = new JobStore(path);
    const first = makeRunner(store, root);
    first.runner.start();
    await tick();
    const a = (await first.runner.submit(req())).id;
    const b = (await first.runner.submit(req())).id;
    await until(() => first.workers[0].jobs.length === 1, "job a on the worker");
    first.workers[0].send({ type: "started", id: a, iteration: 0, resumed_from: null, gpu_memory_bytes: 1 });
    const model = presetConfig("gpt2-tiny");
    const n = paramLayout(model).totalSize;
    const ck = await saveCheckpoint(
      first.runner.checkpointDir(a),
      {
        job_id: a,
        model,
        train: store.getJob(a)!.config as TrainConfig,
        sampler: { epoch: 0, position: 20 },
        metrics: { loss: 6, val_loss: null },
      },
      { step: 10, params: new Float32Array(n), m: new Float32Array(n), v: new Float32Array(n) },
      2,
    );
    first.workers[0].send({ type: "checkpoint", id: a, iteration: 10, name: ck.name, path: ck.path });
    first.runner.shutdown(); // no "done": like SIGKILL, the store still says running
    store.close();

    store = new JobStore(path);
    assert.equal(store.getJob(a)!.status, "running");
    const second = makeRunner(store, root);
    second.runner.start();
    assert.equal(store.getJob(a)!.status, "interrupted");
    const events = store.eventsAfter(a).map((e) => e.data.status).filter(Boolean);
    assert.deepEqual(events, ["queued", "running", "interrupted"]);
    await until(() => second.workers[0].jobs.length === 1, "job a resumed on the worker");
    const handed = second.workers[0].jobs;
    assert.deepEqual(handed.map((j) => j.id), [a]);
    assert.equal(handed[0].resume_path, ck.path);
    const job = store.getJob(a)!;
    assert.equal(job.status, "running");
    assert.equal(job.resumes, 1);
    assert.equal(job.last_checkpoint, "iter_0000010");
    assert.equal(store.getJob(b)!.status, "queued");

    // A job being cancelled when the server died is not resumed: it ends cancelled.
    second.runner.cancel(a);
    second.runner.shutdown();
    store.close();
    store = new JobStore(path);
    const third = makeRunner(store, root);
    third.runner.start();
    assert.equal(store.getJob(a)!.status, "cancelled");
    await until(() => third.workers[0].jobs.length === 1, "job b on the worker");
    assert.deepEqual(third.workers[0].jobs.map((j) => j.id), [b]);
    third.runner.shutdown();
    store.close();
  } finally {
    await Deno.remove(root, { recursive: true });
  }
});

runnerTest(
  "a crashed Worker interrupts its job, which resumes first on the fresh Worker",
  async ({ runner, workers, store }) => {
    const a = (await runner.submit(req())).id;
    const b = (await runner.submit(req())).id;
    await until(() => workers[0].jobs.length === 1, "job a on the worker");
    workers[0].onerror!(new ErrorEvent("error", { message: "Uncaught RangeError: boom", cancelable: true }));
    await until(() => workers[1]?.jobs.length === 1, "job a again on the fresh worker");
    assert.ok(workers[0].terminated);
    assert.deepEqual(workers[1].jobs.map((j) => j.id), [a]);
    const job = store.getJob(a)!;
    assert.equal(job.status, "running");
    assert.equal(job.resumes, 1);
    assert.ok(
      store.eventsAfter(a, 0).some((e) =>
        String(e.data.message).includes("GPU worker crashed at iteration 0")
      ),
    );
    assert.equal(store.getJob(b)!.status, "queued");
  },
);

runnerTest(
  "a job whose Worker keeps crashing without progress fails after three crashes",
  async ({ runner, workers, store }) => {
    const a = (await runner.submit(req())).id;
    for (let i = 0; i < 3; i++) {
      await until(() => workers[i]?.jobs.length === 1, `job a on worker ${i}`);
      workers[i].onerror!(new ErrorEvent("error", { message: "out of memory", cancelable: true }));
    }
    await until(() => store.getJob(a)!.status === "failed", "job a failed");
    assert.equal(store.getJob(a)!.error, "GPU worker crashed 3 times at iteration 0: out of memory");
  },
);

runnerTest(
  "JobRunner.stop() has the running job save and end interrupted, ends streams, shuts Workers down",
  async ({ runner, workers, store }) => {
    const a = (await runner.submit(req())).id;
    const b = (await runner.submit(req())).id;
    await until(() => workers[0].jobs.length === 1, "job a on the worker");
    const seen: string[] = [];
    runner.subscribe(a, (e) => seen.push(e.type));
    const stopped = runner.stop(5000);
    await until(() => workers[0].stopRequested, "stop flag raised");
    assert.ok(runner.draining);
    await assert.rejects(() => runner.submit(req()), /shutting down/);
    workers[0].send({ type: "checkpoint", id: a, iteration: 7, name: "iter_0000007", path: "x" });
    workers[0].send({ type: "done", id: a, status: "interrupted", iteration: 7, error: null });
    await stopped;
    assert.ok(workers[0].shutDown);
    assert.ok(workers[0].terminated);
    assert.deepEqual(seen, ["checkpoint", "log", "shutdown"]);
    assert.equal(store.getJob(a)!.status, "interrupted");
    assert.equal(store.getJob(a)!.iteration, 7);
    assert.equal(store.getJob(b)!.status, "queued");
    assert.equal(workers[0].jobs.length, 1, "no new job starts while stopping");
  },
);

Deno.test("JobRunner.submit() refuses a split shorter than one sequence, naming it and seq_len", async () => {
  const root = await Deno.makeTempDir({ prefix: "gpt2_runner_" });
  const store = new JobStore(":memory:");
  const runner = new JobRunner(store, {
    root,
    gpus: 1,
    spawn: () => new ScriptedWorker(),
    datasetExists: () => Promise.resolve(true),
    splitTokens: (id) => Promise.resolve(id === "small" ? { train: 100_000, valid: 0, test: 60 } : null),
  });
  try {
    runner.start();
    await assert.rejects(() => runner.submit(req({ dataset: "small", seq_len: 64 })), {
      name: "InvalidJobError",
      message: 'The test split of dataset "small" has 60 tokens, fewer than one sequence of seq_len + 1 = 65',
    });
    // An empty split (weight 0) is not evaluated, and a sequence that fits is accepted.
    assert.equal((await runner.submit(req({ dataset: "small", seq_len: 32 }))).status, "queued");
  } finally {
    runner.shutdown();
    store.close();
    await Deno.remove(root, { recursive: true });
  }
});
