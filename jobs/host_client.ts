/**
 * The server's side of the GPU host (jobs/gpu_host.ts): starts the child process, hands the
 * runner one port per GPU that relays messages over the child's stdin and stdout, and notices
 * when the child dies. A dead host fails every port (the runner then marks their jobs
 * interrupted and asks for new ports); asking for a port restarts the host, after a back-off
 * when it keeps dying. No WebGPU is ever loaded in this process.
 */

import type { FromHost, FromWorker, ToHost, ToWorker } from "./messages.ts";
import type { SpawnWorker, WorkerPort } from "./gpu_port.ts";

/** What `/health` shows of the host. */
export interface HostStatus {
  state: "starting" | "running" | "restarting" | "stopped";
  pid: number | null;
  /** Times the host was started again after dying. */
  restarts: number;
  /** How the previous host process ended, if one did. */
  last_exit: { code: number; signal: string | null; at: string } | null;
}

/** Options of {@link GpuHostClient}. */
export interface HostClientOptions {
  /** Extra environment for the host (merged over this process's). */
  env?: Record<string, string>;
  /** Deno flags for the child (default: -A). */
  denoFlags?: string[];
  /** First restart delay after a crash, in ms; doubles per consecutive crash up to 30 s. */
  restartDelayMs?: number;
}

const encoder = new TextEncoder();

class HostPort implements WorkerPort {
  onmessage: ((e: MessageEvent<FromWorker>) => void) | null = null;
  onerror: ((e: ErrorEvent) => void) | null = null;
  dead = false;
  constructor(readonly gpu: number, public generation: number, private client: GpuHostClient) {}
  postMessage(msg: ToWorker): void {
    if (!this.dead) this.client.write(this.generation, { gpu: this.gpu, msg });
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
  #status: HostStatus = { state: "stopped", pid: null, restarts: 0, last_exit: null };
  #closing = false;
  #exited: Promise<Deno.CommandStatus> | null = null;
  #crashStreak = 0;
  #startedAt = 0;
  #restartTimer: ReturnType<typeof setTimeout> | null = null;
  #pending: ToHost[] = [];

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

  /** Sends one message to the host (queued while it restarts). */
  write(generation: number, msg: ToHost): void {
    if (generation !== this.#generation) return;
    if (!this.#writer) {
      this.#pending.push(msg);
      return;
    }
    this.#writer.write(encoder.encode(JSON.stringify(msg) + "\n")).catch(() => {});
  }

  #startNow(): void {
    this.#restartTimer = null;
    this.#generation++;
    // Ports handed out while the host was down belong to this one.
    for (const p of this.#ports.values()) if (!p.dead) p.generation = this.#generation;
    this.#status.state = this.#status.last_exit ? "restarting" : "starting";
    const cmd = new Deno.Command(Deno.execPath(), {
      args: ["run", ...(this.#opts.denoFlags ?? ["-A"]), new URL("./gpu_host.ts", import.meta.url).pathname],
      stdin: "piped",
      stdout: "piped",
      stderr: "inherit",
      env: { ...this.#opts.env, GPT2_GPU_HOST_CHILD: "1" },
    });
    const child = cmd.spawn();
    this.#child = child;
    this.#startedAt = Date.now();
    this.#status.pid = child.pid;
    this.#status.state = "running";
    this.#writer = child.stdin.getWriter();
    const generation = this.#generation;
    for (const m of this.#pending.splice(0)) this.write(generation, m);
    this.#readLoop(child, generation);
    this.#exited = child.status;
    child.status.then((s) => this.#onExit(child, generation, s));
  }

  async #readLoop(child: Deno.ChildProcess, generation: number): Promise<void> {
    const decoder = new TextDecoder();
    let buffered = "";
    try {
      for await (const chunk of child.stdout) {
        buffered += decoder.decode(chunk, { stream: true });
        let nl: number;
        while ((nl = buffered.indexOf("\n")) >= 0) {
          const line = buffered.slice(0, nl);
          buffered = buffered.slice(nl + 1);
          if (line.trim()) this.#onLine(line, generation);
        }
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
    const port = this.#ports.get(msg.gpu);
    if (!port || port.generation !== generation) return;
    if ("error" in msg) port.fail(msg.error);
    else port.deliver(msg.msg);
  }

  #onExit(child: Deno.ChildProcess, generation: number, s: Deno.CommandStatus): void {
    if (this.#child !== child) return;
    this.#child = null;
    this.#writer = null;
    this.#status.pid = null;
    this.#status.last_exit = { code: s.code, signal: s.signal, at: new Date().toISOString() };
    if (this.#closing) {
      this.#status.state = "stopped";
      return;
    }
    this.#status.state = "restarting";
    this.#status.restarts++;
    // Back off when the host keeps dying soon after it starts.
    this.#crashStreak = Date.now() - this.#startedAt > 60_000 ? 1 : this.#crashStreak + 1;
    const how = s.signal ? `signal ${s.signal}` : `status ${s.code}`;
    console.error(`GPU host (pid ${child.pid}) exited with ${how}; restarting`);
    const delay = Math.min(30_000, (this.#opts.restartDelayMs ?? 500) * 2 ** (this.#crashStreak - 1));
    this.#restartTimer = setTimeout(() => {
      if (!this.#closing && !this.#child) this.#startNow();
    }, delay);
    // Ports of the dead host fail; the runner asks for new ones, which attach to the next host.
    for (const port of [...this.#ports.values()]) {
      if (port.generation === generation) port.fail(`GPU host exited with ${how}`);
    }
  }

  /**
   * Ends the host: closes its stdin (it stops and shuts down its Workers, see gpu_host.ts) and
   * waits for it to exit, killing it after `timeoutMs`. Returns how it ended.
   */
  async close(timeoutMs: number): Promise<Deno.CommandStatus | null> {
    this.#closing = true;
    if (this.#restartTimer !== null) clearTimeout(this.#restartTimer);
    for (const p of this.#ports.values()) p.terminate();
    const child = this.#child;
    if (!child || !this.#exited) return null;
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
