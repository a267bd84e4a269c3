/**
 * Quotas, fair share and the audit trail through the routes (tests/_auth.ts): past `queued_jobs`,
 * a day's `gpu_seconds_per_day` or `streams`, 429 naming the quota, the user and when it frees;
 * the queue alternates between users and holds a user at `running_gpus`; an admin lists who did
 * what; with no token configured nothing is asked until a user token exists.
 */

import assert from "node:assert/strict";
import { authServer, BOOT, fakeCheckpoint } from "../_auth.ts";
import { apiError } from "../_api.ts";
import { until } from "../_wait.ts";
import type { FromWorker } from "../../protocol.ts";

Deno.test("queued_jobs and gpu_seconds_per_day: 429 naming the quota, the user and when it frees; admins set them per user", async () => {
  const t = await authServer();
  try {
    const alice = (await t.mint("alice", ["read", "train"])).token;
    const bob = (await t.mint("bob", ["read", "train"])).token;
    const set = await t.call(BOOT, "PUT", "/admin/users/alice/quotas", { queued_jobs: 2 });
    assert.equal(set.status, 200);
    assert.equal((await set.json()).quotas.queued_jobs, 2);
    await apiError(await t.call(BOOT, "PUT", "/admin/users/nobody/quotas", { queued_jobs: 2 }), 404);
    await apiError(await t.call(BOOT, "PUT", "/admin/users/alice/quotas", { queued: 2 }), 400);
    await t.train(alice); // starts at once on the one GPU
    await t.train(alice);
    await t.train(alice);
    const e = await apiError(
      await t.call(alice, "POST", "/train", { model: "gpt2-tiny", dataset: "sotu" }),
      429,
      { code: "quota_exceeded" },
    );
    assert.equal(
      e.message,
      'Quota "queued_jobs" reached: user "alice" has 2 jobs waiting (limit 2); it frees when one of them starts, is cancelled or deleted',
    );
    await apiError(await t.call(alice, "POST", "/evaluate", { model: "tiny", texts: ["Hello there"] }), 429, {
      code: "quota_exceeded",
    });
    await t.train(bob); // bob's own quota is untouched
    const me = await (await t.call(alice, "GET", "/auth/me")).json();
    assert.deepEqual([me.quotas.queued_jobs, me.usage.queued_jobs, me.usage.running_gpus], [2, 2, 1]);

    await t.call(BOOT, "PUT", "/admin/users/bob/quotas", { gpu_seconds_per_day: 0 });
    const res = await t.call(bob, "POST", "/train", { model: "gpt2-tiny", dataset: "sotu" });
    const retry = Number(res.headers.get("Retry-After"));
    const g = await apiError(res, 429, { code: "quota_exceeded" });
    assert.match(
      g.message,
      /^Quota "gpu_seconds_per_day" reached: user "bob" used \d+ GPU-seconds today \(limit 0\); it frees at \d{4}-\d\d-\d\dT00:00:00\.000Z$/,
    );
    assert.ok(retry > 0 && retry <= 86_400, String(retry));
    const users = (await (await t.call(BOOT, "GET", "/admin/users")).json()).users;
    assert.deepEqual(users.map((u: { name: string; tokens: number }) => [u.name, u.tokens]), [["alice", 1], [
      "bob",
      1,
    ]]);
  } finally {
    await t.cleanup();
  }
});

Deno.test("streams: a user past their generation streams gets 429 until one ends; another user's streams are their own", async () => {
  const t = await authServer({ quotas: { streams: 1 } });
  try {
    const alice = (await t.mint("alice", ["generate"])).token;
    const bob = (await t.mint("bob", ["generate"])).token;
    const body = { model: "tiny", prompt: "Hi", max_tokens: 2 };
    const first = t.call(alice, "POST", "/v1/completions", body);
    const worker = t.workers[0];
    await until(() => worker.generations.length >= 1, "the first generation");
    const e = await apiError(await t.call(alice, "GET", "/generate?model=tiny&prompt=Hi"), 429, {
      code: "quota_exceeded",
    });
    assert.equal(
      e.message,
      'Quota "streams" reached: user "alice" has 1 generation streams open (limit 1); it frees when one of them ends',
    );
    const two = await apiError(await t.call(alice, "POST", "/v1/completions", { ...body, n: 2 }), 429);
    assert.equal(
      two.message,
      'Quota "streams": this request needs 2 generation streams (n = 2), more than user "alice"\'s limit of 1: lower n',
    );
    // Bob's streams are his own.
    const second = t.call(bob, "POST", "/v1/completions", body);
    await until(() => worker.generations.length >= 2, "bob's generation");
    for (const g of worker.generations) {
      for (
        const m of [
          { type: "gen_started", load_ms: 1 },
          { type: "gen_tokens", tokens: [995] },
          { type: "gen_done", reason: "length", error: null, completion_tokens: 1 },
        ]
      ) worker.send({ id: g.id, ...m } as FromWorker);
    }
    assert.equal((await first).status, 200);
    assert.equal((await second).status, 200);
    assert.equal(t.quotas.usage("alice").streams, 0, "the stream was given back");
    const third = t.call(alice, "POST", "/v1/completions", body);
    await until(() => worker.generations.length >= 3, "alice's next generation");
    worker.send({
      id: worker.generations[2].id,
      type: "gen_done",
      reason: "length",
      error: null,
      completion_tokens: 0,
    });
    assert.equal((await third).status, 200);
  } finally {
    await t.cleanup();
  }
});

/** Plays "done" for the job the `w`-th Worker runs now. */
function finish(t: Awaited<ReturnType<typeof authServer>>, w = 0): string {
  const job = t.workers[w].jobs.at(-1)!;
  t.workers[w].send({ type: "done", id: job.id, status: "succeeded", iteration: 10, error: null });
  return job.id;
}

Deno.test("fair share: with several users waiting, the queue alternates between them instead of running one user's jobs first", async () => {
  const t = await authServer({ quotas: { queued_jobs: 100 } });
  try {
    const alice = (await t.mint("alice", ["train"])).token;
    const bob = (await t.mint("bob", ["train"])).token;
    const carol = (await t.mint("carol", ["train"])).token;
    const ids: Record<string, string> = {};
    ids.a1 = await t.train(alice);
    await until(() => t.workers[0].jobs.length === 1, "the first job");
    for (const n of ["a2", "a3", "a4"]) ids[n] = await t.train(alice);
    for (const n of ["b1", "b2"]) ids[n] = await t.train(bob);
    ids.c1 = await t.train(carol);
    const name = Object.fromEntries(Object.entries(ids).map(([k, v]) => [v, k]));
    const order = [name[t.workers[0].jobs[0].id]];
    for (let i = 1; i < 7; i++) {
      finish(t);
      await until(() => t.workers[0].jobs.length > i, "the next job");
      order.push(name[t.workers[0].jobs[i].id]);
    }
    assert.deepEqual(order, ["a1", "b1", "c1", "a2", "b2", "a3", "a4"]);
  } finally {
    await t.cleanup();
  }
});

Deno.test("running_gpus: a user at their quota waits while a free GPU takes another user's job, and goes on the first GPU that frees, even another queue's", async () => {
  const t = await authServer({ gpus: 2, quotas: { running_gpus: 1, queued_jobs: 100 } });
  try {
    const alice = (await t.mint("alice", ["train"])).token;
    const bob = (await t.mint("bob", ["train"])).token;
    await until(() => t.runner.gpus().every((g) => g.state === "idle"), "both GPUs");
    const a1 = await t.train(alice);
    const a2 = await t.train(alice); // on the other GPU's queue, held by alice's quota
    await new Promise((r) => setTimeout(r, 50));
    const running = () => t.workers.map((w) => w.jobs.map((j) => j.id)).flat();
    assert.deepEqual(running(), [a1]);
    assert.equal(t.store.getJob(a2)!.status, "queued");
    const gpuA1 = t.workers.findIndex((w) => w.jobs.some((j) => j.id === a1));
    assert.equal(t.store.getJob(a2)!.gpu, 1 - gpuA1);
    const b1 = await t.train(bob);
    await until(() => running().includes(b1), "bob's job on the free GPU");
    assert.equal(t.workers[1 - gpuA1].jobs.at(-1)!.id, b1);
    // a2 waited on the queue of the GPU bob's job took; a1's GPU frees with nothing of its own to
    // run, and alice is under quota again: a2 moves there at once instead of waiting behind b1.
    finish(t, gpuA1);
    await until(
      () => t.workers[gpuA1].jobs.some((j) => j.id === a2),
      "alice's second job on the GPU that freed",
    );
    const moved = t.store.getJob(a2)!;
    assert.deepEqual([moved.status, moved.gpu], ["running", gpuA1]);
    assert.deepEqual(t.workers[1 - gpuA1].jobs.map((j) => j.id), [b1], "bob's job runs on undisturbed");
    assert.equal(t.store.getJob(b1)!.status, "running");
    assert.deepEqual(t.store.queue(0).concat(t.store.queue(1)), []);
    const log = t.store.eventsAfter(a2).map((e) => e.data.message);
    assert.ok(
      log.includes(`Moved from GPU ${1 - gpuA1}'s queue to GPU ${gpuA1}, free first`),
      log.join("\n"),
    );
  } finally {
    await t.cleanup();
  }
});

Deno.test("GET /admin/audit lists who created, cancelled and deleted what, and token changes; newest first, by user", async () => {
  const t = await authServer();
  try {
    const alice = await t.mint("alice", ["read", "train"]);
    const id = await t.train(alice.token);
    assert.equal((await t.call(alice.token, "POST", `/jobs/${id}/cancel`, {})).status, 202);
    t.workers[0].send({ type: "done", id, status: "cancelled", iteration: 0, error: null });
    await until(() => t.store.getJob(id)!.status === "cancelled", "the cancel");
    assert.equal((await t.call(alice.token, "DELETE", `/jobs/${id}`)).status, 200);
    assert.equal((await t.call(BOOT, "DELETE", `/admin/tokens/${alice.id}`)).status, 200);
    const all = (await (await t.call(BOOT, "GET", "/admin/audit")).json()).events;
    assert.deepEqual(
      all.map((e: { user: string; action: string; target: string }) => [e.user, e.action, e.target]),
      [
        [null, "token.revoke", alice.id],
        ["alice", "job.delete", id],
        ["alice", "job.cancel", id],
        ["alice", "job.create", id],
        [null, "token.create", alice.id],
      ],
    );
    const mine = await (await t.call(BOOT, "GET", "/admin/audit?user=alice&limit=2")).json();
    assert.deepEqual(mine.events.map((e: { action: string }) => e.action), ["job.delete", "job.cancel"]);
    assert.equal(mine.has_more, true);
  } finally {
    await t.cleanup();
  }
});

Deno.test("with no token configured nothing is asked (loopback default) until a user token exists; then every request needs one, even once it is revoked", async () => {
  const t = await authServer();
  try {
    // An app over the same runner with no token configured (its own TokenAuth, no bootstrap token).
    const { createApp } = await import("../../server/routes/mod.ts");
    const app = createApp({ runner: t.runner, token: null });
    assert.equal((await app.request("/jobs")).status, 200);
    const me = await (await app.request("/auth/me")).json();
    assert.deepEqual([me.user, me.admin, me.auth_required], [null, true, false]);
    const made = await app.request("/admin/tokens", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ user: "alice", scopes: ["read", "admin"] }),
    });
    assert.equal(made.status, 201);
    const { token, id } = await made.json();
    await apiError(await app.request("/jobs"), 401, { code: "missing_api_key" });
    const auth = { Authorization: `Bearer ${token}` };
    assert.equal((await app.request("/jobs", { headers: auth })).status, 200);
    // Revoking the last token does not open the server again.
    assert.equal((await app.request(`/admin/tokens/${id}`, { method: "DELETE", headers: auth })).status, 200);
    await apiError(await app.request("/jobs", { headers: auth }), 401, { code: "revoked_api_key" });
    await apiError(await app.request("/jobs"), 401, { code: "missing_api_key" });
  } finally {
    await t.cleanup();
  }
});

Deno.test("token use by route class becomes token.use audit events; /metrics has per-user usage and quota gauges", async () => {
  const t = await authServer();
  try {
    const alice = await t.mint("alice", ["read", "train"]);
    await t.train(alice.token);
    for (let i = 0; i < 3; i++) await (await t.call(alice.token, "GET", "/jobs")).body?.cancel();
    const prom = await (await t.call(BOOT, "GET", "/metrics")).text();
    assert.ok(prom.includes('gpt2_user_usage{user="alice",quota="running_gpus"} 1\n'), prom);
    assert.ok(prom.includes('gpt2_user_quota{user="alice",quota="queued_jobs"} 20\n'), prom);
    assert.ok(prom.includes('gpt2_user_requests_total{user="alice",class="read"} 3\n'), prom);
    assert.ok(prom.includes('gpt2_user_requests_total{user="alice",class="train"} 1\n'), prom);
    t.tokens.stop(); // writes what is pending (a minute's worth, by default)
    const uses = t.store.audit().filter((e) => e.action === "token.use");
    assert.equal(uses.length, 1);
    assert.deepEqual([uses[0].user, uses[0].target, uses[0].detail.requests], ["alice", alice.id, {
      train: 1,
      read: 3,
    }]);
  } finally {
    await t.cleanup();
  }
});

Deno.test("what an admin shares every user may use (a checkpoint and its models); the job itself stays its owner's", async () => {
  const t = await authServer();
  try {
    const alice = (await t.mint("alice", ["read", "train", "generate"])).token;
    const bob = (await t.mint("bob", ["read", "generate"])).token;
    const id = await t.train(alice);
    await fakeCheckpoint(t.root, id);
    assert.equal((await t.call(bob, "GET", `/v1/models/${id}`)).status, 404);
    await apiError(await t.call(bob, "POST", "/admin/shares", { kind: "checkpoint", id }), 403);
    // Only what exists: a name shared before anyone holds it would go to whoever takes it next.
    await apiError(
      await t.call(BOOT, "POST", "/admin/shares", { kind: "checkpoint", id: "job_ffffffffffff" }),
      404,
      {
        message: 'No checkpoint "job_ffffffffffff" to share',
        param: "id",
      },
    );
    await apiError(await t.call(BOOT, "POST", "/admin/shares", { kind: "dataset", id: "later" }), 404, {
      code: "dataset_not_found",
    });
    const shared = await t.call(BOOT, "POST", "/admin/shares", { kind: "checkpoint", id });
    assert.equal(shared.status, 201);
    const models = (await (await t.call(bob, "GET", "/v1/models")).json()).data.map((m: { id: string }) =>
      m.id
    );
    assert.deepEqual(models.sort(), [id, `${id}/iter_0000005`, "tiny"].sort());
    assert.equal((await t.call(bob, "GET", `/v1/models/${id}/iter_0000005`)).status, 200);
    assert.equal((await t.call(bob, "GET", `/jobs/${id}`)).status, 404, "the job itself stays alice's");
    assert.deepEqual(t.store.audit({ limit: 1 }).map((e) => [e.action, e.target]), [[
      "share",
      `checkpoint/${id}`,
    ]]);
  } finally {
    await t.cleanup();
  }
});

Deno.test("running_gpus counts a job's Workers: a data-parallel job on two GPUs holds two", async () => {
  const t = await authServer({ gpus: 2, quotas: { running_gpus: 2, queued_jobs: 100 } });
  try {
    const alice = (await t.mint("alice", ["read", "train"])).token;
    await until(() => t.runner.gpus().every((g) => g.state === "idle"), "both GPUs");
    const dp = await t.train(alice, { data_parallel: 2, batch_size: 4 });
    await until(() => t.workers.every((w) => w.jobs.some((j) => j.id === dp)), "both ranks");
    const me = await (await t.call(alice, "GET", "/auth/me")).json();
    assert.equal(me.usage.running_gpus, 2);
    assert.deepEqual(t.quotas.atRunningQuota(), ["alice"]);
  } finally {
    await t.cleanup();
  }
});
