/**
 * `deno task bench hosts [--jobs 20] [--hosts 1,2] [--smoke] [--pg-bin DIR] [--pg-lib DIR] …`:
 * many GPU hosts, one service (issue 29). For each host count it starts that many servers
 * (main.ts with `deno task serve`'s permissions, `GPT2_GPUS=1` each, their own `GPT2_HOME`) on one
 * throwaway PostgreSQL cluster (`initdb` in a temp folder, as tests/_postgres.ts) and one
 * `GPT2_SHARED_DIR`, submits `--jobs` short training jobs at once (round robin over the hosts:
 * the queue is shared, any host may run any job), waits for all of them, and reports jobs per
 * hour (jobs / (last finish − first submit)), queue wait (a job's start − its submission) at p50
 * and max, run time per job, and how many jobs each host ran. The builtin dataset is prepared in
 * the shared folder first, and one warm-up job per host runs before the timed ones (each host
 * opens its device and compiles its kernels; they land in the driver's shader cache too).
 *
 * `--smoke`: the GPU machine's check, two servers sharing the one GPU through one database
 * (hosts 2 only unless `--hosts` says otherwise, 8 jobs unless `--jobs` says otherwise); it fails
 * (exit 1) unless every job succeeded and both hosts ran some.
 *
 * Needs PostgreSQL's server binaries (initdb, pg_ctl, postgres; any version from 12): found on
 * PATH or in /usr/lib/postgresql/N/bin, or given by `--pg-bin DIR`, with `--pg-lib DIR` for
 * shared libraries they need that the machine lacks. As root the cluster runs as the `postgres`
 * user, or `nobody` where there is none (the binaries must then be readable by all: /tmp is).
 *
 * Options: --jobs N, --hosts 1,2, --model gpt2-tiny, --iters 20, --batch 4, --seq 32, --lease 10
 * (GPT2_LEASE_S), --timeout 1800 (s, for the whole run), --json FILE (the figures as JSON).
 */

import { isPostgresBin, POSTGRES_BIN, startPostgres } from "../tests/_postgres.ts";
import { prepareDataset } from "../data/mod.ts";

const USAGE = "deno task bench hosts [--jobs N] [--hosts 1,2] [--smoke] [--pg-bin DIR] [--pg-lib DIR] " +
  "[--model NAME] [--iters N] [--batch N] [--seq N] [--lease S] [--timeout S] [--json FILE]";

/** Parsed options; a bad one exits 2 naming it. */
function options() {
  const flags = new Set(["smoke"]);
  const known = new Set([
    "jobs",
    "hosts",
    "pg-bin",
    "pg-lib",
    "model",
    "iters",
    "batch",
    "seq",
    "lease",
    "timeout",
    "json",
  ]);
  const args = new Map<string, string>();
  const fail = (msg: string): never => {
    console.error(`${msg}\nusage: ${USAGE}`);
    Deno.exit(2);
  };
  for (let i = 0; i < Deno.args.length; i++) {
    const a = Deno.args[i];
    const name = a.replace(/^--/, "");
    if (!a.startsWith("--")) fail(`Unexpected argument "${a}"`);
    if (flags.has(name)) {
      args.set(name, "true");
      continue;
    }
    if (!known.has(name)) fail(`Unknown option "${a}"`);
    const value = Deno.args[++i];
    if (value === undefined) fail(`Option "${a}" needs a value`);
    args.set(name, value);
  }
  const smoke = args.has("smoke");
  const int = (name: string, def: number, min = 1) => {
    const raw = args.get(name);
    const v = raw === undefined ? def : Number(raw);
    if (!Number.isInteger(v) || v < min) fail(`Invalid --${name} "${raw}": expected an integer >= ${min}`);
    return v;
  };
  const hosts = (args.get("hosts") ?? (smoke ? "2" : "1,2")).split(",").map(Number);
  if (hosts.some((h) => !Number.isInteger(h) || h < 1 || h > 8)) {
    fail(`Invalid --hosts "${args.get("hosts")}": expected host counts from 1 to 8, comma-separated`);
  }
  const pgBin = args.get("pg-bin") ?? POSTGRES_BIN;
  if (!pgBin || !isPostgresBin(pgBin)) {
    fail(
      (pgBin
        ? `No initdb and pg_ctl in "${pgBin}" (--pg-bin).`
        : "This benchmark needs PostgreSQL's server binaries (initdb, pg_ctl, postgres; version 12 or later), " +
          "and none were found on PATH or in /usr/lib/postgresql/N/bin.") +
        " Install them (Debian and Ubuntu: apt-get install postgresql) or pass --pg-bin <folder holding initdb " +
        "and pg_ctl>, with --pg-lib <folder> for shared libraries they need that this machine lacks.",
    );
  }
  const pgLib = args.get("pg-lib");
  if (pgLib !== undefined) {
    try {
      if (!Deno.statSync(pgLib).isDirectory) throw new Error("not a folder");
    } catch (e) {
      fail(`Invalid --pg-lib "${pgLib}": ${(e as Error).message}`);
    }
  }
  return {
    smoke,
    jobs: int("jobs", smoke ? 8 : 20),
    hosts,
    pgBin: pgBin!,
    pgLib,
    model: args.get("model") ?? "gpt2-tiny",
    iters: int("iters", 20),
    batch: int("batch", 4),
    seq: int("seq", 32),
    lease: int("lease", 10),
    timeoutS: int("timeout", 1800),
    json: args.get("json") ?? null,
  };
}

const opts = options();
const REPO = new URL("..", import.meta.url).pathname;

/** `deno task serve`'s permission flags, read from deno.json so the servers run as that task does. */
function serveFlags(): string[] {
  const task: string = JSON.parse(Deno.readTextFileSync(`${REPO}/deno.json`)).tasks.serve;
  const words = task.split(/\s+/);
  const flags = words.slice(words.indexOf("run") + 1, words.indexOf("main.ts"));
  if (flags.length === 0 || !flags.every((f) => f.startsWith("--"))) {
    throw new Error(`Cannot read the serve task's flags from deno.json: "${task}"`);
  }
  return flags;
}

interface Host {
  id: string;
  url: string;
  child: Deno.ChildProcess;
  log: string[];
}

/** Starts one server and waits for its listening line and `/ready`. */
async function startHost(id: string, home: string, env: Record<string, string>): Promise<Host> {
  const child = new Deno.Command(Deno.execPath(), {
    args: ["run", ...serveFlags(), "main.ts"],
    cwd: REPO,
    env: {
      PORT: "0",
      HOST: "127.0.0.1",
      GPT2_HOME: home,
      GPT2_HOST_ID: id,
      GPT2_GPUS: "1",
      DENO_WEBGPU_BACKEND: Deno.env.get("DENO_WEBGPU_BACKEND") ?? "vulkan",
      ...env,
    },
    stdout: "piped",
    stderr: "piped",
  }).spawn();
  const log: string[] = [];
  const url = Promise.withResolvers<string>();
  const read = async (stream: ReadableStream<Uint8Array>) => {
    let buffered = "";
    const decoder = new TextDecoder();
    for await (const bytes of stream) {
      const chunk = decoder.decode(bytes, { stream: true });
      log.push(chunk);
      if (log.length > 400) log.splice(0, 200);
      buffered = (buffered + chunk).slice(-4096);
      const m = buffered.match(/listening on (http:\/\/127\.0\.0\.1:\d+)\//);
      if (m) url.resolve(m[1]);
    }
  };
  read(child.stdout).catch(() => {});
  read(child.stderr).catch(() => {});
  child.status.then((s) =>
    url.reject(new Error(`${id} exited (${s.code}) before listening:\n${log.join("")}`))
  );
  const timer = setTimeout(
    () => url.reject(new Error(`${id} did not start in 120 s:\n${log.join("")}`)),
    120_000,
  );
  try {
    const host = { id, url: await url.promise, child, log };
    const deadline = Date.now() + 120_000;
    while ((await fetch(`${host.url}/ready`).then((r) => (r.body?.cancel(), r.status))) !== 200) {
      if (Date.now() > deadline) throw new Error(`${id} not ready in 120 s:\n${log.join("")}`);
      await new Promise((r) => setTimeout(r, 200));
    }
    return host;
  } finally {
    clearTimeout(timer);
  }
}

/** Stops a server gracefully (SIGTERM), or kills it after 30 s. */
async function stopHost(h: Host): Promise<void> {
  try {
    h.child.kill("SIGTERM");
  } catch {
    return; // already gone
  }
  const killer = setTimeout(() => {
    try {
      h.child.kill("SIGKILL");
    } catch {
      // gone meanwhile
    }
  }, 30_000);
  await h.child.status;
  clearTimeout(killer);
}

async function api(url: string, init?: RequestInit): Promise<Record<string, unknown>> {
  const res = await fetch(url, init);
  const body = await res.json();
  if (!res.ok) throw new Error(`${init?.method ?? "GET"} ${url}: ${res.status} ${JSON.stringify(body)}`);
  return body;
}

function jobBody(): Record<string, unknown> {
  return {
    model: opts.model,
    dataset: "sotu",
    train_iters: opts.iters,
    batch_size: opts.batch,
    seq_len: opts.seq,
    log_interval: Math.max(1, Math.floor(opts.iters / 2)),
    eval_interval: 0,
    eval_iters: 1,
    save_interval: 0,
    keep_checkpoints: 1,
  };
}

/** The host a job ran on last, from its "Running on GPU … of host "…"" events. */
async function ranOn(url: string, id: string): Promise<string | null> {
  const res = await fetch(`${url}/jobs/${id}/events`);
  const reader = res.body!.pipeThrough(new TextDecoderStream()).getReader();
  let text = "", host: string | null = null;
  const deadline = setTimeout(() => reader.cancel().catch(() => {}), 10_000);
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      text += value;
      for (const m of text.matchAll(/of host \\"([^"\\]+)\\"/g)) host = m[1];
      if (/^event: done$/m.test(text)) break;
    }
  } catch {
    // cancelled by the deadline
  } finally {
    clearTimeout(deadline);
    await reader.cancel().catch(() => {});
  }
  return host;
}

const ms = (iso: unknown) => Date.parse(String(iso));
function quantile(sorted: number[], q: number): number {
  if (sorted.length === 0) return NaN;
  const i = (sorted.length - 1) * q, lo = Math.floor(i), hi = Math.ceil(i);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (i - lo);
}

interface Result {
  hosts: number;
  jobs: number;
  succeeded: number;
  makespan_s: number;
  jobs_per_hour: number;
  queue_wait_p50_s: number;
  queue_wait_max_s: number;
  run_p50_s: number;
  per_host: Record<string, number>;
  /** The machine's 1-minute load average as the timed jobs were submitted and once they had finished. */
  load_before: number;
  load_after: number;
}

/** One timed run on `n` hosts sharing a fresh database and the prepared shared folder. */
async function runHosts(n: number, db: string, shared: string, tmp: string): Promise<Result> {
  const hosts: Host[] = [];
  try {
    const env = { GPT2_DATABASE_URL: db, GPT2_SHARED_DIR: shared, GPT2_LEASE_S: String(opts.lease) };
    // One at a time: each GPU host opens its device while the previous ones are already up.
    for (let i = 0; i < n; i++) {
      hosts.push(await startHost(`host-${i + 1}`, `${tmp}/home-${n}-${i + 1}`, env));
    }
    // A warm-up job per host, at once: each host (one GPU) claims one, and opens its device and
    // compiles its kernels before the timed jobs.
    const t0 = performance.now();
    const warm: string[] = [];
    for (const h of hosts) {
      const job = await api(`${h.url}/train`, {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(jobBody()),
      });
      warm.push(String(job.id));
    }
    await waitAll(hosts[0].url, warm);
    const warmed = new Set(await Promise.all(warm.map((id) => ranOn(hosts[0].url, id))));
    console.log(
      `  ${n} host(s) up; warm-up jobs done in ${((performance.now() - t0) / 1000).toFixed(1)} s ` +
        `on ${warmed.size} of them`,
    );
    const loadBefore = Deno.loadavg()[0];
    const ids: string[] = [];
    for (let i = 0; i < opts.jobs; i++) {
      const job = await api(`${hosts[i % n].url}/train`, {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(jobBody()),
      });
      ids.push(String(job.id));
    }
    const jobs = await waitAll(hosts[0].url, ids);
    const loadAfter = Deno.loadavg()[0];
    const waits = jobs.map((j) => (ms(j.started_at) - ms(j.created_at)) / 1000).sort((a, b) => a - b);
    const runs = jobs.map((j) => (ms(j.finished_at) - ms(j.started_at)) / 1000).sort((a, b) => a - b);
    const first = Math.min(...jobs.map((j) => ms(j.created_at)));
    const last = Math.max(...jobs.map((j) => ms(j.finished_at)));
    const makespan = (last - first) / 1000;
    const per_host: Record<string, number> = {};
    for (const id of ids) {
      const h = (await ranOn(hosts[0].url, id)) ?? "unknown";
      per_host[h] = (per_host[h] ?? 0) + 1;
    }
    const failed = jobs.filter((j) => j.status !== "succeeded");
    for (const j of failed) console.error(`  job ${j.id} ${j.status}: ${j.error}`);
    return {
      hosts: n,
      jobs: jobs.length,
      succeeded: jobs.length - failed.length,
      makespan_s: makespan,
      jobs_per_hour: (jobs.length / makespan) * 3600,
      queue_wait_p50_s: quantile(waits, 0.5),
      queue_wait_max_s: waits.at(-1)!,
      run_p50_s: quantile(runs, 0.5),
      per_host,
      load_before: loadBefore,
      load_after: loadAfter,
    };
  } catch (e) {
    for (const h of hosts) console.error(`--- ${h.id} log tail ---\n${h.log.join("").slice(-3000)}`);
    throw e;
  } finally {
    await Promise.all(hosts.map(stopHost));
  }
}

/** Polls until every job has finished; returns their records. */
async function waitAll(url: string, ids: string[]): Promise<Record<string, unknown>[]> {
  const deadline = Date.now() + opts.timeoutS * 1000;
  for (;;) {
    const jobs = await Promise.all(ids.map((id) => api(`${url}/jobs/${id}`)));
    if (jobs.every((j) => ["succeeded", "failed", "cancelled"].includes(String(j.status)))) return jobs;
    if (Date.now() > deadline) {
      throw new Error(
        `Jobs unfinished after ${opts.timeoutS} s (--timeout): ` +
          jobs.filter((j) => !["succeeded", "failed", "cancelled"].includes(String(j.status)))
            .map((j) => `${j.id} ${j.status}`).join(", "),
      );
    }
    await new Promise((r) => setTimeout(r, 250));
  }
}

const tmp = await Deno.makeTempDir({ prefix: "gpt2_hosts_bench_" });
// As root the cluster runs as another user, who must reach its folder under this one.
await Deno.chmod(tmp, 0o755);
console.log(
  `hosts bench: ${opts.jobs} jobs of ${opts.model} (${opts.iters} steps, batch ${opts.batch} × ${opts.seq}) ` +
    `on ${opts.hosts.join(" and ")} host(s), PostgreSQL from ${opts.pgBin}` +
    (opts.smoke ? " (smoke)" : ""),
);
const pg = await startPostgres({ bin: opts.pgBin, libDir: opts.pgLib });
const results: Result[] = [];
try {
  const shared = `${tmp}/shared`;
  const t = performance.now();
  await prepareDataset(shared, { builtin: "sotu" });
  console.log(`  dataset prepared in the shared folder in ${((performance.now() - t) / 1000).toFixed(1)} s`);
  for (const n of opts.hosts) {
    const r = await runHosts(n, await pg.database(), shared, tmp);
    results.push(r);
    console.log(
      `  ${n} host(s): ${r.succeeded}/${r.jobs} succeeded in ${r.makespan_s.toFixed(1)} s: ` +
        `${r.jobs_per_hour.toFixed(0)} jobs/h, queue wait p50 ${r.queue_wait_p50_s.toFixed(1)} s, ` +
        `max ${r.queue_wait_max_s.toFixed(1)} s, run p50 ${r.run_p50_s.toFixed(1)} s, per host ` +
        `${JSON.stringify(r.per_host)}, load ${r.load_before.toFixed(1)} → ${r.load_after.toFixed(1)} ` +
        `on ${navigator.hardwareConcurrency} cores`,
    );
  }
} finally {
  await pg.stop();
  await Deno.remove(tmp, { recursive: true }).catch(() => {});
}

console.log(
  "\n| hosts | jobs | succeeded | makespan (s) | jobs/hour | queue wait p50 (s) | max (s) | run p50 (s) | jobs per host |",
);
console.log(
  "| ----- | ---- | --------- | ------------ | --------- | ------------------ | ------- | ----------- | ------------- |",
);
for (const r of results) {
  console.log(
    `| ${r.hosts} | ${r.jobs} | ${r.succeeded} | ${r.makespan_s.toFixed(1)} | ${
      r.jobs_per_hour.toFixed(0)
    } | ` +
      `${r.queue_wait_p50_s.toFixed(1)} | ${r.queue_wait_max_s.toFixed(1)} | ${r.run_p50_s.toFixed(1)} | ` +
      `${Object.entries(r.per_host).map(([h, c]) => `${h}: ${c}`).join(", ")} |`,
  );
}
const summary = { date: new Date().toISOString(), options: opts, results };
console.log(JSON.stringify(summary));
if (opts.json) await Deno.writeTextFile(opts.json, JSON.stringify(summary, null, 2) + "\n");

let bad = results.some((r) => r.succeeded !== r.jobs);
if (opts.smoke) {
  for (const r of results) {
    const used = Object.keys(r.per_host).filter((h) => h !== "unknown").length;
    if (r.hosts > 1 && used < 2) {
      console.error(`smoke: only ${used} of ${r.hosts} hosts ran jobs`);
      bad = true;
    }
  }
  console.log(bad ? "smoke: FAILED" : "smoke: ok (every job succeeded, every host ran jobs)");
}
Deno.exit(bad ? 1 : 0);
