/**
 * `deno task bench demo`: the newcomer's first command, `deno task demo`, timed the way a user
 * meets it (issue 24, Targets). Each run spawns `<deno-cmd> task demo` in a checkout with a fresh
 * GPT2_HOME and records the wall time from spawn to exit, the exit code, the longest silent stretch
 * of output (from spawn, including the wait until exit) with the line that ended it, the time of
 * every line, the first-token times the demo prints ("first after N ms" or "N s") and, as a
 * fallback, the time from each line announcing a sample to the next line that is not a reminder
 * ("...", "server:", compilation), the adapter line and the first and last training loss.
 *
 *   deno task bench demo [--runs cold,warm | --cold | --warm] [--checkout DIR]
 *                        [--deno-cmd "npx --yes deno@2.9.6"] [--backend auto|vulkan|gl] [--no-cache]
 *                        [--timeout 900] [--out DIR] [--quiet] [-- demo args, e.g. --no-install]
 *
 * Shader caches: every run's XDG_CACHE_HOME is a temp dir (Mesa's cache is
 * $XDG_CACHE_HOME/mesa_shader_cache, NVIDIA's $XDG_CACHE_HOME/nvidia); MESA_SHADER_CACHE_DIR and
 * the like are removed. `cold` starts it empty (and with MESA_SHADER_CACHE_DISABLE=true under
 * `--no-cache`); `warm` measures a second run on the cache a first one filled: the cold run's when
 * it ran in the same call with the cache on and succeeded, else a fill run of its own. Deno's module
 * cache (DENO_DIR) stays where it was, so only the shader caches are cold. `--backend` sets
 * DENO_WEBGPU_BACKEND (auto: unset, and the demo picks; it picks vulkan where lavapipe is installed).
 *
 * After `--timeout` seconds the demo's process group (it runs in a session of its own) gets
 * SIGTERM, then SIGKILL 5 s later. Processes of the group still alive after the demo exits are
 * counted (`leftover_processes`) and killed. Prints a line per demo line (unless `--quiet`), a
 * table, and one `RESULT {json}` line for bench/RESULTS.md; exits 1 when a run failed, timed out or
 * left processes behind.
 */

const usage = "deno task bench demo [--runs cold,warm | --cold | --warm] [--checkout DIR] " +
  '[--deno-cmd "npx --yes deno@2.9.6"] [--backend auto|vulkan|gl] [--no-cache] [--timeout 900] ' +
  "[--out DIR] [--quiet] [-- demo args]";

interface Options {
  runs: ("cold" | "warm")[];
  checkout: string;
  denoCmd: string[];
  backend: "auto" | "vulkan" | "gl";
  noCache: boolean;
  timeoutS: number;
  out: string | null;
  quiet: boolean;
  demoArgs: string[];
}

function fail(message: string): never {
  console.error(`${message}\nUsage: ${usage}`);
  Deno.exit(2);
}

function parseOptions(args: string[]): Options {
  const o: Options = {
    runs: ["cold", "warm"],
    checkout: new URL("..", import.meta.url).pathname.replace(/\/$/, ""),
    denoCmd: ["npx", "--yes", "deno@2.9.6"],
    backend: "auto",
    noCache: false,
    timeoutS: 900,
    out: null,
    quiet: false,
    demoArgs: [],
  };
  for (let i = 0; i < args.length; i++) {
    const a = args[i];
    const value = () => args[++i] ?? fail(`Option "${a}" needs a value`);
    if (a === "--") {
      o.demoArgs = args.slice(i + 1);
      break;
    } else if (a === "--cold" || a === "--warm") o.runs = [a === "--cold" ? "cold" : "warm"];
    else if (a === "--runs") {
      const runs = value().split(",").map((s) => s.trim()).filter(Boolean);
      if (!runs.length || runs.some((r) => r !== "cold" && r !== "warm")) {
        fail(`Invalid --runs "${runs.join(",")}": expected cold, warm or cold,warm`);
      }
      o.runs = runs as Options["runs"];
    } else if (a === "--checkout") o.checkout = value().replace(/\/$/, "");
    else if (a === "--deno-cmd") o.denoCmd = value().trim().split(/\s+/).filter(Boolean);
    else if (a === "--backend") {
      const b = value();
      if (b !== "auto" && b !== "vulkan" && b !== "gl") {
        fail(`Invalid --backend "${b}": expected gl, vulkan or auto`);
      }
      o.backend = b;
    } else if (a === "--no-cache") o.noCache = true;
    else if (a === "--timeout") {
      o.timeoutS = Number(value());
      if (!(o.timeoutS > 0)) fail(`Invalid --timeout "${args[i]}": expected seconds > 0`);
    } else if (a === "--out") o.out = value();
    else if (a === "--quiet") o.quiet = true;
    else fail(`Unknown argument "${a}"`);
  }
  if (!o.denoCmd.length) fail("Invalid --deno-cmd: empty");
  try {
    Deno.statSync(`${o.checkout}/deno.json`);
  } catch {
    fail(`Cannot use checkout "${o.checkout}": no deno.json there`);
  }
  return o;
}

// ---------------------------------------------------------------------------------------------
// Output capture: lines timed by their first byte; silence measured between output chunks.

/** One line of the demo's output; `t_ms` is when its first byte arrived, from spawn. */
interface Line {
  t_ms: number;
  stream: "out" | "err";
  text: string;
}

class Capture {
  lines: Line[] = [];
  /** The longest stretch without output: from `from_ms`, ended by `line` (null: by the exit). */
  longest: { gap_ms: number; from_ms: number; line: Line | null } = { gap_ms: 0, from_ms: 0, line: null };
  #open: Record<Line["stream"], Line | null> = { out: null, err: null };
  #lastMs = 0;
  #onLine: (line: Line) => void;

  constructor(onLine: (line: Line) => void) {
    this.#onLine = onLine;
  }

  add(stream: Line["stream"], text: string, t: number): void {
    if (!text) return;
    let first: Line | null = null;
    const parts = text.split("\n");
    for (let i = 0; i < parts.length; i++) {
      const last = i === parts.length - 1;
      if (last && parts[i] === "") break;
      let line = this.#open[stream];
      if (!line) {
        line = { t_ms: t, stream, text: "" };
        this.lines.push(line);
        this.#open[stream] = line;
      }
      line.text += parts[i];
      first ??= line;
      if (!last) this.#close(stream);
    }
    this.#gap(t, first);
  }

  /** Closes open lines and counts the silence until `t` (the exit, or the kill). */
  end(t: number): void {
    this.#close("out");
    this.#close("err");
    this.#gap(t, null);
  }

  #close(stream: Line["stream"]): void {
    const line = this.#open[stream];
    if (!line) return;
    // deno-lint-ignore no-control-regex
    line.text = line.text.replace(/\x1b\[[0-9;]*m/g, "").replace(/\r$/, "");
    this.#open[stream] = null;
    this.#onLine(line);
  }

  #gap(t: number, line: Line | null): void {
    if (t - this.#lastMs > this.longest.gap_ms) {
      this.longest = { gap_ms: t - this.#lastMs, from_ms: this.#lastMs, line };
    }
    this.#lastMs = t;
  }
}

// ---------------------------------------------------------------------------------------------
// One run of the demo.

interface RunResult {
  run: "cold" | "warm" | "fill";
  cache: string;
  wall_s: number;
  exit_code: number | null;
  signal: string | null;
  timed_out: boolean;
  lines: number;
  longest_silence_s: number;
  longest_silence_from_s: number;
  longest_silence_ended_by: string;
  first_token_ms: number[];
  sample_waits: { announced: string; wait_s: number; next: string }[];
  adapter: string | null;
  first_loss: number | null;
  last_loss: number | null;
  leftover_processes: number;
  log: string | null;
}

/** Pids in process group `pgid` that are still running (zombies excluded); [] off Linux. */
function groupMembers(pgid: number): number[] {
  const pids: number[] = [];
  try {
    for (const e of Deno.readDirSync("/proc")) {
      if (!/^\d+$/.test(e.name)) continue;
      try {
        const stat = Deno.readTextFileSync(`/proc/${e.name}/stat`);
        const [state, , pgrp] = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
        if (Number(pgrp) === pgid && state !== "Z") pids.push(Number(e.name));
      } catch { /* exited meanwhile */ }
    }
  } catch { /* no /proc */ }
  return pids;
}

function killGroup(pgid: number, signal: Deno.Signal): void {
  try {
    Deno.kill(-pgid, signal);
  } catch { /* the group is gone */ }
}

const delay = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));
const round = (x: number, digits = 1) => Math.round(x * 10 ** digits) / 10 ** digits;

/** The pgid of the demo running now, for the SIGINT handler. */
let current: number | null = null;

async function runDemo(
  o: Options,
  run: RunResult["run"],
  cache: { dir: string; label: string; disable: boolean },
): Promise<RunResult> {
  const home = await Deno.makeTempDir({ prefix: "demo_bench_home_" });
  const env = Deno.env.toObject();
  for (
    const k of [
      "MESA_SHADER_CACHE_DIR",
      "MESA_GLSL_CACHE_DIR",
      "MESA_SHADER_CACHE_DISABLE",
      "MESA_GLSL_CACHE_DISABLE",
      "__GL_SHADER_DISK_CACHE_PATH",
      "DENO_WEBGPU_BACKEND",
    ]
  ) delete env[k];
  env.DENO_DIR = Deno.env.get("DENO_DIR") ??
    `${Deno.env.get("XDG_CACHE_HOME") ?? `${Deno.env.get("HOME") ?? "/root"}/.cache`}/deno`;
  env.XDG_CACHE_HOME = cache.dir;
  env.GPT2_HOME = home;
  if (cache.disable) env.MESA_SHADER_CACHE_DISABLE = "true";
  if (o.backend !== "auto") env.DENO_WEBGPU_BACKEND = o.backend;
  const argv = [...o.denoCmd, "task", "demo", ...o.demoArgs];
  console.log(`-- ${run} run (${cache.label}): ${argv.join(" ")} in ${o.checkout}`);

  const t0 = performance.now();
  const now = () => performance.now() - t0;
  const capture = new Capture((line) => {
    if (!o.quiet) console.log(`[${run} ${(line.t_ms / 1000).toFixed(1).padStart(6)} s] ${line.text}`);
  });
  let child: Deno.ChildProcess;
  try {
    child = new Deno.Command(argv[0], {
      args: argv.slice(1),
      cwd: o.checkout,
      env,
      clearEnv: true,
      stdin: "null",
      stdout: "piped",
      stderr: "piped",
      detached: true, // a session and process group of its own: the timeout kills the whole tree
    }).spawn();
  } catch (e) {
    throw new Error(`Cannot run "${argv.join(" ")}": ${e instanceof Error ? e.message : e}`);
  }
  current = child.pid;
  const readers = ([["out", child.stdout], ["err", child.stderr]] as const).map(([stream, body]) => {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    const done = (async () => {
      try {
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          capture.add(stream, decoder.decode(value, { stream: true }), now());
        }
      } catch { /* cancelled */ }
    })();
    return { reader, done };
  });

  let timedOut = false;
  let killTimer: ReturnType<typeof setTimeout> | undefined;
  const timer = setTimeout(() => {
    timedOut = true;
    console.log(`-- ${run} run: timed out after ${o.timeoutS} s, SIGTERM to process group ${child.pid}`);
    killGroup(child.pid, "SIGTERM");
    killTimer = setTimeout(() => killGroup(child.pid, "SIGKILL"), 5000);
  }, o.timeoutS * 1000);
  const status = await child.status;
  const exitMs = now();
  clearTimeout(timer);
  clearTimeout(killTimer);
  // A process of the group that outlived the demo may hold the pipes open: wait a little, then kill it.
  await Promise.race([Promise.all(readers.map((r) => r.done)), delay(2000)]);
  const leftover = groupMembers(child.pid);
  if (leftover.length) {
    console.log(
      `-- ${run} run: ${leftover.length} process(es) of the demo's group outlived it (${leftover}): SIGKILL`,
    );
    killGroup(child.pid, "SIGKILL");
  }
  await Promise.race([Promise.all(readers.map((r) => r.done)), delay(2000)]);
  for (const r of readers) await r.reader.cancel().catch(() => {});
  current = null;
  capture.end(exitMs);
  await Deno.remove(home, { recursive: true }).catch(() => {});

  const lines = capture.lines;
  let log: string | null = null;
  if (o.out) {
    await Deno.mkdir(o.out, { recursive: true });
    log = `${o.out}/demo_${run}_${new Date().toISOString().replace(/[:.]/g, "-")}.log`;
    const header = `# ${argv.join(" ")} in ${o.checkout}; ${cache.label}; XDG_CACHE_HOME=${cache.dir}` +
      `${
        o.backend === "auto" ? "" : `; DENO_WEBGPU_BACKEND=${o.backend}`
      }\n# seconds from spawn, stream, line\n`;
    const body = lines.map((l) => `${(l.t_ms / 1000).toFixed(3).padStart(9)} ${l.stream} ${l.text}`).join(
      "\n",
    );
    await Deno.writeTextFile(
      log,
      `${header}${body}\n# exit ${status.code} at ${(exitMs / 1000).toFixed(3)} s\n`,
    );
  }

  const longest = capture.longest;
  return {
    run,
    cache: cache.label,
    wall_s: round(exitMs / 1000),
    exit_code: status.code,
    signal: status.signal ?? null,
    timed_out: timedOut,
    lines: lines.length,
    longest_silence_s: round(longest.gap_ms / 1000),
    longest_silence_from_s: round(longest.from_ms / 1000),
    longest_silence_ended_by: longest.line
      ? longest.line.text.trim() || "(blank line)"
      : timedOut
      ? "(timeout)"
      : "(exit)",
    ...parseLines(lines),
    leftover_processes: leftover.length,
    log,
  };
}

/** What the demo's lines say: first-token times, waits after sample announcements, adapter, losses. */
function parseLines(lines: Line[]) {
  const firstTokenMs: number[] = [];
  const sampleWaits: RunResult["sample_waits"] = [];
  let adapterLine: string | null = null, adapterInText: string | null = null;
  const iterLosses: number[] = [], anyLosses: number[] = [];
  const reminder = /^\s*(\.\.\.|server:)|compil/i;
  lines.forEach((l, i) => {
    const ft = l.text.match(/first after (\d+(?:\.\d+)?) ?(ms|s)\b/);
    if (ft) firstTokenMs.push(Math.round(Number(ft[1]) * (ft[2] === "s" ? 1000 : 1)));
    const ad = l.text.match(/adapter: (.*)/)?.[1].trim();
    if (ad && /^\s*adapter: /.test(l.text)) adapterLine = ad;
    else if (ad) adapterInText ??= ad; // "... on this adapter: ...", when no line starts with it
    const loss = l.text.match(/loss ([0-9.]+)/);
    if (loss && Number.isFinite(Number(loss[1]))) {
      anyLosses.push(Number(loss[1]));
      if (/\biter(ation)?\b/i.test(l.text) && !l.text.includes("->")) iterLosses.push(Number(loss[1]));
    }
    if (/sample|generat/i.test(l.text) && !/^\s*(>|server:|\.\.\.)/.test(l.text)) {
      const next = lines.slice(i + 1).find((n) => !reminder.test(n.text));
      if (next) {
        sampleWaits.push({
          announced: l.text.trim(),
          wait_s: round((next.t_ms - l.t_ms) / 1000, 2),
          next: next.text.trim() || "(blank line)",
        });
      }
    }
  });
  const losses = iterLosses.length ? iterLosses : anyLosses;
  return {
    first_token_ms: firstTokenMs,
    sample_waits: sampleWaits,
    adapter: adapterLine ?? adapterInText,
    first_loss: losses[0] ?? null,
    last_loss: losses.at(-1) ?? null,
  };
}

// ---------------------------------------------------------------------------------------------

async function gitCommit(dir: string): Promise<string | null> {
  try {
    const out = await new Deno.Command("git", {
      args: ["-C", dir, "rev-parse", "--short", "HEAD"],
      stderr: "null",
    })
      .output();
    return out.success ? new TextDecoder().decode(out.stdout).trim() : null;
  } catch {
    return null;
  }
}

function printTable(results: RunResult[]): void {
  const rows = [
    ["run", "cache", "exit", "wall s", "longest silence", "first token", "sample waits s", "loss", "adapter"],
    ...results.map((r) => [
      r.run,
      r.cache,
      r.timed_out ? "timeout" : String(r.exit_code),
      r.wall_s.toFixed(1),
      `${r.longest_silence_s.toFixed(1)} s from ${r.longest_silence_from_s.toFixed(1)} s`,
      r.first_token_ms.length ? r.first_token_ms.map((ms) => `${ms} ms`).join(", ") : "-",
      r.sample_waits.length ? r.sample_waits.map((w) => w.wait_s.toFixed(1)).join(", ") : "-",
      r.first_loss === null ? "-" : `${r.first_loss} -> ${r.last_loss}`,
      r.adapter?.replace(/ \[.*$/, "") ?? "-",
    ]),
  ];
  const widths = rows[0].map((_, c) => Math.max(...rows.map((row) => row[c].length)));
  for (const row of rows) console.log(row.map((cell, c) => cell.padEnd(widths[c])).join("  ").trimEnd());
  for (const r of results) {
    console.log(`${r.run}: longest silence ended by: ${r.longest_silence_ended_by}`);
    if (r.leftover_processes) console.log(`${r.run}: ${r.leftover_processes} process(es) outlived the demo`);
    if (r.log) console.log(`${r.run}: log ${r.log}`);
  }
}

async function main(): Promise<number> {
  const o = parseOptions(Deno.args);
  Deno.addSignalListener("SIGINT", () => {
    if (current !== null) killGroup(current, "SIGKILL");
    Deno.exit(130);
  });
  const caches: string[] = [];
  const tempCache = async () => {
    caches.push(await Deno.makeTempDir({ prefix: "demo_bench_cache_" }));
    return caches.at(-1)!;
  };
  const results: RunResult[] = [];
  try {
    let filled: string | null = null; // a cache the cold run filled
    for (const run of o.runs) {
      if (run === "cold") {
        const dir = await tempCache();
        const r = await runDemo(o, "cold", {
          dir,
          label: o.noCache ? "disabled" : "empty",
          disable: o.noCache,
        });
        results.push(r);
        if (!o.noCache && r.exit_code === 0) filled = dir;
        continue;
      }
      let dir = filled, label = "filled by the cold run";
      if (!dir) {
        dir = await tempCache();
        label = "filled by a fill run";
        const fill = await runDemo(o, "fill", { dir, label: "empty, filling", disable: false });
        results.push(fill);
        if (fill.timed_out || fill.exit_code !== 0) {
          console.log(
            `-- The fill run failed (exit ${fill.exit_code}${
              fill.timed_out ? ", timed out" : ""
            }): warm anyway`,
          );
        }
      }
      results.push(await runDemo(o, "warm", { dir, label, disable: false }));
    }
  } finally {
    for (const dir of caches) await Deno.remove(dir, { recursive: true }).catch(() => {});
  }

  console.log();
  printTable(results);
  const summary = {
    bench: "demo",
    command: [...o.denoCmd, "task", "demo", ...o.demoArgs].join(" "),
    checkout: o.checkout,
    commit: await gitCommit(o.checkout),
    backend: o.backend,
    no_cache: o.noCache,
    timeout_s: o.timeoutS,
    cpus: navigator.hardwareConcurrency,
    date: new Date().toISOString(),
    runs: results,
  };
  console.log(`RESULT ${JSON.stringify(summary)}`);
  return results.every((r) => !r.timed_out && r.exit_code === 0 && !r.leftover_processes) ? 0 : 1;
}

Deno.exit(await main());
