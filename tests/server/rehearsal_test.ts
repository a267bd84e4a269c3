/**
 * The HTTP process's rehearsal (server/rehearsal.ts) on its own: which requests are marked as the
 * warm-up's (only its own, in memory or over the socket with the process's secret), and what the
 * generation manager's Rehearsals does with them (answered here with no GPU ready, else handed to
 * the GPU's Worker flagged and routed back until done, a crash ending that GPU's only, a time limit
 * of at most 10 s, statistics nowhere). The whole path through createApp and the manager is in
 * generate_routes_test.ts.
 */

import { deepStrictEqual as assertEquals, ok as assert } from "node:assert/strict";
import { Hono } from "hono";
import type { ToWorker, WorkerGeneration } from "../../protocol.ts";
import { Generation } from "../../server/generate/mod.ts";
import { isRehearsal, markRehearsal, Rehearsals, warmUp } from "../../server/rehearsal.ts";

type Posted = Extract<ToWorker, { type: "generate" | "generate_cancel" }>;

/** A Rehearsals whose Worker messages land in `posted`. */
function rehearsals(): { r: Rehearsals; posted: Array<[number, Posted]> } {
  const posted: Array<[number, Posted]> = [];
  const r = new Rehearsals((gpu, msg) => posted.push([gpu, msg]), (...a) => new Generation(...a));
  return { r, posted };
}

/** A rehearsal's Generation settings and Worker request, as the manager makes them. */
function rehearsal(r: Rehearsals, id: string, gpu: number, prompt: number[], timeout_ms = 600_000) {
  const model = r.model("warm-up.rehearsal");
  const init = {
    id,
    model,
    prompt,
    truncated_tokens: 0,
    max_tokens: 12,
    seed: 7,
    gpu,
    stop: [],
    timeout_ms,
  };
  const request: WorkerGeneration = {
    id,
    model,
    prompt,
    max_tokens: 12,
    temperature: 1,
    top_k: 40,
    top_p: 1,
    seed: 7,
    stop_at_eos: true,
    logprobs: null,
  };
  return { init, request };
}

Deno.test("markRehearsal() marks warmUp()'s own requests, in memory and over the socket, and no other; isRehearsal() reads the mark", async () => {
  const seen: Array<{ path: string; marked: boolean; flag: boolean }> = [];
  const app = new Hono();
  app.use("*", async (c, next) => {
    const marked = markRehearsal(c);
    seen.push({ path: c.req.path, marked, flag: isRehearsal(c) });
    await next();
  });
  const answer = () => new Response("data: {}\n\n", { headers: { "Content-Type": "text/event-stream" } });
  app.post("/v1/completions", answer);
  app.get("/generate", answer);
  const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen: () => {} }, app.fetch);
  try {
    let waited = 0;
    const ready = () => Promise.resolve(waited++);
    const opts = { host: "127.0.0.1", port: server.addr.port, socketRounds: 2, burst: 4, ready };
    assert((await warmUp(app, opts, 3)) >= 0);
    assertEquals(waited, 1, "the socket rounds waited for a ready GPU once");
    // 3 rounds of two in memory, then 2 × 4 over the socket (every fourth a /generate).
    assertEquals(seen.length, 3 * 2 + 2 * 4);
    assert(seen.every((s) => s.marked && s.flag), JSON.stringify(seen));
    assertEquals(seen.filter((s) => s.path === "/generate").length, 3 + 2);
    seen.length = 0;
    const base = `http://127.0.0.1:${server.addr.port}`;
    const forged: Array<Record<string, string>> = [{}, { "x-gpt2-warm-up": "0".repeat(48) }, {
      "x-gpt2-warm-up": "short",
    }];
    for (const headers of forged) {
      await (await fetch(`${base}/generate`, { headers })).body?.cancel();
    }
    await (await app.fetch(new Request(`${base}/generate`))).body?.cancel();
    assertEquals(seen, Array(4).fill({ path: "/generate", marked: false, flag: false }));
  } finally {
    await server.shutdown();
  }
});

Deno.test("Rehearsals.start() with no GPU ready answers here: the prompt's first 8 tokens in two chunks, then done; nothing posted, counted as here", async () => {
  const { r, posted } = rehearsals();
  const prompt = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19];
  const { init, request } = rehearsal(r, "r1", -1, prompt);
  const gen = r.start(init, request);
  assert(typeof request.sent_at === "number", "stamped when sent");
  assertEquals(request.rehearsal, undefined, "no Worker sees it");
  const chunks: number[][] = [];
  let done = null;
  for await (const batch of gen.batches()) {
    const ids = batch.flatMap((e) => e.type === "token" && e.id !== null ? [e.id] : []);
    if (ids.length > 0) chunks.push(ids);
    for (const e of batch) if (e.type === "done") done = e;
  }
  assertEquals(chunks, [[10, 11, 12, 13], [14, 15, 16, 17]]);
  assertEquals(done?.finish_reason, "length");
  assertEquals(done?.completion_tokens, 8);
  assertEquals(done?.load_ms, 0);
  assertEquals(posted, []);
  assertEquals(r.counts, { worker: 0, here: 1 });
  // Its model names GPT-2 small's shape and no files.
  assertEquals([init.model.path, init.model.version, init.model.config.n_positions], ["", "rehearsal", 1024]);
  gen.cancel(); // finished: nothing to post
  assertEquals(posted, []);
});

Deno.test("Rehearsals.start() with a ready GPU hands the rehearsal to its Worker flagged, routes the reports back until done, and a crash ends that GPU's rehearsals only", async () => {
  const { r, posted } = rehearsals();
  const a = rehearsal(r, "a", 0, [1, 2, 3]), b = rehearsal(r, "b", 1, [4]), c = rehearsal(r, "c", 0, [5]);
  const [ga, gb, gc] = [r.start(a.init, a.request), r.start(b.init, b.request), r.start(c.init, c.request)];
  assertEquals(posted.map(([gpu, m]) => [gpu, m.type, m.type === "generate" && m.request.rehearsal]), [
    [0, "generate", true],
    [1, "generate", true],
    [0, "generate", true],
  ]);
  assert(posted.every(([, m]) => m.type === "generate" && typeof m.request.sent_at === "number"));
  assertEquals(r.counts, { worker: 3, here: 0 });
  r.report({ type: "gen_started", id: "a", load_ms: 0 });
  r.report({ type: "gen_tokens", id: "a", tokens: [1, 2, 3] });
  r.report({ type: "gen_done", id: "a", reason: "length", error: null, completion_tokens: 3 });
  const { done } = await ga.collect();
  assertEquals([done.finish_reason, done.completion_tokens], ["length", 3]);
  r.report({ type: "gen_tokens", id: "a", tokens: [9] }); // forgotten once done: ignored
  r.report({ type: "gen_tokens", id: "nobody", tokens: [9] });
  r.crashed(0, { type: "gen_crash", error: "Worker 0 crashed" });
  const crashed = await gc.collect();
  assertEquals([crashed.done.finish_reason, crashed.done.error], ["error", "Worker 0 crashed"]);
  assert(!gb.finished, "the other GPU's rehearsal goes on");
  gb.cancel();
  assertEquals(posted.at(-1), [1, { type: "generate_cancel", id: "b" }]);
});

Deno.test("a rehearsal's time limit is the user's or 10 s, whichever is less, and a timeout cancels it on its Worker", async () => {
  const { r, posted } = rehearsals();
  const limits: number[] = [];
  const real = globalThis.setTimeout;
  globalThis.setTimeout = ((fn: () => void, ms?: number) => {
    limits.push(ms ?? 0);
    return real(fn, ms);
  }) as typeof setTimeout;
  let long: Generation | undefined;
  try {
    const slow = rehearsal(r, "slow", 0, [1]);
    long = r.start(slow.init, slow.request);
    const quick = rehearsal(r, "quick", 0, [1], 30);
    const gen = r.start(quick.init, quick.request);
    assertEquals(limits, [10_000, 30]);
    const { done } = await gen.collect();
    assertEquals(done.finish_reason, "timeout");
    assertEquals(posted.at(-1), [0, { type: "generate_cancel", id: "quick" }]);
  } finally {
    globalThis.setTimeout = real;
  }
  long?.cancel(); // clears its timer
});
