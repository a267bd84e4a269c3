/**
 * `deno task bench faults [--only sigint,sigterm,…] [--json FILE] [--model gpt2-tiny] [--iters N]`:
 * the fault matrix (issue 37). It breaks things the way operations and users do, against the real
 * server started exactly as README says: `deno task serve` in a process group of its own
 * (`detached`), with LD_LIBRARY_PATH set as on a GPU host, GPT2_HOME a temporary folder, PORT=0,
 * HOST=127.0.0.1. Each fault runs small jobs (batch 2, seq_len 16, log_interval 1) and reports what
 * happened to each: finished, resumed (and finished), failed with the reason, or hung (neither
 * finished nor advanced for 120 s, counted over the fault's jobs together, since they share the
 * GPUs), and the steps lost: the iteration a job had reached when the fault hit minus the
 * iteration it resumed from (what a crash costs: the steps since its newest checkpoint), with
 * how many of those lie beyond its newest checkpoint (target 0: it resumed from the newest).
 * "Graceful-stop steps lost" counts, for the faults that stop the server gracefully, the steps a
 * job had reported past the iteration the stop saved (target 0). Everything is read from the
 * job's own event stream (`GET /jobs/:id/events`, replayed once the job ended) and records.
 *
 * The faults (`--only` takes their keys):
 *  1. `sigint`: Ctrl-C (SIGINT to the group) mid-job with no periodic checkpoint, then
 *     `deno task serve` again on the same GPT2_HOME: resumes at the step it stopped at, finishes.
 *  2. `sigterm`: `kill -TERM -PGID` likewise. 3. `systemd`: systemd's stop (SIGTERM to the group
 *     and to the GPU host's pid from /health, which runs in a session of its own) likewise.
 *  4. `docker`: docker stop, `unshare --pid --fork --mount-proc deno task serve` with SIGTERM to
 *     `deno task` (PID 1 of the namespace) alone (skipped, saying why, where unshare fails).
 *  5. `postgres`: two servers on one throwaway PostgreSQL cluster (tests/_postgres.ts), one
 *     GPT2_SHARED_DIR, GPT2_LEASE_S=3; 2 jobs running past their first checkpoint (save_interval 5)
 *     and 1 queued when the database halts for 8 s (`pg_ctl stop -m immediate`), then starts
 *     again: all finish; the /health codes seen during the outage are reported (expected 503,
 *     never 500), and any request (/health, or a static page that needs no store) that took over
 *     5 s is a finding. Steps a host trained while the store was away and then gave up with its
 *     lost lease were never recorded, so they are not in its steps lost. Skipped without
 *     PostgreSQL's binaries.
 *  6. `host-kill`: the GPU host SIGKILLed mid-step (save_interval 5): resumes from its newest
 *     checkpoint. 7. `server-kill`: the server's whole group SIGKILLed mid-job, restarted: likewise.
 *  8. `enospc`: GPT2_HOME/checkpoints on a tmpfs sized (after measuring one checkpoint of the
 *     model with a 1-step job) so that the job's first checkpoint fits and its second does not:
 *     the job fails naming ENOSPC and the checkpoint's path, and the one before loads and verifies
 *     (checkpoint/checkpoint.ts loadCheckpoint: sizes and SHA-256 from its manifest). Skipped,
 *     saying why, where mounting a tmpfs is not allowed (not root).
 *  9. `corrupt`: the newest checkpoint's model.safetensors has bytes flipped in its middle while
 *     the server is stopped: the restart resumes from the previous one with a warn event, finishes.
 * 10. `fp16`: a 10-step fp16 job succeeds (skipped with the server's reason when the adapter lacks
 *     shader-f16, as the server then refuses it with 400).
 *
 * Job length: `--iters` (default 40 on a CPU adapter such as lavapipe, 400 on a GPU, so a fault
 * still lands mid-job where steps take milliseconds); the faults fire at a quarter of it, or
 * after the checkpoints they need. The whole matrix takes about three and a half minutes on two
 * CPU cores with lavapipe. Every wait has a deadline and says what it waited for; every process
 * (the servers' groups, GPU hosts left in their own sessions, PostgreSQL), mount and temporary
 * folder is cleaned up at the end of each fault, also when it fails, and on Ctrl-C of the bench.
 *
 * At the end: a Markdown table for bench/RESULTS.md (one row per fault), the date, the adapter
 * (/health's gpus[].adapter) and the command line, then each finding (a fault that did not behave
 * as issue 37 expects). Exit status 1 when there was a finding or a fault could not be run.
 * `--json FILE` writes every fault's raw results.
 */

import { POSTGRES_BIN, startPostgres } from "../tests/_postgres.ts";
import { prepareDataset } from "../data/mod.ts";
import { listCheckpoints, loadCheckpoint } from "../checkpoint/checkpoint.ts";
import { trainingModel } from "../job/job_config.ts";
import type { TrainConfig } from "../job/job.ts";

const REPO = new URL("..", import.meta.url).pathname.replace(/\/$/, "");
const USAGE = "deno task bench faults [--only KEY,KEY] [--json FILE] [--model NAME] [--iters N]";
/** A job that neither finishes nor advances for this long is hung. */
const HUNG_MS = 120_000;
/** The longest any one wait for jobs to end may take, whatever they do. */
const SETTLE_CAP_MS = 900_000;
const START_MS = 180_000;
const STOP_MS = 90_000;
const TRIGGER_MS = 240_000;
/** How long PostgreSQL stays down in the `postgres` fault. */
const OUTAGE_MS = 8_000;
/** The longest a request during the outage is waited for, and what counts as slow (a probe's timeout). */
const HEALTH_MS = 30_000;
const SLOW_MS = 5_000;

// ---------------------------------------------------------------------------------------------
// Options

interface Options {
  only: string[] | null;
  json: string | null;
  model: string;
  iters: number | null;
}

function options(keys: string[]): Options {
  const known = new Set(["only", "json", "model", "iters"]);
  const args = new Map<string, string>();
  const fail = (msg: string): never => {
    console.error(`${msg}\nusage: ${USAGE}\nfaults: ${keys.join(", ")}`);
    Deno.exit(2);
  };
  for (let i = 0; i < Deno.args.length; i++) {
    const a = Deno.args[i];
    if (a === "--help" || a === "-h") {
      console.log(`usage: ${USAGE}\nfaults: ${keys.join(", ")}`);
      Deno.exit(0);
    }
    const eq = a.indexOf("=");
    const name = a.replace(/^--/, "").split("=")[0];
    if (!a.startsWith("--") || !known.has(name)) fail(`Unknown argument "${a}"`);
    const value = eq >= 0 ? a.slice(eq + 1) : Deno.args[++i];
    if (value === undefined) fail(`Option "--${name}" needs a value`);
    args.set(name, value);
  }
  const only = args.has("only") ? args.get("only")!.split(",").map((s) => s.trim()).filter(Boolean) : null;
  const unknown = only?.filter((k) => !keys.includes(k)) ?? [];
  if (unknown.length > 0) fail(`Unknown fault "${unknown.join(", ")}" in --only`);
  const raw = args.get("iters");
  const iters = raw === undefined ? null : Number(raw);
  if (iters !== null && !(Number.isInteger(iters) && iters >= 16)) {
    fail(`Invalid --iters "${raw}": expected an integer >= 16`);
  }
  return { only, json: args.get("json") ?? null, model: args.get("model") ?? "gpt2-tiny", iters };
}

// ---------------------------------------------------------------------------------------------
// Small helpers

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
const t0 = performance.now();
const clock = () => ((performance.now() - t0) / 1000).toFixed(1).padStart(6);

/** `fn` or a rejection naming `what` after `ms`. */
async function deadline<T>(p: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  try {
    return await Promise.race([
      p,
      new Promise<never>((_, reject) => {
        timer = setTimeout(() => reject(new Error(`Timed out after ${ms / 1000} s waiting for ${what}`)), ms);
      }),
    ]);
  } finally {
    clearTimeout(timer);
  }
}

/** GET (or POST with `body`) `url` as JSON, within `ms`. */
async function http(
  url: string,
  body?: unknown,
  ms = 15_000,
): Promise<{ status: number; body: Record<string, unknown> }> {
  const res = await fetch(url, {
    method: body === undefined ? "GET" : "POST",
    headers: body === undefined ? {} : { "Content-Type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body),
    signal: AbortSignal.timeout(ms),
  });
  const text = await res.text();
  let json: Record<string, unknown>;
  try {
    json = JSON.parse(text);
  } catch {
    json = { text };
  }
  return { status: res.status, body: json };
}

async function run(cmd: string[]): Promise<{ ok: boolean; out: string }> {
  try {
    const o = await new Deno.Command(cmd[0], { args: cmd.slice(1), stdout: "piped", stderr: "piped" })
      .output();
    const dec = new TextDecoder();
    return { ok: o.success, out: (dec.decode(o.stdout) + dec.decode(o.stderr)).trim() };
  } catch (e) {
    return { ok: false, out: (e as Error).message };
  }
}

/** Pids of processes (not this one) whose command line mentions `text`. */
async function pidsMentioning(text: string): Promise<number[]> {
  const { out } = await run(["ps", "-eo", "pid=,args="]);
  return out.split("\n").flatMap((line) => {
    const m = line.trim().match(/^(\d+)\s+(.*)$/);
    return m && m[2].includes(text) && Number(m[1]) !== Deno.pid && !m[2].startsWith("ps ")
      ? [Number(m[1])]
      : [];
  });
}

const isCpuAdapter = (adapter: string) => /llvmpipe|lavapipe|swiftshader|softpipe/i.test(adapter);

// ---------------------------------------------------------------------------------------------
// The server, as `deno task serve`

interface Server {
  label: string;
  home: string;
  pid1: boolean;
  child: Deno.ChildProcess;
  url: string;
  exited: boolean;
  exit: Promise<Deno.CommandStatus>;
  output(): string;
}

/** Starts `deno task serve` in its own group (as PID 1 of a PID namespace with `pid1`); waits for /ready. */
async function serve(
  ctx: Ctx,
  label: string,
  home: string,
  env: Record<string, string> = {},
  pid1 = false,
): Promise<Server> {
  const task = [Deno.execPath(), "task", "serve"];
  const argv = pid1 ? ["unshare", "--pid", "--fork", "--mount-proc", ...task] : task;
  const child = new Deno.Command(argv[0], {
    args: argv.slice(1),
    cwd: REPO,
    env: {
      PORT: "0",
      HOST: "127.0.0.1",
      GPT2_HOME: home,
      DENO_WEBGPU_BACKEND: Deno.env.get("DENO_WEBGPU_BACKEND") ?? "vulkan",
      // What CUDA hosts and their containers set; Deno's scoped --allow-run refuses it.
      LD_LIBRARY_PATH: Deno.env.get("LD_LIBRARY_PATH") ?? "/usr/local/lib",
      NO_COLOR: "1",
      ...env,
    },
    stdin: "null",
    stdout: "piped",
    stderr: "piped",
    detached: true,
  }).spawn();
  let text = "";
  const listening = Promise.withResolvers<string>();
  const pump = async (stream: ReadableStream<Uint8Array>) => {
    const decoder = new TextDecoder();
    for await (const chunk of stream) {
      text += decoder.decode(chunk, { stream: true });
      if (text.length > 400_000) text = text.slice(-200_000);
      const m = text.match(/listening on (http:\/\/127\.0\.0\.1:\d+)\//);
      if (m) listening.resolve(m[1]);
    }
  };
  pump(child.stdout).catch(() => {});
  pump(child.stderr).catch(() => {});
  const server: Server = {
    label,
    home,
    pid1,
    child,
    url: "",
    exited: false,
    exit: child.status,
    output: () => text,
  };
  ctx.servers.push(server);
  child.status.then((s) => {
    server.exited = true;
    listening.reject(
      new Error(`${label} exited (code ${s.code}, signal ${s.signal}) before listening:\n${tail(text)}`),
    );
  });
  server.url = await deadline(listening.promise, START_MS, `${label} to print its listening line`);
  const until = Date.now() + START_MS;
  for (;;) {
    const ready = await http(`${server.url}/ready`).catch(() => null);
    if (ready?.status === 200) break;
    if (server.exited) throw new Error(`${label} exited before /ready answered 200:\n${tail(text)}`);
    if (Date.now() > until) {
      throw new Error(
        `${label} not ready in ${START_MS / 1000} s: ${JSON.stringify(ready?.body)}\n${tail(text)}`,
      );
    }
    await sleep(100);
  }
  ctx.log(`${label} up at ${server.url}${pid1 ? " (PID 1 of its own PID namespace)" : ""}`);
  return server;
}

const tail = (text: string, lines = 15) => text.trim().split("\n").slice(-lines).join("\n");

/** Waits for the server to exit (SIGKILL to its group past `ms`); the exit and seconds it took. */
async function exited(
  ctx: Ctx,
  s: Server,
  ms = STOP_MS,
): Promise<{ code: number | null; signal: string | null; s: number; killed: boolean }> {
  const start = performance.now();
  try {
    const st = await deadline(s.exit, ms, `${s.label} to exit`);
    return { code: st.code, signal: st.signal, s: (performance.now() - start) / 1000, killed: false };
  } catch (e) {
    ctx.log(`${(e as Error).message}: SIGKILL to its group`);
    killGroup(s);
    const st = await deadline(s.exit, 10_000, `${s.label} to die of SIGKILL`).catch(() => null);
    return {
      code: st?.code ?? null,
      signal: st?.signal ?? null,
      s: (performance.now() - start) / 1000,
      killed: true,
    };
  }
}

function killGroup(s: Server, signal: Deno.Signal = "SIGKILL"): void {
  try {
    Deno.kill(-s.child.pid, signal);
  } catch { /* gone */ }
}

/** Stops a server as an operator would (SIGTERM to its group) and waits. */
async function stop(ctx: Ctx, s: Server) {
  if (s.exited) return null;
  killGroup(s, "SIGTERM");
  return await exited(ctx, s);
}

/**
 * After a server's exit: whether a process still names its data folder (the GPU host, in its own
 * session, must end with the server's pipe); any left after `ms` is SIGKILLed and reported.
 */
async function leftovers(ctx: Ctx, home: string, ms = 15_000): Promise<number[]> {
  const until = Date.now() + ms;
  let pids = await pidsMentioning(home);
  while (pids.length > 0 && Date.now() < until) {
    await sleep(200);
    pids = await pidsMentioning(home);
  }
  for (const pid of pids) {
    ctx.log(`process ${pid} still names ${home} ${ms / 1000} s after its server exited: SIGKILL`);
    try {
      Deno.kill(pid, "SIGKILL");
    } catch { /* gone */ }
  }
  return pids;
}

// ---------------------------------------------------------------------------------------------
// Jobs and their events

interface Ev {
  id: number;
  event: string;
  data: Record<string, unknown>;
}

interface JobRecord {
  id: string;
  status: string;
  iteration: number;
  error: string | null;
  resumes: number;
  resumed_from: string | null;
  last_checkpoint: string | null;
  config: TrainConfig;
  metrics: Record<string, unknown>;
}

const FINISHED = new Set(["succeeded", "failed", "cancelled"]);

async function submit(url: string, body: Record<string, unknown>): Promise<string> {
  const res = await http(`${url}/train`, body);
  if (res.status !== 202) throw new Error(`POST /train answered ${res.status}: ${JSON.stringify(res.body)}`);
  return String(res.body.id);
}

async function job(url: string, id: string): Promise<JobRecord> {
  const res = await http(`${url}/jobs/${id}`);
  if (res.status !== 200) {
    throw new Error(`GET /jobs/${id} answered ${res.status}: ${JSON.stringify(res.body)}`);
  }
  return res.body as unknown as JobRecord;
}

/**
 * Reads job `id`'s event stream from the start until `stop(e)` holds (the event is returned),
 * the stream ends (the job's `done`), or `ms` pass.
 */
async function events(
  url: string,
  id: string,
  ms: number,
  stop: (e: Ev, seen: Ev[]) => boolean = () => false,
): Promise<{ events: Ev[]; hit: Ev | null; ended: "hit" | "done" | "closed" | "timeout" }> {
  const seen: Ev[] = [];
  const abort = new AbortController();
  const timer = setTimeout(() => abort.abort(), ms);
  try {
    const res = await fetch(`${url}/jobs/${id}/events`, { signal: abort.signal });
    if (res.status !== 200) {
      await res.body?.cancel();
      throw new Error(`GET /jobs/${id}/events answered ${res.status}`);
    }
    const reader = res.body!.pipeThrough(new TextDecoderStream()).getReader();
    let buf = "";
    for (;;) {
      let chunk: ReadableStreamReadResult<string>;
      try {
        chunk = await reader.read();
      } catch {
        return { events: seen, hit: null, ended: abort.signal.aborted ? "timeout" : "closed" };
      }
      if (chunk.done) {
        return { events: seen, hit: null, ended: seen.at(-1)?.event === "done" ? "done" : "closed" };
      }
      buf += chunk.value;
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, i);
        buf = buf.slice(i + 2);
        if (block.startsWith(":")) continue;
        const f: Record<string, string> = {};
        for (const line of block.split("\n")) {
          const c = line.indexOf(":");
          if (c > 0) f[line.slice(0, c)] = line.slice(c + 1).trimStart();
        }
        if (!f.event) continue;
        let data: Record<string, unknown> = {};
        try {
          data = JSON.parse(f.data ?? "{}");
        } catch { /* keep empty */ }
        const e = { id: Number(f.id ?? 0), event: f.event, data };
        seen.push(e);
        if (stop(e, seen)) {
          abort.abort();
          return { events: seen, hit: e, ended: "hit" };
        }
        if (e.event === "done") {
          abort.abort();
          return { events: seen, hit: null, ended: "done" };
        }
      }
    }
  } catch (e) {
    if (abort.signal.aborted) return { events: seen, hit: null, ended: "timeout" };
    throw e;
  } finally {
    clearTimeout(timer);
  }
}

const trainIter = (e: Ev) =>
  e.event === "progress" && (e.data.kind === undefined || e.data.kind === "train")
    ? Number(e.data.iteration)
    : null;

/**
 * Waits for the first event that `pred` accepts (the fault's moment); throws naming `what` when
 * the job ends first or the deadline passes.
 */
async function waitFor(
  url: string,
  id: string,
  what: string,
  pred: (e: Ev, seen: Ev[]) => boolean,
  ms = TRIGGER_MS,
): Promise<Ev> {
  const r = await events(url, id, ms, pred);
  if (r.hit) return r.hit;
  const done = r.events.find((e) => e.event === "done");
  if (done) {
    throw new Error(
      `job ${id} ended (${JSON.stringify(done.data)}) before ${what}: make jobs longer with --iters`,
    );
  }
  throw new Error(`no ${what} for job ${id} within ${ms / 1000} s (stream ${r.ended})`);
}

/** Jobs' ends: each job's record, and those that stopped advancing for {@link HUNG_MS}. */
async function settle(
  ctx: Ctx,
  url: () => string,
  ids: string[],
  server?: () => Server,
): Promise<{ jobs: Map<string, JobRecord | null>; hung: Set<string>; why: string | null }> {
  const jobs = new Map<string, JobRecord | null>();
  const started = Date.now();
  let changed = Date.now();
  let last = "";
  let why: string | null = null;
  let lastReport = 0;
  for (;;) {
    const now = await Promise.all(ids.map((id) => job(url(), id).catch(() => null)));
    now.forEach((j, i) => j && jobs.set(ids[i], j));
    const sig = JSON.stringify(ids.map((id) => [jobs.get(id)?.status, jobs.get(id)?.iteration]));
    if (sig !== last) {
      last = sig;
      changed = Date.now();
    }
    const open = ids.filter((id) => !FINISHED.has(jobs.get(id)?.status ?? ""));
    if (open.length === 0) break;
    if (Date.now() - lastReport > 10_000) {
      lastReport = Date.now();
      ctx.log(
        `waiting: ${
          ids.map((id) => `${id} ${jobs.get(id)?.status ?? "?"} @${jobs.get(id)?.iteration ?? "?"}`).join(
            ", ",
          )
        }`,
      );
    }
    if (server?.().exited) {
      why = `${server().label} exited while jobs were open`;
      break;
    }
    if (Date.now() - changed > HUNG_MS) {
      why = `no job advanced for ${HUNG_MS / 1000} s`;
      break;
    }
    if (Date.now() - started > SETTLE_CAP_MS) {
      why = `jobs still open after ${SETTLE_CAP_MS / 1000} s`;
      break;
    }
    await sleep(250);
  }
  const hung = new Set(ids.filter((id) => !FINISHED.has(jobs.get(id)?.status ?? "")));
  if (why) ctx.log(`stopped waiting: ${why}`);
  return { jobs, hung, why };
}

/** One job's fate in a fault. */
interface JobOutcome {
  id: string;
  role: string;
  /** finished, resumed (then finished), failed, hung, or the status it ended in. */
  outcome: string;
  status: string;
  iteration: number;
  train_iters: number;
  resumes: number;
  resumed_from: string | null;
  error: string | null;
  /** Per resume: iteration reached before it, iteration resumed from, newest checkpoint then. */
  restarts: {
    reached: number;
    from: number;
    newest_checkpoint: number | null;
    after_graceful_stop: boolean;
  }[];
  /** Per graceful stop: the iteration it saved and the newest iteration reported before it. */
  graceful_stops: { saved: number; reached: number }[];
  steps_lost: number;
  steps_lost_beyond_checkpoint: number;
  graceful_stop_steps_lost: number;
  warnings: string[];
}

/** What the job's events and record say happened to it. */
async function outcome(
  url: string,
  id: string,
  role: string,
  record: JobRecord | null,
  hung: boolean,
): Promise<JobOutcome> {
  const { events: evs } = await events(url, id, hung ? 5_000 : 30_000).catch(() => ({ events: [] as Ev[] }));
  const restarts: JobOutcome["restarts"] = [];
  const graceful: JobOutcome["graceful_stops"] = [];
  const warnings: string[] = [];
  let last = 0, newest: number | null = null, starts = 0, stopped = false;
  for (const e of evs) {
    const it = trainIter(e);
    if (it !== null) last = it;
    else if (e.event === "checkpoint") newest = Math.max(newest ?? 0, Number(e.data.iteration));
    else if (e.event === "log") {
      const msg = String(e.data.message ?? "");
      if (e.data.level === "warn") {
        warnings.push(msg);
        // "… stopped renewing its lease at iteration 10", "GPU worker crashed at iteration 7 …": reached.
        const at = msg.match(/ at iteration (\d+)/);
        if (at) last = Math.max(last, Number(at[1]));
      }
      if (msg.startsWith("Stopped by server shutdown")) {
        const saved = Number(e.data.iteration);
        graceful.push({ saved, reached: Math.max(last, saved) });
        last = Math.max(last, saved);
        stopped = true;
      } else if (msg.startsWith("Resumed from") || msg.startsWith("Started at")) {
        const from = Number(e.data.iteration ?? 0);
        if (starts++ > 0) {
          restarts.push({ reached: last, from, newest_checkpoint: newest, after_graceful_stop: stopped });
        }
        last = from;
        stopped = false;
      }
    }
  }
  const status = record?.status ?? "unknown";
  const resumes = record?.resumes ?? restarts.length;
  const out = hung
    ? "hung"
    : status === "succeeded"
    ? (resumes > 0 ? "resumed" : "finished")
    : status === "failed"
    ? "failed"
    : status;
  return {
    id,
    role,
    outcome: out,
    status,
    iteration: record?.iteration ?? last,
    train_iters: record?.config.train_iters ?? 0,
    resumes,
    resumed_from: record?.resumed_from ?? null,
    error: record?.error ?? null,
    restarts,
    graceful_stops: graceful,
    steps_lost: restarts.reduce((a, r) => a + Math.max(0, r.reached - r.from), 0),
    steps_lost_beyond_checkpoint: restarts.reduce(
      (a, r) => a + Math.max(0, (r.newest_checkpoint ?? 0) - r.from),
      0,
    ),
    graceful_stop_steps_lost: graceful.reduce((a, g) => a + Math.max(0, g.reached - g.saved), 0),
    warnings,
  };
}

// ---------------------------------------------------------------------------------------------
// Faults

interface FaultResult {
  key: string;
  title: string;
  expected: string;
  state: "ok" | "finding" | "skipped" | "error";
  skipped: string | null;
  error: string | null;
  findings: string[];
  notes: string[];
  jobs: JobOutcome[];
  /** Whether the fault stops the server gracefully (the graceful-stop column applies). */
  graceful: boolean;
  wall_s: number;
  extra: Record<string, unknown>;
}

interface Ctx {
  key: string;
  dir: string;
  result: FaultResult;
  servers: Server[];
  cleanups: (() => Promise<void>)[];
  log(msg: string): void;
  /** Records a finding unless `ok`. */
  check(ok: boolean, finding: string): void;
  /** A fresh GPT2_HOME holding the prepared builtin dataset. */
  home(name: string): Promise<string>;
  skip(reason: string): never;
}

class Skip extends Error {}

interface Fault {
  key: string;
  title: string;
  expected: string;
  graceful: boolean;
  run(ctx: Ctx): Promise<void>;
}

let opts: Options;
let iters = 40;
let adapter: string | null = null;
let datasetCache = "";

const jobBody = (over: Record<string, unknown> = {}) => ({
  model: opts.model,
  dataset: "sotu",
  train_iters: iters,
  batch_size: 2,
  seq_len: 16,
  log_interval: 1,
  eval_interval: 0,
  eval_iters: 1,
  save_interval: 0,
  keep_checkpoints: 3,
  seed: 37,
  ...over,
});

/** Notes the adapter of the first server seen, and sets the default job length from it. */
async function noteAdapter(s: Server): Promise<void> {
  if (adapter !== null) return;
  const h = await http(`${s.url}/health`);
  const gpus = (h.body.gpus ?? []) as { adapter?: string }[];
  adapter = gpus.map((g) => g.adapter ?? "?").join("; ") || "unknown";
  if (opts.iters === null) iters = isCpuAdapter(adapter) ? 40 : 400;
  console.log(
    `adapter: ${adapter}\njob length: ${iters} iterations${
      opts.iters === null ? " (default for this adapter)" : ""
    }`,
  );
}

/** The outcomes of `ids` once they ended (or hung), into the result. */
async function record(ctx: Ctx, url: () => string, roles: [string, string][], server?: () => Server) {
  const { jobs, hung, why } = await settle(ctx, url, roles.map(([id]) => id), server);
  if (why) ctx.result.notes.push(why);
  for (const [id, role] of roles) {
    const o = await outcome(url(), id, role, jobs.get(id) ?? null, hung.has(id));
    ctx.result.jobs.push(o);
    const r = o.restarts.map((x) =>
      `reached ${x.reached}, resumed from ${x.from} (newest checkpoint ${x.newest_checkpoint ?? "none"})`
    ).join("; ");
    ctx.log(
      `job ${id} (${role}): ${o.outcome === "resumed" ? "resumed, finished" : o.outcome}${
        o.error ? ` (${o.error})` : ""
      } at iteration ${o.iteration} of ${o.train_iters}` +
        `${
          r ? `; ${r}` : ""
        }; steps lost ${o.steps_lost}, beyond the newest checkpoint ${o.steps_lost_beyond_checkpoint}` +
        (o.graceful_stops.length ? `, at the graceful stop ${o.graceful_stop_steps_lost}` : ""),
    );
  }
}

/** Stops, then starts again, the way a user does: the graceful stops 1-4. */
function stopFault(
  key: string,
  title: string,
  how: { signal: "SIGINT" | "SIGTERM"; host: boolean; pid1: boolean },
): Fault {
  return {
    key,
    title,
    graceful: true,
    expected: "exit 0, the job resumes at the iteration it was stopped at (0 steps lost) and finishes",
    async run(ctx) {
      if (how.pid1) {
        const u = await run(["unshare", "--pid", "--fork", "--mount-proc", "true"]);
        if (!u.ok) {
          ctx.skip(`cannot start a process as PID 1 of its own PID namespace: ${u.out || "unshare failed"}`);
        }
      }
      const home = await ctx.home("home");
      let s = await serve(ctx, "server", home, {}, how.pid1);
      await noteAdapter(s);
      const id = await submit(s.url, jobBody({ save_interval: 0 }));
      const at = Math.max(3, Math.floor(iters / 4));
      const hit = await waitFor(s.url, id, `iteration ${at}`, (e) => (trainIter(e) ?? 0) >= at);
      const seen = trainIter(hit)!;
      if (how.pid1) {
        // The container's PID 1 is `deno task`, unshare's child.
        const ps = await run(["pgrep", "-P", String(s.child.pid)]);
        const pid = Number(ps.out.split("\n")[0]);
        if (!pid) throw new Error(`cannot find deno task under unshare (pid ${s.child.pid}): ${ps.out}`);
        ctx.log(`iteration ${seen}: ${how.signal} to deno task (pid ${pid}, PID 1 of its namespace)`);
        Deno.kill(pid, how.signal);
      } else {
        const hostPid = how.host ? ((await http(`${s.url}/health`)).body.gpu_host as { pid: number }).pid : 0;
        ctx.log(
          `iteration ${seen}: ${how.signal} to the group ${s.child.pid}${
            hostPid ? ` and to the GPU host ${hostPid}` : ""
          }`,
        );
        Deno.kill(-s.child.pid, how.signal);
        if (hostPid) Deno.kill(hostPid, how.signal);
      }
      const ex = await exited(ctx, s);
      const log = s.output();
      ctx.log(`server exited: code ${ex.code}, signal ${ex.signal}, ${ex.s.toFixed(1)} s after the signal`);
      ctx.result.extra.exit = ex;
      ctx.check(
        !ex.killed && ex.code === 0,
        `the server exited with code ${ex.code} (signal ${ex.signal}${
          ex.killed ? ", killed after the stop deadline" : ""
        }), not 0: ${tail(log, 5)}`,
      );
      ctx.check(/Stopped/.test(log), 'the server never printed "Stopped"');
      ctx.check(
        !/exiting now/.test(log),
        'a forwarded copy of the signal was taken for a second one ("exiting now")',
      );
      ctx.check(
        !/GPU host \(pid \d+\) exited/.test(log),
        "the GPU host died of the signal instead of being stopped",
      );
      const left = await leftovers(ctx, home);
      ctx.check(left.length === 0, `processes ${left.join(", ")} outlived the server`);
      s = await serve(ctx, "server (restarted)", home, {}, how.pid1);
      await record(ctx, () => s.url, [[id, `stopped at ${seen}`]], () => s);
      const o = ctx.result.jobs[0];
      ctx.check(
        o.outcome === "resumed",
        `the job ${o.outcome}${o.error ? ` (${o.error})` : ""}, expected resumed and finished`,
      );
      ctx.check(
        o.steps_lost === 0,
        `${o.steps_lost} steps lost (stopped at ${o.restarts[0]?.reached}, resumed from ${
          o.restarts[0]?.from
        })`,
      );
      ctx.check(
        o.graceful_stops.length > 0 && o.graceful_stops[0].saved >= seen,
        `the stop saved at ${
          o.graceful_stops[0]?.saved ?? "no iteration"
        }, before iteration ${seen} seen when the signal was sent`,
      );
      await stop(ctx, s);
    },
  };
}

const FAULTS: Fault[] = [
  stopFault("sigint", "Ctrl-C (SIGINT to the group)", { signal: "SIGINT", host: false, pid1: false }),
  stopFault("sigterm", "kill -TERM -PGID", { signal: "SIGTERM", host: false, pid1: false }),
  stopFault("systemd", "systemd stop (SIGTERM to the group and the GPU host)", {
    signal: "SIGTERM",
    host: true,
    pid1: false,
  }),
  stopFault("docker", "docker stop (SIGTERM to PID 1)", { signal: "SIGTERM", host: false, pid1: true }),
  {
    key: "postgres",
    title: "PostgreSQL restart (8 s, 2 hosts, 3 s leases)",
    graceful: false,
    expected: "all 3 jobs finish; /health answers 503 during the outage, never 500",
    async run(ctx) {
      if (!POSTGRES_BIN) {
        ctx.skip("no PostgreSQL server binaries (initdb, pg_ctl) on PATH or in /usr/lib/postgresql/N/bin");
      }
      const pg = await startPostgres({ durable: true });
      ctx.cleanups.push(() => pg.stop().catch(() => {}));
      const db = await pg.database();
      const shared = `${ctx.dir}/shared`;
      await Deno.mkdir(shared);
      await copyDatasets(shared);
      const env = (host: string) => ({
        GPT2_DATABASE_URL: db,
        GPT2_SHARED_DIR: shared,
        GPT2_HOST_ID: host,
        GPT2_LEASE_S: "3",
        GPT2_GPUS: "1",
      });
      const a = await serve(ctx, "host-a", await ctx.home("a"), env("host-a"));
      await noteAdapter(a);
      const b = await serve(ctx, "host-b", await ctx.home("b"), env("host-b"));
      const body = jobBody({ save_interval: 5 });
      const ids = [
        await submit(a.url, body),
        await submit(a.url, body),
        await submit(a.url, { ...body, seed: 38 }),
      ];
      // Past the first checkpoint (iteration 5), so a job that moves host resumes from one.
      const at = Math.max(7, Math.floor(iters / 8));
      const until = Date.now() + TRIGGER_MS;
      let states: JobRecord[] = [];
      for (;;) {
        states = await Promise.all(ids.map((id) => job(a.url, id)));
        const running = states.filter((j) => j.status === "running" && j.iteration >= at);
        if (running.length >= 2 && states.some((j) => j.status === "queued")) break;
        if (states.some((j) => FINISHED.has(j.status))) {
          throw new Error(
            `a job ended before the outage (${
              states.map((j) => `${j.status}@${j.iteration}`).join(", ")
            }): raise --iters`,
          );
        }
        if (Date.now() > until) {
          throw new Error(
            `no 2 running jobs past iteration ${at} with 1 queued in ${TRIGGER_MS / 1000} s: ${
              states.map((j) => `${j.status}@${j.iteration}`).join(", ")
            }`,
          );
        }
        await sleep(100);
      }
      const before = states.map((j) => `${j.id} ${j.status}@${j.iteration}`).join(", ");
      ctx.log(`halting PostgreSQL (pg_ctl stop -m immediate) for ${OUTAGE_MS / 1000} s: ${before}`);
      await pg.halt();
      const downAt = Date.now();
      // Each host's /health, and a static page that needs no store (is the whole server held up?),
      // every 250 ms while the database is down; each answer waited for up to 30 s.
      const polls: { host: string; route: string; at_s: number; status: string; ms: number }[] = [];
      const seen500: string[] = [];
      const poll = async (s: Server, route: string) => {
        while (Date.now() - downAt < OUTAGE_MS) {
          const t = Date.now();
          const r = await http(`${s.url}${route}`, undefined, HEALTH_MS).then(
            (r) => ({ status: String(r.status), body: r.body }),
            (e) => ({ status: `no answer (${(e as Error).name})`, body: {} }),
          );
          polls.push({
            host: s.label,
            route,
            at_s: (t - downAt) / 1000,
            status: r.status,
            ms: Date.now() - t,
          });
          if (r.status === "500") {
            seen500.push(`${s.label} ${route}: ${JSON.stringify(r.body).slice(0, 300)}`);
          }
          await sleep(250);
        }
      };
      const polling = Promise.all([a, b].flatMap((s) => [poll(s, "/health"), poll(s, "/web/meta.json")]));
      await sleep(OUTAGE_MS - (Date.now() - downAt));
      await pg.resume();
      const upAt = Date.now();
      await polling;
      const health = polls.filter((p) => p.route === "/health");
      const codes: Record<string, number> = {};
      for (const p of health) codes[p.status] = (codes[p.status] ?? 0) + 1;
      const slowest = (route: string) =>
        polls.filter((p) => p.route === route).reduce((m, p) => (p.ms > m.ms ? p : m));
      const [slowHealth, slowPage] = [slowest("/health"), slowest("/web/meta.json")];
      const slowText = (p: typeof slowHealth) =>
        `${p.ms} ms (${p.host}, asked ${p.at_s.toFixed(1)} s into the outage)`;
      ctx.log(
        `PostgreSQL started again after ${
          ((upAt - downAt) / 1000).toFixed(1)
        } s; /health during the outage: ` +
          `${JSON.stringify(codes)}, slowest ${slowText(slowHealth)}; /web/meta.json slowest ${
            slowText(slowPage)
          }`,
      );
      const slow = polls.filter((p) => p.ms > SLOW_MS);
      for (const p of slow) {
        ctx.log(
          `${p.host}'s ${p.route} asked ${p.at_s.toFixed(1)} s into the outage: ${p.status} after ${p.ms} ms`,
        );
      }
      ctx.check(
        slow.length === 0,
        `${slow.length} of ${polls.length} requests during the outage took over ${SLOW_MS / 1000} s: ` +
          slow.map((p) => `${p.host} ${p.route} ${p.status} in ${(p.ms / 1000).toFixed(1)} s`).join(", "),
      );
      const backAt = upAt;
      let recovered: number | null = null;
      while (Date.now() - backAt < 60_000) {
        const rs = await Promise.all(
          [a, b].map((s) => http(`${s.url}/health`, undefined, 5_000).catch(() => null)),
        );
        if (rs.every((r) => r?.status === 200)) {
          recovered = (Date.now() - backAt) / 1000;
          break;
        }
        await sleep(250);
      }
      ctx.result.extra.health_polls = polls;
      ctx.result.extra.health_during_outage = codes;
      ctx.result.extra.health_200_again_s = recovered;
      ctx.result.notes.push(
        `/health during the outage: ${Object.entries(codes).map(([c, n]) => `${c} ×${n}`).join(", ")}, ` +
          `slowest ${slowHealth.ms} ms (/web/meta.json ${slowPage.ms} ms); ` +
          (recovered === null
            ? "not 200 again within 60 s"
            : `200 again ${recovered.toFixed(1)} s after the restart`),
      );
      ctx.check(seen500.length === 0, `/health answered 500 during the outage: ${seen500[0]}`);
      ctx.check(
        (codes["503"] ?? 0) > 0,
        `/health never answered 503 during the outage: ${JSON.stringify(codes)}`,
      );
      ctx.check(
        Object.keys(codes).every((c) => c === "200" || c === "503"),
        `/health answered ${JSON.stringify(codes)} during the outage`,
      );
      ctx.check(recovered !== null, "/health did not answer 200 on both hosts within 60 s of the restart");
      await record(
        ctx,
        () => a.url,
        ids.map((id, i) => [id, i < 2 ? "running at the outage" : "queued at the outage"]),
      );
      for (const o of ctx.result.jobs) {
        ctx.check(o.status === "succeeded", `job ${o.id} ${o.outcome}${o.error ? ` (${o.error})` : ""}`);
        ctx.check(
          o.steps_lost_beyond_checkpoint === 0,
          `job ${o.id} lost ${o.steps_lost_beyond_checkpoint} steps beyond its newest checkpoint`,
        );
      }
      const moved = ctx.result.jobs.flatMap((o) => o.warnings.filter((w) => /resuming on host/.test(w)));
      if (moved.length > 0) {
        ctx.result.notes.push(
          `${moved.length} job(s) moved host after the outage, though both hosts were up throughout: ` +
            moved.join("; "),
        );
      }
      const log = a.output() + b.output();
      ctx.check(!/Job runner: handling .* failed/.test(log), "a host's runner failed handling a message");
      await Promise.all([stop(ctx, a), stop(ctx, b)]);
    },
  },
  {
    key: "host-kill",
    title: "GPU host SIGKILL mid-step",
    graceful: false,
    expected: "the host restarts, the job resumes from its newest checkpoint and finishes",
    async run(ctx) {
      const home = await ctx.home("home");
      const s = await serve(ctx, "server", home);
      await noteAdapter(s);
      const id = await submit(s.url, jobBody({ save_interval: 5 }));
      const hit = await crashPoint(s.url, id);
      const before = (await http(`${s.url}/health`)).body.gpu_host as { pid: number; restarts: number };
      ctx.log(`iteration ${trainIter(hit)}: SIGKILL to the GPU host (pid ${before.pid})`);
      Deno.kill(before.pid, "SIGKILL");
      await record(ctx, () => s.url, [[id, `killed at ${trainIter(hit)}`]], () => s);
      const after = (await http(`${s.url}/health`)).body.gpu_host as {
        pid: number;
        restarts: number;
        last_exit: unknown;
      };
      ctx.result.extra.gpu_host = { before, after };
      ctx.check(
        after.restarts === before.restarts + 1,
        `GPU host restarts ${before.restarts} → ${after.restarts}, expected one more`,
      );
      crashChecks(ctx);
      await stop(ctx, s);
    },
  },
  {
    key: "server-kill",
    title: "server SIGKILL (whole group) mid-job",
    graceful: false,
    expected:
      "the GPU host exits with the server; the restart resumes from the newest checkpoint and finishes",
    async run(ctx) {
      const home = await ctx.home("home");
      let s = await serve(ctx, "server", home);
      await noteAdapter(s);
      const id = await submit(s.url, jobBody({ save_interval: 5 }));
      const hit = await crashPoint(s.url, id);
      ctx.log(`iteration ${trainIter(hit)}: SIGKILL to the group ${s.child.pid}`);
      killGroup(s);
      await exited(ctx, s, 10_000);
      const left = await leftovers(ctx, home);
      ctx.check(
        left.length === 0,
        `processes ${left.join(", ")} (the GPU host) outlived the SIGKILLed server by 15 s`,
      );
      s = await serve(ctx, "server (restarted)", home);
      await record(ctx, () => s.url, [[id, `killed at ${trainIter(hit)}`]], () => s);
      crashChecks(ctx);
      await stop(ctx, s);
    },
  },
  {
    key: "enospc",
    title: "disk full while a checkpoint is written (tmpfs)",
    graceful: false,
    expected:
      "the job fails naming ENOSPC and the checkpoint's path; the checkpoint before it loads and verifies",
    async run(ctx) {
      const home = await ctx.home("home");
      const mnt = `${home}/checkpoints`;
      await Deno.mkdir(mnt, { recursive: true });
      if (Deno.build.os !== "linux") ctx.skip("tmpfs is Linux only");
      const m = await run(["mount", "-t", "tmpfs", "tmpfs", mnt]);
      if (!m.ok) ctx.skip(`mount -t tmpfs is not permitted here (${m.out})`);
      ctx.cleanups.push(async () => void await run(["umount", "-l", mnt]));
      const s = await serve(ctx, "server", home);
      await noteAdapter(s);
      // One checkpoint of this model, measured: a 1-step job saves one at its end.
      const probe = await submit(s.url, jobBody({ train_iters: 1 }));
      const p = await settle(ctx, () => s.url, [probe], () => s);
      if (p.jobs.get(probe)?.status !== "succeeded") {
        throw new Error(
          `the 1-step measuring job ${p.jobs.get(probe)?.status ?? "did not end"}: ${
            p.jobs.get(probe)?.error ?? p.why
          }`,
        );
      }
      const cks = (await http(`${s.url}/jobs/${probe}/checkpoints`)).body.checkpoints as { bytes: number }[];
      const bytes = cks[0].bytes;
      const used = Number((await run(["df", "-B1", "--output=used", mnt])).out.split("\n").at(-1));
      const size = Math.ceil((used + bytes * 1.5) / 4096) * 4096;
      const r = await run(["mount", "-o", `remount,size=${size}`, mnt]);
      if (!r.ok) throw new Error(`cannot resize the tmpfs to ${size} bytes: ${r.out}`);
      ctx.log(
        `one checkpoint is ${bytes} bytes; tmpfs resized to ${size} bytes (${used} used): the next fits once`,
      );
      ctx.result.extra.checkpoint_bytes = bytes;
      ctx.result.extra.tmpfs_bytes = size;
      const id = await submit(
        s.url,
        jobBody({ save_interval: 5, keep_checkpoints: 2, train_iters: Math.max(iters, 12) }),
      );
      await record(ctx, () => s.url, [[id, "checkpoints on a full tmpfs"]], () => s);
      const o = ctx.result.jobs[0];
      ctx.check(o.status === "failed", `the job ${o.outcome}, expected failed`);
      ctx.check(/ENOSPC/.test(o.error ?? ""), `the job's reason does not name ENOSPC: ${o.error}`);
      ctx.check(
        (o.error ?? "").includes(`checkpoints/${id}/iter_0000010`),
        `the job's reason does not name the checkpoint's path (checkpoints/${id}/iter_0000010): ${o.error}`,
      );
      const dir = `${mnt}/${id}`;
      const names = [...Deno.readDirSync(dir)].map((e) => e.name).sort();
      ctx.result.extra.left_in_job_folder = names;
      ctx.check(
        names.length === 1 && names[0] === "iter_0000005",
        `the job's folder holds ${JSON.stringify(names)}, expected ["iter_0000005"]`,
      );
      const previous = (await listCheckpoints(dir)).at(-1);
      if (!previous) ctx.check(false, "no checkpoint before the failed one is left");
      else {
        const rec = await job(s.url, id);
        const loaded = await loadCheckpoint(previous.path, trainingModel(rec.config)).then(
          ({ state }) => `loads and verifies (iteration ${state.step})`,
          (e) => `does not load: ${(e as Error).message}`,
        );
        ctx.log(`the checkpoint before, ${previous.name}, ${loaded}`);
        ctx.result.notes.push(`previous checkpoint ${previous.name} ${loaded}`);
        ctx.check(loaded.startsWith("loads"), `the previous checkpoint ${previous.name} ${loaded}`);
      }
      await stop(ctx, s);
    },
  },
  {
    key: "corrupt",
    title: "newest checkpoint corrupted while stopped",
    graceful: true,
    expected: "the restart resumes from the previous checkpoint with a warn event and finishes",
    async run(ctx) {
      const home = await ctx.home("home");
      let s = await serve(ctx, "server", home);
      await noteAdapter(s);
      const id = await submit(
        s.url,
        jobBody({ save_interval: 5, keep_checkpoints: 3, train_iters: Math.max(iters, 20) }),
      );
      let second = 0;
      const hit = await waitFor(s.url, id, "two checkpoints, then 2 more steps", (e, seen) => {
        const cks = seen.filter((x) => x.event === "checkpoint").map((x) => Number(x.data.iteration));
        if (cks.length >= 2) second = cks[1];
        return second > 0 && (trainIter(e) ?? 0) >= second + 2;
      });
      ctx.log(`iteration ${trainIter(hit)}: SIGTERM to the group`);
      killGroup(s, "SIGTERM");
      const ex = await exited(ctx, s);
      ctx.check(
        ex.code === 0 && !ex.killed,
        `the server exited with code ${ex.code} (signal ${ex.signal}) on SIGTERM`,
      );
      await leftovers(ctx, home);
      const cks = await listCheckpoints(`${home}/checkpoints/${id}`);
      if (cks.length < 2) {
        throw new Error(`only ${cks.length} checkpoints after the stop: ${cks.map((c) => c.name)}`);
      }
      const [previous, newest] = cks.slice(-2);
      const file = `${newest.path}/model.safetensors`;
      const bytes = await Deno.readFile(file);
      const mid = bytes.length >> 1;
      for (let i = mid; i < mid + 16; i++) bytes[i] ^= 0xff;
      await Deno.writeFile(file, bytes);
      ctx.log(
        `flipped 16 bytes in the middle of ${newest.name}/model.safetensors; previous is ${previous.name}`,
      );
      ctx.result.extra.corrupted = newest.name;
      ctx.result.extra.expected_resume = previous.name;
      s = await serve(ctx, "server (restarted)", home);
      await record(ctx, () => s.url, [[id, `${newest.name} corrupted`]], () => s);
      const o = ctx.result.jobs[0];
      ctx.check(
        o.outcome === "resumed",
        `the job ${o.outcome}${o.error ? ` (${o.error})` : ""}, expected resumed and finished`,
      );
      ctx.check(
        o.restarts.at(-1)?.from === previous.iteration,
        `resumed from iteration ${
          o.restarts.at(-1)?.from
        }, expected ${previous.iteration} (${previous.name})`,
      );
      if (o.steps_lost_beyond_checkpoint > 0) {
        ctx.result.notes.push(
          `the ${o.steps_lost_beyond_checkpoint} steps beyond the newest checkpoint are the corrupted ` +
            `${newest.name}'s, as intended`,
        );
      }
      ctx.check(
        o.warnings.some((w) => w.includes(newest.name) && /unusable/.test(w)),
        `no warn event names ${newest.name} as unusable: ${JSON.stringify(o.warnings)}`,
      );
      await stop(ctx, s);
    },
  },
  {
    key: "fp16",
    title: "fp16 short job (10 steps)",
    graceful: false,
    expected: "succeeds (skipped when the adapter lacks shader-f16)",
    async run(ctx) {
      const home = await ctx.home("home");
      const s = await serve(ctx, "server", home);
      await noteAdapter(s);
      const res = await http(`${s.url}/train`, jobBody({ train_iters: 10, precision: "fp16" }));
      const f16 = /shader-f16/.test(adapter ?? "");
      if (res.status === 400 && !f16) {
        const err = res.body.error as { message?: string } | undefined;
        await stop(ctx, s);
        ctx.skip(`the adapter lacks shader-f16: ${err?.message ?? JSON.stringify(res.body)}`);
      }
      if (res.status !== 202) {
        throw new Error(`POST /train (fp16) answered ${res.status}: ${JSON.stringify(res.body)}`);
      }
      const id = String(res.body.id);
      await record(ctx, () => s.url, [[id, "fp16"]], () => s);
      const o = ctx.result.jobs[0];
      ctx.check(o.status === "succeeded", `the fp16 job ${o.outcome}${o.error ? ` (${o.error})` : ""}`);
      const rec = await job(s.url, id);
      const loss = Number(rec.metrics.loss);
      const skipped = Number(rec.metrics.skipped_steps);
      const all = skipped >= rec.iteration;
      ctx.result.notes.push(
        `fp16 loss ${
          loss.toFixed(3)
        }, loss scale ${rec.metrics.loss_scale}, ${skipped} of ${rec.iteration} ` +
          `steps skipped${
            all ? " (each overflowed while the loss scale backed off from 2^32: no update)" : ""
          }`,
      );
      ctx.check(Number.isFinite(loss), `the fp16 job's loss is ${rec.metrics.loss}`);
      await stop(ctx, s);
    },
  },
];

/** The moment of a crash: after the job's first checkpoint, two steps into the next interval. */
function crashPoint(url: string, id: string): Promise<Ev> {
  let first = 0;
  return waitFor(url, id, "a checkpoint, then 2 more steps", (e) => {
    if (e.event === "checkpoint" && !first) first = Number(e.data.iteration);
    return first > 0 && (trainIter(e) ?? 0) >= first + 2;
  });
}

function crashChecks(ctx: Ctx): void {
  const o = ctx.result.jobs[0];
  ctx.check(
    o.outcome === "resumed",
    `the job ${o.outcome}${o.error ? ` (${o.error})` : ""}, expected resumed and finished`,
  );
  ctx.check(o.resumes === 1, `the job resumed ${o.resumes} times, expected once`);
  ctx.check(
    o.steps_lost_beyond_checkpoint === 0,
    `resumed from iteration ${o.restarts[0]?.from}, not its newest checkpoint ${
      o.restarts[0]?.newest_checkpoint
    }`,
  );
}

async function copyDatasets(to: string): Promise<void> {
  const r = await run(["cp", "-a", `${datasetCache}/datasets`, `${to}/`]);
  if (!r.ok) throw new Error(`cannot copy the prepared dataset: ${r.out}`);
}

// ---------------------------------------------------------------------------------------------
// Running them

let activeCtx: Ctx | null = null;
/** Set on the bench's own SIGINT or SIGTERM: the fault under way is cleaned up, and nothing more is said. */
let stopping = false;

async function cleanup(ctx: Ctx): Promise<void> {
  for (const s of ctx.servers) {
    if (!s.exited) {
      killGroup(s);
      await deadline(s.exit, 10_000, `${s.label} to die`).catch((e) => ctx.log((e as Error).message));
    }
  }
  for (const s of ctx.servers) await leftovers(ctx, s.home, 5_000);
  for (const fn of ctx.cleanups.reverse()) {
    await fn().catch((e) => ctx.log(`cleanup: ${(e as Error).message}`));
  }
  ctx.cleanups.length = 0;
  await Deno.remove(ctx.dir, { recursive: true }).catch((e) =>
    ctx.log(`cannot remove ${ctx.dir}: ${e.message}`)
  );
}

async function runFault(f: Fault, root: string): Promise<FaultResult> {
  const result: FaultResult = {
    key: f.key,
    title: f.title,
    expected: f.expected,
    state: "ok",
    skipped: null,
    error: null,
    findings: [],
    notes: [],
    jobs: [],
    graceful: f.graceful,
    wall_s: 0,
    extra: {},
  };
  const dir = await Deno.makeTempDir({ dir: root, prefix: `${f.key}_` });
  const ctx: Ctx = {
    key: f.key,
    dir,
    result,
    servers: [],
    cleanups: [],
    log: (msg) => void (stopping || console.log(`[${clock()} s] ${f.key}: ${msg}`)),
    check(ok, finding) {
      if (ok) return;
      result.findings.push(finding);
      this.log(`FINDING: ${finding}`);
    },
    async home(name) {
      const home = `${dir}/${name}`;
      await Deno.mkdir(home, { recursive: true });
      await copyDatasets(home);
      return home;
    },
    skip(reason) {
      throw new Skip(reason);
    },
  };
  activeCtx = ctx;
  console.log(`\n== ${f.key}: ${f.title}\n   expected: ${f.expected}`);
  const start = performance.now();
  try {
    await f.run(ctx);
  } catch (e) {
    if (e instanceof Skip) {
      result.skipped = e.message;
      ctx.log(`skipped: ${e.message}`);
    } else {
      result.error = (e as Error).message;
      ctx.log(`ERROR: ${(e as Error).message}`);
      for (const s of ctx.servers) ctx.log(`${s.label}'s last output:\n${tail(s.output(), 20)}`);
    }
  } finally {
    // A finding is explained by what the servers said.
    if (result.findings.length > 0 && !result.error) {
      for (const s of ctx.servers) ctx.log(`${s.label}'s last output:\n${tail(s.output(), 40)}`);
    }
    await cleanup(ctx);
    activeCtx = null;
  }
  result.wall_s = (performance.now() - start) / 1000;
  result.state = result.skipped
    ? "skipped"
    : result.error
    ? "error"
    : result.findings.length
    ? "finding"
    : "ok";
  ctx.log(`${result.state} in ${result.wall_s.toFixed(1)} s`);
  return result;
}

const cell = (s: string) => s.replace(/\|/g, "\\|").replace(/\n/g, " ");
const cut = (s: string, n = 140) => (s.length > n ? `${s.slice(0, n - 1)}…` : s);

function row(r: FaultResult): string[] {
  const name = r.skipped
    ? `${r.title} (skipped: ${r.skipped})`
    : r.error
    ? `${r.title} (could not run: ${r.error})`
    : r.title;
  if (r.jobs.length === 0) return [cut(name, 240), "—", "—", "—", "—", "—", "—", "—", r.wall_s.toFixed(0)];
  const count = (p: (o: JobOutcome) => boolean) => r.jobs.filter(p).length;
  const failed = r.jobs.filter((o) => o.status === "failed");
  const reasons = [...new Set(failed.map((o) => o.error ?? "no reason"))];
  const interrupted = r.jobs.some((o) => o.restarts.length > 0);
  const lost = r.jobs.reduce((a, o) => a + o.steps_lost, 0);
  const beyond = r.jobs.reduce((a, o) => a + o.steps_lost_beyond_checkpoint, 0);
  const graceful = r.jobs.reduce((a, o) => a + o.graceful_stop_steps_lost, 0);
  return [
    name,
    String(r.jobs.length),
    String(count((o) => o.status === "succeeded")),
    String(count((o) => o.resumes > 0)),
    failed.length ? `${failed.length} (${cut(reasons.join("; "))})` : "0",
    String(count((o) => o.outcome === "hung")),
    interrupted ? `${lost} (${beyond} beyond newest checkpoint)` : "—",
    r.graceful ? String(graceful) : "—",
    r.wall_s.toFixed(0),
  ];
}

function table(results: FaultResult[]): string {
  const head = [
    "fault",
    "jobs",
    "finished",
    "resumed",
    "failed with reason",
    "hung",
    "steps lost",
    "graceful-stop steps lost",
    "wall s",
  ];
  const rows = [head, ...results.map(row)].map((r) => r.map(cell));
  const widths = head.map((_, i) => Math.max(...rows.map((r) => r[i].length)));
  const right = new Set([1, 2, 3, 5, 7, 8]);
  const line = (r: string[]) =>
    `| ${r.map((c, i) => (right.has(i) ? c.padStart(widths[i]) : c.padEnd(widths[i]))).join(" | ")} |`;
  const rule = `| ${
    widths.map((w, i) => (right.has(i) ? `${"-".repeat(w - 1)}:` : "-".repeat(w))).join(" | ")
  } |`;
  return [line(rows[0]), rule, ...rows.slice(1).map(line)].join("\n");
}

async function main(): Promise<number> {
  opts = options(FAULTS.map((f) => f.key));
  if (opts.iters !== null) iters = opts.iters;
  const chosen = opts.only ? FAULTS.filter((f) => opts.only!.includes(f.key)) : FAULTS;
  const command = `deno task bench faults${Deno.args.length ? ` ${Deno.args.join(" ")}` : ""}`;
  const root = await Deno.makeTempDir({ prefix: "gpt2_faults_" });
  const onSignal = async () => {
    stopping = true;
    console.log("\nInterrupted: cleaning up");
    if (activeCtx) await cleanup(activeCtx);
    await Deno.remove(root, { recursive: true }).catch(() => {});
    Deno.exit(130);
  };
  Deno.addSignalListener("SIGINT", onSignal);
  Deno.addSignalListener("SIGTERM", onSignal);
  const date = new Date().toISOString();
  const started = performance.now();
  const results: FaultResult[] = [];
  try {
    datasetCache = `${root}/dataset`;
    console.log(`${command}\npreparing the builtin dataset once (copied into each GPT2_HOME)`);
    await prepareDataset(datasetCache, { builtin: "sotu" });
    for (const f of chosen) results.push(await runFault(f, root));
  } finally {
    await Deno.remove(root, { recursive: true }).catch(() => {});
    Deno.removeSignalListener("SIGINT", onSignal);
    Deno.removeSignalListener("SIGTERM", onSignal);
  }
  const wall = (performance.now() - started) / 1000;
  console.log(`\n## Fault matrix (issue 37)\n`);
  console.log(`- Date: ${date.slice(0, 10)}`);
  console.log(`- Adapter: ${adapter ?? "none (no fault started a server)"}`);
  console.log(
    `- Command: \`${command}\` (model ${opts.model}, ${iters} iterations a job, batch 2, seq_len 16)`,
  );
  console.log(`- Total wall time: ${wall.toFixed(0)} s\n`);
  console.log(table(results));
  const notes = results.flatMap((r) => r.notes.map((n) => `- ${r.title}: ${n}`));
  if (notes.length) console.log(`\n${notes.join("\n")}`);
  const findings = results.flatMap((r) => [
    ...r.findings.map((f) => `- ${r.title}: ${f}`),
    ...(r.error ? [`- ${r.title}: could not run: ${r.error}`] : []),
  ]);
  console.log(
    findings.length
      ? `\nNot as issue 37 expects:\n${findings.join("\n")}`
      : "\nEvery fault behaved as issue 37 expects.",
  );
  if (opts.json) {
    await Deno.writeTextFile(
      opts.json,
      JSON.stringify({ date, adapter, command, options: { ...opts, iters }, wall_s: wall, results }, null, 2),
    );
    console.log(`\nRaw results: ${opts.json}`);
  }
  return findings.length ? 1 : 0;
}

Deno.exit(await main());
