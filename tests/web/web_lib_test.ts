/**
 * The dashboard's pure modules, run in Deno: the SSE parser (split chunks, comments, ids,
 * multi-line data), error bodies in both API shapes, the estimator's total, a dataset's pipeline
 * counts, a job's curves built from its events (eval rows, replays and resumes overwrite), and
 * the signed-in line and the navigation a token's scopes show.
 */

import { deepStrictEqual as assertEquals, ok as assert } from "node:assert/strict";
import { fetchEstimate, followEvents, setToken } from "../../web/api.js";
import { SseParser } from "../../web/sse.js";
import {
  datasetCounts,
  errorInfo,
  estimateBytes,
  fmtBytes,
  fmtTick,
  JobSeries,
  mayUse,
  NAV_SCOPES,
  whoAmI,
} from "../../web/shapes.js";

Deno.test("SseParser joins events split across chunks and skips keepalive comments", () => {
  const p = new SseParser();
  assertEquals(p.push('id: 7\nevent: progress\ndata: {"a"'), []);
  assertEquals(p.push(":1}\n\n: keepalive\n\nid: 8\r\nevent: done\r\ndata: x\r\ndata: y\r\n\r\n"), [
    { id: "7", event: "progress", data: '{"a":1}' },
    { id: "8", event: "done", data: "x\ny" },
  ]);
  assertEquals(p.push("data: [DONE]\n\n"), [{ id: null, event: "message", data: "[DONE]" }]);
});

Deno.test("errorInfo() reads OpenAI's shape and the older one, naming each field once", () => {
  assertEquals(
    errorInfo({
      error: {
        message: "Too small: expected number to be >0",
        type: "invalid_request_error",
        param: "batch_size",
        code: null,
      },
    }),
    {
      message: "Too small: expected number to be >0",
      fields: { batch_size: "Too small: expected number to be >0" },
    },
  );
  const old = errorInfo({
    error: "Invalid training config",
    issues: [
      { path: ["batch_size"], message: "Too small" },
      { path: ["batch_size"], message: "Second" },
      { path: ["model", "n_layer"], message: "Too big" },
      { path: [], code: "unrecognized_keys", keys: ["bogus"], message: "Unrecognized key" },
    ],
  });
  assertEquals(old.message, "Invalid training config");
  assertEquals(old.fields, { batch_size: "Too small", model: "Too big", bogus: 'Unknown field "bogus"' });
  assertEquals(errorInfo({ error: "Unknown dataset", field: "dataset" }).fields, {
    dataset: "Unknown dataset",
  });
  assertEquals(errorInfo(null, 502), { message: "HTTP 502", fields: {} });
});

Deno.test("estimateBytes() finds the total wherever the estimator puts it", () => {
  assertEquals(estimateBytes({ total_bytes: 123 }), 123);
  assertEquals(estimateBytes({ bytes: { params: 1, total: 456 } }), 456);
  assertEquals(estimateBytes({ model: "gpt2-tiny", memory: { total_bytes: 789 } }), 789);
  assertEquals(estimateBytes({ error: "x" }), null);
});

Deno.test("datasetCounts() gives URLs dropped, near-duplicates and short documents", () => {
  assertEquals(
    datasetCounts({ stats: { urls: { input: 10, kept: 7 }, near_duplicates: 2, under_min_tokens: 3 } }),
    { urls_dropped: 3, near_duplicates: 2, short_dropped: 3 },
  );
  assertEquals(datasetCounts({}), { urls_dropped: null, near_duplicates: null, short_dropped: null });
});

Deno.test("JobSeries keeps one row per iteration, with eval points and fp16 fields when present", () => {
  const s = new JobSeries();
  const train = (iteration: number, loss: number, extra = {}) =>
    s.add("progress", {
      kind: "train",
      iteration,
      loss,
      lr: 1e-3,
      grad_norm: 1,
      tokens_per_s: 100,
      ...extra,
    });
  assert(train(2, 10));
  assert(train(4, 9));
  assert(
    s.add("progress", { kind: "eval", split: "valid", iteration: 4, loss: 9.5, perplexity: Math.exp(9.5) }),
  );
  assert(!s.add("log", { message: "hello" }));
  assertEquals(s.hasFp16, false);
  // A resumed run reports iteration 4 again: it replaces the row.
  assert(train(4, 8.5, { loss_scale: 65536, skipped_steps: 1 }));
  assertEquals(s.trainPoints, 2);
  assertEquals(s.hasFp16, true);
  assertEquals(s.columns(["loss", "val_loss", "loss_scale"]), [[2, 4], [10, 8.5], [null, 9.5], [
    null,
    65536,
  ]]);
  assertEquals(s.columns(["train_ppl"])[1][0], Math.exp(10));
  assertEquals(s.latest?.iteration, 4);
});

Deno.test("fmtBytes() and fmtTick() format for people", () => {
  assertEquals(fmtBytes(512), "512 B");
  assertEquals(fmtBytes(66_798_592), "63.7 MiB");
  assertEquals(fmtTick(0.003), "3.0e-3");
  assertEquals(fmtTick(10.4), "10.4");
  assertEquals(fmtTick(null), "");
});

/** Serves `handler` on a free loopback port for the length of `fn`. */
async function withServer(handler: (req: Request) => Response, fn: (base: string) => Promise<void>) {
  const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen: () => {} }, handler);
  try {
    await fn(`http://127.0.0.1:${server.addr.port}`);
  } finally {
    await server.shutdown();
  }
}

const sse = (text: string) => new Response(text, { headers: { "Content-Type": "text/event-stream" } });

Deno.test("followEvents() reopens a broken stream with Last-Event-ID and sends the token", async () => {
  const seen: Array<{ last: string | null; auth: string | null }> = [];
  setToken("tok");
  try {
    await withServer((req) => {
      seen.push({ last: req.headers.get("Last-Event-ID"), auth: req.headers.get("Authorization") });
      // The first stream breaks after two events; the second replays from the last id.
      return seen.length === 1
        ? sse(
          'id: 1\nevent: progress\ndata: {"iteration":1}\n\nid: 2\nevent: progress\ndata: {"iteration":2}\n\n',
        )
        : sse('id: 3\nevent: done\ndata: {"status":"succeeded"}\n\n');
    }, async (base) => {
      const got: Array<[string, unknown, number]> = [];
      await followEvents(`${base}/jobs/x/events`, {
        signal: new AbortController().signal,
        onEvent: (type: string, data: unknown, id: number) => {
          got.push([type, data, id]);
          return type === "done";
        },
      });
      assertEquals(got, [
        ["progress", { iteration: 1 }, 1],
        ["progress", { iteration: 2 }, 2],
        ["done", { status: "succeeded" }, 3],
      ]);
    });
    assertEquals(seen, [{ last: null, auth: "Bearer tok" }, { last: "2", auth: "Bearer tok" }]);
  } finally {
    setToken("");
  }
});

Deno.test("fetchEstimate() reads the estimator's total, and is null when the server has no estimator", async () => {
  let query = "";
  await withServer((req) => {
    query = new URL(req.url).search;
    return Response.json({ model: "gpt2-tiny", total_bytes: 4096 });
  }, async (base) => {
    const cfg = { model: "gpt2-tiny", batch_size: 4, seq_len: 32, lr: 1e-3 };
    assertEquals(await fetchEstimate(cfg, undefined, base), 4096);
    assertEquals(query, "?model=gpt2-tiny&batch_size=4&seq_len=32");
  });
  await withServer(
    () => Response.json({ error: "No route for GET /estimate" }, { status: 404 }),
    async (base) => {
      assertEquals(await fetchEstimate({ model: "gpt2-tiny" }, undefined, base), null);
    },
  );
});

Deno.test("whoAmI() and mayUse() read GET /auth/me: the user, scopes and quotas; what the navigation shows", () => {
  const me = {
    user: "alice",
    scopes: ["read", "generate"],
    admin: false,
    auth_required: true,
    quotas: { queued_jobs: 20, running_gpus: 2, streams: 16, gpu_seconds_per_day: 86400 },
    usage: { queued_jobs: 2, running_gpus: 1, streams: 0, gpu_seconds_per_day: 120 },
  };
  assertEquals(
    whoAmI(me),
    "alice · read, generate · 2/20 queued, 1/2 GPUs running, 0/16 streams, 120/86400 GPU-s today",
  );
  assertEquals(
    whoAmI({ user: null, scopes: [], admin: true, auth_required: false }),
    "admin (no token needed)",
  );
  assertEquals(
    whoAmI({ user: null, scopes: [], admin: true, auth_required: true }),
    "admin (bootstrap token)",
  );
  assertEquals(whoAmI(null), "");
  const shown = Object.entries(NAV_SCOPES).filter(([, s]) => mayUse(me, s)).map(([n]) => n);
  assertEquals(shown, ["jobs", "datasets", "playground", "gpus"]);
  assert(Object.values(NAV_SCOPES).every((s) => mayUse({ user: "ada", scopes: ["admin"] }, s)));
  assert(mayUse(null, "train"), "nothing is hidden before the server has said who the caller is");
});
