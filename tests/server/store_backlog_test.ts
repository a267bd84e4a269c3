/**
 * The runner's writes while the job store is away (server/jobs/store_backlog.ts): kept in order,
 * applied once the store answers, nested writes in place, other errors never hold the queue, and
 * the state `/health` shows. Also which errors count as an unreachable store.
 */

import assert from "node:assert/strict";
import { StoreBacklog } from "../../server/jobs/store_backlog.ts";
import { isStoreUnavailable, StoreUnavailableError } from "../../server/jobs/job_store.ts";
import { until } from "../_wait.ts";

/** A store that is away while `down` is set: each write appends to `rows`. */
function fakeStore() {
  const s = {
    down: false,
    rows: [] as string[],
    write(row: string) {
      if (s.down) throw new StoreUnavailableError("connection refused");
      s.rows.push(row);
    },
    probe: () => s.down ? "connection refused" : null,
  };
  return s;
}

Deno.test("store backlog: writes wait in order while the store is away and land once it answers", async () => {
  const store = fakeStore();
  let recovered = 0, lost = 0;
  const b = new StoreBacklog({
    probe: store.probe,
    retryMs: 5,
    maxRetryMs: 20,
    onLost: () => lost++,
    onRecovered: () => recovered++,
  });
  b.write(() => store.write("a"));
  assert.deepEqual(store.rows, ["a"]);
  assert.equal(b.state().state, "ok");

  store.down = true;
  b.write(() => store.write("b"));
  assert.equal(b.reachable, false);
  const down = b.state();
  assert.equal(down.state, "unreachable");
  assert.match(down.error!, /connection refused/);
  assert.ok(Date.parse(down.since!) <= Date.now());
  // Later writes queue behind it without touching the store, a nested one runs inside its parent.
  b.write(() => {
    store.write("c");
    b.write(() => store.write("c.1"));
  });
  b.write(() => store.write("d"), "metric");
  assert.equal(b.state().pending, 3);
  assert.equal(lost, 1);
  await new Promise((r) => setTimeout(r, 50)); // several tries, all refused
  assert.deepEqual(store.rows, ["a"]);
  assert.equal(lost, 1, "one outage is reported once");

  store.down = false;
  await until(() => b.reachable, "the backlog to flush", 2000);
  assert.deepEqual(store.rows, ["a", "b", "c", "c.1", "d"]);
  assert.equal(recovered, 1);
  assert.deepEqual(b.state(), { state: "ok", since: null, error: null, pending: 0, dropped: 0 });
  b.write(() => store.write("e"));
  assert.deepEqual(store.rows.at(-1), "e");
  b.stop();
});

Deno.test("store backlog: a write failing otherwise is thrown now, or dropped from the queue without holding it", async () => {
  const store = fakeStore();
  const b = new StoreBacklog({ probe: store.probe, retryMs: 5 });
  assert.throws(
    () => b.write(() => store.write(undefined as unknown as string) ?? JSON.parse("{")),
    SyntaxError,
  );
  store.down = true;
  b.write(() => store.write("x"));
  b.write(() => {
    throw new Error("bad row");
  });
  b.write(() => store.write("y"));
  const logged: string[] = [];
  const error = console.error;
  console.error = (m: string) => logged.push(m);
  try {
    store.down = false;
    await until(() => b.reachable, "the backlog to flush", 2000);
  } finally {
    console.error = error;
  }
  assert.deepEqual(store.rows.slice(-2), ["x", "y"]);
  assert.ok(logged.some((m) => m.includes("bad row")), logged.join("\n"));
  b.stop();
});

Deno.test("store backlog: past its limit the oldest metric points go first, other records never", () => {
  const store = fakeStore();
  store.down = true;
  const b = new StoreBacklog({ probe: store.probe, retryMs: 60_000, limit: 3 });
  b.write(() => store.write("event 1"));
  b.write(() => store.write("metric 1"), "metric");
  b.write(() => store.write("metric 2"), "metric");
  b.write(() => store.write("event 2"));
  assert.equal(b.state().pending, 3);
  assert.equal(b.state().dropped, 1);
  store.down = false;
  b.flush();
  assert.deepEqual(store.rows, ["event 1", "metric 2", "event 2"]);
  b.stop();
});

Deno.test("store backlog: with nothing to write, the probe alone finds the store back", async () => {
  let down = true;
  const b = new StoreBacklog({ probe: () => down ? "no answer" : null, retryMs: 5 });
  assert.equal(b.failed(new Error("a bug, not an outage")), false);
  assert.equal(b.reachable, true);
  assert.equal(b.failed(new StoreUnavailableError("PostgreSQL did not answer")), true);
  assert.equal(b.reachable, false);
  await new Promise((r) => setTimeout(r, 30));
  assert.equal(b.reachable, false);
  down = false;
  await until(() => b.reachable, "the probe to pass", 2000);
  b.stop();
});

Deno.test("which errors are an unreachable store", () => {
  assert.ok(isStoreUnavailable(new StoreUnavailableError("x")));
  for (const code of ["ECONNREFUSED", "CONNECTION_CLOSED", "CONNECT_TIMEOUT", "57P01", "57P03", "08006"]) {
    assert.ok(isStoreUnavailable(Object.assign(new Error(code), { code })), code);
  }
  // SQLite: busy, locked, I/O error, disk full (extended codes keep the primary in the low byte).
  for (const errcode of [5, 6, 10, 13, 14, 10 | (4 << 8)]) {
    assert.ok(isStoreUnavailable(Object.assign(new Error("x"), { code: "ERR_SQLITE_ERROR", errcode })));
  }
  assert.ok(!isStoreUnavailable(Object.assign(new Error("x"), { code: "ERR_SQLITE_ERROR", errcode: 19 })));
  assert.ok(!isStoreUnavailable(Object.assign(new Error("dup"), { code: "23505" })));
  assert.ok(!isStoreUnavailable(new TypeError("bug")));
  assert.ok(!isStoreUnavailable(null));
});
