/**
 * Runs side by side (issue 41): `GET /jobs/compare` aligns the metric series of jobs of different
 * lengths on one iteration axis, with their final figures, evaluations during training and the
 * fields where their configs differ; `GET /jobs/:id/metrics?format=csv` exports one run. Jobs and
 * histories are written to the store directly; nothing here needs a GPU. The dashboard's pure
 * readers of the answer (web/shapes.js) draw it by iteration, tokens or time.
 */

import assert from "node:assert/strict";
import { completeConfig, JobRunner, JobStore, type TrainConfig } from "../../server/jobs/mod.ts";
import { TrainRequestSchema } from "../../server/routes/schemas.ts";
import { ScriptedWorker } from "../fakes/fake_worker.ts";
import { createApp } from "../../server/routes/mod.ts";
import { apiError } from "../_api.ts";
import { compareEvalNames, evalTaskKey, JobSeries, overlayColumns } from "../../web/shapes.js";

/** A store holding jobs a (30 iterations, lr 6e-4) and b (50 iterations, lr 3e-4, an eval task). */
async function setup() {
  const root = await Deno.makeTempDir({ prefix: "gpt2_compare_" });
  const store = new JobStore(":memory:");
  const runner = new JobRunner(store, {
    root,
    gpus: 1,
    spawn: () => new ScriptedWorker(),
    datasetExists: () => Promise.resolve(true),
  });
  const config = (body: Record<string, unknown>): TrainConfig =>
    completeConfig(TrainRequestSchema.parse({ model: "gpt2-tiny", batch_size: 4, seq_len: 32, ...body }));
  store.createJob("job_a", 0, config({ train_iters: 30, lr: 6e-4 }));
  store.createJob(
    "job_b",
    0,
    config({
      train_iters: 50,
      lr: 3e-4,
      eval_tasks: [{
        name: "mc",
        task: "multiple_choice",
        examples: [{ context: "a", endings: ["b"], label: 0 }],
      }],
    }),
  );
  for (const [id, iters, offset] of [["job_a", 30, 0], ["job_b", 50, 0.5]] as const) {
    for (let it = 10; it <= iters; it += 10) {
      store.addMetric(id, {
        iteration: it,
        split: "train",
        loss: 10 - it / 10 + offset,
        perplexity: null,
        lr: 1e-4,
        tokens_per_s: 100,
      });
      if (it % 20 === 0) {
        store.addMetric(id, {
          iteration: it,
          split: "valid",
          loss: 11 - it / 10,
          perplexity: Math.exp(11 - it / 10),
          lr: null,
          tokens_per_s: null,
        });
      }
    }
  }
  // b's evaluation task at 25 (an iteration no training point has) and 50; one failed at 40.
  store.addEvent("job_b", "eval_task", {
    iteration: 25,
    name: "mc",
    task: "multiple_choice",
    accuracy: 0.25,
    accuracy_norm: 0.5,
    loss: 3,
  });
  store.addEvent("job_b", "eval_task", {
    iteration: 40,
    name: "mc",
    task: "multiple_choice",
    error: "Cannot evaluate, oops",
  });
  store.addEvent("job_b", "eval_task", {
    iteration: 50,
    name: "mc",
    task: "multiple_choice",
    accuracy: 0.75,
    accuracy_norm: 1,
    loss: 2,
  });
  store.updateJob("job_a", { status: "succeeded", iteration: 30, metrics: { loss: 7, val_loss: 8 } });
  store.updateJob("job_b", { status: "succeeded", iteration: 50, metrics: { loss: 5.5, val_loss: 6 } });
  const app = createApp({ runner, token: null, maxBodyBytes: 4096, maxUploadBytes: 8192 });
  const cleanup = async () => {
    runner.shutdown();
    store.close();
    await Deno.remove(root, { recursive: true });
  };
  return { app, store, cleanup };
}

Deno.test("GET /jobs/compare aligns the series of jobs of different lengths on one iteration axis", async () => {
  const t = await setup();
  try {
    const res = await t.app.request("/jobs/compare?ids=job_a,job_b");
    assert.equal(res.status, 200, await res.clone().text());
    const c = await res.json();
    assert.deepEqual(c.ids, ["job_a", "job_b"]);
    assert.deepEqual(c.iterations, [10, 20, 25, 30, 40, 50]);
    assert.deepEqual(c.series.train_loss, {
      job_a: [9, 8, null, 7, null, null],
      job_b: [9.5, 8.5, null, 7.5, 6.5, 5.5],
    });
    assert.deepEqual(c.series.val_loss, {
      job_a: [null, 9, null, null, null, null],
      job_b: [null, 9, null, null, 7, null],
    });
    // Tokens seen: iteration × batch 4 × seq_len 32.
    assert.deepEqual(c.series.tokens.job_a, [1280, 2560, null, 3840, null, null]);
    assert.equal(c.series.time_s.job_a[0], 0);
    assert.deepEqual(c.series["eval:mc:accuracy"], {
      job_a: [null, null, null, null, null, null],
      job_b: [null, null, 0.25, null, null, 0.75],
    });
    for (const s of Object.values(c.series) as Record<string, unknown[]>[]) {
      for (const values of Object.values(s)) assert.equal(values.length, c.iterations.length);
    }
    const [a, b] = c.jobs;
    assert.deepEqual([a.id, a.iteration, a.final.loss, a.final.val_loss, a.final.tokens], [
      "job_a",
      30,
      7,
      8,
      3840,
    ]);
    assert.deepEqual(b.evaluations.mc.accuracy, 0.75);
    assert.deepEqual(a.evaluations, {});
    const diff = Object.fromEntries(
      c.config_differences.map((d: { field: string; values: unknown[] }) => [d.field, d.values]),
    );
    assert.deepEqual(diff.lr, [6e-4, 3e-4]);
    assert.deepEqual(diff.train_iters, [30, 50]);
    assert.deepEqual(diff.eval_tasks, [null, ["mc (multiple_choice)"]]);
    assert.equal(diff.batch_size, undefined, "equal fields are not differences");

    await apiError(await t.app.request("/jobs/compare?ids=job_a,nope"), 404, {
      message: 'Job "nope" not found',
    });
    await apiError(await t.app.request("/jobs/compare?ids="), 400, { param: "ids" });
    await apiError(await t.app.request("/jobs/compare"), 400, { param: "ids" });
    await apiError(await t.app.request("/jobs/compare?ids=job_a,job_a"), 400, {
      param: "ids",
      message: /Cannot compare job "job_a" with itself/,
    });
    const nine = Array.from({ length: 9 }, (_, i) => `job_${i}`).join(",");
    await apiError(await t.app.request(`/jobs/compare?ids=${nine}`), 400, { message: /at most 8/ });
  } finally {
    await t.cleanup();
  }
});

Deno.test("GET /jobs/:id/metrics?format=csv exports a run with its evaluations during training", async () => {
  const t = await setup();
  try {
    const res = await t.app.request("/jobs/job_b/metrics?format=csv");
    assert.equal(res.status, 200);
    assert.equal(res.headers.get("Content-Type"), "text/csv; charset=utf-8");
    assert.match(res.headers.get("Content-Disposition")!, /filename="job_b_metrics.csv"/);
    const lines = (await res.text()).trimEnd().split("\n");
    assert.equal(lines[0], "iteration,split,loss,perplexity,lr,tokens_per_s,accuracy,accuracy_norm,error,at");
    assert.equal(lines.length, 1 + 5 + 2 + 3);
    assert.match(lines[1], /^10,train,9.5,,0.0001,100,,,,\d{4}-/);
    const evals = lines.filter((l) => l.includes(",eval:mc,"));
    assert.equal(evals.length, 3);
    assert.match(evals[0], /^25,eval:mc,3,,,,0.25,0.5,,/);
    assert.match(evals[1], /^40,eval:mc,,,,,,,"Cannot evaluate, oops",/);
    const json = await (await t.app.request("/jobs/job_b/metrics")).json();
    assert.equal(json.metrics.length, 7);
    assert.deepEqual(json.evaluations.map((e: { iteration: number }) => e.iteration), [25, 40, 50]);
    await apiError(await t.app.request("/jobs/job_b/metrics?format=xml"), 400, { param: "format" });
  } finally {
    await t.cleanup();
  }
});

Deno.test("overlayColumns() draws a comparison by iteration, tokens or time; JobSeries takes eval_task events", async () => {
  const t = await setup();
  try {
    const c = await (await t.app.request("/jobs/compare?ids=job_a,job_b")).json();
    // By iteration: the answer's own alignment, points only where a job has one.
    assert.deepEqual(overlayColumns(c, "val_loss", "iteration"), [[20, 40], [9, null], [9, 7]]);
    // By tokens: each job's iterations × its tokens per iteration (both 128 here), merged.
    assert.deepEqual(overlayColumns(c, "val_loss", "tokens"), [[2560, 5120], [9, null], [9, 7]]);
    // By time: each job's own seconds (the points here were written within milliseconds), merged ascending.
    const byTime = overlayColumns(c, "train_loss", "time");
    const times = byTime[0] as number[];
    assert.equal(byTime.length, 3);
    assert.deepEqual(times, [...new Set(times)].sort((x, y) => x - y));
    assert.ok(times.every((x) => x >= 0 && x < 60));
    assert.deepEqual(compareEvalNames(c), ["mc"]);
    assert.deepEqual(overlayColumns(c, "eval:mc:accuracy"), [[25, 50], [null, null], [0.25, 0.75]]);
    assert.deepEqual(overlayColumns(c, "no_such_series"), [[], [], []]);

    const s = new JobSeries();
    assert.ok(s.add("eval_task", { iteration: 4, name: "mc", accuracy: 0.5, loss: 2 }));
    assert.ok(s.add("eval_task", { iteration: 4, name: "ppl", loss: 3.5 }));
    assert.ok(s.add("eval_task", { iteration: 8, name: "mc", error: "Cannot evaluate" }));
    assert.deepEqual(s.columns([evalTaskKey("mc"), evalTaskKey("ppl")]), [[4, 8], [0.5, null], [3.5, null]]);
  } finally {
    await t.cleanup();
  }
});
