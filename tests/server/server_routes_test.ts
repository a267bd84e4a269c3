/**
 * Route tests through `app.request()`: status codes, bodies, validation, auth, SSE replay and
 * Prometheus output, with the real store and runner and a scripted stand-in for the GPU Worker
 * (tests/fakes/fake_worker.ts), so nothing here needs a GPU.
 */

import { deepStrictEqual as assertEquals, match as assertMatch, ok as assert } from "node:assert/strict";
import { type FromWorker } from "../../protocol.ts";
import { JobRunner, JobStore } from "../../server/jobs/mod.ts";
import { ScriptedWorker } from "../fakes/fake_worker.ts";
import { createApp } from "../../server/routes/mod.ts";
import { until } from "../_wait.ts";
import { apiError } from "../_api.ts";

/** Waits until `cond()` holds (the runner hands jobs over asynchronously; CI machines can be slow). */
async function setup(opts: { token?: string; unavailable?: string } = {}) {
  const root = await Deno.makeTempDir({ prefix: "gpt2_routes_" });
  const store = new JobStore(":memory:");
  const workers: ScriptedWorker[] = [];
  const runner = new JobRunner(store, {
    root,
    gpus: 1,
    spawn: () => {
      const w = new ScriptedWorker({ unavailable: opts.unavailable });
      workers.push(w);
      return w;
    },
    datasetExists: (id) => Promise.resolve(id === "sotu"),
  });
  runner.start();
  await new Promise((r) => setTimeout(r, 0)); // let the worker answer init
  const app = createApp({ runner, token: opts.token ?? null, maxBodyBytes: 4096, maxUploadBytes: 8192 });
  const post = (path: string, body: unknown, headers: Record<string, string> = {}) =>
    app.request(path, {
      method: "POST",
      body: typeof body === "string" ? body : JSON.stringify(body),
      headers: { "Content-Type": "application/json", ...headers },
    });
  const cleanup = async () => {
    runner.shutdown();
    store.close();
    await Deno.remove(root, { recursive: true });
  };
  return { app, runner, store, workers, post, root, cleanup };
}

Deno.test("POST /train queues a job with defaults and hands it to the GPU worker", async () => {
  const t = await setup();
  try {
    const res = await t.post("/train", { model: "gpt2-tiny", train_iters: 50 });
    assertEquals(res.status, 202);
    const body = await res.json();
    assertMatch(body.id, /^job_[0-9a-f]{12}$/);
    assertEquals(body.status, "queued");
    assertEquals(res.headers.get("Location"), `/jobs/${body.id}`);
    await until(() => t.workers[0].jobs.length === 1, "the job on the worker");
    assertEquals(t.workers[0].jobs.length, 1);
    const handed = t.workers[0].jobs[0];
    assertEquals(handed.id, body.id);
    assertEquals(handed.config.seq_len, 64); // gpt2-tiny's position table
    assertEquals(handed.config.dataset, "sotu");
    assertEquals(handed.config.lr_decay_style, "cosine");
    assertEquals(handed.resume_path, null);
    const job = await (await t.app.request(`/jobs/${body.id}`)).json();
    assertEquals(job.status, "running");
    assertEquals(job.config.train_iters, 50);
  } finally {
    await t.cleanup();
  }
});

Deno.test("POST /train returns 400 naming every invalid field, the first as param", async () => {
  const t = await setup();
  try {
    const res = await t.post("/train", { batch_size: -1, lr_decay_style: "step", bogus: 1 });
    const e = await apiError(res, 400, {
      param: "batch_size",
      code: "too_small",
      type: "invalid_request_error",
    });
    assertMatch(e.message, /^Invalid training config: batch_size: Too small/);
    assertMatch(e.message, /; lr_decay_style: Invalid option/);
    assertMatch(e.message, /; bogus: Unrecognized key: "bogus"/);
  } finally {
    await t.cleanup();
  }
});

Deno.test("POST /train returns 400 naming overlap_grad_reduce when it is not a boolean", async () => {
  const t = await setup();
  try {
    const e = await apiError(await t.post("/train", { overlap_grad_reduce: "yes" }), 400, {
      param: "overlap_grad_reduce",
      type: "invalid_request_error",
    });
    assertMatch(e.message, /^Invalid training config: overlap_grad_reduce: /);
  } finally {
    await t.cleanup();
  }
});

Deno.test("POST /train returns 400 naming an unknown model, dataset, seq_len or checkpoint", async () => {
  const t = await setup();
  try {
    await apiError(await t.post("/train", { model: "gpt2-xxl" }), 400, {
      param: "model",
      message: /^Invalid training config: model: Unknown model preset: expected one of gpt2-tiny/,
    });
    const dataset = await t.post("/train", { dataset: "nope" });
    assertEquals(await dataset.json(), {
      error: {
        message: 'Unknown dataset "nope"',
        type: "invalid_request_error",
        param: "dataset",
        code: "invalid_value",
      },
    });
    await apiError(await t.post("/train", { model: "gpt2-tiny", seq_len: 65 }), 400, { param: "seq_len" });
    const dims = await t.post("/train", { model: { n_layer: 2, n_head: 3, n_embd: 64, n_positions: 64 } });
    await apiError(dims, 400, { param: "n_embd" });
    // A union of a preset name and dimensions names the missing dimension, not "Invalid input".
    await apiError(await t.post("/train", { model: { n_layer: 2, n_head: 4, n_embd: 64 } }), 400, {
      param: "model.n_positions",
      message:
        "Invalid training config: model.n_positions: Invalid input: expected number, received undefined",
    });
    await apiError(await t.post("/train", { resume_from: "job_000000000000" }), 400, {
      param: "resume_from",
      message: 'Unknown checkpoint "job_000000000000"',
    });
    const tooBig = await t.post("/train", {
      model: { n_layer: 48, n_head: 16, n_embd: 2048, n_positions: 1024 },
      keep_checkpoints: 1,
    });
    await apiError(tooBig, 400, { param: "model", message: /^Model does not fit the GPU/ });
    // The scripted Worker's adapter lists no shader-f16.
    await apiError(await t.post("/train", { precision: "fp16", keep_checkpoints: 1 }), 400, {
      param: "precision",
    });
    await apiError(await t.post("/train", "{not json"), 400, { message: "Malformed JSON in request body" });
    assertEquals(t.store.listJobs().length, 0);
  } finally {
    await t.cleanup();
  }
});

Deno.test("POST /train returns 413 for an oversized body", async () => {
  const t = await setup();
  try {
    const res = await t.post("/train", { dataset: "x".repeat(5000) });
    await apiError(res, 413, { message: "Request body is larger than 4096 bytes", code: "body_too_large" });
    // Other routes (dataset uploads) have their own, larger limit.
    const other = await t.post("/elsewhere", { texts: ["x".repeat(5000)] });
    assertEquals(other.status, 404);
    assertEquals((await t.post("/elsewhere", { texts: ["x".repeat(9000)] })).status, 413);
  } finally {
    await t.cleanup();
  }
});

Deno.test("unknown jobs are 404 on every job route", async () => {
  const t = await setup();
  try {
    for (
      const path of ["/jobs/job_x", "/jobs/job_x/events", "/jobs/job_x/checkpoints", "/jobs/job_x/metrics"]
    ) {
      const res = await t.app.request(path);
      await apiError(res, 404, { message: 'Job "job_x" not found', type: "not_found_error", param: "id" });
    }
    await apiError(await t.post("/jobs/job_x/cancel", {}), 404, { code: "job_not_found" });
    await apiError(await t.app.request("/jobs/job_x", { method: "DELETE" }), 404, { code: "job_not_found" });
    await apiError(await t.app.request("/nowhere"), 404, { message: "No route for GET /nowhere" });
  } finally {
    await t.cleanup();
  }
});

Deno.test("progress from the worker shows in GET /jobs/:id, /jobs, metrics history and Prometheus", async () => {
  const t = await setup();
  try {
    const { id } = await (await t.post("/train", { train_iters: 20 })).json();
    await until(() => t.workers[0].jobs.length === 1, "the job on the worker");
    const w = t.workers[0];
    w.send({ type: "started", id, iteration: 0, resumed_from: null, gpu_memory_bytes: 1234 });
    const timings = {
      forward_ms: 1.5,
      backward_ms: 3,
      allreduce_ms: 0,
      optimizer_ms: 0.5,
      batch_generator_ms: 0.1,
      data_loader_ms: 20,
      step_ms: 6,
    };
    w.send({
      type: "progress",
      id,
      iteration: 10,
      loss: 7.5,
      grad_norm: 2,
      lr: 3e-4,
      tokens_per_s: 900,
      timings,
      gpu_memory_bytes: 1234,
      skipped_steps: 1,
      loss_scale: 65536,
    });
    w.send({
      type: "eval",
      id,
      iteration: 10,
      split: "valid",
      loss: 7.75,
      perplexity: Math.exp(7.75),
      tokens: 4096,
    });
    const job = await (await t.app.request(`/jobs/${id}`)).json();
    assertEquals(job.iteration, 10);
    assertEquals(job.metrics.loss, 7.5);
    assertEquals(job.metrics.val_loss, 7.75);
    assertEquals(job.metrics.val_perplexity, Math.exp(7.75));
    assertEquals(job.metrics.timings, timings);
    assertEquals(job.metrics.gpu_memory_bytes, 1234);
    assertEquals(job.metrics.skipped_steps, 1);
    assertEquals(job.metrics.loss_scale, 65536);
    assert(job.metrics.gpu_memory_estimate_bytes > 0, "the plan's estimate beside the measured bytes");
    assertEquals(job.metrics.val_tokens, 4096);
    const list = await (await t.app.request("/jobs?status=running")).json();
    assertEquals(list.jobs.map((j: { id: string }) => j.id), [id]);
    await apiError(await t.app.request("/jobs?status=weird"), 400, { param: "status" });
    const hist = await (await t.app.request(`/jobs/${id}/metrics`)).json();
    assertEquals(hist.metrics.map((m: { split: string; loss: number }) => [m.split, m.loss]), [
      ["train", 7.5],
      ["valid", 7.75],
    ]);
    const prom = await t.app.request("/metrics");
    assertEquals(prom.headers.get("Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
    const text = await prom.text();
    assert(text.includes(`gpt2_job_loss{job_id="${id}",gpu="0"} 7.5\n`), text);
    assert(text.includes(`gpt2_jobs{status="running"} 1\n`), text);
    assert(text.includes(`gpt2_gpu_busy{gpu="0"} 1\n`), text);
    assert(text.includes(`gpt2_job_phase_seconds{job_id="${id}",phase="backward"} 0.003\n`), text);
    assert(text.includes(`# TYPE gpt2_job_step_seconds histogram\n`), text);
    assert(text.includes(`gpt2_job_step_seconds_bucket{le="0.005",job_id="${id}"} 0\n`), text);
    assert(text.includes(`gpt2_job_step_seconds_bucket{le="0.01",job_id="${id}"} 1\n`), text);
    assert(text.includes(`gpt2_job_step_seconds_count{job_id="${id}"} 1\n`), text);
    assert(text.includes(`# TYPE gpt2_http_requests_total counter\n`), text);
    assert(!/\{job="/.test(text), "no job label");
    assert(text.includes(`gpt2_job_loss_scale{job_id="${id}",gpu="0"} 65536\n`), text);
    assert(text.includes(`gpt2_job_skipped_steps{job_id="${id}",gpu="0"} 1\n`), text);
    const health = await (await t.app.request("/health")).json();
    assertEquals(health.status, "ok");
    assertEquals(health.gpus[0].state, "busy");
    assertEquals(health.gpus[0].job, id);
  } finally {
    await t.cleanup();
  }
});

/** Parses an SSE body into events. */
function parseSse(text: string) {
  return text.split("\n\n").filter((b) => b.trim() && !b.startsWith(":")).map((block) => {
    const f: Record<string, string> = {};
    for (const line of block.split("\n")) {
      const i = line.indexOf(":");
      f[line.slice(0, i)] = line.slice(i + 1).trimStart();
    }
    return { id: Number(f.id), event: f.event, data: JSON.parse(f.data) };
  });
}

Deno.test("GET /jobs/:id/events streams live events until done and replays after Last-Event-ID", async () => {
  const t = await setup();
  try {
    const { id } = await (await t.post("/train", { train_iters: 20 })).json();
    await until(() => t.workers[0].jobs.length === 1, "the job on the worker");
    const w = t.workers[0];
    const res = await t.app.request(`/jobs/${id}/events`);
    assertEquals(res.status, 200);
    assertEquals(res.headers.get("Content-Type"), "text/event-stream");
    const body = res.text();
    const script: FromWorker[] = [
      { type: "started", id, iteration: 0, resumed_from: null, gpu_memory_bytes: 1 },
      { type: "checkpoint", id, iteration: 10, name: "iter_0000010", path: "/x/iter_0000010" },
      { type: "done", id, status: "succeeded", iteration: 20, error: null },
    ];
    for (const m of script) {
      await new Promise((r) => setTimeout(r, 5));
      w.send(m);
    }
    const events = parseSse(await body);
    assertEquals(events.map((e) => e.event), ["log", "log", "log", "checkpoint", "done"]);
    assertEquals(events[0].data.status, "queued");
    assertEquals(events[3].data, {
      iteration: 10,
      name: "iter_0000010",
      path: `checkpoints/${id}/iter_0000010`,
    });
    assertEquals(events.at(-1)!.data.status, "succeeded");
    for (let i = 1; i < events.length; i++) assert(events[i].id > events[i - 1].id);

    // Reconnect after the checkpoint: only what came later is replayed, then the stream ends.
    const replay = await t.app.request(`/jobs/${id}/events`, {
      headers: { "Last-Event-ID": String(events[2].id) },
    });
    const missed = parseSse(await replay.text());
    assertEquals(missed.map((e) => e.id), [events[3].id, events[4].id]);
    await apiError(await t.app.request(`/jobs/${id}/events`, { headers: { "Last-Event-ID": "x" } }), 400, {
      param: "Last-Event-ID",
      message: 'Invalid Last-Event-ID "x": expected a non-negative integer',
    });
    assertEquals((await (await t.app.request(`/jobs/${id}`)).json()).status, "succeeded");
  } finally {
    await t.cleanup();
  }
});

Deno.test("POST /jobs/:id/cancel cancels queued jobs at once, flags running ones, is idempotent, 409 once finished", async () => {
  const t = await setup();
  try {
    const a = (await (await t.post("/train", {})).json()).id;
    const b = (await (await t.post("/train", {})).json()).id;
    await until(() => t.workers[0].jobs.length === 1, "the job on the worker");
    assertEquals(t.workers[0].jobs.map((j) => j.id), [a]); // FIFO: b waits

    const qb = await t.post(`/jobs/${b}/cancel`, {});
    assertEquals(qb.status, 202);
    assertEquals((await qb.json()).status, "cancelled");
    assertEquals((await t.post(`/jobs/${b}/cancel`, {})).status, 202);

    const ra = await (await t.post(`/jobs/${a}/cancel`, {})).json();
    assertEquals(ra, { id: a, status: "running", cancel_requested: true });
    assert(t.workers[0].cancelRequested);
    assertEquals((await t.post(`/jobs/${a}/cancel`, {})).status, 202);
    t.workers[0].send({ type: "done", id: a, status: "cancelled", iteration: 3, error: null });
    assertEquals((await (await t.app.request(`/jobs/${a}`)).json()).status, "cancelled");

    const c = (await (await t.post("/train", {})).json()).id;
    await until(() => t.workers[0].jobs.length === 2, "the job on the worker");
    t.workers[0].send({ type: "done", id: c, status: "succeeded", iteration: 1000, error: null });
    const late = await t.post(`/jobs/${c}/cancel`, {});
    await apiError(late, 409, { message: `Cannot cancel job "${c}": it already succeeded` });
  } finally {
    await t.cleanup();
  }
});

Deno.test("a job fails with the device's reason when no GPU adapter exists; the server keeps serving", async () => {
  const t = await setup({ unavailable: "No WebGPU adapter found: requestAdapter returned null" });
  try {
    const { id } = await (await t.post("/train", {})).json();
    const job = await (await t.app.request(`/jobs/${id}`)).json();
    assertEquals(job.status, "failed");
    assertEquals(job.error, "No WebGPU adapter found: requestAdapter returned null");
    assertEquals((await t.app.request("/health")).status, 200);
  } finally {
    await t.cleanup();
  }
});

Deno.test("a bearer token is required on every route when configured", async () => {
  const t = await setup({ token: "s3cret" });
  try {
    assertEquals((await t.app.request("/health")).status, 401);
    assertEquals((await t.post("/train", {})).status, 401);
    const ok = await t.app.request("/health", { headers: { Authorization: "Bearer s3cret" } });
    assertEquals(ok.status, 200);
    assertEquals((await t.app.request("/jobs", { headers: { Authorization: "Bearer nope" } })).status, 401);
  } finally {
    await t.cleanup();
  }
});

Deno.test("while draining, every route answers 503 with Retry-After in the one error shape", async () => {
  const store = new JobStore(":memory:");
  const runner = new JobRunner(store, {
    root: "/nonexistent",
    gpus: 1,
    spawn: () => new ScriptedWorker(),
    datasetExists: () => Promise.resolve(true),
  });
  let draining = false;
  const app = createApp({ runner, token: null, draining: { active: () => draining, retryAfterSeconds: 30 } });
  try {
    assertEquals((await app.request("/health")).status, 200);
    draining = true;
    for (const path of ["/health", "/jobs", "/"]) {
      const res = await app.request(path);
      assertEquals(res.status, 503, path);
      assertEquals(res.headers.get("Retry-After"), "30");
      const body = await res.json();
      assertEquals([body.error.type, body.error.code], ["unavailable", "shutting_down"]);
    }
  } finally {
    runner.shutdown();
    store.close();
  }
});
