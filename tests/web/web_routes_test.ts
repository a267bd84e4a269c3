/**
 * The dashboard's routes through `app.request()`: the page and its files are served (ahead of the
 * bearer token, which the page asks for), uPlot comes from node_modules, unknown or traversing
 * names are 404, `GET /web/meta.json` carries the `POST /train` schema, and a checkpoint's files
 * download through `GET /jobs/:id/checkpoints/:name/:file`. No GPU: a scripted Worker stands in.
 */

import { deepStrictEqual as assertEquals, match as assertMatch, ok as assert } from "node:assert/strict";
import { JobRunner, JobStore } from "../../server/jobs/mod.ts";
import { ScriptedWorker } from "../fakes/fake_worker.ts";
import { createApp } from "../../server/routes/mod.ts";

/** The message of an error body, in today's shape (`{error}`) or OpenAI's (`{error: {message}}`). */
function message(body: { error: string | { message: string } }): string {
  return typeof body.error === "string" ? body.error : body.error.message;
}

async function setup(token: string | null = null) {
  const root = await Deno.makeTempDir({ prefix: "gpt2_web_" });
  const store = new JobStore(":memory:");
  const runner = new JobRunner(store, {
    root,
    gpus: 1,
    spawn: () => new ScriptedWorker(),
    datasetExists: (id) => Promise.resolve(id === "sotu"),
  });
  runner.start();
  await new Promise((r) => setTimeout(r, 0));
  const app = createApp({ runner, token });
  const cleanup = async () => {
    runner.shutdown();
    store.close();
    await Deno.remove(root, { recursive: true });
  };
  return { app, runner, root, cleanup };
}

Deno.test("GET / serves the dashboard page and its files without a token, the API still needs one", async () => {
  const t = await setup("s3cret");
  try {
    const page = await t.app.request("/");
    assertEquals(page.status, 200);
    assertEquals(page.headers.get("Content-Type"), "text/html; charset=utf-8");
    assertMatch(page.headers.get("Content-Security-Policy")!, /default-src 'self'/);
    const html = await page.text();
    for (const src of ["/web/vendor/uPlot.iife.min.js", "/web/vendor/uPlot.min.css", "/web/app.js"]) {
      assert(html.includes(src), `index.html does not load ${src}`);
      const res = await t.app.request(src);
      assertEquals(res.status, 200, src);
      assert((await res.arrayBuffer()).byteLength > 100, src);
    }
    const script = await t.app.request("/web/app.js");
    assertEquals(script.headers.get("Content-Type"), "text/javascript; charset=utf-8");
    assertEquals((await t.app.request("/jobs")).status, 401);
    const authed = await t.app.request("/jobs", { headers: { Authorization: "Bearer s3cret" } });
    assertEquals(authed.status, 200);
  } finally {
    await t.cleanup();
  }
});

Deno.test("GET /web/ answers 404 for unknown files and names that leave web/", async () => {
  const t = await setup();
  try {
    for (const path of ["/web/nope.js", "/web/..%2Fmain.ts", "/web/vendor/uPlot.esm.js", "/web/app.ts"]) {
      const res = await t.app.request(path);
      assertEquals(res.status, 404, path);
      assertMatch(message(await res.json()), /^No dashboard file "/);
    }
  } finally {
    await t.cleanup();
  }
});

Deno.test("GET /web/meta.json gives presets, built-in datasets and the POST /train JSON Schema", async () => {
  const t = await setup();
  try {
    const meta = await (await t.app.request("/web/meta.json")).json();
    assert(meta.presets.includes("gpt2-tiny"));
    assert(meta.builtin_datasets.includes("sotu"));
    const props = meta.train_schema.properties;
    assertEquals(props.batch_size.type, "integer");
    assertEquals(props.batch_size.default, 4);
    assertEquals(props.lr_decay_style.enum, ["cosine", "linear", "constant"]);
    assert("seq_len" in props && "resume_from" in props);
  } finally {
    await t.cleanup();
  }
});

Deno.test("GET /jobs/:id/checkpoints/:name/:file downloads a checkpoint's file; 404 names what is missing", async () => {
  const t = await setup();
  try {
    const res = await t.app.request("/train", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ model: "gpt2-tiny", train_iters: 10 }),
    });
    const { id } = await res.json();
    const dir = `${t.runner.checkpointDir(id)}/iter_0000010`;
    await Deno.mkdir(dir, { recursive: true });
    const manifest = { iteration: 10, created_at: new Date().toISOString(), metrics: {} };
    await Deno.writeTextFile(`${dir}/manifest.json`, JSON.stringify(manifest));
    const weights = new Uint8Array([1, 2, 3, 4, 5, 6, 7]);
    await Deno.writeFile(`${dir}/model.safetensors`, weights);

    const got = await t.app.request(`/jobs/${id}/checkpoints/iter_0000010/model.safetensors`);
    assertEquals(got.status, 200);
    assertEquals(got.headers.get("Content-Type"), "application/octet-stream");
    assertEquals(got.headers.get("Content-Length"), "7");
    assertEquals(
      got.headers.get("Content-Disposition"),
      `attachment; filename="${id}_iter_0000010_model.safetensors"`,
    );
    assertEquals(new Uint8Array(await got.arrayBuffer()), weights);
    // A tensor-parallel checkpoint's shard files download the same way.
    await Deno.writeFile(`${dir}/model-tp01-of-02.safetensors`, weights);
    const shard = await t.app.request(`/jobs/${id}/checkpoints/iter_0000010/model-tp01-of-02.safetensors`);
    assertEquals(shard.status, 200);
    assertEquals(new Uint8Array(await shard.arrayBuffer()), weights);

    const unknownFile = await t.app.request(`/jobs/${id}/checkpoints/iter_0000010/..%2F..%2Fjobs.sqlite`);
    assertEquals(unknownFile.status, 404);
    assertMatch(message(await unknownFile.json()), /^Unknown checkpoint file "\.\.\/\.\.\/jobs\.sqlite"/);
    const unknownCkpt = await t.app.request(`/jobs/${id}/checkpoints/iter_0000020/config.json`);
    assertEquals(unknownCkpt.status, 404);
    assertEquals(message(await unknownCkpt.json()), `Job "${id}" has no checkpoint "iter_0000020"`);
    const noOptimizer = await t.app.request(`/jobs/${id}/checkpoints/iter_0000010/optimizer.safetensors`);
    assertEquals(noOptimizer.status, 404);
    assertEquals(
      message(await noOptimizer.json()),
      `Checkpoint "iter_0000010" of job "${id}" has no "optimizer.safetensors"`,
    );
    assertEquals(
      (await t.app.request(`/jobs/job_000000000000/checkpoints/iter_0000010/config.json`)).status,
      404,
    );
  } finally {
    await t.cleanup();
  }
});
