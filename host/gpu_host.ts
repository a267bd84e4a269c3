/**
 * The GPU host: a child process of the server that owns one Worker thread per GPU, so a driver
 * fault, an out-of-memory kill or a crash at exit takes down this process and never the HTTP
 * server. Its Workers live in one process so that the ring allreduce can share memory between
 * them. It speaks JSON lines: `ToHost` on stdin, `FromHost` on stdout (console output of the host
 * and its Workers goes to stderr).
 *
 * Workers start one at a time, each pinned to its GPU by the device-select variables set just
 * before its `requestAdapter` (host/gpu_select.ts); with several NVIDIA GPUs a probe buffer shows
 * which GPU each landed on. When stdin closes (the server is done, or died), running jobs are
 * cancelled without saving and every Worker is shut down before the host exits.
 *
 * The server alone stops it. It runs in its own session (spawned detached), so a terminal's Ctrl-C
 * never reaches it, and it ignores SIGINT and SIGTERM that reach it anyway (systemd's default stop
 * signals every process of the service's cgroup): a graceful stop needs its Workers alive to save
 * their jobs' checkpoints when the server asks.
 *
 * Run by server/gpus/host_client.ts as `deno run <hostPermissions()> host/gpu_host.ts`: it reads its code
 * and the data directory, writes the data directory, sets the device-select variables and runs
 * `nvidia-smi`. A Worker that cannot start reports its GPU unavailable with the reason; the
 * queue of later messages goes on.
 */

import { epochMs, type FromHost, type FromWorker, type ToHost, type ToWorker } from "../protocol.ts";
import { LocalGpuPort } from "./local_port.ts";
import {
  checkPlacement,
  deviceSelectEnv,
  gpuMemoryUsedMiB,
  grownGpu,
  listNvidiaGpus,
  type PciGpu,
  SELECT_VARS,
  type SelectMode,
} from "./gpu_select.ts";
import { readHostSettings } from "./host_settings.ts";

/** Bytes of the placement probe; its growth in nvidia-smi must stand out from other processes' noise. */
const PROBE_BYTES = 1024 * 1024 * 1024;
const PROBE_MIN_MIB = 768;

const encoder = new TextEncoder();
/** One write per line, so lines from concurrent sends never interleave. */
function send(msg: FromHost): void {
  const bytes = encoder.encode(JSON.stringify(msg) + "\n");
  try {
    for (let done = 0; done < bytes.length;) done += Deno.stdout.writeSync(bytes.subarray(done));
  } catch {
    // The server is gone (broken pipe): stdin's end shuts this host down.
  }
}

class GpuHost {
  #ports = new Map<number, LocalGpuPort>();
  #closed = new Set<number>();
  #pci: PciGpu[] = [];
  #mode: SelectMode;
  /** GPU index each Worker landed on (measured), by Worker. */
  #placed: (number | null)[] = [];
  /** Workers start strictly one after another: the pinning variables are process-wide. */
  #starting: Promise<void> = Promise.resolve();

  constructor(mode: SelectMode) {
    this.#mode = mode;
  }

  async init(): Promise<void> {
    this.#pci = (await listNvidiaGpus()) ?? [];
    if (this.#pci.length > 0) {
      console.error(
        `GPU host: ${this.#pci.length} NVIDIA GPU(s): ${this.#pci.map((g) => g.bus).join(", ")}; ` +
          `pinning "${this.#mode}"`,
      );
    }
  }

  handle(line: ToHost): void {
    const { gpu, msg } = line;
    if (msg.type === "init") {
      const failed = (error: string) =>
        send({
          gpu,
          msg: { type: "unavailable", gpu, error: `Cannot start the Worker of GPU ${gpu}: ${error}` },
        });
      this.#queue(() => this.#start(gpu), failed);
      return;
    }
    const deliver = () => {
      const port = this.#ports.get(gpu);
      if (port && msg.type === "generate") msg.request.relayed_at = epochMs();
      if (port) return port.postMessage(msg);
      // No Worker (it died, or never started): answer what would otherwise wait forever.
      if (msg.type === "train") {
        const error = `GPU ${gpu} has no worker`;
        send({ gpu, msg: { type: "done", id: msg.job.id, status: "failed", iteration: 0, error } });
      } else if (msg.type === "generate") {
        send({
          gpu,
          msg: {
            type: "gen_done",
            id: msg.request.id,
            reason: "error",
            error: `GPU ${gpu} has no worker`,
            completion_tokens: 0,
          },
        });
      } else if (msg.type === "shutdown") {
        send({ gpu, msg: { type: "closed", gpu } });
      }
    };
    // Flags, generation traffic and commit answers (a job waits on them) go straight to a started
    // Worker; the rest waits for its start.
    const urgent = msg.type === "cancel" || msg.type === "stop" || msg.type.startsWith("generate") ||
      msg.type === "commit_answer";
    const lost = (error: string) =>
      console.error(`GPU host: cannot deliver "${msg.type}" to GPU ${gpu}: ${error}`);
    if (urgent && this.#ports.has(gpu)) deliver();
    else this.#queue(deliver, lost);
  }

  /** Runs `step` after the Workers' starts queued before it; a step that throws never stops the ones after. */
  #queue(step: () => void | Promise<void>, onError: (message: string) => void): void {
    this.#starting = this.#starting.then(step).catch((e) => onError(`${(e as Error).message ?? e}`));
  }

  async #start(gpu: number): Promise<void> {
    this.#ports.get(gpu)?.terminate();
    this.#closed.delete(gpu);
    const env = deviceSelectEnv(this.#pci, gpu % Math.max(1, this.#pci.length), this.#mode);
    for (const k of SELECT_VARS) Deno.env.delete(k);
    for (const [k, v] of Object.entries(env)) Deno.env.set(k, v);
    const probe = this.#pci.length > 1;
    const before = probe ? await gpuMemoryUsedMiB() : null;
    const port = new LocalGpuPort({ probeBytes: probe ? PROBE_BYTES : 0 });
    this.#ports.set(gpu, port);
    const first = Promise.withResolvers<FromWorker>();
    port.onmessage = (e) => {
      const msg = e.data;
      if (msg.type === "ready" || msg.type === "unavailable") {
        first.resolve(msg);
        return; // sent once the placement is known
      }
      if (msg.type === "closed") this.#closed.add(gpu);
      send({ gpu, msg });
    };
    port.onerror = (e) => {
      e.preventDefault();
      this.#ports.delete(gpu);
      first.resolve({ type: "unavailable", gpu, error: `Worker crashed while starting: ${e.message}` });
      send({ gpu, error: e.message ?? String(e) });
    };
    port.postMessage({ type: "init", gpu });
    let reply = await first.promise;
    if (reply.type === "ready" && probe) {
      const after = await gpuMemoryUsedMiB();
      const landed = before && after ? grownGpu(before, after, PROBE_MIN_MIB) : null;
      this.#placed[gpu] = landed;
      port.probeDone();
      reply = { ...reply, pci_bus: landed === null ? null : this.#pci[landed]?.bus ?? null };
      try {
        checkPlacement(this.#placed, this.#pci.length);
      } catch (e) {
        reply = { type: "unavailable", gpu, error: (e as Error).message };
      }
      console.error(
        `GPU host: worker ${gpu} landed on ${
          landed === null
            ? "an unknown GPU"
            : `GPU ${landed} (${reply.type === "ready" ? reply.pci_bus : "conflict"})`
        }`,
      );
    } else if (reply.type === "ready" && this.#pci.length === 1) {
      reply = { ...reply, pci_bus: this.#pci[0].bus };
    }
    send({ gpu, msg: reply });
  }

  /**
   * Cancels running jobs, shuts every Worker down and waits for them. Reached when stdin closes:
   * after a graceful stop nothing runs any more; if the server died, a new server may already be
   * resuming these jobs from their checkpoints, so nothing more is written.
   */
  async shutdownAll(timeoutMs: number): Promise<void> {
    await this.#starting;
    for (const port of this.#ports.values()) port.postMessage({ type: "cancel" } satisfies ToWorker);
    for (const port of this.#ports.values()) port.postMessage({ type: "shutdown" } satisfies ToWorker);
    const deadline = Date.now() + timeoutMs;
    while ([...this.#ports.keys()].some((g) => !this.#closed.has(g)) && Date.now() < deadline) {
      await new Promise((r) => setTimeout(r, 20));
    }
  }
}

if (import.meta.main) {
  for (const signal of ["SIGINT", "SIGTERM"] as const) {
    let told = false;
    Deno.addSignalListener(signal, () => {
      if (told) return;
      told = true;
      console.error(`GPU host: ${signal} ignored; the server stops this host once its jobs have saved`);
    });
  }
  const settings = readHostSettings(Deno.env);
  const host = new GpuHost(settings.select);
  await host.init();
  let buffered = "";
  const decoder = new TextDecoder();
  for await (const chunk of Deno.stdin.readable) {
    buffered += decoder.decode(chunk, { stream: true });
    let start = 0;
    for (let nl = buffered.indexOf("\n"); nl >= 0; nl = buffered.indexOf("\n", start)) {
      const line = buffered.slice(start, nl).trim();
      start = nl + 1;
      if (!line) continue;
      try {
        host.handle(JSON.parse(line) as ToHost);
      } catch (e) {
        console.error(`GPU host: bad message ${JSON.stringify(line.slice(0, 200))}: ${(e as Error).message}`);
      }
    }
    buffered = buffered.slice(start);
  }
  // stdin closed: the server is gone or done with us. Leave nothing running on the GPUs.
  await host.shutdownAll(settings.shutdownMs);
  // Exit with the Workers parked and their devices open: destroying them first is what crashes
  // NVIDIA's driver at exit (see worker/gpu_worker.ts).
  Deno.exit(0);
}
