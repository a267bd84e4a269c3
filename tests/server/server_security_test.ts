/**
 * The hardened HTTP service through `app.request()`, with the real store and runner and the
 * scripted GPU Worker: tokens of any printable characters and the 401 challenge, JSON-only
 * state changes, Host/Origin/Sec-Fetch-Site checks and CORS preflight, limits answered with 429
 * or 507 naming their setting, /ready, paging, DELETE, paged replay and relative paths.
 */

import { deepStrictEqual as assertEquals, ok as assert } from "node:assert/strict";
import { JobRunner, JobStore } from "../../server/jobs/mod.ts";
import { type Limits } from "../../server/settings.ts";
import { ScriptedWorker } from "../fakes/fake_worker.ts";
import { type AppOptions, createApp } from "../../server/routes/mod.ts";
import { datasetRoutes } from "../../server/routes/datasets.ts";
import { scrubPaths } from "../../server/routes/api_errors.ts";
import { until } from "../_wait.ts";
import { apiError } from "../_api.ts";

async function setup(opts: Partial<AppOptions> & { unavailable?: string; limits?: Partial<Limits> } = {}) {
  const root = await Deno.makeTempDir({ prefix: "gpt2_security_" });
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
  await new Promise((r) => setTimeout(r, 0));
  const app = createApp({
    token: null,
    ...opts,
    runner,
    extra: [datasetRoutes(root, { workers: 1, waitMs: 0 })],
  });
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

Deno.test("a token with any printable characters works; 401 keeps WWW-Authenticate: Bearer and says why", async () => {
  const token = "p@ss!w0rd/with spaces#and~=";
  const t = await setup({ token });
  try {
    const ok = await t.app.request("/health", { headers: { Authorization: `Bearer ${token}` } });
    assertEquals(ok.status, 200);
    const posted = await t.post("/train", {}, { Authorization: `Bearer ${token}` });
    assertEquals(posted.status, 202);
    const missing = await t.app.request("/health");
    assertEquals(missing.headers.get("WWW-Authenticate"), 'Bearer realm="gpt2-webgpu"');
    await apiError(missing, 401, { type: "authentication_error", code: "missing_api_key" });
    const wrong = await t.app.request("/jobs", { headers: { Authorization: `Bearer ${token}x` } });
    assert(wrong.headers.get("WWW-Authenticate")!.startsWith("Bearer "));
    await apiError(wrong, 401, { message: "Invalid bearer token", code: "invalid_api_key" });
    await apiError(await t.app.request("/jobs", { headers: { Authorization: `Basic ${token}` } }), 401, {
      message: 'Authorization is not "Bearer <token>": send "Authorization: Bearer <token>"',
      code: "invalid_api_key",
    });
  } finally {
    await t.cleanup();
  }
});

Deno.test("state-changing routes require application/json: a text/plain form post from another page is 415", async () => {
  const t = await setup();
  try {
    const plain = { "Content-Type": "text/plain" };
    await apiError(await t.post("/train", "{}", plain), 415, {
      param: "Content-Type",
      code: "unsupported_media_type",
    });
    await apiError(await t.post("/datasets", '{"builtin":"sotu"}', plain), 415);
    await apiError(await t.app.request("/train", { method: "POST", body: "{}" }), 415, {
      message: /^(Missing Content-Type|Unsupported Content-Type "text\/plain;charset=UTF-8")/,
    });
    assertEquals(t.store.listJobs().length, 0);
    const id = (await (await t.post("/train", {})).json()).id;
    await apiError(
      await t.post(`/jobs/${id}/cancel`, "", { "Content-Type": "application/x-www-form-urlencoded" }),
      415,
    );
    assertEquals(t.store.getJob(id)!.cancel_requested, false);
    assertEquals((await t.post(`/jobs/${id}/cancel`, {})).status, 202);
  } finally {
    await t.cleanup();
  }
});

Deno.test("the Host header must name the server (DNS rebinding) and the port it is bound to", async () => {
  const t = await setup({ host: "127.0.0.1", port: 8080 });
  try {
    const get = (host: string) => t.app.request("http://127.0.0.1:8080/health", { headers: { Host: host } });
    assertEquals((await get("127.0.0.1:8080")).status, 200);
    assertEquals((await get("localhost:8080")).status, 200);
    assertEquals((await get("[::1]:8080")).status, 200);
    await apiError(await get("attacker.example:8080"), 400, { param: "Host", code: "invalid_host" });
    await apiError(await get("127.0.0.1:9999"), 400, { param: "Host" });
    await apiError(await get("127.0.0.1.attacker.example"), 400);
  } finally {
    await t.cleanup();
  }
  const wide = await setup({ host: "0.0.0.0", allowedHosts: ["gpu-box.lan"], token: "t" });
  try {
    const get = (host: string) =>
      wide.app.request("/health", { headers: { Host: host, Authorization: "Bearer t" } });
    assertEquals((await get("gpu-box.lan:8080")).status, 200);
    assertEquals((await get("GPU-BOX.LAN")).status, 200);
    await apiError(await get("other.lan"), 400, { param: "Host" });
  } finally {
    await wide.cleanup();
  }
});

Deno.test("cross-site requests are refused; allowed CORS origins get a correct preflight and headers", async () => {
  const t = await setup({ corsOrigins: ["https://dash.example"] });
  try {
    const evil = await t.post("/train", {}, { Origin: "https://evil.example" });
    await apiError(evil, 403, { param: "Origin", code: "origin_not_allowed" });
    // An <img src="http://127.0.0.1:8080/generate?..."> sends no Origin, but is marked cross-site.
    const img = await t.app.request("/jobs", { headers: { "Sec-Fetch-Site": "cross-site" } });
    await apiError(img, 403, { code: "cross_site_request" });
    assertEquals(
      (await t.app.request("/jobs", { headers: { "Sec-Fetch-Site": "same-origin" } })).status,
      200,
    );
    assertEquals((await t.app.request("/jobs", { headers: { "Sec-Fetch-Site": "none" } })).status, 200);
    assertEquals((await t.post("/train", {}, { Origin: "http://localhost" })).status, 202); // same origin
    assertEquals(t.store.listJobs().length, 1);

    const pre = await t.app.request("/train", {
      method: "OPTIONS",
      headers: {
        Origin: "https://dash.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, authorization",
        "Sec-Fetch-Site": "cross-site",
      },
    });
    assertEquals(pre.status, 204);
    assertEquals(pre.headers.get("Access-Control-Allow-Origin"), "https://dash.example");
    assertEquals(pre.headers.get("Access-Control-Allow-Methods"), "GET,POST,DELETE,OPTIONS");
    assertEquals(pre.headers.get("Access-Control-Allow-Headers"), "Authorization,Content-Type,Last-Event-ID");
    assertEquals(pre.headers.get("Access-Control-Max-Age"), "600");
    assert(pre.headers.get("Vary")!.includes("Origin"));
    const actual = await t.post("/train", {}, {
      Origin: "https://dash.example",
      "Sec-Fetch-Site": "cross-site",
    });
    assertEquals(actual.status, 202);
    assertEquals(actual.headers.get("Access-Control-Allow-Origin"), "https://dash.example");
    const badPre = await t.app.request("/train", {
      method: "OPTIONS",
      headers: { Origin: "https://evil.example", "Access-Control-Request-Method": "POST" },
    });
    assertEquals(badPre.headers.get("Access-Control-Allow-Origin"), null);
    await apiError(badPre, 403, { param: "Origin" });
  } finally {
    await t.cleanup();
  }
});

Deno.test("POST /train past the queue limit is 429 and past the checkpoint disk limit 507, naming the setting", async () => {
  const t = await setup({ limits: { maxQueuedJobs: 1 } });
  try {
    assertEquals((await t.post("/train", {})).status, 202); // runs at once
    await until(() => t.workers[0].jobs.length === 1, "the first job on the worker");
    assertEquals((await t.post("/train", {})).status, 202); // waits
    await apiError(await t.post("/train", {}), 429, {
      type: "rate_limit_error",
      code: "limit_exceeded",
      message: "Too many queued jobs: 1 are waiting (limit GPT2_MAX_QUEUED_JOBS=1); retry when one starts",
    });
    const disk = await t.post("/train", { model: "gpt2-345M", keep_checkpoints: 1000, dataset: "sotu" });
    const e = await apiError(disk, 429); // the queue check comes first
    assert(e.message.startsWith("Too many queued jobs"));
  } finally {
    await t.cleanup();
  }
  const d = await setup();
  try {
    const e = await apiError(await d.post("/train", { model: "gpt2-345M", keep_checkpoints: 1000 }), 507, {
      param: "keep_checkpoints",
      type: "insufficient_storage_error",
    });
    assert(
      e.message.startsWith(
        "Checkpoints would need 4258455552000 bytes (keep_checkpoints 1000 × 4258455552 bytes)",
      ),
    );
    assert(e.message.includes("GPT2_MAX_CHECKPOINT_BYTES=68719476736"), e.message);
    assertEquals(d.store.listJobs().length, 0);
  } finally {
    await d.cleanup();
  }
});

Deno.test("open event streams are bounded per client and in all; a closed stream frees its slot", async () => {
  const t = await setup({ limits: { maxStreamsPerClient: 1, maxStreams: 2 } });
  try {
    const { id } = await (await t.post("/train", {})).json();
    await until(() => t.workers[0].jobs.length === 1, "the job on the worker");
    const first = await t.app.request(`/jobs/${id}/events`);
    assertEquals(first.status, 200);
    await apiError(await t.app.request(`/jobs/${id}/events`), 429, {
      message: "Too many open streams from this client: 1 (limit GPT2_MAX_STREAMS_PER_CLIENT=1)",
    });
    const other = { remoteAddr: { hostname: "10.0.0.2" } };
    const second = await t.app.request(`/jobs/${id}/events`, {}, other);
    assertEquals(second.status, 200);
    await apiError(
      await t.app.request(`/jobs/${id}/events`, {}, { remoteAddr: { hostname: "10.0.0.3" } }),
      429,
      {
        message: "Too many open streams: 2 (limit GPT2_MAX_STREAMS=2)",
      },
    );
    await first.body!.cancel();
    const again = await t.app.request(`/jobs/${id}/events`);
    assertEquals(again.status, 200);
    await again.body!.cancel();
    await second.body!.cancel();
    // A stream that ends on its own (job done) frees its slot too.
    t.workers[0].send({ type: "done", id, status: "succeeded", iteration: 1, error: null });
    for (let i = 0; i < 3; i++) {
      const r = await t.app.request(`/jobs/${id}/events`);
      assertEquals(r.status, 200);
      assert((await r.text()).includes("event: done"));
    }
  } finally {
    await t.cleanup();
  }
});

Deno.test("GET /ready is 503 until a GPU is open; /health stays 200 and reports ready", async () => {
  const down = await setup({ unavailable: "No WebGPU adapter found" });
  try {
    await apiError(await down.app.request("/ready"), 503, {
      code: "not_ready",
      message: "Not ready: No GPU is open (GPU 0 unavailable: No WebGPU adapter found)",
    });
    const health = await down.app.request("/health");
    assertEquals(health.status, 200);
    assertEquals((await health.json()).ready, false);
  } finally {
    await down.cleanup();
  }
  const up = await setup();
  try {
    const ready = await up.app.request("/ready");
    assertEquals(ready.status, 200);
    assertEquals(await ready.json(), { status: "ready", gpus: [{ index: 0, state: "idle" }] });
    assertEquals((await (await up.app.request("/health")).json()).ready, true);
  } finally {
    await up.cleanup();
  }
});

Deno.test("GET /jobs pages with limit and after; DELETE /jobs/:id removes a finished job and its checkpoints", async () => {
  const t = await setup({ unavailable: "no GPU" }); // jobs fail at once: all finished
  try {
    const ids: string[] = [];
    for (let i = 0; i < 5; i++) ids.push((await (await t.post("/train", {})).json()).id);
    const newest = [...ids].reverse();
    const p1 = await (await t.app.request("/jobs?limit=2")).json();
    assertEquals(p1.jobs.map((j: { id: string }) => j.id), newest.slice(0, 2));
    assertEquals([p1.has_more, p1.first_id, p1.last_id], [true, newest[0], newest[1]]);
    const p2 = await (await t.app.request(`/jobs?limit=2&after=${p1.last_id}`)).json();
    assertEquals(p2.jobs.map((j: { id: string }) => j.id), newest.slice(2, 4));
    const p3 = await (await t.app.request(`/jobs?limit=2&after=${p2.last_id}`)).json();
    assertEquals([p3.jobs.map((j: { id: string }) => j.id), p3.has_more], [newest.slice(4), false]);
    assertEquals((await (await t.app.request("/jobs?status=failed&limit=1000")).json()).jobs.length, 5);
    await apiError(await t.app.request("/jobs?limit=0"), 400, { param: "limit" });
    await apiError(await t.app.request("/jobs?limit=1001"), 400, { param: "limit" });
    await apiError(await t.app.request("/jobs?after=job_nope"), 400, { param: "after" });
    await apiError(await t.app.request("/jobs?bogus=1"), 400, { param: "bogus" });

    const dir = t.runner.checkpointDir(ids[0]);
    await Deno.mkdir(`${dir}/iter_0000001`, { recursive: true });
    const del = await t.app.request(`/jobs/${ids[0]}`, { method: "DELETE" });
    assertEquals(await del.json(), { id: ids[0], deleted: true });
    await apiError(await t.app.request(`/jobs/${ids[0]}`), 404);
    assertEquals(await Deno.stat(dir).then(() => "exists", (e) => e.name), "NotFound");
    assertEquals(t.store.eventsAfter(ids[0]).length, 0);
    await apiError(await t.app.request(`/jobs/${ids[0]}`, { method: "DELETE" }), 404);
  } finally {
    await t.cleanup();
  }
  const r = await setup();
  try {
    const { id } = await (await r.post("/train", {})).json();
    await until(() => r.workers[0].jobs.length === 1, "the job on the worker");
    await apiError(await r.app.request(`/jobs/${id}`, { method: "DELETE" }), 409, {
      message: `Cannot delete job "${id}": it is running (cancel it first)`,
    });
  } finally {
    await r.cleanup();
  }
});

Deno.test("replay after Last-Event-ID reads the history a page at a time and misses nothing", async () => {
  const t = await setup();
  try {
    const { id } = await (await t.post("/train", {})).json();
    await until(() => t.workers[0].jobs.length === 1, "the job on the worker");
    for (let i = 1; i <= 700; i++) t.store.addEvent(id, "progress", { kind: "train", iteration: i });
    t.workers[0].send({
      type: "checkpoint",
      id,
      iteration: 700,
      name: "iter_0000700",
      path: `${t.root}/abs`,
    });
    t.workers[0].send({ type: "done", id, status: "succeeded", iteration: 700, error: null });
    const all = t.store.eventsAfter(id);
    const text =
      await (await t.app.request(`/jobs/${id}/events`, { headers: { "Last-Event-ID": String(all[1].id) } }))
        .text();
    const ids = [...text.matchAll(/^id: (\d+)$/gm)].map((m) => Number(m[1]));
    assertEquals(ids, all.slice(2).map((e) => e.id));
    assert(text.includes(`"path":"checkpoints/${id}/iter_0000700"`), "checkpoint path relative");
    assert(!text.includes(t.root), "no absolute path");
  } finally {
    await t.cleanup();
  }
});

Deno.test("scrubPaths() replaces the data folder by its name, longest folder first", () => {
  assertEquals(
    scrubPaths('Cannot read "/srv/gpt2/sources/x" or /srv/gpt2/jobs.sqlite', [
      ["/srv/gpt2", "$GPT2_HOME"],
      ["/srv/gpt2/sources/", "$GPT2_SOURCES"],
    ]),
    'Cannot read "$GPT2_SOURCES/x" or $GPT2_HOME/jobs.sqlite',
  );
});

Deno.test("job errors and events name the data directory $GPT2_HOME, never its absolute path", async () => {
  const root = await Deno.makeTempDir({ prefix: "gpt2_home_" });
  const t = await setup({ unavailable: `Cannot open "${root}/gpu.lock": busy`, home: root });
  try {
    const { id } = await (await t.post("/train", {})).json();
    const job = await (await t.app.request(`/jobs/${id}`)).json();
    assertEquals(job.status, "failed");
    assertEquals(job.error, 'Cannot open "$GPT2_HOME/gpu.lock": busy');
    const list = await (await t.app.request("/jobs")).json();
    assertEquals(list.jobs[0].error, 'Cannot open "$GPT2_HOME/gpu.lock": busy');
    const events = await (await t.app.request(`/jobs/${id}/events`)).text();
    assert(events.includes('Cannot open \\"$GPT2_HOME/gpu.lock\\": busy'), events);
    assert(!events.includes(root) && !JSON.stringify(job).includes(root));
    t.store.updateJob(id, { resumed_from: `${root}/checkpoints/${id}/iter_0000040` });
    const resumed = await (await t.app.request(`/jobs/${id}`)).json();
    assertEquals(resumed.resumed_from, `$GPT2_HOME/checkpoints/${id}/iter_0000040`);
  } finally {
    await t.cleanup();
    await Deno.remove(root, { recursive: true });
  }
});
