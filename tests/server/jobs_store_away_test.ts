/**
 * The runner when its job store goes away and when a Worker goes silent, without a GPU (the
 * scripted Worker double): a SQLite store made unreachable (every call throws what a full disk or
 * a locked file throws) keeps the job training, keeps its records in order and writes them once the
 * store is back; the next queued job starts only then; the Worker's messages never throw into the
 * relay. The watchdog replaces a Worker that reports nothing for GPT2_STALL_S and resumes its job,
 * recording why, and fails it after repeated stalls.
 */

import assert from "node:assert/strict";
import { JobRunner, JobStore, type TrainRequest } from "../../server/jobs/mod.ts";
import { ScriptedWorker } from "../fakes/fake_worker.ts";
import { until } from "../_wait.ts";

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

/** `store` behind a switch: while `down`, every call throws SQLite's "database or disk is full". */
function switchable(store: JobStore): { store: JobStore; set(down: boolean): void; calls: () => number } {
  let down = false, calls = 0;
  const proxy = new Proxy(store, {
    get(target, key, receiver) {
      const value = Reflect.get(target, key, receiver);
      if (typeof value !== "function" || key === "onEvent" || key === "close") {
        return typeof value === "function" ? value.bind(target) : value;
      }
      return (...args: unknown[]) => {
        if (down) {
          calls++;
          throw Object.assign(new Error("database or disk is full"), {
            code: "ERR_SQLITE_ERROR",
            errcode: 13,
          });
        }
        return value.apply(target, args);
      };
    },
  });
  return { store: proxy, set: (d) => down = d, calls: () => calls };
}

function makeRunner(store: JobStore, root: string, extra: { stallMs?: number } = {}) {
  const workers: ScriptedWorker[] = [];
  const runner = new JobRunner(store, {
    root,
    gpus: 1,
    spawn: () => {
      const w = new ScriptedWorker();
      workers.push(w);
      return w;
    },
    datasetExists: (id) => Promise.resolve(id === "sotu"),
    storeRetryMs: 10,
    ...extra,
  });
  return { runner, workers };
}

Deno.test("job store away: training goes on, its records wait in order, the queue waits for the store", async () => {
  const root = await Deno.makeTempDir({ prefix: "gpt2_away_" });
  const sqlite = new JobStore(":memory:");
  const sw = switchable(sqlite);
  const { runner, workers } = makeRunner(sw.store, root);
  const errors: string[] = [];
  const error = console.error;
  console.error = (...a: unknown[]) => errors.push(a.join(" "));
  try {
    runner.start();
    await until(() => runner.gpus()[0].state === "idle", "the Worker");
    const first = await runner.submit(req());
    const second = await runner.submit(req({ seed: 2 }));
    await until(() => workers[0].jobs.length === 1, "the first job on the Worker");
    const w = workers[0];
    const seen: string[] = [];
    runner.subscribe(first.id, (e) => seen.push(`${e.type}:${e.data.iteration ?? e.data.status ?? ""}`));
    w.send({ type: "started", id: first.id, iteration: 0, resumed_from: null, gpu_memory_bytes: 1 });
    w.send(progress(first.id, 5));

    assert.equal(runner.gpus()[0].queued, 1); // as /health reads it
    sw.set(true);
    // Nothing throws back into the relay, whatever the Worker reports meanwhile.
    for (const it of [10, 15]) w.send(progress(first.id, it));
    w.send({ type: "checkpoint", id: first.id, iteration: 10, name: "iter_0000010", path: `${root}/x` });
    w.send({ type: "log", id: first.id, level: "info", message: "still training" });
    w.send(progress(first.id, 20));
    w.send({ type: "done", id: first.id, status: "succeeded", iteration: 20, error: null });
    assert.equal(runner.storeState().state, "unreachable");
    assert.match(runner.storeState().error!, /disk is full/);
    assert.ok(runner.storeState().pending >= 7, JSON.stringify(runner.storeState()));
    // /health's GPU list still answers (the queue length as last known).
    assert.equal(runner.gpus()[0].queued, 1);
    await new Promise((r) => setTimeout(r, 100));
    assert.equal(w.jobs.length, 1, "a job started while the store was away");
    const callsWhileDown = sw.calls();
    await new Promise((r) => setTimeout(r, 100));
    assert.ok(sw.calls() - callsWhileDown <= 3, "the runner kept calling an unreachable store");

    sw.set(false);
    await until(() => runner.storeState().state === "ok", "the store to come back", 5000);
    const job = runner.get(first.id);
    assert.equal(job.status, "succeeded");
    assert.equal(job.iteration, 20);
    assert.equal(job.last_checkpoint, "iter_0000010");
    assert.deepEqual(sqlite.metrics(first.id).map((m) => m.iteration), [5, 10, 15, 20]);
    const types = sqlite.eventsAfter(first.id).map((e) => e.type);
    assert.deepEqual(types.slice(-7), [
      "progress",
      "progress",
      "progress",
      "checkpoint",
      "log",
      "progress",
      "done",
    ]);
    assert.deepEqual(seen, [
      "log:0",
      "progress:5",
      "progress:10",
      "progress:15",
      "checkpoint:10",
      "log:",
      "progress:20",
      "done:20",
    ]);
    // Only now does the next job start.
    await until(() => w.jobs.length === 2, "the second job to start once the store is back");
    assert.equal(w.jobs[1].id, second.id);
    assert.ok(!errors.some((e) => e.includes("Job runner: handling")), errors.join("\n"));
    assert.ok(errors.some((e) => e.includes("Job store unreachable")), errors.join("\n"));
  } finally {
    console.error = error;
    runner.shutdown();
    sqlite.close();
    await Deno.remove(root, { recursive: true });
  }
});

Deno.test("watchdog: a Worker silent past GPT2_STALL_S is replaced and its job resumes; repeated stalls fail it", async () => {
  const root = await Deno.makeTempDir({ prefix: "gpt2_stall_" });
  const store = new JobStore(":memory:");
  const { runner, workers } = makeRunner(store, root, { stallMs: 120 });
  const error = console.error;
  console.error = () => {};
  try {
    runner.start();
    await until(() => runner.gpus()[0].state === "idle", "the Worker");
    const { id } = await runner.submit(req());
    await until(() => workers[0].jobs.length === 1, "the job on the Worker");
    // Reports keep it alive past the stall time.
    for (let i = 1; i <= 5; i++) {
      await new Promise((r) => setTimeout(r, 50));
      workers[0].send(progress(id, i));
    }
    assert.equal(workers[0].terminated, false);
    // Then silence: replaced, and the job goes to a fresh Worker.
    await until(() => workers[0].terminated, "the silent Worker to be replaced", 5000);
    await until(() => workers.length >= 2 && workers[1].jobs.length === 1, "the job on the new Worker", 5000);
    assert.equal(workers[1].jobs[0].id, id);
    const messages = store.eventsAfter(id).map((e) => String(e.data.message ?? ""));
    assert.ok(
      messages.some((m) => /reported nothing for \d+ s \(GPT2_STALL_S 0\.12\): stalled/.test(m)),
      messages.join("\n"),
    );
    assert.equal(store.getJob(id)!.resumes, 1);
    // Silent again twice more without getting further: failed, with the reason.
    await until(() => store.getJob(id)!.status === "failed", "the job to fail after repeated stalls", 10_000);
    assert.match(store.getJob(id)!.error!, /crashed 3 times at iteration 5: .*stalled/);
  } finally {
    console.error = error;
    runner.shutdown();
    store.close();
    await Deno.remove(root, { recursive: true });
  }
});

function progress(id: string, iteration: number) {
  return {
    type: "progress" as const,
    id,
    iteration,
    loss: 10 - iteration / 10,
    grad_norm: 1,
    lr: 1e-3,
    tokens_per_s: 100,
    timings: {
      forward_ms: null,
      backward_ms: null,
      allreduce_ms: 0,
      optimizer_ms: null,
      batch_generator_ms: 0,
      data_loader_ms: 0,
      step_ms: 1,
    },
    gpu_memory_bytes: 1,
    skipped_steps: 0,
    loss_scale: 1,
  };
}
