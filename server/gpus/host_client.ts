/**
 * The server's side of the GPU host (host/gpu_host.ts): starts the child process, hands the
 * runner one port per GPU that relays messages over the child's stdin and stdout, and notices
 * when the child dies. A dead host fails every port (the runner then marks their jobs
 * interrupted and asks for new ports); asking for a port restarts the host, after a back-off
 * when it keeps dying. No WebGPU is ever loaded in this process.
 *
 * A host that cannot be spawned (a missing executable, a missing permission) or that exits
 * before its first answer is a state, "failed" with the reason, never an exception in the HTTP
 * process: its ports stay open, messages to it wait, and it is tried again with the same
 * back-off until it starts.
 */

import { fileURLToPath } from "node:url";
import type { FromHost, FromWorker, ToHost, ToWorker } from "../../protocol.ts";
import type { SpawnWorker, WorkerPort } from "../../protocol.ts";

/** What `/health` shows of the host. */
export interface HostStatus {
  state: "starting" | "running" | "restarting" | "failed" | "stopped";
  pid: number | null;
  /** Times the host was started again (or tried) after dying or failing to start. */
  restarts: number;
  /** How the previous host process ended, if one did. */
  last_exit: { code: number; signal: string | null; at: string } | null;
  /**
   * Why the host is down, while "failed" (it could not be spawned, or exited before its first
   * answer: the error, or its exit and last line of stderr) or "restarting".
   */
  reason: string | null;
  /** When the next start is due while the host is down (ISO time). */
  retry_at: string | null;
}

/** Options of {@link GpuHostClient}. */
export interface HostClientOptions {
  /** Extra environment for the host (merged over this process's). */
  env?: Record<string, string>;
  /** The Deno executable that runs the host (default: this process's own, `Deno.execPath()`). */
  deno?: string;
  /** Deno flags for the child (default: -A; the server passes {@link hostPermissions}). */
  denoFlags?: string[];
  /** First restart delay after a crash, in ms; doubles per consecutive crash up to 30 s. */
  restartDelayMs?: number;
}

/** The repository: the host reads its own modules and the npm packages under it. */
const ROOT = fileURLToPath(new URL("../..", import.meta.url));

/**
 * The host's Deno permissions: read its code and the data directories, write the data
 * directories, read and set the environment (the device-select variables, see gpu_select.ts),
 * and run `nvidia-smi`; no network. Running is unscoped because every CUDA host sets
 * LD_LIBRARY_PATH, and Deno refuses to spawn a child that inherits it under a scoped
 * `--allow-run`.
 */
export function hostPermissions(dataDirs: string[]): string[] {
  const list = (paths: string[]) => [...new Set(paths)].map((p) => p.replaceAll(",", ",,")).join(",");
  return [
    `--allow-read=${list([ROOT, ...dataDirs])}`,
    `--allow-write=${list(dataDirs)}`,
    "--allow-env",
    "--allow-run",
    "--no-prompt",
  ];
}

const encoder = new TextEncoder();
/** Bytes of the host's stderr kept to explain an early exit. */
const STDERR_TAIL = 4096;

class HostPort implements WorkerPort {
  onmessage: ((e: MessageEvent<FromWorker>) => void) | null = null;
  onerror: ((e: ErrorEvent) => void) | null = null;
  dead = false;
  constructor(readonly gpu: number, public generation: number, private client: GpuHostClient) {}
  postMessage(msg: ToWorker): void {
    if (this.dead) return;
    if (msg.type === "shutdown" && !this.client.running) {
      // No host process to shut down: answer for it, as the host does for a GPU without a Worker.
      queueMicrotask(() => this.deliver({ type: "closed", gpu: this.gpu }));
      return;
    }
    this.client.write(this.generation, { gpu: this.gpu, msg });
  }
  deliver(msg: FromWorker): void {
    if (!this.dead) this.onmessage?.(new MessageEvent("message", { data: msg }));
  }
  fail(message: string): void {
    if (this.dead) return;
    this.dead = true;
    this.onerror?.(new ErrorEvent("error", { message, cancelable: true }));
  }
  terminate(): void {
    this.dead = true;
  }
}

/** Runs the GPU host child process and relays its messages. */
export class GpuHostClient {
  #opts: HostClientOptions;
  #child: Deno.ChildProcess | null = null;
  #writer: WritableStreamDefaultWriter<Uint8Array> | null = null;
  /** Bumped on every start: messages for ports of an older host are dropped. */
  #generation = 0;
  #ports = new Map<number, HostPort>();
  #status: HostStatus = {
    state: "stopped",
    pid: null,
    restarts: 0,
    last_exit: null,
    reason: null,
    retry_at: null,
  };
  #closing = false;
  #exited: Promise<Deno.CommandStatus> | null = null;
  #starts = 0;
  /** Whether the current host has sent a line yet; one that exits before it did has failed. */
  #answered = false;
  #crashStreak = 0;
  #startedAt = 0;
  #restartTimer: ReturnType<typeof setTimeout> | null = null;
  #pending: ToHost[] = [];
  /** Lines for the host's stdin written in this task, not yet flushed (see write). */
  #lines: string[] = [];

  constructor(opts: HostClientOptions = {}) {
    this.#opts = opts;
  }

  /** The runner's `spawn`: a port for GPU `gpu` on the live host, (re)starting it when needed. */
  readonly spawn: SpawnWorker = (gpu) => {
    if (this.#closing) throw new Error("GPU host is shutting down");
    if (!this.#child && this.#restartTimer === null) this.#startNow();
    this.#ports.get(gpu)?.terminate();
    const port = new HostPort(gpu, this.#generation, this);
    this.#ports.set(gpu, port);
    return port;
  };

  get status(): HostStatus {
    return { ...this.#status };
  }

  /** Whether a host process is running. */
  get running(): boolean {
    return this.#child !== null;
  }

  /** Sends one message to the host (queued while it is down). */
  write(generation: number, msg: ToHost): void {
    if (generation !== this.#generation) return;
    if (!this.#writer) {
      this.#pending.push(msg);
      return;
    }
    // Lines written in one task go out as one write: a burst of requests (64 at once) then costs
    // the pipe one write instead of 64, each waiting for its own turn of the event loop.
    this.#lines.push(JSON.stringify(msg));
    if (this.#lines.length === 1) queueMicrotask(() => this.#flush());
  }

  /** Writes the lines queued by write() to the host's stdin at once. */
  #flush(): void {
    const lines = this.#lines;
    this.#lines = [];
    if (lines.length === 0) return;
    if (!this.#writer) {
      for (const line of lines) this.#pending.push(JSON.parse(line));
      return;
    }
    this.#writer.write(encoder.encode(lines.join("\n") + "\n")).catch(() => {});
  }

  #startNow(): void {
    this.#restartTimer = null;
    this.#generation++;
    // Ports handed out while the host was down belong to this one.
    for (const p of this.#ports.values()) if (!p.dead) p.generation = this.#generation;
    if (this.#starts++ > 0) this.#status.restarts++;
    this.#startedAt = Date.now();
    let child: Deno.ChildProcess;
    try {
      child = new Deno.Command(this.#opts.deno ?? Deno.execPath(), {
        args: [
          "run",
          ...(this.#opts.denoFlags ?? ["-A"]),
          fileURLToPath(new URL("../../host/gpu_host.ts", import.meta.url)),
        ],
        stdin: "piped",
        stdout: "piped",
        stderr: "piped",
        env: { ...this.#opts.env, GPT2_GPU_HOST_CHILD: "1" },
        // Its own session and process group: Ctrl-C in the server's terminal, or a supervisor's
        // signal to the server's group, never reaches it. The server stops it through the
        // protocol (after its jobs saved), and its stdin's end stops it if the server dies.
        detached: true,
      }).spawn();
    } catch (e) {
      const hint = e instanceof Deno.errors.NotCapable
        ? " (start the server with --allow-run, as `deno task serve` does)"
        : "";
      this.#retry("failed", `Cannot start the GPU host: ${(e as Error).message.replace(/\.$/, "")}${hint}`);
      return;
    }
    this.#child = child;
    this.#answered = false;
    this.#status = { ...this.#status, state: "running", pid: child.pid, reason: null, retry_at: null };
    this.#writer = child.stdin.getWriter();
    const generation = this.#generation;
    for (const m of this.#pending.splice(0)) this.write(generation, m);
    this.#readLoop(child, generation);
    const tail = { text: "" };
    const stderrDone = pumpStderr(child.stderr, tail);
    this.#exited = child.status;
    child.status
      .then(async (s) => {
        // Its last words explain an early exit: let them arrive (a grandchild may hold the pipe).
        await settledWithin(stderrDone, 500);
        this.#onExit(child, generation, s, tail.text);
      })
      .catch((e) => console.error(`GPU host client: ${(e as Error).message}`));
  }

  async #readLoop(child: Deno.ChildProcess, generation: number): Promise<void> {
    const decoder = new TextDecoder();
    let buffered = "";
    try {
      for await (const chunk of child.stdout) {
        buffered += decoder.decode(chunk, { stream: true });
        let start = 0;
        for (let nl = buffered.indexOf("\n"); nl >= 0; nl = buffered.indexOf("\n", start)) {
          const line = buffered.slice(start, nl);
          start = nl + 1;
          if (line.trim()) this.#onLine(line, generation);
        }
        buffered = buffered.slice(start);
      }
    } catch { /* the pipe broke with the child */ }
  }

  #onLine(line: string, generation: number): void {
    let msg: FromHost;
    try {
      msg = JSON.parse(line);
    } catch {
      console.error(line); // stray output of a native library: keep it visible as a log line
      return;
    }
    if (generation !== this.#generation) return;
    this.#answered = true;
    const port = this.#ports.get(msg.gpu);
    if (!port || port.generation !== generation) return;
    try {
      if ("error" in msg) port.fail(msg.error);
      else port.deliver(msg.msg);
    } catch (e) {
      // The relay must outlive whatever a receiver does wrong: stopping to read the host's stdout
      // would block it on a full pipe, every GPU with it.
      console.error(
        `GPU host client: a receiver of GPU ${msg.gpu}'s "${
          "error" in msg ? "error" : msg.msg.type
        }" threw: ${(e as Error).stack ?? e}`,
      );
    }
  }

  #onExit(child: Deno.ChildProcess, generation: number, s: Deno.CommandStatus, stderr: string): void {
    if (this.#child !== child) return;
    this.#child = null;
    this.#writer = null;
    this.#status.pid = null;
    this.#status.last_exit = { code: s.code, signal: s.signal, at: new Date().toISOString() };
    if (this.#closing) {
      this.#status.state = "stopped";
      return;
    }
    const how = s.signal ? `signal ${s.signal}` : `status ${s.code}`;
    if (this.#answered) {
      this.#retry("restarting", `GPU host (pid ${child.pid}) exited with ${how}`);
    } else {
      const last = lastErrorLine(stderr);
      this.#retry("failed", `GPU host exited with ${how} before it answered${last ? `: ${last}` : ""}`);
    }
    // Ports of the dead host fail; the runner asks for new ones, which attach to the next host.
    for (const port of [...this.#ports.values()]) {
      if (port.generation === generation) port.fail(`GPU host exited with ${how}`);
    }
  }

  /** The host is down: start it again after a back-off that doubles while it keeps dying soon after starting. */
  #retry(state: "failed" | "restarting", reason: string): void {
    this.#crashStreak = Date.now() - this.#startedAt > 60_000 ? 1 : this.#crashStreak + 1;
    const delay = Math.min(30_000, (this.#opts.restartDelayMs ?? 500) * 2 ** (this.#crashStreak - 1));
    this.#status.state = state;
    this.#status.reason = reason;
    this.#status.retry_at = new Date(Date.now() + delay).toISOString();
    console.error(`${reason}; ${state === "failed" ? "trying again" : "restarting"} in ${delay / 1000} s`);
    this.#restartTimer = setTimeout(() => {
      if (!this.#closing && !this.#child) this.#startNow();
    }, delay);
  }

  /**
   * Ends the host: closes its stdin (it stops and shuts down its Workers, see gpu_host.ts) and
   * waits for it to exit, killing it after `timeoutMs`. Returns how it ended (null when no host
   * was running).
   */
  async close(timeoutMs: number): Promise<Deno.CommandStatus | null> {
    this.#closing = true;
    if (this.#restartTimer !== null) clearTimeout(this.#restartTimer);
    this.#restartTimer = null;
    this.#status.retry_at = null;
    for (const p of this.#ports.values()) p.terminate();
    const child = this.#child;
    if (!child || !this.#exited) {
      this.#status.state = "stopped";
      return null;
    }
    await this.#writer?.close().catch(() => {});
    let timer: ReturnType<typeof setTimeout> | undefined;
    const timedOut = new Promise<null>((r) => timer = setTimeout(() => r(null), timeoutMs));
    const status = await Promise.race([this.#exited, timedOut]);
    clearTimeout(timer);
    if (status) return status;
    try {
      child.kill("SIGKILL");
    } catch { /* gone meanwhile */ }
    return await this.#exited;
  }

  /** Kills the host at once (tests: a GPU host crash). */
  kill(signal: Deno.Signal = "SIGKILL"): void {
    this.#child?.kill(signal);
  }
}

/** Copies the host's stderr to this process's, keeping its last bytes in `tail.text`. */
async function pumpStderr(stderr: ReadableStream<Uint8Array>, tail: { text: string }): Promise<void> {
  const decoder = new TextDecoder();
  try {
    for await (const chunk of stderr) {
      try {
        for (let done = 0; done < chunk.length;) done += Deno.stderr.writeSync(chunk.subarray(done));
      } catch { /* this process's stderr is gone: keep draining the host's */ }
      tail.text = (tail.text + decoder.decode(chunk, { stream: true })).slice(-STDERR_TAIL);
    }
  } catch { /* the pipe broke with the child */ }
}

/** Waits for `p` to settle, or `ms` at most. */
async function settledWithin(p: Promise<unknown>, ms: number): Promise<void> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  await Promise.race([p.catch(() => {}), new Promise((r) => timer = setTimeout(r, ms))]);
  clearTimeout(timer);
}

/** The line of a dead host's stderr that says why: Deno's "error: ..." line, else its last line. */
function lastErrorLine(stderr: string): string | null {
  const lines = stderr.split("\n").map((l) => l.trim()).filter((l) => l && !l.startsWith("at "));
  const line = lines.findLast((l) => l.startsWith("error: ")) ?? lines.at(-1);
  return line ? line.replace(/^error: (Uncaught (\(in promise\) )?)?/, "").slice(0, 500) : null;
}
