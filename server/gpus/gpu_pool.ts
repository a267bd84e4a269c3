/**
 * The GPU pool: one slot per GPU, each with its Worker (in the GPU host process, see
 * host_client.ts; each Worker opens its own device, since mapAsync and onSubmittedWorkDone block
 * the JS thread). The pool spawns the Workers, replaces one that dies, watches busy ones for
 * stalls, ends them all at shutdown, and routes what they report to its two clients: the job
 * runner (server/jobs/runner.ts: training and evaluation reports, slots becoming ready, crashes)
 * and the generation manager (server/generate/generation_manager.ts: generation reports).
 *
 * The job runner decides what runs where: it sets a slot's `job` and `reserved`, and decides
 * when a crashed slot's Worker is replaced (in order with the job's records).
 */

import type { FromWorker, FromWorkerGeneration, SpawnWorker, ToWorker, WorkerPort } from "../../protocol.ts";
import type { HostStatus } from "./host_client.ts";
import type { DeviceBudget } from "../../job/job_config.ts";

/** What one GPU slot is doing. */
export interface GpuState {
  index: number;
  state: "starting" | "idle" | "busy" | "unavailable";
  adapter: string | null;
  error: string | null;
  job: string | null;
  queued: number;
  max_buffer_bytes: number | null;
  /** PCI bus of the GPU the Worker landed on, when known. */
  pci_bus: string | null;
}

/** One GPU and its current Worker; a replaced Worker comes with a new slot at the same index. */
export interface GpuSlot {
  readonly index: number;
  readonly worker: WorkerPort;
  state: GpuState["state"];
  pciBus: string | null;
  /** The Worker answered `shutdown`: its device is destroyed. */
  closed: boolean;
  adapter: string | null;
  error: string | null;
  maxBuffer: number | null;
  maxBinding: number | null;
  /** The job the Worker runs (set by the job runner), or null. */
  job: string | null;
  /** A data-parallel job waiting for more free GPUs holds this one for itself. */
  reserved: string | null;
}

/** What a GPU Worker reports about generations, plus its crash (every generation on it is lost). */
export type GenerationReport = FromWorkerGeneration | { type: "gen_crash"; error: string };

/** What a Worker reports about the job it runs (everything but generations and its own state). */
export type JobReport = Exclude<
  FromWorker,
  { type: "gen_started" | "gen_tokens" | "gen_done" | "ready" | "closed" | "unavailable" }
>;

/** The job runner's side of the pool. */
export interface JobClient {
  /** A slot's Worker is ready, or found no device (`state` "unavailable"): it may take work. */
  slotChanged(slot: GpuSlot): void;
  /** A Worker's report on a job. */
  report(slot: GpuSlot, msg: JobReport): void;
  /**
   * `slot`'s Worker died (terminated already): the client records what this means for its job and
   * puts a fresh Worker in its place with {@link GpuPool.replace}, in the order its records need.
   */
  crashed(slot: GpuSlot, message: string): void;
  /** The watchdog found `slot`'s job silent: recorded before the Worker is treated as crashed. */
  stalled(slot: GpuSlot, message: string): void;
}

/** Options of {@link GpuPool}. */
export interface GpuPoolOptions {
  /** Number of GPUs (one Worker each). */
  gpus: number;
  spawn: SpawnWorker;
  /** The GPU host's state, when the Workers run in one (shown by /health). */
  host?: () => HostStatus;
  /** A busy Worker silent this long is treated as crashed (0: no watchdog; default 600 s). */
  stallMs?: number;
}

/** Default of {@link GpuPoolOptions.stallMs}. */
export const DEFAULT_STALL_MS = 600_000;

/** The GPU slots and their Workers. */
export class GpuPool {
  #opts: GpuPoolOptions;
  #slots: GpuSlot[] = [];
  #jobs: JobClient | null = null;
  #generation: ((gpu: number, msg: GenerationReport) => void) | null = null;
  #stopped = false;
  #draining = false;
  /** When each busy slot's Worker last reported on its job (the watchdog's clock), by slot index. */
  #reported = new Map<number, number>();
  #watchdog: ReturnType<typeof setInterval> | null = null;
  /** Workers terminated already (a crashed one is terminated before its replacement is made). */
  #terminated = new WeakSet<WorkerPort>();

  constructor(opts: GpuPoolOptions) {
    this.#opts = opts;
  }

  /** Starts one Worker per GPU, reporting on jobs to `jobs`. */
  start(jobs: JobClient): void {
    this.#jobs = jobs;
    for (let i = 0; i < this.#opts.gpus; i++) this.#slots.push(this.#spawn(i));
    const stallMs = this.#opts.stallMs ?? DEFAULT_STALL_MS;
    if (stallMs > 0) {
      this.#watchdog = setInterval(() => this.#checkStalls(stallMs), Math.min(5000, stallMs / 4));
    }
  }

  /** The slots, by GPU index (a replaced Worker's slot is a new object). */
  get slots(): readonly GpuSlot[] {
    return this.#slots;
  }

  /** Whether shutdown() has run: every Worker is gone. */
  get stopped(): boolean {
    return this.#stopped;
  }

  /** What GPU `gpu` reported about itself (for the memory fit check), or null before it is ready. */
  device(gpu: number): DeviceBudget | null {
    const s = this.#slots[gpu];
    if (!s || s.maxBinding === null) return null;
    return { adapter: s.adapter, max_binding_bytes: s.maxBinding, max_buffer_bytes: s.maxBuffer };
  }

  /** The GPU host's state, or null when Workers run in this process. */
  hostStatus(): HostStatus | null {
    return this.#opts.host?.() ?? null;
  }

  /**
   * Each GPU slot's index, state and error alone, read from memory: what placing a generation
   * needs, on every request.
   */
  gpuStates(): Pick<GpuState, "index" | "state" | "error">[] {
    return this.#slots.map((s) => ({ index: s.index, state: s.state, error: s.error }));
  }

  /** Posts a generation message to GPU `gpu`'s Worker (see server/generate/generation_manager.ts). */
  postGeneration(gpu: number, msg: Extract<ToWorker, { type: "generate" | "generate_cancel" }>): void {
    const slot = this.#slots[gpu];
    if (!slot || this.#stopped) throw new Error(`GPU ${gpu} has no worker`);
    slot.worker.postMessage(msg);
  }

  /** Receives every Worker's generation reports (one receiver: the generation manager). */
  onGeneration(fn: (gpu: number, msg: GenerationReport) => void): void {
    this.#generation = fn;
  }

  /** Every generation on every GPU is lost (the server stops): their receiver hears it with `error`. */
  generationsLost(error: string): void {
    for (const s of this.#slots) this.#generation?.(s.index, { type: "gen_crash", error });
  }

  /** Stopping: a Worker that dies now is not replaced, its slot stays "unavailable"; no stall checks. */
  drain(): void {
    this.#draining = true;
  }

  /** Asks every Worker to destroy its device and end; resolves once all have (or `deadline`, ms since epoch). */
  async close(deadline: number): Promise<void> {
    for (const s of this.#slots) s.worker.postMessage({ type: "shutdown" });
    while (!this.#slots.every((s) => s.closed || s.state === "unavailable") && Date.now() < deadline) {
      await new Promise((r) => setTimeout(r, 20));
    }
  }

  /** Stops at once: every Worker is terminated and nothing they send is routed any more. */
  shutdown(): void {
    this.#stopped = true;
    this.#draining = true;
    if (this.#watchdog !== null) clearInterval(this.#watchdog);
    for (const s of this.#slots) this.#terminate(s);
  }

  /** Terminates `slot`'s Worker and puts a fresh one (a new slot, "starting") at its index. */
  replace(slot: GpuSlot): GpuSlot {
    this.#terminate(slot);
    return this.#slots[slot.index] = this.#spawn(slot.index);
  }

  /**
   * `slot`'s Worker died (or stalled): every generation on it is lost, and the job runner records
   * its job's fate and replaces it. While stopping, the slot just becomes "unavailable".
   */
  crash(slot: GpuSlot, message: string): void {
    if (this.#stopped) return;
    this.#terminate(slot);
    if (this.#draining) {
      slot.state = "unavailable";
      slot.job = null;
      return; // stopping anyway: the job stays as it is and resumes on the next start
    }
    this.#generation?.(slot.index, { type: "gen_crash", error: `GPU worker crashed: ${message}` });
    this.#jobs!.crashed(slot, message);
  }

  #terminate(slot: GpuSlot): void {
    if (this.#terminated.has(slot.worker)) return;
    this.#terminated.add(slot.worker);
    slot.worker.terminate();
  }

  #spawn(index: number): GpuSlot {
    const slot: GpuSlot = {
      index,
      reserved: null,
      worker: this.#opts.spawn(index),
      state: "starting",
      pciBus: null,
      closed: false,
      adapter: null,
      error: null,
      job: null,
      maxBuffer: null,
      maxBinding: null,
    };
    slot.worker.onmessage = (e) => this.#onMessage(slot, e.data);
    slot.worker.onerror = (e) => {
      e.preventDefault();
      this.crash(slot, e.message ?? String(e));
    };
    slot.worker.postMessage({ type: "init", gpu: index });
    return slot;
  }

  /**
   * A Worker's message. Nothing it causes may escape to the port: an error there would stop the
   * host's relay of every GPU's messages (and with it the host). It is logged instead.
   */
  #onMessage(slot: GpuSlot, msg: FromWorker): void {
    if (this.#stopped) return;
    if ("id" in msg && msg.id !== null && msg.id === slot.job) this.#reported.set(slot.index, Date.now());
    try {
      this.#route(slot, msg);
    } catch (e) {
      console.error(
        `GPU pool: handling "${msg.type}" from GPU ${slot.index} failed: ${(e as Error).stack ?? e}`,
      );
    }
  }

  #route(slot: GpuSlot, msg: FromWorker): void {
    switch (msg.type) {
      case "gen_started":
      case "gen_tokens":
      case "gen_done":
        this.#generation?.(slot.index, msg);
        return;
      case "ready":
        slot.state = "idle";
        slot.pciBus = msg.pci_bus ?? null;
        slot.adapter = msg.adapter;
        slot.maxBuffer = msg.max_buffer_bytes;
        slot.maxBinding = msg.max_binding_bytes;
        this.#jobs?.slotChanged(slot);
        return;
      case "closed":
        slot.closed = true;
        return;
      case "unavailable":
        slot.state = "unavailable";
        slot.error = msg.error;
        this.#jobs?.slotChanged(slot);
        return;
      default:
        this.#jobs?.report(slot, msg);
    }
  }

  /**
   * The watchdog: a busy Worker that reported nothing on its job for `stallMs` is treated as
   * crashed (replaced; its job resumes from its newest checkpoint or fails after repeated stalls).
   */
  #checkStalls(stallMs: number): void {
    if (this.#stopped || this.#draining) return;
    const now = Date.now();
    for (const slot of [...this.#slots]) {
      if (!slot.job || slot.state !== "busy") {
        this.#reported.delete(slot.index);
        continue;
      }
      const last = this.#reported.get(slot.index);
      if (last === undefined) {
        this.#reported.set(slot.index, now);
        continue;
      }
      if (now - last < stallMs) continue;
      this.#reported.delete(slot.index);
      const message =
        `its Worker on GPU ${slot.index} reported nothing for ${Math.round((now - last) / 1000)} s ` +
        `(GPT2_STALL_S ${stallMs / 1000}): stalled, replaced`;
      console.error(`Job "${slot.job}": ${message}`);
      this.#jobs?.stalled(slot, message);
      this.crash(slot, message);
    }
  }
}
