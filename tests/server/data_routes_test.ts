/**
 * Tests of the dataset HTTP routes on a bare Hono sub-app: 201, 202 with progress, and the one
 * error shape for 400, 403 (outside the sources folder), 404, 422 (naming bad files) and 429.
 */
import assert from "node:assert/strict";
import { join } from "node:path";
import { Hono } from "hono";
import { datasetRoutes } from "../../server/routes/datasets.ts";
import { makeDocs, withRoot } from "../data_fixtures.ts";
import { apiError } from "../_api.ts";

/** POST a JSON body. */
function post(app: Hono, body: unknown): Promise<Response> {
  return Promise.resolve(app.request("/datasets", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: typeof body === "string" ? body : JSON.stringify(body),
  }));
}

const OPTS = { min_tokens: 16, seq_len: 8, split: [8, 1, 1] };

Deno.test("datasetRoutes POST /datasets answers 201 with id, documents, tokens and splits; GET lists it", async () => {
  await withRoot(async (root) => {
    const app = new Hono().route("/", datasetRoutes(root, { workers: 1, waitMs: 30_000 }));
    const res = await post(app, { texts: makeDocs(6, 100, 3), id: "mine", ...OPTS });
    assert.equal(res.status, 201);
    const body = await res.json();
    assert.equal(body.id, "mine");
    assert.equal(body.documents, 6);
    assert.equal(body.splits.train + body.splits.valid + body.splits.test, body.tokens);
    const list = await (await app.request("/datasets")).json();
    assert.deepEqual(list.datasets.map((d: { id: string; status: string }) => [d.id, d.status]), [[
      "mine",
      "ready",
    ]]);
    const one = await app.request("/datasets/mine");
    assert.equal(one.status, 200);
    assert.equal((await one.json()).tokens, body.tokens);
    // The same id with other texts is not prepared over (jobs reading it would train on other data)
    // unless asked to; a built-in's id is not taken.
    await apiError(await post(app, { texts: makeDocs(6, 100, 4), id: "mine", ...OPTS }), 409, {
      param: "id",
      message: /^Dataset "mine" exists, prepared from another source or with other options: .*force/,
    });
    assert.equal((await (await app.request("/datasets/mine")).json()).tokens, body.tokens);
    assert.equal((await post(app, { texts: makeDocs(6, 100, 3), id: "mine", ...OPTS })).status, 201); // the same: reused
    assert.equal(
      (await post(app, { texts: makeDocs(6, 100, 4), id: "mine", force: true, ...OPTS })).status,
      201,
    );
    await apiError(await post(app, { texts: makeDocs(6, 100, 4), id: "sotu", ...OPTS }), 400, {
      param: "id",
      message: 'Dataset id "sotu" is a built-in dataset\'s: choose another id',
    });
  });
});

Deno.test("datasetRoutes answers 202 for long work and GET /datasets/:id reports progress until ready", async () => {
  await withRoot(async (root) => {
    const app = datasetRoutes(root, { workers: 1, waitMs: 0 });
    const res = await post(app, { texts: makeDocs(8, 100, 4), id: "slow", ...OPTS });
    assert.equal(res.status, 202);
    assert.equal(res.headers.get("location"), "/datasets/slow");
    assert.deepEqual(await res.json().then((b) => [b.id, b.status]), ["slow", "running"]);
    let status = "running", body: Record<string, unknown> = {};
    for (let i = 0; i < 300 && status === "running"; i++) {
      await new Promise((r) => setTimeout(r, 20));
      body = await (await app.request("/datasets/slow")).json();
      status = body.status as string;
    }
    assert.equal(status, "ready");
    assert.equal(body.documents, 8);
  });
});

Deno.test("datasetRoutes rejects bad bodies with 400, paths outside the sources folder with 403, unknown ids with 404", async () => {
  await withRoot(async (root) => {
    await Deno.mkdir(join(root, "sources", "inside"), { recursive: true });
    await Deno.writeTextFile(join(root, "jobs.sqlite"), "not for training");
    const app = datasetRoutes(root, { workers: 1 });
    const twoSources = await post(app, { builtin: "sotu", texts: ["x"] });
    await apiError(twoSources, 400, { param: null, message: /exactly one source/ });
    await apiError(await post(app, { builtin: "sotu", min_tokens: -1 }), 400, { param: "min_tokens" });
    await apiError(await post(app, "{not json"), 400, { message: "Malformed JSON in request body" });
    await apiError(await post(app, { builtin: "wikipedia" }), 400, { param: "builtin" });
    await apiError(await post(app, { path: "../../etc/passwd" }), 403, {
      param: "path",
      code: "path_outside_sources",
      message: 'Path "../../etc/passwd" is outside the sources folder: put sources under it',
    });
    // The data directory (job database, checkpoints) is not a source, even though it holds the sources.
    await apiError(await post(app, { path: "../jobs.sqlite" }), 403, { param: "path" });
    await apiError(await post(app, { url_list: root }), 403, { param: "url_list" });
    const missing = await apiError(await post(app, { path: "nothing-here" }), 400, {
      message: /^Cannot read "nothing-here"/,
    });
    assert.ok(!missing.message.includes(root), missing.message);
    await apiError(await post(app, { texts: ["tiny"], ...OPTS }), 422, {
      code: "preparation_failed",
      message: /No documents left to train on/,
    });
    await apiError(await app.request("/datasets/nope"), 404, {
      message: 'Dataset "nope" not found',
      param: "id",
    });
  });
});

Deno.test("datasetRoutes names each bad file in a failed preparation and answers with paths relative to the sources folder", async () => {
  await withRoot(async (root) => {
    const dir = join(root, "sources", "mail");
    await Deno.mkdir(dir, { recursive: true });
    await Deno.writeFile(join(dir, "a.txt"), new Uint8Array([0x50, 0x00, 0x01]));
    await Deno.writeTextFile(join(dir, "b.jsonl"), "{broken\n");
    await Deno.writeTextFile(join(dir, "c.pdf"), "%PDF");
    const app = datasetRoutes(root, { workers: 1, waitMs: 30_000 });
    const e = await apiError(await post(app, { path: "mail", ...OPTS }), 422);
    assert.match(e.message, /No documents left to train on: 0 read/);
    assert.match(
      e.message,
      /files skipped or bad: "a\.txt": binary \(NUL bytes\); "b\.jsonl": malformed JSON on line 1; "c\.pdf": unsupported extension "\.pdf"/,
    );
    assert.ok(!e.message.includes(root), e.message);

    await Deno.writeTextFile(join(dir, "d.txt"), makeDocs(6, 100, 5).join("\n\n"));
    await Deno.writeTextFile(join(dir, "e.txt"), makeDocs(6, 100, 6).join("\n\n"));
    const ok = await post(app, { path: "mail", id: "mail", ...OPTS, min_tokens: 1 });
    assert.equal(ok.status, 201, await ok.clone().text());
    const info = await (await app.request("/datasets/mail")).json();
    assert.equal(info.source.path, "mail");
    assert.equal(info.stats.file_issues.length, 3);
    assert.ok(!JSON.stringify(info).includes(root));
  });
});

Deno.test("datasetRoutes answers 429 naming the limit when too many preparations run", async () => {
  await withRoot(async (root) => {
    const app = datasetRoutes(root, { workers: 1, waitMs: 0, limits: { maxPreparations: 1 } });
    const first = await post(app, { texts: makeDocs(8, 100, 4), id: "one", ...OPTS });
    assert.equal(first.status, 202);
    await apiError(await post(app, { texts: makeDocs(8, 100, 5), id: "two", ...OPTS }), 429, {
      type: "rate_limit_error",
      code: "limit_exceeded",
      message:
        "Too many dataset preparations running: 1 (limit GPT2_MAX_PREPARATIONS=1); retry when one finishes",
    });
    for (let i = 0; i < 500; i++) {
      if ((await (await app.request("/datasets/one")).json()).status !== "running") break;
      await new Promise((r) => setTimeout(r, 20));
    }
    assert.equal((await post(app, { texts: makeDocs(8, 100, 5), id: "two", ...OPTS })).status, 202);
    for (let i = 0; i < 500; i++) {
      if ((await (await app.request("/datasets/two")).json()).status !== "running") break;
      await new Promise((r) => setTimeout(r, 20));
    }
  });
});

Deno.test("datasetRoutes refuses URL sources on loopback, private and link-local addresses without fetching them", async () => {
  await withRoot(async (root) => {
    let hits = 0;
    const controller = new AbortController();
    const server = Deno.serve({
      hostname: "127.0.0.1",
      port: 0,
      signal: controller.signal,
      onListen: () => {},
    }, () => {
      hits++;
      return new Response("secret", { headers: { "content-type": "text/plain" } });
    });
    try {
      const app = datasetRoutes(root, { workers: 1, waitMs: 30_000 });
      const urls = [
        `http://127.0.0.1:${server.addr.port}/admin`,
        "http://169.254.169.254/latest/meta-data",
        "http://10.0.0.1/",
      ];
      const e = await apiError(await post(app, { urls, ...OPTS }), 422, { code: "preparation_failed" });
      assert.match(
        e.message,
        /No documents downloaded: all 3 URLs failed \(first: "[^"]+": Refusing "[^"]+": a (loopback|link-local|private) address/,
      );
      assert.equal(hits, 0);
    } finally {
      controller.abort();
      await server.finished;
    }
  });
});

Deno.test("datasetRoutes: a source file cut for time fails with 422 naming file and line, or is shown as partial when allowed", async () => {
  await withRoot(async (root) => {
    const sources = join(root, "sources");
    await Deno.mkdir(sources);
    // 30 ordinary lines, then 40 made slow to parse by 2 MB of padding each: at least 20 ms in all
    // on any machine, against a limit of 5 (at 100 ms a fast machine parsed them all in time).
    const pad = "x".repeat(1 << 21);
    const lines = makeDocs(70, 60, 36).map((text, i) => JSON.stringify(i < 30 ? { text } : { text, pad }));
    await Deno.writeTextFile(join(sources, "web.jsonl"), lines.join("\n"));
    const app = datasetRoutes(root, { workers: 1, waitMs: 60_000 });
    const failed = await post(app, { path: "web.jsonl", max_file_ms: 5, id: "cut", ...OPTS });
    assert.equal(failed.status, 422);
    const cut = (await failed.json()).error.message;
    assert.match(
      cut,
      /^Cannot prepare dataset "cut": source file "web\.jsonl" was cut at line \d+ \(timed out/,
    );
    assert.match(cut, /Set allow_partial \(--allow-partial\)/);
    assert.equal((await app.request("/datasets/cut")).status, 200); // the failed job, not a dataset
    const res = await post(app, {
      path: "web.jsonl",
      max_file_ms: 5,
      allow_partial: true,
      id: "cut",
      ...OPTS,
    });
    assert.equal(res.status, 201);
    const partial = await (await app.request("/datasets/cut")).json();
    assert.equal(partial.status, "ready");
    assert.equal(partial.partial, true);
    assert.equal(partial.cut[0].file, "web.jsonl");
    assert.equal(partial.documents, partial.cut[0].cut.line - 1);
    const ok = await post(app, { path: "web.jsonl", allow_partial: true, id: "whole", ...OPTS });
    assert.equal(ok.status, 201);
    const whole = await (await app.request("/datasets/whole")).json();
    assert.equal(whole.partial, undefined);
    assert.equal(whole.documents, 70);
  });
});
