/**
 * Multiple-choice evaluation (issue 41): tokenization, rows and figures on the CPU; on the GPU
 * (lavapipe on CI), every ending's summed log-probability of a generated set of 50 examples against
 * the float64 CPU reference model, and the same accuracies; a forward-only plan sharing a trainer's
 * weights scores as the trainer's own plan; `POST /evaluate` 400s naming
 * `examples.N.field`; an evaluation job on a real GPU Worker over the shipped example file; and
 * `deno task eval --task multiple_choice`. GPU tests skip without an adapter.
 */

import assert from "node:assert/strict";
import { presetConfig } from "../../model/config.ts";
import {
  argmax,
  checkedChoiceJsonl,
  choiceFigures,
  choiceRow,
  type ChoiceScores,
  type ChoiceTokens,
  choiceTokens,
  parseChoiceJsonl,
} from "../../model/multiple_choice.ts";
import { choiceWindow, EvalModel, multipleChoice, scoreChoices, tokenize } from "../../worker/evaluation.ts";
import { initParams, referenceForward } from "../reference/cpu_gpt2.ts";
import { noGpu, testContext } from "../_helpers.ts";
import { exportTensors, hfConfig } from "../../checkpoint/checkpoint.ts";
import { isFinished, JobRunner, JobStore } from "../../server/jobs/mod.ts";
import { writeSafetensors } from "../../checkpoint/safetensors.ts";
import { withWorkerRunner } from "../_runner.ts";
import { ScriptedWorker } from "../fakes/fake_worker.ts";
import { createApp } from "../../server/routes/mod.ts";
import { apiError } from "../_api.ts";
import { until } from "../_wait.ts";

const tiny = presetConfig("gpt2-tiny");
const EXAMPLE_FILE = new URL("../../data/tasks/example_choice.jsonl", import.meta.url).pathname;

Deno.test("choiceTokens() tokenizes context and endings apart, an ending after one space", () => {
  const t = choiceTokens({ context: "The cat", endings: ["sat down.", " ran"], label: 1 }, tokenize);
  assert.deepEqual(t.context, tokenize("The cat"));
  assert.deepEqual(t.endings, [tokenize(" sat down."), tokenize(" ran")]);
  assert.deepEqual(t.bytes, [9, 4]); // as given: the space added is not counted
  const after = choiceTokens({ context: "Answer: ", endings: ["yes"], label: 0 }, tokenize);
  assert.deepEqual(after.endings, [tokenize("yes")]); // the context already ends with whitespace
});

Deno.test("choiceRow() cuts the context from the left and keeps the whole ending", () => {
  assert.deepEqual(choiceRow([1, 2, 3], [4, 5], 8, "x"), { tokens: [1, 2, 3, 4, 5], first: 2, count: 2 });
  // seq_len 3: rows of 4 tokens, the ending's 2 targets at input positions 1 and 2.
  assert.deepEqual(choiceRow([1, 2, 3, 4, 5], [6, 7], 3, "x"), { tokens: [4, 5, 6, 7], first: 1, count: 2 });
  assert.throws(
    () => choiceRow([1], [2, 3, 4], 2, "example 3 ending 1"),
    /example 3 ending 1: its ending takes 3 tokens/,
  );
});

Deno.test("choiceFigures(): accuracy by the sum (or the mean per token), accuracy_norm per byte", () => {
  const scores: ChoiceScores[] = [
    // Sum picks 0; per byte picks 1 (−6/3 = −2 < −4/1 = −4); per token picks 1 (−6/2 < −4/1? no: −3 < −4).
    { logprobs: [-4, -6], tokens: [1, 2], bytes: [1, 3], label: 1 },
    // Everything picks the label.
    { logprobs: [-1, -9, -9], tokens: [1, 1, 1], bytes: [5, 5, 5], label: 0 },
  ];
  const sum = choiceFigures(scores, "sum");
  assert.deepEqual([sum.correct, sum.accuracy, sum.correct_norm, sum.accuracy_norm], [1, 0.5, 2, 1]);
  assert.equal(sum.loss, (6 + 1) / 3); // the right endings' nats per token
  const mean = choiceFigures(scores, "mean_token");
  assert.deepEqual([mean.correct, mean.correct_norm], [2, 2]);
  assert.equal(argmax([1, 3, 3]), 1);
});

Deno.test("checkedChoiceJsonl() names the file and line of a bad example", () => {
  const line = (o: unknown) => JSON.stringify(o);
  const text = [
    line({ context: "a", endings: ["b"], label: 0 }),
    "",
    line({ context: "", endings: ["b"], label: 0 }),
  ]
    .join("\n");
  assert.throws(
    () => checkedChoiceJsonl(text, "t.jsonl"),
    /^RangeError: Cannot evaluate "t.jsonl" line 3: its context is empty$/,
  );
  assert.throws(() => checkedChoiceJsonl("\n", "e.jsonl"), /Cannot evaluate "e.jsonl": it has no examples/);
});

Deno.test("parseChoiceJsonl() reads the shipped example file and names a bad line", async () => {
  const examples = parseChoiceJsonl(await Deno.readTextFile(EXAMPLE_FILE), "example_choice.jsonl");
  assert.ok(examples.length >= 20);
  for (const ex of examples) {
    assert.ok(ex.label >= 0 && ex.label < ex.endings.length && ex.endings.length >= 2);
  }
  assert.throws(
    () => parseChoiceJsonl('{"context": "a", "endings": ["b"], "label": 0}\n\n{"context": 1}', "f.jsonl"),
    /Cannot read "f.jsonl" line 3: expected \{"context"/,
  );
});

const gpuTest = (name: string, fn: () => Promise<void>) =>
  Deno.test({ name, ignore: noGpu, sanitizeResources: false, sanitizeOps: false, fn });

/** A deterministic pseudo-random generator of integers below `n`. */
function lcg(seed: number): (n: number) => number {
  let x = seed >>> 0;
  return (n) => {
    x = (Math.imul(x, 1664525) + 1013904223) >>> 0;
    return x % n;
  };
}

/** 50 token examples: contexts of 1–24 tokens (some longer than the window), 2–5 endings of 1–5 tokens. */
function generatedExamples(): ChoiceTokens[] {
  const r = lcg(41);
  return Array.from({ length: 50 }, () => {
    const k = 2 + r(4);
    const endings = Array.from({ length: k }, () => Array.from({ length: 1 + r(5) }, () => r(5000)));
    return {
      context: Array.from({ length: 1 + r(24) }, () => r(5000)),
      endings,
      bytes: endings.map((e) => 2 + e.length * (1 + r(6))),
      label: r(k),
    };
  });
}

/** Log-softmax of `row` at `target`, in float64. */
function logProb(row: Float64Array | Float32Array, target: number): number {
  let max = -Infinity, sum = 0;
  for (const x of row) max = Math.max(max, x);
  for (const x of row) sum += Math.exp(x - max);
  return row[target] - max - Math.log(sum);
}

gpuTest(
  "scoreChoices() matches the float64 CPU reference on 50 generated examples: logprobs to 1e-5, same accuracies",
  async () => {
    const ctx = (await testContext())!;
    const B = 4, T = 16;
    const params = initParams(tiny, 41), p64 = Float64Array.from(params);
    const V = tiny.vocab_size, Vp = tiny.padded_vocab_size;
    const examples = generatedExamples();
    assert.ok(examples.some((e) => e.endings.length > B), "an example with more endings than rows spills");
    assert.ok(examples.some((e) => e.context.length + 5 > T + 1), "a context cut from the left");
    const model = await EvalModel.create(ctx, tiny, params, B, T);
    let gpu: ChoiceScores[], result;
    try {
      gpu = await scoreChoices(model, examples);
      result = await multipleChoice(model, examples, "sum");
    } finally {
      model.destroy();
    }
    const cpu: ChoiceScores[] = examples.map((ex, e) => ({
      logprobs: ex.endings.map((ending, k) => {
        const row = choiceRow(ex.context, ending, T, `example ${e} ending ${k}`);
        const len = row.tokens.length - 1;
        const { logits } = referenceForward(tiny, p64, Int32Array.from(row.tokens), 1, len);
        let lp = 0;
        for (let p = row.first; p < row.first + row.count; p++) {
          lp += logProb(logits.subarray(p * Vp, p * Vp + V), row.tokens[p + 1]);
        }
        return lp;
      }),
      tokens: ex.endings.map((x) => x.length),
      bytes: ex.bytes,
      label: ex.label,
    }));
    let worst = 0;
    for (const [e, c] of cpu.entries()) {
      for (const [k, want] of c.logprobs.entries()) {
        worst = Math.max(worst, Math.abs(gpu[e].logprobs[k] - want) / Math.max(1, Math.abs(want)));
      }
    }
    assert.ok(worst < 1e-5, `largest relative difference ${worst}`);
    for (const scoring of ["sum", "mean_token"] as const) {
      const a = choiceFigures(gpu, scoring), b = choiceFigures(cpu, scoring);
      assert.deepEqual([a.correct, a.correct_norm], [b.correct, b.correct_norm], scoring);
    }
    const want = choiceFigures(cpu, "sum");
    assert.equal(result.examples, 50);
    assert.equal(result.correct, want.correct);
    assert.equal(result.accuracy, want.accuracy);
    assert.equal(result.accuracy_norm, want.accuracy_norm);
    assert.equal(result.endings, examples.reduce((a, e) => a + e.endings.length, 0));
    assert.ok(Math.abs(result.loss - want.loss) < 1e-5 * want.loss);
    assert.equal(choiceWindow(examples, 1024), 32); // the longest row is 24 + 5 tokens
  },
);

gpuTest(
  "EvalModel.sharing() scores in a forward-only plan over a trainer's weights as the trainer does",
  async () => {
    const ctx = (await testContext())!;
    const examples = generatedExamples().slice(0, 12);
    const full = await EvalModel.create(ctx, tiny, initParams(tiny, 5), 4, 64);
    const short = await EvalModel.sharing(ctx, full.trainer, 9, 32);
    try {
      assert.ok(short, "one fp32 weight buffer: shared");
      const a = await scoreChoices(full, examples), b = await scoreChoices(short, examples);
      for (const [e, s] of a.entries()) {
        for (const [k, lp] of s.logprobs.entries()) {
          assert.ok(
            Math.abs(lp - b[e].logprobs[k]) <= 1e-5 * Math.max(1, Math.abs(lp)),
            `${e}/${k}: ${lp} vs ${b[e].logprobs[k]}`,
          );
        }
      }
    } finally {
      short?.destroy();
      full.destroy();
    }
  },
);

/** Writes a Hugging Face GPT-2 folder of gpt2-tiny under `root/models/name`. */
async function writeHfFolder(root: string, name: string, params: Float32Array): Promise<void> {
  const dir = `${root}/models/${name}`;
  await Deno.mkdir(dir, { recursive: true });
  await Deno.writeTextFile(
    `${dir}/config.json`,
    JSON.stringify(hfConfig(tiny, { attention_dropout: 0, hidden_dropout: 0 })),
  );
  await writeSafetensors(`${dir}/model.safetensors`, exportTensors(tiny, params));
}

Deno.test("POST /evaluate multiple_choice: a bad example is a 400 naming examples.N.field; a good one is queued", async () => {
  const root = await Deno.makeTempDir({ prefix: "gpt2_choice_routes_" });
  await writeHfFolder(root, "hf_choice", initParams(tiny, 3));
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
  const app = createApp({ runner, token: null, maxBodyBytes: 4096, maxUploadBytes: 1 << 20 });
  const post = (body: unknown) =>
    app.request("/evaluate", {
      method: "POST",
      body: JSON.stringify({ model: "hf_choice", task: "multiple_choice", ...body as object }),
      headers: { "Content-Type": "application/json" },
    });
  const good = { context: "The sky is", endings: ["blue", "a fish"], label: 0 };
  try {
    await apiError(await post({ examples: [good, { ...good, endings: [] }] }), 400, {
      param: "examples.1.endings",
      message: /: Cannot evaluate example 1: it has no endings$/,
    });
    await apiError(await post({ examples: [{ ...good, label: 2 }] }), 400, {
      param: "examples.0.label",
      message: /: Cannot evaluate example 0: label 2 is not an index of its 2 endings$/,
    });
    await apiError(await post({ examples: [good, good, { ...good, context: " " }] }), 400, {
      param: "examples.2.context",
      message: /: Cannot evaluate example 2: its context is empty$/,
    });
    await apiError(await post({ examples: [{ ...good, endings: ["a", ""] }] }), 400, {
      param: "examples.0.endings.1",
    });
    await apiError(await post({ examples: [{ ...good, label: 0.5 }] }), 400, { param: "examples.0.label" });
    await apiError(await post({}), 400, { param: "examples" });
    await apiError(await post({ examples: [good], texts: ["a b"] }), 400, { param: "texts" });
    await apiError(await post({ task: "cloze", examples: [good] }), 400, { param: "examples" });
    await apiError(await post({ examples: [good], scoring: "max" }), 400, { param: "scoring" });

    // A task file: unknown, with a bad line (named), given with examples.
    await apiError(await post({ examples_file: "nope" }), 400, {
      param: "examples_file",
      message: /Unknown task file "nope"/,
    });
    await apiError(await post({ examples_file: "../etc" }), 400, { param: "examples_file" });
    await Deno.mkdir(`${root}/tasks`);
    await Deno.writeTextFile(
      `${root}/tasks/mine.jsonl`,
      JSON.stringify(good) + "\n\n" + JSON.stringify({ ...good, label: 5 }) + "\n",
    );
    await apiError(await post({ examples_file: "mine" }), 400, {
      param: "examples_file",
      message: 'Cannot evaluate "mine.jsonl" line 3: label 5 is not an index of its 2 endings',
    });
    await apiError(await post({ examples: [good], examples_file: "example_choice" }), 400, {
      param: "examples_file",
    });
    const file = await post({ examples_file: "example_choice" });
    assert.equal(file.status, 202, await file.clone().text());

    const five = { context: "Pick", endings: ["a", "b", "c", "d", "e"], label: 4 };
    const res = await post({ examples: [good, five], scoring: "mean_token", batch_size: 2 });
    assert.equal(res.status, 202, await res.clone().text());
    await until(() => workers[0]?.jobs.length === 1, "the job on the worker");
    assert.deepEqual(workers[0].jobs[0].config.evaluate!.examples_file, "example_choice");
    workers[0].send({
      type: "done",
      id: workers[0].jobs[0].id,
      status: "succeeded",
      iteration: 0,
      error: null,
    });
    await until(() => workers[0]?.jobs.length === 2, "the second job on the worker");
    const handed = workers[0].jobs[1];
    assert.deepEqual(handed.config.evaluate, {
      task: "multiple_choice",
      model: "hf_choice",
      stride: 64,
      strict: false,
      examples: [good, five],
      scoring: "mean_token",
    });
    assert.equal(handed.config.batch_size, 5, "every ending of an example in one batch");
  } finally {
    runner.shutdown();
    store.close();
    await Deno.remove(root, { recursive: true });
  }
});

Deno.test({
  name: "a multiple-choice evaluation job runs on a GPU Worker over the shipped example file",
  ignore: noGpu,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: () =>
    withWorkerRunner("gpt2_choice_jobs_", 1, async (runner, root) => {
      await writeHfFolder(root, "hf_choice", initParams(tiny, 3));
      const examples = parseChoiceJsonl(await Deno.readTextFile(EXAMPLE_FILE), "example_choice.jsonl");
      const submitted = await runner.submitEvaluation({
        model: "hf_choice",
        task: "multiple_choice",
        examples,
        scoring: "sum",
        split: "test",
        batch_size: 8,
        strict: false,
      });
      await until(async () => isFinished((await runner.get(submitted.id)).status), "the job done", 300_000);
      const job = runner.get(submitted.id);
      assert.equal(job.status, "succeeded", job.error ?? "");
      const r = job.metrics.evaluation!;
      assert.equal(r.task, "multiple_choice");
      assert.equal(r.examples, examples.length);
      assert.equal(r.endings, examples.reduce((a, e) => a + e.endings.length, 0));
      assert.ok(r.accuracy! >= 0 && r.accuracy! <= 1 && r.correct === Math.round(r.accuracy! * r.examples!));
      assert.ok(r.accuracy_norm! >= 0 && r.accuracy_norm! <= 1);
      assert.ok(r.seq_len <= 64 && r.seq_len % 32 === 0, `window ${r.seq_len}`);
      assert.ok(r.endings_per_s! > 0);
    }),
});

Deno.test({
  name: "deno task eval --task multiple_choice reads JSONL examples and names a bad one's field",
  ignore: noGpu,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: async () => {
    const root = await Deno.makeTempDir({ prefix: "gpt2_choice_cli_" });
    try {
      await writeHfFolder(root, "hf_cli", initParams(tiny, 3));
      const cli = async (...args: string[]) => {
        const out = await new Deno.Command(Deno.execPath(), {
          args: ["run", "-A", "scripts/eval.ts", "--home", root, "--model", "hf_cli", ...args],
          cwd: new URL("../..", import.meta.url).pathname,
          stdout: "piped",
          stderr: "piped",
        }).output();
        const d = new TextDecoder();
        return { code: out.code, out: d.decode(out.stdout), err: d.decode(out.stderr) };
      };
      const bad = `${root}/bad.jsonl`;
      await Deno.writeTextFile(
        bad,
        '{"context": "a", "endings": ["b", "c"], "label": 0}\n' +
          '{"context": "a", "endings": ["b", "c"], "label": 2}\n',
      );
      const label = await cli("--task", "multiple_choice", "--jsonl", bad);
      assert.equal(label.code, 2);
      assert.match(label.err, /Invalid "examples\.1\.label": Cannot evaluate example 1: label 2/);
      const file = await cli("--task", "multiple_choice", "--examples-file", "nope");
      assert.equal(file.code, 2);
      assert.match(file.err, /Invalid "examples_file": Unknown task file "nope"/);
      const ok = await cli("--task", "multiple_choice", "--jsonl", EXAMPLE_FILE, "--json");
      assert.equal(ok.code, 0, ok.err);
      const r = JSON.parse(ok.out);
      assert.equal(r.task, "multiple_choice");
      assert.equal(r.examples, 20);
      assert.equal(r.scoring, "sum");
    } finally {
      await Deno.remove(root, { recursive: true });
    }
  },
});
