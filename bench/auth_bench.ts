/**
 * `deno run -A bench/auth_bench.ts [--rounds 200] [--tokens 1000]`: what the token check costs a
 * request (issue 40's target: 0.2 ms at most). The same app (the real store, runner and routes, a
 * scripted GPU Worker) answers `GET /jobs?limit=1` in bursts of 64 concurrent requests, first with
 * no token configured (nothing checked), then with `--tokens` users' tokens in the store and each
 * request carrying one (hash, constant-time compare, scope, ownership filter), interleaved round
 * by round; then TokenAuth.check() alone. Prints the mean per request of each and the difference.
 */

import { parseArgs } from "node:util";
import { JobRunner, JobStore } from "../server/jobs/mod.ts";
import { createApp } from "../server/routes/mod.ts";
import { TokenAuth } from "../server/auth/mod.ts";
import { ScriptedWorker } from "../tests/fakes/fake_worker.ts";

const { values } = parseArgs({
  args: Deno.args,
  options: { rounds: { type: "string", default: "200" }, tokens: { type: "string", default: "1000" } },
});
const rounds = Number(values.rounds), count = Number(values.tokens), burst = 64;

function server(withTokens: boolean) {
  const store = new JobStore(":memory:");
  const runner = new JobRunner(store, {
    root: Deno.makeTempDirSync({ prefix: "gpt2_auth_bench_" }),
    gpus: 1,
    spawn: () => new ScriptedWorker(),
    datasetExists: () => Promise.resolve(true),
  });
  runner.start();
  const tokens = new TokenAuth(store, { bootstrap: withTokens ? ["bench-admin"] : [] });
  let token = "";
  for (let i = 0; withTokens && i < count; i++) {
    token = tokens.create({ user: `user${i % 100}`, scopes: ["read", "train", "generate"] }).token;
  }
  return { app: createApp({ runner, token: null, auth: { tokens } }), token, runner, store, tokens };
}

const open = server(false), checked = server(true);
const burstMs = async (s: typeof open) => {
  const headers: Record<string, string> = s.token ? { Authorization: `Bearer ${s.token}` } : {};
  const t0 = performance.now();
  const all = await Promise.all(
    Array.from({ length: burst }, () => s.app.request("/jobs?limit=1", { headers })),
  );
  for (const r of all) {
    if (r.status !== 200) throw new Error(`GET /jobs answered ${r.status}`);
    await r.body?.cancel();
  }
  return performance.now() - t0;
};
for (let i = 0; i < 20; i++) await burstMs(open), await burstMs(checked); // warm up
let a = 0, b = 0;
for (let i = 0; i < rounds; i++) {
  a += await burstMs(open);
  b += await burstMs(checked);
}
const perOpen = a / rounds / burst, perChecked = b / rounds / burst;
const n = 20_000, t0 = performance.now();
for (let i = 0; i < n; i++) checked.tokens.check(checked.token);
const check = (performance.now() - t0) / n;
console.log(
  `${rounds} bursts of ${burst} requests, ${count} tokens in the store: ` +
    `${(perOpen * 1000).toFixed(1)} µs per request with no token checked, ${
      (perChecked * 1000).toFixed(1)
    } µs with one; difference ${((perChecked - perOpen) * 1000).toFixed(1)} µs. ` +
    `TokenAuth.check() alone: ${(check * 1000).toFixed(2)} µs`,
);
for (const s of [open, checked]) {
  s.tokens.stop();
  s.runner.shutdown();
  s.store.close();
}
