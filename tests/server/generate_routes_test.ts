/**
 * Generation routes through `app.request()` with a scripted GPU Worker (no GPU): the SSE and
 * OpenAI stream formats byte for byte, a multi-byte character split across tokens, stop
 * sequences, end-of-text, bad input (404, 400 naming the parameters), prompt truncation, the
 * empty prompt, disconnects reaching the Worker as a cancel, and the model list.
 */

import { deepStrictEqual as assertEquals, match as assertMatch, ok as assert } from "node:assert/strict";
import { encode } from "gpt-tokenizer/encoding/r50k_base";
import { type FromWorker } from "../../protocol.ts";
import { GenerationManager, type GenerationManagerOptions, TextStream } from "../../server/generate/mod.ts";
import { JobRunner, JobStore } from "../../server/jobs/mod.ts";
import { ScriptedWorker } from "../fakes/fake_worker.ts";
import { Hono } from "hono";
import { createApp } from "../../server/routes/mod.ts";
import { warmUp } from "../../server/rehearsal.ts";
import { onError } from "../../server/routes/api_errors.ts";
import { generateRoutes } from "../../server/routes/generate.ts";
import { until } from "../_wait.ts";
import { epochMs } from "../../protocol.ts";
import { modelSourceStamp } from "../../checkpoint/model_source.ts";

const assertAlmostEquals = (a: number, b: number, tol: number) =>
  assert(Math.abs(a - b) <= tol, `${a} is not within ${tol} of ${b}`);

const tinyDims = { n_layer: 2, n_head: 4, n_embd: 64, n_positions: 64 };

async function setup(opts: GenerationManagerOptions = {}) {
  const root = await Deno.makeTempDir({ prefix: "gpt2_genroutes_" });
  // A Hugging Face directory (the scripted worker never reads the weights) and a checkpoint manifest.
  await Deno.mkdir(`${root}/models/tiny`, { recursive: true });
  await Deno.writeTextFile(
    `${root}/models/tiny/config.json`,
    JSON.stringify({ ...tinyDims, vocab_size: 50257 }),
  );
  await Deno.writeFile(`${root}/models/tiny/model.safetensors`, new Uint8Array(8));
  const ck = `${root}/checkpoints/job_0123456789ab/iter_0000005`;
  await Deno.mkdir(ck, { recursive: true });
  await Deno.writeTextFile(
    `${ck}/manifest.json`,
    JSON.stringify({
      format: "gpt2-webgpu-checkpoint",
      version: 1,
      job_id: "job_0123456789ab",
      name: "iter_0000005",
      iteration: 5,
      created_at: "2025-01-01T00:00:00.000Z",
      model: { ...tinyDims, vocab_size: 50257, padded_vocab_size: 50304 },
      metrics: { loss: 1, val_loss: null },
    }),
  );
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
    datasetExists: () => Promise.resolve(true),
  });
  const manager = new GenerationManager(runner.pool, root, opts);
  runner.start();
  await new Promise((r) => setTimeout(r, 0));
  const app = createApp({ runner, generation: manager, token: null });
  const worker = workers[0];
  /** Waits for the n-th generation request and plays `msgs` back (ids filled in). */
  const answer = async (n: number, msgs: Record<string, unknown>[]) => {
    await until(() => worker.generations.length >= n, "the generation request");
    const id = worker.generations[n - 1].id;
    for (const m of msgs) worker.send({ id, ...m } as FromWorker);
    return worker.generations[n - 1];
  };
  const cleanup = async () => {
    runner.shutdown();
    store.close();
    await Deno.remove(root, { recursive: true });
  };
  return { app, worker, manager, runner, answer, cleanup, root };
}

const done = (reason: string, n: number) => ({ type: "gen_done", reason, error: null, completion_tokens: n });

/** Splits an SSE body into events, dropping the variable timings of done events. */
function sse(body: string) {
  return body.split("\n\n").filter((b) => b).map((b) => {
    const event = b.match(/^event: (.*)$/m)?.[1] ?? null;
    const data = b.match(/^data: (.*)$/m)![1];
    return { event, data: data === "[DONE]" ? data : JSON.parse(data) };
  });
}

Deno.test("GET /generate streams one token event per token, then done with finish_reason, counts and timings; /metrics counts it", async () => {
  const t = await setup();
  try {
    const q = "model=tiny&prompt=Hello&max_tokens=5&temperature=0.7&top_k=40&top_p=0.9&seed=3";
    const resP = t.app.request(`/generate?${q}`);
    const world = encode(" world!"); // [995, 0]
    const req = await t.answer(1, [
      { type: "gen_started", load_ms: 12 },
      { type: "gen_tokens", tokens: world },
      done("eos", 2),
    ]);
    assertEquals(req.prompt, encode("Hello"));
    assertEquals([req.max_tokens, req.temperature, req.top_k, req.top_p, req.seed, req.stop_at_eos], [
      5,
      0.7,
      40,
      0.9,
      3,
      true,
    ]);
    const res = await resP;
    assertEquals(res.status, 200);
    assertEquals(res.headers.get("Content-Type"), "text/event-stream");
    const body = await res.text();
    assert(
      body.startsWith(
        `event: token\ndata: {"id":995,"text":" world"}\n\nevent: token\ndata: {"id":0,"text":"!"}\n\nevent: done\ndata: {"finish_reason":"eos",`,
      ),
      body,
    );
    const final = sse(body).at(-1)!.data;
    assertEquals(final.model, "tiny");
    assertEquals([final.prompt_tokens, final.completion_tokens, final.truncated_tokens, final.seed], [
      1,
      2,
      0,
      3,
    ]);
    assertEquals(final.timings.load_ms, 12);
    assert(final.timings.ttft_ms >= 0 && final.timings.tokens_per_s > 0 && final.timings.total_ms > 0);
    const prom = await (await t.app.request("/metrics")).text();
    assert(prom.includes("gpt2_generation_requests_total 1\n"), prom);
    assert(prom.includes('gpt2_generation_finished_total{reason="eos"} 1\n'), prom);
    assert(prom.includes("gpt2_generation_tokens_total 2\n"), prom);
    assert(
      prom.includes("# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total 2\n"),
      prom,
    );
    assert(prom.includes("vllm:prompt_tokens_total 1\n"), prom);
    assert(prom.includes('vllm:request_success_total{finished_reason="eos"} 1\n'), prom);
    assert(prom.includes("vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n".split("\n")[0]), prom);
    assert(prom.includes('vllm:time_to_first_token_seconds_bucket{le="+Inf"} 1\n'), prom);
    assert(prom.includes("vllm:time_to_first_token_seconds_count 1\n"), prom);
  } finally {
    await t.cleanup();
  }
});

Deno.test("GET /generate emits a multi-byte character split across tokens whole", async () => {
  const t = await setup();
  try {
    const resP = t.app.request("/generate?model=tiny&prompt=Hi");
    const tokens = encode(" 😀 日"); // the emoji and 日 each span two tokens
    await t.answer(1, [{ type: "gen_tokens", tokens }, done("length", tokens.length)]);
    const events = sse(await (await resP).text());
    const texts = events.filter((e) => e.event === "token").map((e) => e.data.text);
    assertEquals(texts.join(""), " 😀 日");
    assert(texts.every((s) => !s.includes("\uFFFD")), JSON.stringify(texts));
    assertEquals(texts.length, tokens.length);
  } finally {
    await t.cleanup();
  }
});

Deno.test("TextStream keeps one decoder per stream: a partial character in one never leaks into another", () => {
  const [a0, a1] = encode(" 😀"); // " \xf0\x9f\x98", "\x80"
  const a = new TextStream(), b = new TextStream();
  assertEquals(a.push(a0).text, " ");
  assertEquals(b.push(encode("x")[0]).text, "x");
  assertEquals(a.push(a1).text, "😀");
  const c = new TextStream();
  c.push(a0);
  assertEquals(c.finish().text, "\uFFFD");
});

Deno.test("TextStream holds back a possible stop sequence and cuts the text before it", () => {
  const s = new TextStream(["\n\n", "END"]);
  const out = encode("one\ntwo EN").map((id) => s.push(id).text);
  assertEquals(out.join(""), "one\ntwo ");
  assertEquals(s.push(encode("D")[0]), { text: "", stopped: true });
  assertEquals(s.text, "one\ntwo ");
});

Deno.test("a stop sequence ends the generation with finish_reason stop and cancels the worker", async () => {
  const t = await setup();
  try {
    const resP = t.app.request("/generate?model=tiny&prompt=Q&stop=%0A&stop=zzz&ignore_eos=true");
    const req = await t.answer(1, [{ type: "gen_tokens", tokens: encode(" yes\nno more") }]);
    assertEquals(req.stop_at_eos, false);
    const events = sse(await (await resP).text());
    assertEquals(events.filter((e) => e.event === "token").map((e) => e.data.text).join(""), " yes");
    assertEquals(events.at(-1)!.data.finish_reason, "stop");
    await until(() => t.worker.generationCancels.includes(req.id), "the cancel");
    t.worker.send({ id: req.id, ...done("cancelled", 4) } as FromWorker);
    await until(() => t.manager.active === 0, "the worker's confirmation");
  } finally {
    await t.cleanup();
  }
});

Deno.test("POST /v1/completions streams OpenAI chunks then data: [DONE]", async () => {
  const t = await setup();
  try {
    const resP = t.app.request("/v1/completions", {
      method: "POST",
      body: JSON.stringify({ model: "job_0123456789ab", prompt: "Hi", max_tokens: 3, stream: true, seed: 1 }),
      headers: { "Content-Type": "application/json" },
    });
    const req = await t.answer(1, [{ type: "gen_tokens", tokens: encode(" there") }, done("eos", 1)]);
    assertEquals(req.model.id, "job_0123456789ab/iter_0000005");
    assertEquals([req.temperature, req.top_k, req.top_p], [1, 0, 1]); // OpenAI's defaults
    const res = await resP;
    assertEquals(res.headers.get("Content-Type"), "text/event-stream");
    const body = await res.text();
    assert(body.endsWith("\n\ndata: [DONE]\n\n"), body);
    const chunks = sse(body);
    assertEquals(chunks.length, 3);
    const [first, last] = [chunks[0].data, chunks[1].data];
    assertMatch(first.id, /^cmpl-[0-9a-f]{12}$/);
    assertEquals(first.object, "text_completion");
    assertEquals(first.model, "job_0123456789ab/iter_0000005");
    assertEquals(first.choices, [{ text: " there", index: 0, logprobs: null, finish_reason: null }]);
    assertEquals(last.choices, [{ text: "", index: 0, logprobs: null, finish_reason: "stop" }]);
    assertEquals(last.usage, undefined); // only with stream_options.include_usage
    assertEquals(chunks.map((c) => c.event), [null, null, null]);
  } finally {
    await t.cleanup();
  }
});

Deno.test("POST /v1/completions without stream answers one OpenAI completion", async () => {
  const t = await setup();
  try {
    const resP = t.app.request("/v1/completions", {
      method: "POST",
      body: JSON.stringify({ model: "tiny", prompt: ["Hi"], max_tokens: 2, temperature: 0 }),
      headers: { "Content-Type": "application/json" },
    });
    await t.answer(1, [{ type: "gen_tokens", tokens: encode(" there you") }, done("length", 2)]);
    const res = await resP;
    assertEquals(res.status, 200);
    const body = await res.json();
    assertEquals(body.object, "text_completion");
    assertEquals(body.choices, [{ text: " there you", index: 0, logprobs: null, finish_reason: "length" }]);
    assertEquals(body.usage, { prompt_tokens: 1, completion_tokens: 2, total_tokens: 3 });
  } finally {
    await t.cleanup();
  }
});

Deno.test("unknown models are 404 and out-of-range parameters are 400 naming them", async () => {
  const t = await setup();
  try {
    const missing = await t.app.request("/generate?model=nope&prompt=x");
    assertEquals(missing.status, 404);
    const m = (await missing.json()).error;
    assertMatch(m.message, /^Model "nope" not found/);
    assertEquals([m.type, m.param, m.code], ["invalid_request_error", "model", "model_not_found"]);
    assertEquals((await t.app.request("/generate?model=job_0123456789ab/iter_0000009")).status, 404);
    const bad = await t.app.request("/generate?model=tiny&temperature=-1&top_p=1.5&top_k=2.5&max_tokens=0");
    assertEquals(bad.status, 400);
    const err = (await bad.json()).error;
    assertEquals(
      err.message,
      "Invalid parameters: max_tokens (Too small: expected number to be >=1), temperature (Too small: expected number to be >=0), " +
        "top_k (expected a whole number), top_p (Too big: expected number to be <=1)",
    );
    assertEquals(err.param, "max_tokens");
    const long = await t.app.request("/generate?model=tiny&max_tokens=64");
    assertEquals(long.status, 400);
    assertEquals((await long.json()).error.param, "max_tokens");
    const unknown = await t.app.request("/generate?model=tiny&temprature=1");
    assertEquals((await unknown.json()).error.message, "Invalid parameters: temprature (unknown parameter)");
    const post = (body: unknown) =>
      t.app.request("/v1/completions", {
        method: "POST",
        body: JSON.stringify(body),
        headers: { "Content-Type": "application/json" },
      });
    const oa = await post({ model: "tiny", n: 9, top_p: 0 });
    assertEquals(oa.status, 400);
    assertEquals(
      (await oa.json()).error.message,
      "Invalid parameters: top_p (Too small: expected number to be >0), n (Too big: expected number to be <=8)",
    );
    // Unknown fields are refused, byte for byte in OpenAI's error shape.
    const extra = await post({ model: "tiny", prompt: "x", frobnicate: true });
    assertEquals(extra.status, 400);
    assertEquals(
      await extra.text(),
      '{"error":{"message":"Invalid parameters: frobnicate (unknown parameter)","type":"invalid_request_error","param":"frobnicate","code":null}}',
    );
    const penalty = await post({ model: "tiny", presence_penalty: 0.5 });
    assertEquals((await penalty.json()).error.param, "presence_penalty");
    assertEquals((await post({ model: "tiny", prompt: [50257] })).status, 400);
    assertEquals(t.worker.generations.length, 0);
  } finally {
    await t.cleanup();
  }
});

Deno.test("a prompt longer than the context is cut from the left and the response says so", async () => {
  const t = await setup();
  try {
    const prompt = Array.from({ length: 100 }, (_, i) => `w${i}`).join(" ");
    const resP = t.app.request(`/generate?model=tiny&max_tokens=16&prompt=${encodeURIComponent(prompt)}`);
    const req = await t.answer(1, [done("length", 0)]);
    const all = encode(prompt);
    assertEquals(req.prompt, all.slice(all.length - 48)); // context 64 - 16 new tokens
    const res = await resP;
    assertEquals(res.headers.get("X-Prompt-Truncated"), String(all.length - 48));
    const final = sse(await res.text()).at(-1)!.data;
    assertEquals([final.prompt_tokens, final.truncated_tokens], [48, all.length - 48]);
  } finally {
    await t.cleanup();
  }
});

Deno.test("an empty prompt starts from <|endoftext|>", async () => {
  const t = await setup();
  try {
    const resP = t.app.request("/generate?model=tiny");
    const req = await t.answer(1, [done("length", 0)]);
    assertEquals(req.prompt, [50256]);
    assertEquals(req.max_tokens, 32); // default: min(64, context / 2)
    await (await resP).text();
  } finally {
    await t.cleanup();
  }
});

Deno.test("a client that disconnects cancels its generation on the worker", async () => {
  const t = await setup();
  try {
    const resP = t.app.request("/generate?model=tiny&prompt=Hi&max_tokens=30");
    const req = await t.answer(1, [{ type: "gen_tokens", tokens: encode(" a b") }]);
    const reader = (await resP).body!.getReader();
    assertMatch(new TextDecoder().decode((await reader.read()).value), /^event: token\n/);
    await reader.cancel();
    await until(() => t.worker.generationCancels.includes(req.id), "the cancel on the worker");
    assertEquals(t.manager.active, 1); // until the worker confirms
    t.worker.send({ id: req.id, ...done("cancelled", 2) } as FromWorker);
    assertEquals(t.manager.active, 0);
    assertEquals(t.manager.stats.finished.cancelled, 1);
  } finally {
    await t.cleanup();
  }
});

Deno.test("GET /v1/models lists each job's newest checkpoint, every checkpoint and HF directories", async () => {
  const t = await setup();
  try {
    const res = await t.app.request("/v1/models");
    assertEquals(res.status, 200);
    const body = await res.json();
    assertEquals(body.object, "list");
    assertEquals(body.data.map((m: { id: string; kind: string }) => [m.id, m.kind]), [
      ["job_0123456789ab", "checkpoint"],
      ["job_0123456789ab/iter_0000005", "checkpoint"],
      ["tiny", "safetensors"],
    ]);
    assertEquals(body.data[0].object, "model");
    assertEquals(body.data[0].n_positions, 64);
  } finally {
    await t.cleanup();
  }
});

const postJson = (
  app: { request: (p: string, i: RequestInit) => Response | Promise<Response> },
  path: string,
  body: unknown,
) =>
  app.request(path, {
    method: "POST",
    body: JSON.stringify(body),
    headers: { "Content-Type": "application/json" },
  });

Deno.test("POST /v1/completions with stream_options.include_usage ends with a usage chunk of empty choices", async () => {
  const t = await setup();
  try {
    const resP = postJson(t.app, "/v1/completions", {
      model: "tiny",
      prompt: "Hi",
      max_tokens: 2,
      stream: true,
      stream_options: { include_usage: true },
    });
    await t.answer(1, [{ type: "gen_tokens", tokens: encode(" there you") }, done("length", 2)]);
    const body = await (await resP).text();
    const chunks = sse(body);
    assertEquals(chunks.length, 5); // two tokens, the finish, usage, [DONE]
    assertEquals(chunks[0].data.usage, null);
    assertEquals(chunks[2].data.choices[0].finish_reason, "length");
    assertEquals(chunks[3].data.choices, []);
    assertEquals(chunks[3].data.usage, { prompt_tokens: 1, completion_tokens: 2, total_tokens: 3 });
    assertEquals(chunks[4].data, "[DONE]");
  } finally {
    await t.cleanup();
  }
});

Deno.test("POST /v1/completions: n choices as seeded streams, token-array prompts, echo, logprobs", async () => {
  const t = await setup();
  try {
    const resP = postJson(t.app, "/v1/completions", {
      model: "tiny",
      prompt: [15496, 11],
      max_tokens: 1,
      n: 2,
      seed: 41,
      echo: true,
      logprobs: 1,
    });
    await until(() => t.worker.generations.length === 2, "both choices");
    const [a, b] = t.worker.generations;
    assertEquals([a.prompt, b.prompt], [[15496, 11], [15496, 11]]);
    assertEquals([a.seed, b.seed, a.logprobs, b.logprobs], [41, 42, 1, 1]);
    const lp = (x: number) => ({ logprob: x, top: [[995, -0.5]] as [number, number][] });
    t.worker.send({ type: "gen_tokens", id: b.id, tokens: [995], logprobs: [lp(-0.5)] });
    t.worker.send({ type: "gen_tokens", id: a.id, tokens: [2159], logprobs: [lp(-2)] });
    t.worker.send({ id: a.id, ...done("length", 1) } as FromWorker);
    t.worker.send({ id: b.id, ...done("length", 1) } as FromWorker);
    const res = await (await resP).json();
    assertEquals(res.choices.map((c: { index: number; text: string }) => [c.index, c.text]), [
      [0, "Hello, World"],
      [1, "Hello, world"],
    ]);
    assertEquals(res.choices[1].logprobs, {
      tokens: ["Hello", ",", " world"],
      token_logprobs: [null, null, -0.5],
      top_logprobs: [null, null, { " world": -0.5 }],
      text_offset: [0, 5, 6],
    });
    assertEquals(res.usage, { prompt_tokens: 2, completion_tokens: 2, total_tokens: 4 });
  } finally {
    await t.cleanup();
  }
});

Deno.test("parameters as clients send them: empty query values are absent, null is absent, echo is what the model read", async () => {
  const t = await setup();
  try {
    // GET /generate: `temperature=` is no temperature (1), not 0; a word is not a number.
    const emptyP = t.app.request("/generate?model=tiny&prompt=a&temperature=&seed=&max_tokens=2");
    await until(() => t.worker.generations.length === 1, "the request with empty values");
    const g = t.worker.generations[0];
    assertEquals([g.temperature, g.max_tokens], [1, 2]);
    t.worker.send({ id: g.id, ...done("length", 0) } as FromWorker);
    assertEquals((await emptyP).status, 200), await (await emptyP).text();
    const hot = await t.app.request("/generate?model=tiny&temperature=hot&top_k=1.5");
    assertEquals(
      (await hot.json()).error.message,
      "Invalid parameters: temperature (expected a number), top_k (expected a whole number)",
    );
    // POST /v1/completions: null is absent, as in OpenAI's API; an empty token prompt echoes nothing.
    const nullP = postJson(t.app, "/v1/completions", {
      model: "tiny",
      prompt: [],
      max_tokens: null,
      temperature: null,
      top_p: null,
      seed: null,
      n: null,
      stream: null,
      echo: true,
    });
    await until(() => t.worker.generations.length === 2, "the request with nulls");
    const h = t.worker.generations[1];
    assertEquals([h.max_tokens, h.temperature, h.top_p, h.prompt], [16, 1, 1, [50256]]);
    t.worker.send({ type: "gen_tokens", id: h.id, tokens: [15496] });
    t.worker.send({ id: h.id, ...done("length", 1) } as FromWorker);
    const res = await (await nullP).json();
    assertEquals(res.choices[0].text, "Hello");
    // Refused, saying why: stream_options without a stream, nine stop strings.
    const opts = await postJson(t.app, "/v1/completions", {
      model: "tiny",
      stream_options: { include_usage: true },
    });
    assertEquals(
      (await opts.json()).error.message,
      "Invalid parameters: stream_options (only allowed when stream is true)",
    );
    const stops = await postJson(t.app, "/v1/completions", { model: "tiny", stop: [..."abcdefghi"] });
    assertMatch(
      (await stops.json()).error.message,
      /^Invalid parameters: stop \(Too big: expected array to have <=8 items\)$/,
    );
  } finally {
    await t.cleanup();
  }
});

Deno.test("requests past the waiting cap get 429 with Retry-After; a started one no longer counts", async () => {
  const t = await setup({ maxWaiting: 2 });
  try {
    const first = t.app.request("/generate?model=tiny&prompt=a");
    const second = t.app.request("/generate?model=tiny&prompt=b");
    await until(() => t.worker.generations.length === 2, "two requests");
    assertEquals([t.manager.stats.waiting, t.manager.stats.running], [2, 0]);
    const third = await t.app.request("/generate?model=tiny&prompt=c");
    assertEquals(third.status, 429);
    assertEquals(third.headers.get("Retry-After"), "1");
    assertMatch(
      (await third.json()).error.message,
      /^Too many generation requests are waiting: 2 of at most 2/,
    );
    t.worker.send({ type: "gen_started", id: t.worker.generations[0].id, load_ms: 0 });
    assertEquals([t.manager.stats.waiting, t.manager.stats.running], [1, 1]);
    const fourth = postJson(t.app, "/v1/completions", { model: "tiny", prompt: "d" });
    await until(() => t.worker.generations.length === 3, "a slot in the queue again");
    for (const g of t.worker.generations) t.worker.send({ id: g.id, ...done("length", 0) } as FromWorker);
    for (const r of [await first, await second, await fourth]) assertEquals(r.status, 200), await r.text();
  } finally {
    await t.cleanup();
  }
});

Deno.test("a request past its time limit ends with finish_reason timeout and cancels the worker", async () => {
  const t = await setup({ timeoutMs: 50 });
  try {
    const resP = t.app.request("/generate?model=tiny&prompt=Hi");
    const req = await t.answer(1, [{ type: "gen_tokens", tokens: encode(" a") }]);
    const final = sse(await (await resP).text()).at(-1)!;
    assertEquals(final.event, "done");
    assertEquals(final.data.finish_reason, "timeout");
    assertMatch(final.data.error, /time limit of 0.05 s/);
    await until(() => t.worker.generationCancels.includes(req.id), "the cancel");
  } finally {
    await t.cleanup();
  }
});

Deno.test("streams send keepalive comments while no token comes", async () => {
  const t = await setup();
  try {
    const app = new Hono();
    app.onError(onError);
    app.route("/", generateRoutes(t.manager, { keepaliveMs: 20 }));
    const resP = app.request("/generate?model=tiny&prompt=Hi");
    await until(() => t.worker.generations.length === 1, "the request");
    const reader = (await resP).body!.getReader();
    const first = new TextDecoder().decode((await reader.read()).value);
    assertEquals(first, ": keepalive\n\n");
    t.worker.send({ type: "gen_tokens", id: t.worker.generations[0].id, tokens: encode(" a") });
    t.worker.send({ id: t.worker.generations[0].id, ...done("length", 1) } as FromWorker);
    let rest = "";
    for (let r = await reader.read(); !r.done; r = await reader.read()) {
      rest += new TextDecoder().decode(r.value);
    }
    assertMatch(rest, /event: token\ndata: \{"id":257,"text":" a"\}/);
  } finally {
    await t.cleanup();
  }
});

Deno.test("GET /v1/models/{id}, POST /tokenize and /detokenize", async () => {
  const t = await setup();
  try {
    const one = await t.app.request("/v1/models/job_0123456789ab/iter_0000005");
    assertEquals(one.status, 200);
    const m = await one.json();
    assertEquals([m.id, m.object, m.kind, m.max_model_len], [
      "job_0123456789ab/iter_0000005",
      "model",
      "checkpoint",
      64,
    ]);
    // A job's id is answered under that id (as /v1/models lists it), with its saved time.
    const job = await (await t.app.request("/v1/models/job_0123456789ab")).json();
    const listed = (await (await t.app.request("/v1/models")).json()).data[0];
    assertEquals([job.id, job.created], ["job_0123456789ab", listed.created]);
    assertEquals(m.created, listed.created);
    const none = await t.app.request("/v1/models/nope");
    assertEquals(none.status, 404);
    assertEquals((await none.json()).error.code, "model_not_found");
    const tok = await postJson(t.app, "/tokenize", { model: "tiny", prompt: "Hello, world" });
    assertEquals(await tok.json(), { count: 3, max_model_len: 64, tokens: [15496, 11, 995] });
    const detok = await postJson(t.app, "/detokenize", { tokens: [15496, 11, 995] });
    assertEquals(await detok.json(), { prompt: "Hello, world" });
    const bad = await postJson(t.app, "/detokenize", { tokens: [60000] });
    assertEquals(bad.status, 400);
    assertEquals((await bad.json()).error.param, "tokens.0");
  } finally {
    await t.cleanup();
  }
});

Deno.test("warmUp() rehearses the generation routes in memory through the ready Worker (which answers without a model): streamed answers, no generation for the Worker, nothing in /metrics, outsiders cannot rehearse, and the token check stays for everyone else", async () => {
  const t = await setup();
  try {
    assert((await warmUp(t.app, {}, 5)) >= 0); // throws unless every rehearsal streamed tokens
    assertEquals(t.worker.generations.length, 0, "no generation reached the Worker");
    // Each round's two requests went the whole way: to the Worker and back, answered by its own code.
    assertEquals(t.worker.rehearsals.length, 10);
    assert(t.worker.rehearsals.every((r) => r.rehearsal === true && r.model.id === "warm-up.rehearsal"));
    assertEquals(t.manager.active, 0, "no live generation left");
    const prom = await (await t.app.request("/metrics")).text();
    assert(!/gpt2_http_requests_total\{/.test(prom), prom);
    assert(prom.includes("gpt2_generation_requests_total 0\n"), prom);
    assert(prom.includes("vllm:time_to_first_token_seconds_count 0\n"), prom);
    assert(prom.includes('gpt2_generation_stage_seconds_count{stage="http"} 0\n'), prom);
    // A user's request naming the warm-up's model is an ordinary request for a model that does not exist.
    const outsider = await postJson(t.app, "/v1/completions", {
      model: "warm-up.rehearsal",
      prompt: "Hi",
      max_tokens: 2,
      stream: true,
    });
    assertEquals(outsider.status, 404);
    await outsider.body?.cancel();
    assertEquals(t.worker.generations.length, 0);
    // With a token: the warm-up passes (its requests are this process's own), a request without it does not.
    const secured = createApp({ runner: t.runner, generation: t.manager, token: "s3cret" });
    assert((await warmUp(secured, {}, 2)) >= 0);
    const res = await secured.request("/v1/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ model: "tiny", prompt: "Hi", max_tokens: 2 }),
    });
    assertEquals(res.status, 401);
    await res.body?.cancel();
    assertEquals(t.worker.generations.length, 0);
  } finally {
    await t.cleanup();
  }
});

Deno.test("warmUp() with no GPU ready answers its rehearsals in the HTTP process; whenReady() says false once no GPU is starting", async () => {
  const root = await Deno.makeTempDir({ prefix: "gpt2_genroutes_" });
  const store = new JobStore(":memory:");
  const workers: ScriptedWorker[] = [];
  const runner = new JobRunner(store, {
    root,
    gpus: 1,
    spawn: () => {
      const w = new ScriptedWorker({ unavailable: "no adapter" });
      workers.push(w);
      return w;
    },
    datasetExists: () => Promise.resolve(true),
  });
  const manager = new GenerationManager(runner.pool, root, {});
  runner.start();
  try {
    assertEquals(await manager.whenReady(5_000), false);
    const app = createApp({ runner, generation: manager, token: null });
    assert((await warmUp(app, {}, 3)) >= 0); // throws unless every rehearsal streamed tokens
    assertEquals(workers[0].rehearsals.length, 0, "nothing was sent to a Worker that is not ready");
    assertEquals(manager.active, 0);
  } finally {
    runner.shutdown();
    store.close();
    await Deno.remove(root, { recursive: true });
  }
});

Deno.test("/metrics splits the time to the first token into stages from the hops' stamps (gpt2_generation_stage_seconds)", async () => {
  const t = await setup();
  try {
    const resP = postJson(t.app, "/v1/completions", {
      model: "tiny",
      prompt: "Hi",
      max_tokens: 1,
      stream: true,
    });
    await until(() => t.worker.generations.length === 1, "the generation request");
    const req = t.worker.generations[0];
    assert(
      typeof req.sent_at === "number" && Math.abs(req.sent_at - epochMs()) < 60_000,
      "stamped when sent",
    );
    // The GPU host, the Worker's thread and its admission, as their hops would stamp them.
    const s = req.sent_at!;
    t.worker.send({
      type: "gen_started",
      id: req.id,
      load_ms: 0,
      stamps: { sent_at: s, relayed_at: s + 2, received_at: s + 5, admitted_at: s + 9 },
    });
    t.worker.send({ type: "gen_tokens", id: req.id, tokens: [995], first_at: s + 25 });
    t.worker.send({ id: req.id, ...done("length", 1) } as FromWorker);
    assertEquals((await resP).status, 200);
    await (await resP).text();
    const prom = await (await t.app.request("/metrics")).text();
    const sum = (stage: string) =>
      Number(prom.match(new RegExp(`gpt2_generation_stage_seconds_sum\\{stage="${stage}"\\} (\\S+)`))?.[1]);
    const count = (stage: string) =>
      Number(prom.match(new RegExp(`gpt2_generation_stage_seconds_count\\{stage="${stage}"\\} (\\S+)`))?.[1]);
    for (const stage of ["http", "to_host", "to_worker", "queue", "prefill", "back", "write"]) {
      assertEquals(count(stage), 1, `${stage} counted once`);
    }
    assertAlmostEquals(sum("to_host"), 0.002, 1e-9);
    assertAlmostEquals(sum("to_worker"), 0.003, 1e-9);
    assertAlmostEquals(sum("queue"), 0.004, 1e-9);
    assertAlmostEquals(sum("prefill"), 0.016, 1e-9);
    assert(sum("http") >= 0 && sum("http") < 5, `http ${sum("http")}`);
    assert(prom.includes("vllm:request_prefill_time_seconds_count 1\n"), prom);
    assert(/vllm:request_queue_time_seconds_sum 0\.004\d*\n/.test(prom), prom);
  } finally {
    await t.cleanup();
  }
});

Deno.test("warmUp() over the server's own socket: fresh connections rehearse the streamed routes, past the token check by the process's secret, uncounted and outside the stream limits; a guessed secret is an ordinary request", async () => {
  const t = await setup();
  // Two streams in all: the warm-up's bursts of 8 from this address must neither be refused nor take them.
  const secured = createApp({
    runner: t.runner,
    generation: t.manager,
    token: "s3cret",
    limits: { maxStreamsPerClient: 2, maxStreams: 2 },
  });
  const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen: () => {} }, secured.fetch);
  const user = (prompt: string) =>
    fetch(`http://127.0.0.1:${server.addr.port}/v1/completions`, {
      method: "POST",
      headers: { "Content-Type": "application/json", Authorization: "Bearer s3cret" },
      body: JSON.stringify({ model: "tiny", prompt, max_tokens: 1, stream: true }),
    });
  try {
    // A user's stream stays open through the warm-up (the test answers it only at the end).
    const first = user("Hi");
    await until(() => t.worker.generations.length === 1, "the user's generation");
    let waited = 0;
    const ready = () => {
      waited++;
      return t.manager.whenReady(5_000);
    };
    assert(
      (await warmUp(
        secured,
        { host: "127.0.0.1", port: server.addr.port, socketRounds: 2, burst: 8, ready },
        1,
      )) >=
        0,
    );
    assertEquals(waited, 1, "the socket rounds waited for a ready GPU once");
    assertEquals(t.worker.generations.length, 1, "no rehearsal reached the Worker as a generation");
    assertEquals(t.worker.rehearsals.length, 2 + 2 * 8, "every rehearsal went through the Worker");
    // The second of the two streams is still free for a user; a third is refused, naming the limit.
    const second = user("Hello");
    await until(() => t.worker.generations.length === 2, "the second user's generation");
    const third = await user("Hey");
    assertEquals(third.status, 429);
    assertMatch(
      await third.text(),
      /Too many open streams from this client: 2 \(limit GPT2_MAX_STREAMS_PER_CLIENT=2\)/,
    );
    for (const [i, res] of [first, second].entries()) {
      t.worker.send({ type: "gen_tokens", id: t.worker.generations[i].id, tokens: [995] });
      t.worker.send({ id: t.worker.generations[i].id, ...done("length", 1) } as FromWorker);
      const r = await res;
      assertEquals(r.status, 200);
      assertMatch(await r.text(), /data: \[DONE\]/);
    }
    const base = `http://127.0.0.1:${server.addr.port}`;
    const prom = await (await fetch(`${base}/metrics`, { headers: { Authorization: "Bearer s3cret" } }))
      .text();
    // The users' requests only (the warm-up's 18 are not counted).
    assert(prom.includes('gpt2_http_requests_total{method="POST",code="200"} 2\n'), prom);
    assert(prom.includes("gpt2_generation_requests_total 2\n"), prom);
    const guess = await fetch(`${base}/v1/completions`, {
      method: "POST",
      headers: { "Content-Type": "application/json", "x-gpt2-warm-up": "0".repeat(48) },
      body: JSON.stringify({ model: "warm-up.rehearsal", prompt: "Hi", max_tokens: 2, stream: true }),
    });
    assertEquals(guess.status, 401);
    await guess.body?.cancel();
  } finally {
    // Ends the users' streams whatever failed, so that the server can shut down.
    for (const g of t.worker.generations) t.worker.send({ id: g.id, ...done("length", 0) } as FromWorker);
    await server.shutdown();
    await t.cleanup();
  }
});

Deno.test("a model lookup is reused while its files' signature holds, and a checkpoint committed later is seen at once", async () => {
  const t = await setup();
  try {
    const job = `${t.root}/checkpoints/job_0123456789ab`;
    const ask = async (n: number) => {
      const res = t.app.request("/generate?model=job_0123456789ab&prompt=Hi&max_tokens=1");
      const req = await t.answer(n, [done("length", 0)]);
      await (await res).text();
      return req.model;
    };
    const first = await ask(1);
    assertEquals([first.path, first.version], [`${job}/iter_0000005`, "2025-01-01T00:00:00.000Z"]);
    // Past the short window, unchanged files: the lookup is reused (a manifest rewritten in place,
    // which a committed checkpoint never is, shows that nothing was read again).
    await new Promise((r) => setTimeout(r, 300));
    const manifest = `${job}/iter_0000005/manifest.json`;
    await Deno.writeTextFile(
      manifest,
      (await Deno.readTextFile(manifest)).replace("2025-01-01T00:00:00.000Z", "2025-02-02T00:00:00.000Z"),
    );
    assertEquals((await ask(2)).version, "2025-01-01T00:00:00.000Z");
    // A new checkpoint is committed as checkpoints are (a folder renamed into the job's): seen at once.
    await new Promise((r) => setTimeout(r, 300));
    const tmp = `${job}/.tmp_iter_0000010`;
    await Deno.mkdir(tmp);
    await Deno.writeTextFile(
      `${tmp}/manifest.json`,
      (await Deno.readTextFile(manifest)).replace('"iter_0000005"', '"iter_0000010"').replace(
        '"iteration":5',
        '"iteration":10',
      ),
    );
    await Deno.rename(tmp, `${job}/iter_0000010`);
    assertEquals((await ask(3)).path, `${job}/iter_0000010`);
    assertEquals(modelSourceStamp(t.root, "../etc"), null);
    assertEquals(modelSourceStamp(t.root, "tiny"), modelSourceStamp(t.root, "tiny"));
  } finally {
    await t.cleanup();
  }
});
