/** Tests of the dataset HTTP routes on a bare Hono sub-app: 201, 202 with progress, 400, 403 and 404. */
import assert from "node:assert/strict";
import { join } from "node:path";
import { Hono } from "hono";
import { datasetRoutes } from "../routes/datasets.ts";
import { makeDocs, withRoot } from "./data_fixtures.ts";

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

Deno.test("datasetRoutes rejects bad bodies with 400, outside paths with 403 naming the path, unknown ids with 404", async () => {
  await withRoot(async (root) => {
    await Deno.mkdir(join(root, "inside"));
    const app = datasetRoutes(root, { workers: 1 });
    const twoSources = await post(app, { builtin: "sotu", texts: ["x"] });
    assert.equal(twoSources.status, 400);
    assert.match(JSON.stringify((await twoSources.json()).issues), /exactly one source/);
    const badOption = await post(app, { builtin: "sotu", min_tokens: -1 });
    assert.equal(badOption.status, 400);
    assert.equal((await badOption.json()).issues[0].path[0], "min_tokens");
    assert.equal((await post(app, "{not json")).status, 400);
    assert.equal((await post(app, { builtin: "wikipedia" })).status, 400);
    const outside = await post(app, { path: "../../etc/passwd" });
    assert.equal(outside.status, 403);
    const ob = await outside.json();
    assert.equal(ob.path, "../../etc/passwd");
    assert.match(ob.error, /Path "\.\.\/\.\.\/etc\/passwd" is outside the data root/);
    const missing = await post(app, { path: "nothing-here" });
    assert.equal(missing.status, 400);
    assert.match((await missing.json()).error, /Cannot read "nothing-here"/);
    const unusable = await post(app, { texts: ["tiny"], ...OPTS });
    assert.equal(unusable.status, 422);
    assert.match((await unusable.json()).error, /No documents left to train on/);
    const unknown = await app.request("/datasets/nope");
    assert.equal(unknown.status, 404);
    assert.equal((await unknown.json()).error, 'Dataset "nope" not found');
  });
});
