/**
 * Evaluation (issue 28): the sliding-window definition and its normalisations on the CPU; on the
 * GPU (lavapipe on CI), stride == seq_len equals the training loop's non-overlapping evaluation,
 * stride < seq_len matches a float64 CPU reference of the definition (each token scored once with
 * the context its window gives it), and cloze accuracy on hand-built token cases whose greedy
 * answers are known, a last word of several tokens included. GPU tests skip without an adapter.
 */

import assert from "node:assert/strict";
import { EOT_TOKEN, presetConfig } from "../../model/config.ts";
import {
  clozeExample,
  countBytes,
  countWords,
  perplexityFigures,
  slidingWindows,
} from "../../model/perplexity.ts";
import { evalBatches } from "../../data/mod.ts";
import { clozeTokens, EvalModel, perplexity, textStream, tokenize } from "../../worker/evaluation.ts";
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

Deno.test("slidingWindows() scores every token after the first exactly once, with the longest context", () => {
  for (const [n, T, stride] of [[2, 8, 8], [40, 8, 3], [41, 8, 8], [17, 8, 1], [9, 8, 5], [100, 16, 7]]) {
    const windows = slidingWindows(n, T, stride);
    const seen = new Array(n).fill(0);
    for (const [w, { start, first, end }] of windows.entries()) {
      assert.equal(start, w * stride);
      assert.ok(first >= 0 && first < end && end <= T);
      for (let k = first; k < end; k++) {
        const j = start + k + 1; // the stream token target k is
        seen[j]++;
        // Context of token j: from its window's start; the longest a window of stride `stride` allows.
        const want = j <= T ? 0 : Math.ceil((j - T) / stride) * stride;
        assert.equal(start, want, `token ${j} of n=${n} T=${T} stride=${stride}`);
      }
    }
    assert.deepEqual(seen, [0, ...new Array(n - 1).fill(1)], `n=${n} T=${T} stride=${stride}`);
  }
  // stride == seq_len: the non-overlapping windows of the training loop's evaluation.
  assert.deepEqual(slidingWindows(25, 8, 8), [
    { start: 0, first: 0, end: 8 },
    { start: 8, first: 0, end: 8 },
    { start: 16, first: 0, end: 8 },
  ]);
  assert.throws(() => slidingWindows(10, 8, 9), /stride must be an integer in \[1, seq_len 8\]/);
  assert.throws(() => slidingWindows(1, 8, 8), /nothing to score/);
});

Deno.test("perplexityFigures() normalises per token, per word (Megatron) and per byte (lm-evaluation-harness)", () => {
  const text = "héllo wörld, a  b";
  assert.equal(countWords(text), 5); // Python's text.strip().split(" "): the double space makes an empty word
  assert.equal(countBytes(text), 19); // é and ö take two bytes each
  const f = perplexityFigures({ nll: 10, tokens: 8, streamTokens: 9, words: 5, bytes: 19 });
  assert.equal(f.loss, 1.25);
  assert.equal(f.perplexity, Math.exp(1.25));
  assert.equal(f.token_ratio, 2); // (9 − 1) / (5 − 1)
  assert.equal(f.word_perplexity, Math.exp(2.5));
  assert.equal(f.byte_perplexity, Math.exp(10 / 19));
  assert.equal(f.bits_per_byte, 10 / 19 / Math.LN2);
  const s = textStream(["One two", "three"]);
  assert.deepEqual([s.words, s.bytes], [3, 12]);
  assert.deepEqual(Array.from(s.tokens), [...tokenize("One two"), EOT_TOKEN, ...tokenize("three")]);
});

Deno.test("clozeExample() splits a LAMBADA line as Megatron does, strict and not", () => {
  const line = "he looked at the tiny marmoset";
  const strict = clozeExample(line, true, tokenize);
  assert.deepEqual(strict.context, tokenize("he looked at the tiny"));
  assert.deepEqual(strict.target, tokenize(" marmoset"));
  assert.ok(strict.target.length > 1, "a last word of several tokens");
  const loose = clozeExample(line, false, tokenize);
  const all = tokenize(line);
  assert.deepEqual(loose, { context: all.slice(0, -1), target: all.slice(-1) });
  assert.throws(() => clozeExample("  lonely ", true, tokenize), /has one word/);
});

const gpuTest = (name: string, fn: () => Promise<void>) =>
  Deno.test({ name, ignore: noGpu, sanitizeResources: false, sanitizeOps: false, fn });

/** A deterministic pseudo-random token stream. */
function stream(n: number, seed: number): Uint32Array {
  const out = new Uint32Array(n);
  let x = seed >>> 0;
  for (let i = 0; i < n; i++) {
    x = (Math.imul(x, 1664525) + 1013904223) >>> 0;
    out[i] = x % 5000;
  }
  return out;
}

gpuTest(
  "perplexity() with stride == seq_len equals the training loop's non-overlapping evaluation",
  async () => {
    const ctx = (await testContext())!;
    const B = 2, T = 16;
    const model = await EvalModel.create(ctx, tiny, initParams(tiny, 7), B, T);
    try {
      const tokens = stream(4 * T + 1, 1); // four whole windows, two batches
      const r = await perplexity(model, { tokens, words: 10, bytes: 100 }, T);
      const e = evalBatches(Uint16Array.from(tokens), B, T, 100);
      const today = await model.trainer.evalLoss(e.batches);
      assert.equal(r.tokens, e.tokens);
      assert.equal(r.windows, 4);
      assert.ok(Math.abs(r.loss - today) / today < 1e-5, `${r.loss} vs ${today}`);
    } finally {
      model.destroy();
    }
  },
);

gpuTest(
  "perplexity() with stride < seq_len matches a float64 CPU reference of the sliding windows",
  async () => {
    const ctx = (await testContext())!;
    const B = 3, T = 8, stride = 3, n = 31;
    const params = initParams(tiny, 11);
    const model = await EvalModel.create(ctx, tiny, params, B, T);
    const tokens = stream(n, 5);
    let r;
    try {
      r = await perplexity(model, { tokens, words: 7, bytes: 50 }, stride);
    } finally {
      model.destroy();
    }
    // The definition, token by token: target j is predicted from tokens [c(j), j), c(j) the start of
    // the latest window whose last target is at or past j. Tokens sharing a context start share a forward.
    const p64 = Float64Array.from(params), V = tiny.vocab_size, Vp = tiny.padded_vocab_size;
    let nll = 0;
    const byStart = new Map<number, number[]>();
    for (let j = 1; j < n; j++) {
      const c = j <= T ? 0 : Math.ceil((j - T) / stride) * stride;
      byStart.set(c, [...(byStart.get(c) ?? []), j]);
    }
    for (const [c, js] of byStart) {
      const last = Math.max(...js), len = last - c; // inputs c … last−1
      const window = Int32Array.from(tokens.subarray(c, last + 1));
      const { logits } = referenceForward(tiny, p64, window, 1, len);
      for (const j of js) {
        const row = logits.subarray((j - 1 - c) * Vp, (j - 1 - c) * Vp + V);
        let max = -Infinity, sum = 0;
        for (const x of row) max = Math.max(max, x);
        for (const x of row) sum += Math.exp(x - max);
        nll += Math.log(sum) + max - row[tokens[j]];
      }
    }
    assert.equal(r.tokens, n - 1);
    const want = nll / (n - 1);
    assert.ok(Math.abs(r.loss - want) / want < 1e-5, `GPU ${r.loss} vs CPU ${want}`);
    assert.ok(Math.abs(r.word_perplexity! - Math.exp(nll / 6)) / Math.exp(nll / 6) < 1e-4);
    assert.ok(Math.abs(r.bits_per_byte! - nll / 50 / Math.LN2) < 1e-5);
  },
);

gpuTest("cloze() is right exactly when the greedy continuation is the whole last word", async () => {
  const ctx = (await testContext())!;
  const B = 2, T = 12;
  const params = initParams(tiny, 21), p64 = Float64Array.from(params);
  const V = tiny.vocab_size, Vp = tiny.padded_vocab_size;
  /** The CPU's greedy next token after `ids`, and its margin over the runner-up. */
  const greedy = (ids: number[]) => {
    const { logits } = referenceForward(tiny, p64, Int32Array.from([...ids, 0]), 1, ids.length);
    const row = logits.subarray((ids.length - 1) * Vp, (ids.length - 1) * Vp + V);
    let a = 0, b = 1;
    if (row[b] > row[a]) [a, b] = [b, a];
    for (let v = 2; v < V; v++) {
      if (row[v] > row[a]) [a, b] = [v, a];
      else if (row[v] > row[b]) b = v;
    }
    return { id: a, margin: row[a] - row[b] };
  };
  // Contexts whose greedy continuations are clear (a margin far above float32 rounding).
  const cases: { context: number[]; target: number[]; right: boolean }[] = [];
  for (let seed = 1; cases.length < 6 && seed < 200; seed++) {
    const context = Array.from(stream(5 + (seed % 4), seed));
    const g1 = greedy(context);
    const g2 = greedy([...context, g1.id]);
    if (g1.margin < 1e-3 || g2.margin < 1e-3) continue;
    const k = cases.length;
    if (k === 0) cases.push({ context, target: [g1.id], right: true });
    else if (k === 1) cases.push({ context, target: [g1.id, g2.id], right: true }); // two tokens
    else if (k === 2) cases.push({ context, target: [g1.id, (g2.id + 1) % V], right: false }); // second wrong
    else if (k === 3) cases.push({ context, target: [(g1.id + 1) % V, g2.id], right: false }); // first wrong
    else if (k === 4) cases.push({ context, target: [(g1.id + 7) % V], right: false });
    else cases.push({ context, target: [g1.id, g2.id], right: true });
  }
  assert.equal(cases.length, 6);
  const model = await EvalModel.create(ctx, tiny, params, B, T);
  try {
    const r = await clozeTokens(model, cases);
    assert.equal(r.examples, 6);
    assert.equal(r.correct, 3);
    assert.equal(r.accuracy, 0.5);
    assert.equal(r.tokens, cases.reduce((a, c) => a + c.target.length, 0));
  } finally {
    model.destroy();
  }
});

/** A runner with a scripted Worker and the app over it; `models/hf_eval` is a gpt2-tiny folder. */
async function routeSetup() {
  const root = await Deno.makeTempDir({ prefix: "gpt2_eval_routes_" });
  await writeHfFolder(root, "hf_eval", initParams(tiny, 3));
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
      body: JSON.stringify(body),
      headers: { "Content-Type": "application/json" },
    });
  const cleanup = async () => {
    runner.shutdown();
    store.close();
    await Deno.remove(root, { recursive: true });
  };
  return { app, runner, workers, post, root, cleanup };
}

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

Deno.test("POST /evaluate: bad input is a 400 naming the field", async () => {
  const t = await routeSetup();
  try {
    await apiError(await t.post({ model: "hf_eval", texts: ["fine", "  "] }), 400, {
      param: "texts.1",
      message: /Cannot evaluate an empty text/,
    });
    await apiError(await t.post({ model: "hf_eval", texts: ["Hello"] }), 400, {
      param: "texts.0",
      message: /it is one token, and scoring needs two/,
    });
    await apiError(await t.post({ model: "hf_eval", texts: ["a b c"], seq_len: 8, stride: 9 }), 400, {
      param: "stride",
      message: /stride 9 larger than seq_len 8/,
    });
    // seq_len from the model (64): a stride past it is refused once the model is known.
    await apiError(await t.post({ model: "hf_eval", texts: ["a b c"], stride: 65 }), 400, {
      param: "stride",
    });
    await apiError(await t.post({ model: "hf_eval", texts: ["a b c"], seq_len: 65 }), 400, {
      param: "seq_len",
    });
    await apiError(await t.post({ model: "hf_eval", task: "cloze", texts: ["two words", "single"] }), 400, {
      param: "texts.1",
      message: /Cannot evaluate cloze line 1: "single" has one word/,
    });
    await apiError(await t.post({ model: "no_such_model", texts: ["a b"] }), 400, {
      param: "model",
      message: /Unknown model "no_such_model" in model/,
    });
    await apiError(await t.post({ model: "hf_eval", dataset: "nope" }), 400, { param: "dataset" });
    await apiError(await t.post({ model: "hf_eval" }), 400, { param: "texts" });
    await apiError(await t.post({ model: "hf_eval", task: "cloze", dataset: "sotu" }), 400, {
      param: "dataset",
    });
  } finally {
    await t.cleanup();
  }
});

Deno.test("POST /evaluate queues an evaluation job with the model resolved; its result is stored and streamed", async () => {
  const t = await routeSetup();
  try {
    const res = await t.post({ model: "hf_eval", texts: ["The quick brown fox"], seq_len: 16, stride: 8 });
    assert.equal(res.status, 202, await res.clone().text());
    const body = await res.json();
    assert.match(body.id, /^eval_[0-9a-f]{12}$/);
    assert.equal(res.headers.get("Location"), `/jobs/${body.id}`);
    await until(() => t.workers[0]?.jobs.length === 1, "the job on the worker");
    const handed = t.workers[0].jobs[0];
    assert.deepEqual(handed.config.evaluate, {
      task: "perplexity",
      model: "hf_eval",
      texts: ["The quick brown fox"],
      stride: 8,
      strict: false,
    });
    assert.equal(handed.config.seq_len, 16);
    assert.equal(handed.init_source?.id, "hf_eval");
    const result = {
      task: "perplexity" as const,
      model: "hf_eval",
      loss: 2,
      perplexity: Math.exp(2),
      tokens: 3,
      seq_len: 16,
      tokens_per_s: 10,
      elapsed_s: 0.3,
    };
    t.workers[0].send({ type: "evaluation", id: body.id, done: 1, total: 1, tokens: 3, tokens_per_s: 10 });
    t.workers[0].send({
      type: "evaluation",
      id: body.id,
      done: 1,
      total: 1,
      tokens: 3,
      tokens_per_s: 10,
      result,
    });
    t.workers[0].send({ type: "done", id: body.id, status: "succeeded", iteration: 0, error: null });
    await until(() => t.runner.get(body.id).status === "succeeded", "the job done");
    const job = await (await t.app.request(`/jobs/${body.id}`)).json();
    assert.deepEqual(job.metrics.evaluation, result);
    const events = await t.runner.store.eventsAfter(body.id, 0);
    assert.ok(events.some((e) => e.type === "progress" && e.data.kind === "evaluate" && e.data.done === 1));
    assert.ok(events.some((e) => e.type === "evaluation" && e.data.perplexity === Math.exp(2)));
  } finally {
    await t.cleanup();
  }
});

/** Submits an evaluation and waits for its end. */
async function evaluation(runner: JobRunner, req: Parameters<JobRunner["submitEvaluation"]>[0]) {
  const submitted = await runner.submitEvaluation(req);
  await until(
    async () => isFinished((await runner.get(submitted.id)).status),
    "the evaluation done",
    300_000,
  );
  return await runner.get(submitted.id);
}

Deno.test({
  name: "evaluation jobs run on a GPU Worker: perplexity of texts and of a dataset split, cloze of lines",
  ignore: noGpu,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: () =>
    withWorkerRunner("gpt2_eval_jobs_", 1, async (runner, root) => {
      await writeHfFolder(root, "hf_eval", initParams(tiny, 3));
      const common = { model: "hf_eval", split: "test" as const, batch_size: 4, strict: false, seq_len: 16 };
      const text = "It was the best of times, it was the worst of times, it was the age of wisdom.";
      const a = await evaluation(runner, { ...common, task: "perplexity", texts: [text], stride: 8 });
      assert.equal(a.status, "succeeded", a.error ?? "");
      const r = a.metrics.evaluation!;
      assert.equal(r.tokens, tokenize(text).length - 1);
      assert.equal(r.words, 18);
      assert.equal(r.bytes, text.length);
      assert.ok(r.loss > 5 && r.loss < 20 && Math.abs(r.perplexity - Math.exp(r.loss)) < 1e-6 * r.perplexity);

      const b = await evaluation(runner, { ...common, task: "perplexity", dataset: "sotu", max_tokens: 100 });
      assert.equal(b.status, "succeeded", b.error ?? "");
      assert.equal(b.metrics.evaluation!.tokens, 100);
      assert.ok(b.metrics.evaluation!.bytes! > 100);

      const lines = ["the cat sat on the mat", "once upon a time there was a princess"];
      const c = await evaluation(runner, { ...common, task: "cloze", texts: lines, strict: true });
      assert.equal(c.status, "succeeded", c.error ?? "");
      assert.equal(c.metrics.evaluation!.examples, 2);
      assert.equal(c.metrics.evaluation!.tokens, tokenize(" mat").length + tokenize(" princess").length);
    }),
});

Deno.test("deno task eval names the field of a bad option, as POST /evaluate does (exit 2)", async () => {
  const root = await Deno.makeTempDir({ prefix: "gpt2_eval_cli_" });
  try {
    await writeHfFolder(root, "hf_cli", initParams(tiny, 3));
    const cli = async (...args: string[]) => {
      const out = await new Deno.Command(Deno.execPath(), {
        args: ["run", "-A", "scripts/eval.ts", "--home", root, ...args],
        cwd: new URL("../..", import.meta.url).pathname,
        stdout: "piped",
        stderr: "piped",
      }).output();
      return { code: out.code, err: new TextDecoder().decode(out.stderr) };
    };
    const stride = await cli("--model", "hf_cli", "--text", "a b c", "--seq-len", "8", "--stride", "9");
    assert.equal(stride.code, 2);
    assert.match(stride.err, /Invalid "stride": Cannot evaluate with stride 9 larger than seq_len 8/);
    const model = await cli("--model", "nope", "--text", "a b c");
    assert.equal(model.code, 2);
    assert.match(model.err, /Invalid "model": unknown model "nope"/);
    const cloze = await cli("--model", "hf_cli", "--task", "cloze", "--text", "lonely");
    assert.equal(cloze.code, 2);
    assert.match(cloze.err, /Invalid "texts\.0": Cannot evaluate cloze line 0/);
    const long = await cli("--model", "hf_cli", "--text", "a b c", "--seq-len", "65");
    assert.equal(long.code, 2);
    assert.match(long.err, /Invalid "seq_len"/);
  } finally {
    await Deno.remove(root, { recursive: true });
  }
});
