/**
 * Hostile input against the whole app (jobs, datasets, generation, health) through
 * `app.request()`: bad JSON, wrong types, huge numbers, path traversal, unicode, oversized
 * bodies, wrong content types, bad Host and Origin headers, bad tokens. Every one must be a 4xx
 * in the one error shape, nothing may be stored or started, and the server must still answer.
 */

import { deepStrictEqual as assertEquals, ok as assert } from "node:assert/strict";
import { GenerationManager } from "../../server/generate/mod.ts";
import { JobRunner, JobStore } from "../../server/jobs/mod.ts";
import { ScriptedWorker } from "../fakes/fake_worker.ts";
import { createApp } from "../../server/routes/mod.ts";
import { datasetRoutes } from "../../server/routes/datasets.ts";
import { apiError } from "../_api.ts";

interface Hostile {
  what: string;
  path: string;
  method?: string;
  body?: string;
  headers?: Record<string, string>;
}

const json = (what: string, path: string, body: unknown, headers: Record<string, string> = {}): Hostile => ({
  what,
  path,
  method: "POST",
  body: typeof body === "string" ? body : JSON.stringify(body),
  headers: { "Content-Type": "application/json", ...headers },
});
const get = (what: string, path: string, headers: Record<string, string> = {}): Hostile => ({
  what,
  path,
  headers,
});

const deep = "[".repeat(7_000) + "]".repeat(7_000);

const HOSTILE: Hostile[] = [
  // Bad JSON.
  json("truncated object", "/train", "{"),
  json("truncated array", "/train", "["),
  json("bare word", "/train", "nul"),
  json("missing value", "/train", '{"a":}'),
  json("NUL byte", "/train", "\u0000"),
  json("empty body", "/train", ""),
  json("trailing garbage", "/train", '{"train_iters": 10} x'),
  json("deeply nested array", "/datasets", deep),
  json("array body", "/train", []),
  json("null body", "/train", "null"),
  json("string body", "/train", '"x"'),
  json("number body", "/v1/completions", "5"),
  // Wrong types and out-of-range numbers.
  json("string for a number", "/train", { train_iters: "10" }),
  json("fraction for an integer", "/train", { batch_size: 1.5 }),
  json("number for a model", "/train", { model: 5 }),
  json("string dims", "/train", { model: { n_layer: "2", n_head: 2, n_embd: 64, n_positions: 64 } }),
  json("negative lr", "/train", { lr: -1 }),
  json("seed beyond 32 bits", "/train", { seed: 2 ** 40 }),
  json("huge iteration count", "/train", { train_iters: 1e308 }),
  json("overflowing number", "/train", '{"train_iters": 1e999}'),
  json("unsafe integer", "/train", '{"batch_size": 9007199254740993}'),
  json("bad split", "/train", { split: "a,b" }),
  json("null enum", "/train", { lr_decay_style: null }),
  json("empty dataset", "/train", { dataset: "" }),
  json("unknown field", "/train", { bogus: 1 }),
  json("__proto__ key", "/train", '{"__proto__": {"admin": true}}'),
  json("constructor key", "/train", { constructor: {} }),
  json("keep_checkpoints past 1000", "/train", { keep_checkpoints: 1e6 }),
  // Traversal.
  json("resume_from traversal", "/train", { resume_from: "../../etc" }),
  json("resume_from nested traversal", "/train", { resume_from: "job_x/../../../etc/passwd" }),
  get("encoded traversal in a job id", "/jobs/..%2F..%2Fetc%2Fpasswd"),
  get("dot-dot job id", "/jobs/%2e%2e/checkpoints"),
  get("encoded traversal in a dataset id", "/datasets/..%2f..%2fjobs.sqlite"),
  json("dataset path to the job database", "/datasets", { path: "../jobs.sqlite" }),
  json("absolute dataset path", "/datasets", { path: "/etc/passwd" }),
  json("url_list traversal", "/datasets", { url_list: "../../etc/hosts" }),
  json("NUL in a path", "/datasets", { path: "a\u0000b" }),
  json("traversal in a dataset id", "/datasets", { builtin: "sotu", id: "../x" }),
  json("file URLs only", "/datasets", { urls: ["file:///etc/passwd", "gopher://127.0.0.1/"] }),
  // Unicode.
  get("emoji job id", "/jobs/%F0%9F%92%A9"),
  get("right-to-left override status", "/jobs?status=%E2%80%AE"),
  json("lone surrogate dataset", "/train", '{"dataset": "\\ud800"}'),
  get("fullwidth digit limit", "/jobs?limit=%EF%BC%91"),
  get("NUL model", "/generate?model=%00&prompt=x"),
  json("unicode field name", "/train", { "tr\u0430in_iters": 10 }),
  // Query strings and headers with huge or odd numbers.
  get("infinite limit", "/jobs?limit=1e309"),
  get("negative limit", "/jobs?limit=-5"),
  get("repeated limit", "/jobs?limit=1&limit=2"),
  get("huge Last-Event-ID", "/jobs/JOB/events", { "Last-Event-ID": "99999999999999999999" }),
  get("negative Last-Event-ID", "/jobs/JOB/events", { "Last-Event-ID": "-1" }),
  get("fractional last_event_id", "/jobs/JOB/events?last_event_id=1.5"),
  get("bad generation numbers", "/generate?model=tiny&temperature=abc&top_k=-1&max_tokens=1e400"),
  get("too many stops", `/generate?model=tiny&${Array.from({ length: 20 }, () => "stop=x").join("&")}`),
  json("completion model as number", "/v1/completions", { model: 1 }),
  json("completion n=2", "/v1/completions", { model: "tiny", n: 2 }),
  json("completion prompt of ids", "/v1/completions", { model: "tiny", prompt: [1, 2] }),
  json("completion stream as string", "/v1/completions", { model: "tiny", stream: "yes" }),
  json("texts not an array", "/datasets", { texts: "one" }),
  json("texts of numbers", "/datasets", { texts: [1, 2] }),
  json("num_perm out of range", "/datasets", { builtin: "sotu", num_perm: 1e9 }),
  json("zero dedup threshold", "/datasets", { builtin: "sotu", dedup_threshold: 0 }),
  json("two sources", "/datasets", { builtin: "sotu", texts: ["x"] }),
  // Oversized bodies.
  json("oversized training config", "/train", { dataset: "x".repeat(5000) }),
  json("oversized upload", "/datasets", { texts: ["x".repeat(20_000)] }),
  json("oversized completion", "/v1/completions", { model: "tiny", prompt: "x".repeat(5000) }),
  // Wrong content types.
  {
    what: "text/plain train",
    path: "/train",
    method: "POST",
    body: "{}",
    headers: { "Content-Type": "text/plain" },
  },
  {
    what: "form cancel",
    path: "/jobs/JOB/cancel",
    method: "POST",
    body: "a=1",
    headers: { "Content-Type": "application/x-www-form-urlencoded" },
  },
  {
    what: "multipart dataset",
    path: "/datasets",
    method: "POST",
    body: "--x--",
    headers: { "Content-Type": "multipart/form-data; boundary=x" },
  },
  {
    what: "jsonx",
    path: "/train",
    method: "POST",
    body: "{}",
    headers: { "Content-Type": "application/jsonx" },
  },
  { what: "no content type", path: "/v1/completions", method: "POST" },
  { what: "PATCH without JSON", path: "/jobs", method: "PATCH" },
  {
    what: "PUT on train",
    path: "/train",
    method: "PUT",
    body: "{}",
    headers: { "Content-Type": "application/json" },
  },
  // Bad Host, Origin, Sec-Fetch-Site.
  get("rebinding host", "/jobs", { Host: "attacker.example" }),
  get("host with a bad port", "/jobs", { Host: "127.0.0.1:99999" }),
  get("unclosed IPv6 host", "/jobs", { Host: "[::1" }),
  get("host with a space", "/jobs", { Host: "a b" }),
  get("host with userinfo", "/jobs", { Host: "user@127.0.0.1" }),
  json("foreign origin", "/train", {}, { Origin: "https://evil.example" }),
  json("null origin", "/datasets", { builtin: "sotu" }, { Origin: "null" }),
  get("cross-site image", "/generate?model=tiny&prompt=x", { "Sec-Fetch-Site": "cross-site" }),
  get("same-site other port", "/jobs", { "Sec-Fetch-Site": "same-site" }),
  {
    what: "foreign preflight",
    path: "/train",
    method: "OPTIONS",
    headers: { Origin: "https://evil.example" },
  },
  // Unknown routes.
  get("unknown route", "/admin"),
  get("unknown job", "/jobs/job_000000000000"),
  { what: "DELETE unknown job", path: "/jobs/job_000000000000", method: "DELETE" },
];

const WITH_TOKEN: Hostile[] = [
  get("no token", "/health"),
  get("empty bearer", "/health", { Authorization: "Bearer " }),
  get("bearer of spaces", "/health", { Authorization: "Bearer     " }),
  get("wrong token", "/health", { Authorization: "Bearer s3cret!x" }),
  get("token prefix", "/health", { Authorization: "Bearer s3cret" }),
  get("basic scheme", "/health", { Authorization: "Basic czNjcmV0IUA=" }),
  get("token without scheme", "/health", { Authorization: "s3cret!@" }),
];

async function setup(token: string | null) {
  const root = await Deno.makeTempDir({ prefix: "gpt2_fuzz_" });
  const store = new JobStore(":memory:");
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
  });
  runner.start();
  await new Promise((r) => setTimeout(r, 0));
  const app = createApp({
    runner,
    generation: new GenerationManager(runner.pool, root),
    token,
    maxBodyBytes: 4096,
    maxUploadBytes: 16_384,
    home: root,
    extra: [datasetRoutes(root, { workers: 1, waitMs: 10_000 })],
  });
  const cleanup = async () => {
    runner.shutdown();
    store.close();
    await Deno.remove(root, { recursive: true });
  };
  return { app, store, workers, root, cleanup };
}

Deno.test("fuzz: every hostile request is a 4xx in the one error shape and the server still answers", async () => {
  assert(HOSTILE.length + WITH_TOKEN.length >= 80, `${HOSTILE.length + WITH_TOKEN.length} requests`);
  const t = await setup(null);
  try {
    // One real job (finished) so job-scoped routes get past the id lookup.
    const job = await t.app.request("/train", {
      method: "POST",
      body: "{}",
      headers: { "Content-Type": "application/json" },
    });
    const { id } = await job.json();
    t.workers[0].send({ type: "done", id, status: "succeeded", iteration: 1, error: null });
    const jobs = t.store.listJobs().length;
    const failures: string[] = [];
    for (const h of HOSTILE) {
      const res = await t.app.request(h.path.replace("JOB", id), {
        method: h.method ?? "GET",
        headers: h.headers,
        body: h.body,
      });
      try {
        assert(res.status >= 400 && res.status < 500, `status ${res.status}: ${await res.clone().text()}`);
        const e = await apiError(res, res.status);
        if (Deno.env.get("FUZZ_LOG")) console.log(`${h.what} -> ${res.status} ${e.message.slice(0, 110)}`);
        assert(!e.message.includes(t.root), `leaks the data directory: ${e.message}`);
      } catch (err) {
        failures.push(`${h.what}: ${(err as Error).message}`);
      }
    }
    assertEquals(failures, []);
    assertEquals(t.store.listJobs().length, jobs, "no hostile request stored a job");
    assertEquals(t.workers[0].generations.length, 0, "no hostile request reached the GPU");
    assertEquals((await t.app.request("/health")).status, 200);
    const ok = await t.app.request("/train", {
      method: "POST",
      body: '{"train_iters": 5}',
      headers: { "Content-Type": "application/json" },
    });
    assertEquals(ok.status, 202);
  } finally {
    await t.cleanup();
  }
  const a = await setup("s3cret!@");
  try {
    for (const h of WITH_TOKEN) {
      const res = await a.app.request(h.path, { headers: h.headers });
      assert(res.headers.get("WWW-Authenticate")?.startsWith("Bearer"), h.what);
      await apiError(res, 401).catch((err) => {
        throw new Error(`${h.what}: ${err.message}`);
      });
    }
    const ok = await a.app.request("/health", { headers: { Authorization: "Bearer s3cret!@" } });
    assertEquals(ok.status, 200);
  } finally {
    await a.cleanup();
  }
});
