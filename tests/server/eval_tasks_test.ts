/**
 * Evaluations during training (issue 41): `eval_tasks` of `POST /train` are checked like
 * `POST /evaluate` bodies (400s naming `eval_tasks.N.field`); on a real GPU Worker a training job
 * records each task at every eval_interval and at the end (an `eval_task` event and a metrics row
 * each), a task that fails is recorded at each interval while the training succeeds, and the last
 * multiple-choice figures (scored in a forward-only plan of the examples' window over the training
 * weights) equal an evaluation job's on the final checkpoint.
 */

import assert from "node:assert/strict";
import { isFinished, JobRunner, JobStore } from "../../server/jobs/mod.ts";
import { TrainRequestSchema } from "../../server/routes/schemas.ts";
import { parseChoiceJsonl } from "../../model/multiple_choice.ts";
import { ScriptedWorker } from "../fakes/fake_worker.ts";
import { createApp } from "../../server/routes/mod.ts";
import { apiError } from "../_api.ts";
import { noGpu } from "../_helpers.ts";
import { trainJob, withWorkerRunner } from "../_runner.ts";
import { until } from "../_wait.ts";

const EXAMPLES = parseChoiceJsonl(
  await Deno.readTextFile(new URL("../../data/tasks/example_choice.jsonl", import.meta.url)),
  "example_choice.jsonl",
);

Deno.test("POST /train: eval_tasks are checked as POST /evaluate bodies, naming eval_tasks.N.field", async () => {
  const root = await Deno.makeTempDir({ prefix: "gpt2_eval_tasks_routes_" });
  const store = new JobStore(":memory:");
  const workers: ScriptedWorker[] = [];
  const runner = new JobRunner(store, {
    root,
    gpus: 2,
    spawn: () => {
      const w = new ScriptedWorker();
      workers.push(w);
      return w;
    },
    datasetExists: (id) => Promise.resolve(id === "sotu"),
  });
  runner.start();
  const app = createApp({ runner, token: null, maxBodyBytes: 65536, maxUploadBytes: 1 << 20 });
  const post = (body: unknown) =>
    app.request("/train", {
      method: "POST",
      body: JSON.stringify({ model: "gpt2-tiny", ...body as object }),
      headers: { "Content-Type": "application/json" },
    });
  const mc = { task: "multiple_choice", examples: EXAMPLES.slice(0, 2) };
  try {
    await apiError(
      await post({ eval_tasks: [{ ...mc, examples: [EXAMPLES[0], { ...EXAMPLES[1], label: 9 }] }] }),
      400,
      { param: "eval_tasks.0.examples.1.label", message: /Cannot evaluate example 1: label 9/ },
    );
    await apiError(await post({ eval_tasks: [mc, mc] }), 400, {
      param: "eval_tasks.1.name",
      message: /Cannot run two eval_tasks named "multiple_choice"/,
    });
    await apiError(await post({ eval_tasks: [{ name: "a:b", ...mc }] }), 400, { param: "eval_tasks.0.name" });
    await apiError(await post({ eval_tasks: [{ task: "perplexity" }] }), 400, {
      param: "eval_tasks.0.texts",
    });
    await apiError(
      await post({ seq_len: 32, eval_tasks: [{ task: "perplexity", texts: ["a b c"], stride: 33 }] }),
      400,
      {
        param: "eval_tasks.0.stride",
      },
    );
    await apiError(await post({ tensor_parallel: 2, eval_tasks: [mc] }), 400, { param: "eval_tasks" });
    await apiError(await post({ eval_tasks: [{ task: "perplexity", dataset: "nope" }] }), 400, {
      param: "eval_tasks.0.dataset",
      message: 'Unknown dataset "nope"',
    });
    await apiError(
      await post({ eval_tasks: [mc, { name: "f", task: "multiple_choice", examples_file: "nope" }] }),
      400,
      {
        param: "eval_tasks.1.examples_file",
        message: /Unknown task file "nope": expected \$GPT2_HOME\/tasks\/nope.jsonl/,
      },
    );

    const res = await post({
      eval_tasks: [
        mc,
        { name: "ppl", task: "perplexity", texts: ["Hello there, world"] },
        { name: "file", task: "multiple_choice", examples_file: "example_choice" },
      ],
    });
    assert.equal(res.status, 202, await res.clone().text());
    await until(() => workers.some((w) => w.jobs.length === 1), "the job on a worker");
    const handed = workers.find((w) => w.jobs.length === 1)!.jobs[0];
    assert.deepEqual(handed.config.eval_tasks!.map((t) => [t.name, t.task, t.scoring, t.split]), [
      ["multiple_choice", "multiple_choice", "sum", "test"],
      ["ppl", "perplexity", "sum", "test"],
      ["file", "multiple_choice", "sum", "test"],
    ]);
    assert.equal(handed.config.eval_tasks![2].examples_file, "example_choice");

    // The runner records a result as an event and an eval:<name> metrics row, an error as an event;
    // a sign of life (done of total) is neither.
    const w = workers.find((w) => w.jobs.length === 1)!, id = handed.id;
    const base = { type: "eval_task" as const, id, iteration: 5, name: "ppl", task: "perplexity" as const };
    w.send({ ...base, done: 1, total: 2 });
    w.send({
      ...base,
      result: {
        task: "perplexity",
        model: "(training)",
        loss: 3,
        perplexity: Math.exp(3),
        tokens: 4,
        seq_len: 64,
        tokens_per_s: 9,
        elapsed_s: 0.5,
      },
    });
    w.send({ ...base, name: "file", task: "multiple_choice", error: "Cannot evaluate: oops" });
    await until(
      () => store.eventsAfter(id, 0).filter((e) => e.type === "eval_task").length === 2,
      "two eval_task events",
    );
    const events = store.eventsAfter(id, 0).filter((e) => e.type === "eval_task").map((e) => e.data);
    assert.deepEqual(events[0], {
      iteration: 5,
      name: "ppl",
      task: "perplexity",
      loss: 3,
      perplexity: Math.exp(3),
      tokens: 4,
      seq_len: 64,
      tokens_per_s: 9,
      elapsed_s: 0.5,
    });
    assert.deepEqual(events[1], {
      iteration: 5,
      name: "file",
      task: "multiple_choice",
      error: "Cannot evaluate: oops",
    });
    assert.deepEqual(store.metrics(id).map((p) => [p.iteration, p.split, p.loss]), [[5, "eval:ppl", 3]]);
  } finally {
    runner.shutdown();
    store.close();
    await Deno.remove(root, { recursive: true });
  }
});

Deno.test({
  name:
    "a training job with eval_tasks records each evaluation at every eval_interval; a failing one does not fail it",
  ignore: noGpu,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: () =>
    withWorkerRunner("gpt2_eval_tasks_", 1, async (runner) => {
      const req = TrainRequestSchema.parse({
        model: "gpt2-tiny",
        train_iters: 12,
        batch_size: 4,
        seq_len: 64,
        log_interval: 4,
        eval_interval: 4,
        eval_iters: 1,
        save_interval: 0,
        eval_tasks: [
          // The shipped file, read by the Worker (data/tasks.ts).
          { name: "mc", task: "multiple_choice", examples_file: "example_choice" },
          // One token: nothing to score, which only running it finds.
          { name: "broken", task: "perplexity", texts: ["Hello"] },
        ],
      });
      const { job } = await trainJob(runner, req);
      assert.equal(job.status, "succeeded", job.error ?? "");
      const events = runner.store.eventsAfter(job.id, 0).filter((e) => e.type === "eval_task");
      const of = (name: string) => events.filter((e) => e.data.name === name).map((e) => e.data);
      // Every eval_interval before the end (4, 8), and at the end (12).
      assert.deepEqual(of("mc").map((d) => d.iteration), [4, 8, 12]);
      for (const d of of("mc")) {
        assert.equal(d.task, "multiple_choice");
        // The examples need 32 tokens, half the training window: a forward-only plan of 32 shares the weights.
        assert.equal(d.seq_len, 32);
        assert.equal(d.examples, EXAMPLES.length);
        assert.ok((d.accuracy as number) >= 0 && (d.accuracy as number) <= 1);
        assert.ok(Number.isFinite(d.loss) && Number.isFinite(d.accuracy_norm));
      }
      assert.deepEqual(of("broken").map((d) => d.iteration), [4, 8, 12]);
      for (const d of of("broken")) {
        assert.match(d.error as string, /A stream of 1 token\(s\) has nothing to score/);
      }
      const rows = runner.store.metrics(job.id).filter((p) => p.split === "eval:mc");
      assert.deepEqual(rows.map((p) => p.iteration), [4, 8, 12]);

      // The last figures are the final weights': an evaluation job on the checkpoint agrees.
      const e = await runner.submitEvaluation({
        model: job.id,
        task: "multiple_choice",
        examples: EXAMPLES,
        scoring: "sum",
        split: "test",
        batch_size: 8,
        strict: false,
      });
      await until(async () => isFinished((await runner.get(e.id)).status), "the evaluation", 300_000);
      const r = runner.get(e.id).metrics.evaluation!;
      const last = of("mc").at(-1)!;
      assert.equal(r.correct, last.correct);
      assert.equal(r.correct_norm, last.correct_norm);
      assert.ok(Math.abs(r.loss - (last.loss as number)) < 1e-5 * r.loss, `${r.loss} vs ${last.loss}`);
    }),
});
