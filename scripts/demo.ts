/**
 * `deno task demo`: a newcomer's first command. It makes sure the fast CPU adapter is there
 * (Mesa's Vulkan driver, lavapipe, installed when it may be), prepares the built-in `sotu`
 * dataset, starts the server with the permissions of `deno task serve`, and shows a model
 * learning: a sample from the untrained model, a short training run with its loss falling, and a
 * sample from the trained one (GET /generate). Kernel compilation is shown as it goes, and no
 * stretch of more than 15 s passes without a line. It prints the dashboard's URL (GET /), where
 * the same jobs show as curves; `--keep` leaves the server running after the demo (until Ctrl-C).
 *
 * Flags: `--keep`; `--no-install` (never install lavapipe, only say how).
 * Environment: GPT2_HOME (default ./.gpt2), PORT (default: any free port), DEMO_ITERS,
 * DENO_WEBGPU_BACKEND (yours wins; otherwise "vulkan" where lavapipe is installed).
 */

import { prepareDataset } from "../data/mod.ts";
import { compileLine, type CompileReport } from "../protocol.ts";

const home = Deno.env.get("GPT2_HOME") || "./.gpt2";
const FLAGS = ["--keep", "--no-install"];
for (const arg of Deno.args) {
  if (!FLAGS.includes(arg)) {
    console.error(`Unknown argument "${arg}": expected ${FLAGS.join(" or ")}`);
    Deno.exit(2);
  }
}
const keep = Deno.args.includes("--keep");
const noInstall = Deno.args.includes("--no-install");
const cpuPattern = /llvmpipe|lavapipe|swiftshader|software|cpu/i;

/**
 * What the OpenGL fallback costs: seconds to compile the demo's kernels (training and generation)
 * with an empty shader cache on 2 cores, by OpenGL llvmpipe and by lavapipe. Measured with
 * `deno task bench demo --backend gl` and its lavapipe run (mostly the generation kernels' first
 * dispatches on OpenGL); update when the kernels change.
 */
const FALLBACK_COST = { gl_s: 420, lavapipe_s: 10, measured: "2026-12-02, 2 cores, empty shader cache" };
/** The server will run on OpenGL llvmpipe (the user's choice, or lavapipe missing). */
let onOpenGl = false;
const LAVAPIPE_PACKAGES = ["libvulkan1", "mesa-vulkan-drivers"];
const PROMPT = "Fellow citizens, the state of our Union is";

// ---------------------------------------------------------------------------------------------
// Output: every line goes through say(); a watchdog speaks up after 10 s of silence.

const QUIET_MS = 10_000;
const t0 = Date.now();
let lastLine = Date.now();
/** A partial line is on the terminal (a sample being streamed). */
let midLine = false;
/** What the demo is waiting for, for the watchdog; null while it needs no reminder. */
let waitingFor: (() => string) | null = null;
let waitStart = Date.now();

/** Server lines that arrived while a sample was streaming: shown after it. */
const held: string[] = [];

/** Waiting for a first token: the server's lines about compiling generation kernels are shown. */
let showCompiles = false;

/**
 * Relays a line of the server's log, or holds it while a sample streams. Its lines about
 * compiling generation kernels are shown only while a first token is awaited (the server goes
 * on compiling other batch sizes in the background).
 */
function relay(line: string): void {
  if (/: compil(ing kernels|ed) \d/.test(line) && !showCompiles) return;
  if (midLine) held.push(line);
  else say(`   server: ${line}`);
}

/** Ends a streamed line, if one is open. */
function endLine(): void {
  if (midLine) console.log();
  midLine = false;
}

function say(line: string): void {
  if (midLine) console.log();
  midLine = false;
  console.log(line);
  lastLine = Date.now();
}

/** Writes `text` without a newline (a streamed sample). */
function write(text: string): void {
  Deno.stdout.writeSync(new TextEncoder().encode(text));
  midLine = !text.endsWith("\n");
  lastLine = Date.now();
}

/** Sets what the watchdog reports while the demo waits (null: nothing). */
function waiting(what: (() => string) | null): void {
  waitingFor = what;
  waitStart = Date.now();
}

const secs = (ms: number) => `${Math.round(ms / 1000)} s`;
setInterval(() => {
  if (waitingFor && Date.now() - lastLine >= QUIET_MS) {
    say(`   ... ${waitingFor()} (${secs(Date.now() - waitStart)}; ${secs(Date.now() - t0)} since start)`);
  }
}, 1000);

function fmt(x: unknown, digits = 3): string {
  return typeof x === "number" && Number.isFinite(x) ? x.toFixed(digits) : "-";
}

// ---------------------------------------------------------------------------------------------
// The adapter: lavapipe where it is missing and the fallback would be OpenGL llvmpipe.

/** Whether Mesa's Vulkan CPU driver and the Vulkan loader are installed. */
function lavapipeInstalled(): boolean {
  const exists = (p: string) => {
    try {
      Deno.statSync(p);
      return true;
    } catch {
      return false;
    }
  };
  const icd = ["/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d"].some((dir) => {
    try {
      return [...Deno.readDirSync(dir)].some((e) => /^lvp_icd.*\.json$/.test(e.name));
    } catch {
      return false;
    }
  });
  const libDirs = [
    ...(Deno.env.get("LD_LIBRARY_PATH") ?? "").split(":").filter(Boolean),
    `/usr/lib/${Deno.build.arch}-linux-gnu`,
    `/lib/${Deno.build.arch}-linux-gnu`,
    "/usr/lib64",
    "/usr/lib",
    "/lib64",
    "/lib",
  ];
  return icd && libDirs.some((d) => exists(`${d}/libvulkan.so.1`));
}

/** The adapter WebGPU picks in this process, or null (a probe: the device is never opened). */
async function probeAdapter(): Promise<string | null> {
  const adapter = await navigator.gpu?.requestAdapter({ powerPreference: "high-performance" });
  return adapter ? adapter.info.description || adapter.info.vendor || "unknown adapter" : null;
}

/** How this process may run apt-get: as root, through passwordless sudo, or not at all. */
async function aptCommand(): Promise<string[] | null> {
  try {
    Deno.statSync("/usr/bin/apt-get");
  } catch {
    return null;
  }
  if (Deno.uid() === 0) return [];
  try {
    const { success } = await new Deno.Command("sudo", {
      args: ["-n", "true"],
      stdout: "null",
      stderr: "null",
    })
      .output();
    return success ? ["sudo", "-n"] : null;
  } catch {
    return null;
  }
}

/** Runs `cmd`, its output hidden unless it fails; the watchdog reports while it runs. */
async function runQuiet(cmd: string[], what: string): Promise<boolean> {
  waiting(() => what);
  const out = await new Deno.Command(cmd[0], {
    args: cmd.slice(1),
    env: { DEBIAN_FRONTEND: "noninteractive" },
    stdout: "piped",
    stderr: "piped",
  }).output();
  waiting(null);
  if (!out.success) {
    const tail = new TextDecoder().decode(out.stderr).trim().split("\n").slice(-5).join("\n      ");
    say(`   "${cmd.join(" ")}" failed (exit ${out.code}):\n      ${tail}`);
  }
  return out.success;
}

/**
 * Picks the backend for the server: the user's DENO_WEBGPU_BACKEND, else Vulkan where lavapipe
 * is installed (installing it first when the only adapter would be OpenGL llvmpipe, or none).
 * Returns the environment to add to the server's.
 */
async function chooseAdapter(): Promise<Record<string, string>> {
  const env: Record<string, string> = {};
  // Mesa warns on every adapter request without it.
  if (!Deno.env.get("XDG_RUNTIME_DIR")) env.XDG_RUNTIME_DIR = await Deno.makeTempDir({ prefix: "xdg_" });
  for (const [k, v] of Object.entries(env)) Deno.env.set(k, v);
  const chosen = Deno.env.get("DENO_WEBGPU_BACKEND");
  if (chosen) {
    say(`   DENO_WEBGPU_BACKEND=${chosen} (yours)`);
    onOpenGl = /^(gl|opengl)$/i.test(chosen);
    return env;
  }
  if (Deno.build.os !== "linux") return env;
  if (!lavapipeInstalled()) {
    const adapter = await probeAdapter().catch(() => null);
    if (adapter && !cpuPattern.test(adapter)) {
      say(`   adapter: ${adapter}`);
      return env; // a real GPU: no CPU driver needed
    }
    const install = LAVAPIPE_PACKAGES;
    const apt = noInstall ? null : await aptCommand();
    say(
      adapter
        ? `   The only adapter is ${adapter}, Mesa's OpenGL fallback: its Vulkan CPU driver (lavapipe) is missing.`
        : "   No WebGPU adapter was found, and Mesa's Vulkan CPU driver (lavapipe) is missing.",
    );
    if (!apt && !noInstall) say("   Not installing it: that takes apt-get, and root or passwordless sudo.");
    if (apt) {
      say(
        `   Installing it: ${
          [...apt, "apt-get", "install", "-y", ...install].join(" ")
        } (after apt-get update)`,
      );
      const ok = await runQuiet([...apt, "apt-get", "update", "-qq"], "apt-get update") &&
        await runQuiet([...apt, "apt-get", "install", "-y", "-qq", ...install], "installing lavapipe");
      if (ok && lavapipeInstalled()) say("   lavapipe installed");
    }
    if (!lavapipeInstalled()) {
      const fallback = `OpenGL llvmpipe compiles this demo's kernels in about ${FALLBACK_COST.gl_s} s on a ` +
        `first run, lavapipe in about ${FALLBACK_COST.lavapipe_s} s (${FALLBACK_COST.measured})`;
      onOpenGl = adapter !== null;
      say(
        `   Continuing without it. ${fallback}. To get it: sudo apt-get install ${install.join(" ")} ` +
          `(Debian, Ubuntu; Fedora: dnf install mesa-vulkan-drivers vulkan-loader), then run the demo again.`,
      );
      return env;
    }
  }
  env.DENO_WEBGPU_BACKEND = "vulkan";
  say("   lavapipe is installed: DENO_WEBGPU_BACKEND=vulkan");
  return env;
}

// ---------------------------------------------------------------------------------------------
// The server.

/** The permission flags of deno.json's `serve` task (the demo runs the server as README says). */
async function serveFlags(): Promise<string[]> {
  const json = JSON.parse(await Deno.readTextFile(new URL("../deno.json", import.meta.url)));
  const task = json.tasks?.serve;
  const line: string = typeof task === "string" ? task : task?.command ?? "";
  const words = line.trim().split(/\s+/);
  const run = words.indexOf("run"), main = words.findIndex((w) => w.endsWith("main.ts"));
  if (run < 0 || main < run) throw new Error(`Cannot read the serve task of deno.json: "${line}"`);
  return words.slice(run + 1, main);
}

/**
 * Starts the server and resolves with its URL once it listens. Its later output is relayed,
 * except the lines about `quiet` jobs, whose events the demo prints itself.
 */
async function startServer(
  env: Record<string, string>,
  quiet: Set<string>,
): Promise<{ url: string; child: Deno.ChildProcess }> {
  const flags = await serveFlags();
  say(`   deno run ${flags.join(" ")} main.ts`);
  const child = new Deno.Command(Deno.execPath(), {
    args: ["run", ...flags, new URL("../main.ts", import.meta.url).pathname],
    env: { ...env, PORT: Deno.env.get("PORT") ?? "0", GPT2_HOME: home, HOST: "127.0.0.1" },
    stdout: "piped",
    stderr: "inherit",
  }).spawn();
  const lines = child.stdout.pipeThrough(new TextDecoderStream()).pipeThrough(lineSplitter());
  const reader = lines.getReader();
  for (;;) {
    const { value, done } = await reader.read();
    if (done) throw new Error("Server exited before listening");
    const m = value.match(/listening on (http:\/\/[^/\s]+)\//);
    if (!m) {
      say(`   server: ${value}`);
      continue;
    }
    (async () => {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        const job = value.match(/^(job_\w+): /)?.[1];
        if (value.trim() && !(job && quiet.has(job))) relay(value);
      }
    })();
    return { url: m[1], child };
  }
}

function lineSplitter(): TransformStream<string, string> {
  let buf = "";
  return new TransformStream({
    transform(chunk, ctl) {
      buf += chunk;
      let i;
      while ((i = buf.indexOf("\n")) >= 0) {
        ctl.enqueue(buf.slice(0, i));
        buf = buf.slice(i + 1);
      }
    },
    flush(ctl) {
      if (buf) ctl.enqueue(buf);
    },
  });
}

/** Reads server-sent events from `res`, calling `on(event, data)` for each; stops when it returns true. */
async function readEvents(res: Response, on: (event: string, data: string) => boolean): Promise<void> {
  const reader = res.body!.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value;
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, i);
      buf = buf.slice(i + 2);
      const type = block.match(/^event: (.*)$/m)?.[1];
      const raw = block.match(/^data: (.*)$/m)?.[1];
      if (type && raw && on(type, raw)) {
        await reader.cancel();
        return;
      }
    }
  }
}

/** Waits until the GPU host has opened GPU 0 (or failed to); returns its adapter, or null after saying why not. */
async function waitForGpu(url: string): Promise<string | null> {
  waiting(() => "waiting for the GPU host to open the adapter");
  try {
    for (;;) {
      const health = await fetch(`${url}/health`).then((r) => r.json()).catch((e) => ({ down: e }));
      if (health.down) {
        say(`   The server stopped answering: ${(health.down as Error).message}`);
        return null;
      }
      const gpu = health.gpus?.[0] as
        | { state: string; adapter: string | null; error: string | null }
        | undefined;
      if (health.gpu_host?.state === "failed") {
        say(`   The GPU host cannot start: ${health.gpu_host.reason ?? "no reason given"}`);
        return null;
      }
      if (gpu && gpu.state !== "starting") {
        if (gpu.state !== "unavailable") return gpu.adapter ?? "unknown adapter";
        say(`   No GPU to train on: ${gpu.error ?? "the worker did not start"}`);
        return null;
      }
      await new Promise((r) => setTimeout(r, 200));
    }
  } finally {
    waiting(null);
  }
}

// ---------------------------------------------------------------------------------------------
// Jobs and samples.

/** What a followed job ended with: its outcome and the first and last training losses logged. */
interface Followed {
  outcome: Record<string, unknown> | null;
  first: { iteration: number; loss: number } | null;
  last: { iteration: number; loss: number } | null;
}

/** Submits a training job and prints its compilation, progress and checkpoints until it ends. */
async function train(
  url: string,
  body: Record<string, unknown>,
  quiet: Set<string>,
  opts: { verbose: boolean },
): Promise<{ id: string; followed: Followed } | null> {
  const res = await fetch(`${url}/train`, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
  });
  const job = await res.json();
  if (res.status !== 202) {
    say(`   Training was refused (HTTP ${res.status}): ${JSON.stringify(job)}`);
    return null;
  }
  quiet.add(job.id);
  if (opts.verbose) {
    say(`   job ${job.id}: its curves at ${url}/#/jobs/${job.id}, or scripts/follow.sh ${job.id}`);
  }
  const iters = body.train_iters as number;
  const followed: Followed = { outcome: null, first: null, last: null };
  let compile: CompileReport | null = null, compileShown = 0;
  waiting(() =>
    compile && compile.done < compile.total
      ? `compiling kernel ${compile.done + 1} of ${compile.total} (after "${compile.label}")`
      : compile
      ? "running the first step"
      : "starting the job"
  );
  try {
    await readEvents(await fetch(`${url}/jobs/${job.id}/events`), (type, raw) => {
      const d = JSON.parse(raw);
      if (type === "compile") {
        compile = d as CompileReport;
        const complete = d.done >= d.total;
        if (d.done === 1 || complete || Date.now() - compileShown >= 5000) {
          say(`   ${compileLine(d)}`);
          compileShown = Date.now();
        }
        waitStart = Date.now();
      } else if (type === "progress" && d.kind === "train") {
        waiting(() => `training, at iteration ${d.iteration}`);
        if (d.loss !== null) {
          followed.first ??= { iteration: d.iteration, loss: d.loss };
          followed.last = { iteration: d.iteration, loss: d.loss };
        }
        if (!opts.verbose) return false;
        const t = d.timings;
        say(
          `   iter ${String(d.iteration).padStart(5)}/${iters}  loss ${fmt(d.loss)}  ` +
            `${Math.round(d.tokens_per_s)} tok/s  step ${fmt(t.step_ms, 0)} ms`,
        );
      } else if (type === "progress" && d.kind === "eval") {
        if (opts.verbose) say(`   ${d.split} loss ${fmt(d.loss)}  perplexity ${fmt(d.perplexity, 1)}`);
        waiting(() => "evaluating and saving");
      } else if (type === "checkpoint") {
        if (opts.verbose) say(`   checkpoint ${d.path}`);
      } else if (type === "log" && d.level === "warn") {
        say(`   ${d.message}`);
      } else if (type === "done") {
        followed.outcome = d;
      }
      return followed.outcome !== null;
    });
  } finally {
    waiting(null);
  }
  if (!followed.outcome || followed.outcome.status !== "succeeded") {
    say(`   Training did not succeed: ${JSON.stringify(followed.outcome)}`);
    return null;
  }
  return { id: job.id, followed };
}

/** Streams a sample from a job's newest checkpoint; the prompt appears with the first token. */
async function sample(url: string, model: string, maxTokens: number): Promise<boolean> {
  const q = new URLSearchParams({
    model,
    prompt: PROMPT,
    max_tokens: String(maxTokens),
    temperature: "0.8",
    top_k: "40",
    seed: "7",
  });
  const slow = onOpenGl ? "; OpenGL llvmpipe takes minutes on a first run" : "";
  waiting(() => `waiting for the first token (the server loads the model and compiles its kernels${slow})`);
  showCompiles = true;
  try {
    const res = await fetch(`${url}/generate?${q}`);
    if (res.status !== 200) {
      say(`   Generation was refused (HTTP ${res.status}): ${await res.text()}`);
      return false;
    }
    let ok = false, tokens = 0;
    await readEvents(res, (type, raw) => {
      const d = JSON.parse(raw);
      if (type === "token") {
        if (tokens++ === 0) {
          showCompiles = false;
          // Slow tokens (kernels compiled for the next steps) get a reminder line between them.
          waiting(() =>
            `${tokens} token${
              tokens === 1 ? "" : "s"
            } so far, waiting for the next (the server compiles kernels)`
          );
          say("");
          write(`   > ${PROMPT}`);
        } else if (!midLine) {
          write("   > "); // the sample goes on after a reminder
        }
        write(d.text.replaceAll("\n", "\n   > "));
      }
      if (type !== "done") return false;
      ok = d.finish_reason !== "error";
      const t = d.timings;
      endLine();
      for (const line of held.splice(0)) say(`   server: ${line}`);
      say(
        `   [${d.finish_reason}${
          d.error ? `: ${d.error}` : ""
        }] ${d.completion_tokens} tokens, the first after ${fmt(t.ttft_ms / 1000, 1)} s, ${
          fmt(t.tokens_per_s, 1)
        } tokens/s`,
      );
      return true;
    });
    return ok;
  } finally {
    showCompiles = false;
    waiting(null);
  }
}

// ---------------------------------------------------------------------------------------------

/** Step 2: the "sotu" dataset, prepared (cached after the first run), its counts shown. */
async function prepareSotu(): Promise<void> {
  say(`2. Preparing the "sotu" dataset in ${home} (cached after the first run)`);
  let stage = "loading the data pipeline";
  waiting(() => `preparing the dataset: ${stage}`);
  const info = await prepareDataset(home, { builtin: "sotu" }, {}, (p) => {
    const next = p.stage === "tokenize" && p.total
      ? `tokenize, ${Math.round((100 * p.done) / p.total)}% of the text`
      : p.stage;
    if (p.stage !== stage.split(",")[0]) say(`   ${p.stage}...`);
    stage = next;
  });
  waiting(null);
  say(
    `   ${info.documents} speeches, ${info.tokens} tokens (train ${info.splits.train}, valid ${info.splits.valid}, test ${info.splits.test})`,
  );
}

/**
 * Steps 4-6 on the server at `url`: samples from the model as initialized, training it, and
 * samples from the trained model. Returns the exit code.
 */
async function trainAndSample(url: string, quiet: Set<string>): Promise<number> {
  const adapter = await waitForGpu(url);
  if (!adapter) return 1;
  const onCpu = cpuPattern.test(adapter);
  say(`   adapter: ${adapter}`);

  // CPU adapters: gpt2-tiny, whose 50304-word LM head dominates its step. Measured 2026-12-02
  // on 2 cores (lavapipe, other work running): ~500 tokens/s whatever the batch (4 x 32: 230-310
  // ms a step), so small batches give the most updates; the training loss falls 10.8 -> 6.4-6.6
  // in 300 steps and validation to 7.2-7.3 for lr 3e-3 to 2e-2 and batches of 4 or 8: common
  // words in their frequencies, not yet grammar, which takes far more tokens than minutes give.
  const iters = Number(Deno.env.get("DEMO_ITERS") ?? (onCpu ? 200 : 2000));
  const config = onCpu
    ? { model: "gpt2-tiny", batch_size: 4, seq_len: 32, lr: 1e-2, min_lr: 1e-3 }
    : { model: "gpt2-small-test", batch_size: 16, seq_len: 128, lr: 1e-3, min_lr: 1e-4 };
  const common = { ...config, dataset: "sotu", attention_dropout: 0, hidden_dropout: 0, seed: 1234 };
  const maxTokens = onCpu ? 40 : 120;

  say(`4. Before training: ${config.model} as initialized (a 1-step job at learning rate 1e-9 saves it)`);
  const before = await train(
    url,
    {
      ...common,
      train_iters: 1,
      lr: 1e-9,
      min_lr: 0,
      log_interval: 1,
      eval_interval: 0,
      eval_iters: 8,
      save_interval: 0,
    },
    quiet,
    { verbose: false },
  );
  if (!before) return 1;
  say(
    `   validation loss ${
      fmt(before.followed.outcome!.val_loss)
    } (guessing uniformly among 50257 tokens: 10.825)`,
  );
  say(`   a sample (temperature 0.8, top-k 40):`);
  if (!(await sample(url, before.id, maxTokens))) return 1;

  say(
    `5. Training ${config.model} for ${iters} iterations (batch ${config.batch_size} x ${config.seq_len} tokens)`,
  );
  const after = await train(
    url,
    {
      ...common,
      train_iters: iters,
      warmup: 0.05,
      log_interval: Math.max(1, Math.round(iters / 20)),
      eval_interval: Math.max(1, Math.round(iters / 2)),
      eval_iters: 8,
      save_interval: 0,
    },
    quiet,
    { verbose: true },
  );
  if (!after) return 1;
  const { first, last, outcome } = after.followed;
  say(
    `   training loss ${fmt(first?.loss)} at iteration ${first?.iteration} -> ${
      fmt(last?.loss)
    } at ${last?.iteration}; ` +
      `validation ${fmt(before.followed.outcome!.val_loss)} -> ${fmt(outcome!.val_loss)}, test ${
        fmt(outcome!.test_loss)
      }`,
  );
  say(`   checkpoints (Hugging Face safetensors + config.json): ${home}/checkpoints/${after.id}/`);
  say(`6. A sample from the trained model (scripts/generate.sh ${after.id} "your prompt" for more)`);
  const ok = await sample(url, after.id, maxTokens);
  say(`Done in ${secs(Date.now() - t0)}.`);
  return ok ? 0 : 1;
}

async function main(): Promise<number> {
  say("1. The GPU adapter");
  const env = await chooseAdapter();

  await prepareSotu();

  say("3. Starting the server");
  const quiet = new Set<string>();
  waiting(() => "starting the server");
  const { url, child } = await startServer(env, quiet);
  waiting(null);
  let kept = false; // the demo is over and the server kept running (--keep)
  const stop = async () => {
    try {
      child.kill("SIGTERM");
    } catch { /* gone */ }
    await child.status;
  };
  Deno.addSignalListener("SIGINT", async () => {
    say(kept ? "\nStopping the server" : "\nStopping (a job resumes from its last checkpoint next time)");
    await stop();
    Deno.exit(130);
  });
  try {
    say(`   ${url}  (dashboard: ${url}/${keep ? "" : ", open while the demo runs, or use --keep"})`);
    return await trainAndSample(url, quiet);
  } finally {
    if (keep) {
      kept = true;
      say(`\nThe server keeps running: open the dashboard at ${url}/ (Ctrl-C stops it)`);
      await child.status;
    }
    await stop();
  }
}

Deno.exit(await main());
