/**
 * The job store's statements (server/jobs/store_sql.ts), written once for both engines: the `sql`
 * tag keeps each value beside its `?` placeholder in order, PostgreSQL's rendering only numbers
 * them, and a dialect changes nothing but the lease clock and the claim's row lock.
 */

import assert from "node:assert/strict";
import {
  join,
  numbered,
  POSTGRES_DIALECT,
  raw,
  read,
  SQL,
  sql,
  sqliteDialect,
} from "../../server/jobs/store_sql.ts";

Deno.test("sql`…` puts a placeholder for each value and inlines pieces with their values, in order", () => {
  const owners = join(["a", "b"].map((o) => sql`${o}`), ", ");
  const s = sql`select * from jobs where gpu = ${1} and owner in (${owners}) and error is ${null}${
    raw(" limit 1")
  }`;
  assert.equal(s.text, "select * from jobs where gpu = ? and owner in (?, ?) and error is ? limit 1");
  assert.deepEqual(s.args, [1, "a", "b", null]);
  assert.equal(
    numbered(s.text),
    "select * from jobs where gpu = $1 and owner in ($2, $3) and error is $4 limit 1",
  );
});

Deno.test("the dialects differ only in the lease clock and the claim's row lock", () => {
  const lease = { job_id: "j", host_id: "h", epoch: 3 };
  const lite = SQL.renew(lease, 1500, sqliteDialect(1000));
  assert.equal(
    lite.text,
    "update jobs set lease_until = ? where id = ? and host_id = ? and lease_epoch = ? returning cancel_requested",
  );
  assert.deepEqual(lite.args, [2500, "j", "h", 3]);
  const pg = SQL.renew(lease, 1500.4, POSTGRES_DIALECT);
  assert.match(
    pg.text,
    /^update jobs set lease_until = \(extract\(epoch from clock_timestamp\(\)\) \* 1000\)::bigint \+ \? where/,
  );
  assert.deepEqual(pg.args, [1500, "j", "h", 3]);

  const claim = (d: typeof POSTGRES_DIALECT) => SQL.claimNext("h", 2, 1000, false, ["u"], d);
  const [a, b] = [claim(sqliteDialect(0)), claim(POSTGRES_DIALECT)];
  assert.ok(!a.text.includes("for update") && b.text.includes("limit 1 for update skip locked)"));
  assert.deepEqual(a.args, ["h", 1000, 2, 0, 0, "u"]);
  assert.deepEqual(b.args, ["h", 1000, 2, 0, "u"]);
});

Deno.test("optional filters add their terms and values only when given", () => {
  assert.deepEqual(SQL.listJobs({}), { text: "select * from jobs order by seq desc limit ?", args: [100] });
  const page = SQL.listJobs({ status: "queued", owner: "ann", after: "job_1", limit: 5 });
  assert.equal(
    page.text,
    "select * from jobs where status = ? and owner = ? and seq < coalesce((select seq from jobs where id = ?), -1) " +
      "order by seq desc limit ?",
  );
  assert.deepEqual(page.args, ["queued", "ann", "job_1", 5]);
  assert.deepEqual(SQL.eventsAfter("j", 7, -1).args, ["j", 7]);
  assert.deepEqual(SQL.eventsAfter("j", 7, 10).args, ["j", 7, 10]);
  assert.equal(
    SQL.countByStatus("ann").text,
    "select status, count(*) as n from jobs where owner = ? group by status",
  );
  assert.equal(SQL.waitingCount().args.length, 0);
});

Deno.test("a claim's row and a heartbeat's renewals read the same on both engines", () => {
  assert.equal(read.claim(undefined, "h"), null);
  const row = {
    id: "j",
    status: "queued",
    gpu: "0",
    config: "{}",
    created_at: "t",
    iteration: 0,
    metrics: "{}",
    cancel_requested: 0,
    resumes: 0,
    lease_epoch: "4",
  };
  assert.deepEqual(read.claim(row, "h")!.lease, { job_id: "j", host_id: "h", epoch: 4 });
  const leases = [{ job_id: "a", host_id: "h", epoch: 1 }, { job_id: "b", host_id: "h", epoch: 1 }];
  assert.deepEqual(read.heartbeat(leases, [{ cancel_requested: "1" }, undefined]), {
    kept: [{ job_id: "a", cancel_requested: true }],
    lost: ["b"],
  });
});
