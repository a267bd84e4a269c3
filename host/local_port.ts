/**
 * A GPU port: what the runner talks to for one GPU. `LocalGpuPort` wraps a Worker thread of this
 * process (worker/gpu_worker.ts): it owns the Worker's shared flags and raises them itself on
 * `cancel` and `stop`, since a training Worker does not yield to its event loop between steps.
 * The GPU host process runs one LocalGpuPort per GPU; tests may run them in-process too.
 */

import {
  CANCEL_FLAG,
  FLAG_COUNT,
  type FromWorker,
  type JobComm,
  STOP_FLAG,
  type ToWorker,
  type ToWorkerThread,
  type WorkerJob,
} from "../protocol.ts";
import { paramLayout } from "../model/config.ts";
import {
  abortCommBuffer,
  createCommBuffer,
  createControlBuffer,
  dataParallelGroups,
  parallelLayout,
  shardLayout,
  tensorParallelGroups,
  wireDtype,
} from "../engine/parallel/mod.ts";
import { trainingModel } from "../model/job_config.ts";

/** Gradient bucket capacity in elements (64 MiB of fp32), or the whole model when smaller. */
const BUCKET_ELEMENTS = 16 << 20;
/** Gradient lanes: one bucket read back while the previous one is summed. */
const GRAD_LANES = 2;

/** All communicators of one parallel run: one control buffer, then per group. */
interface RunComms {
  control: SharedArrayBuffer;
  /** Gradient lanes of each data-parallel group (one group per tensor-parallel index), when dp > 1. */
  grads: SharedArrayBuffer[][];
  weights: SharedArrayBuffer[][];
  /** Lanes of each tensor-parallel group (one per data-parallel index), when tp > 1. */
  tp: SharedArrayBuffer[][];
}

/** Communicators of the parallel runs of this process, by run id, with the ranks still using them. */
const runs = new Map<string, { comms: RunComms; users: number }>();

/**
 * The shared communicators of rank `job.parallel.rank` of a parallel run: made by its first
 * rank's port, shared by the rest. Ranks are numbered tensor-parallel fastest (Megatron's order).
 */
function commOf(job: WorkerJob): JobComm {
  const p = job.parallel!;
  const dp = job.config.data_parallel ?? 1, tp = job.config.tensor_parallel ?? 1;
  const layout = parallelLayout(p.size, { tp, dp });
  let hit = runs.get(p.run);
  if (hit) {
    hit.users++;
  } else {
    const model = trainingModel(job.config);
    const n = (tp > 1 ? shardLayout(model, tp) : paramLayout(model)).totalSize;
    const capacity = Math.min(BUCKET_ELEMENTS, Math.ceil(n / 4) * 4);
    const dtype = wireDtype(job.config.allreduce_dtype);
    const lanes = (ranks: number, capacity: number, dtype: "f32" | "f16" | "bf16") =>
      Array.from({ length: GRAD_LANES }, () => createCommBuffer({ ranks, capacity, dtype }));
    // Activations of one micro-batch: B·T·C floats (the largest exchange of a layer).
    const act = Math.min(BUCKET_ELEMENTS, job.config.batch_size * job.config.seq_len * model.n_embd);
    const comms: RunComms = {
      control: createControlBuffer(p.size),
      grads: dp > 1 ? dataParallelGroups(layout).map(() => lanes(dp, capacity, dtype)) : [],
      weights: dp > 1 && job.config.distributed_optimizer
        ? dataParallelGroups(layout).map(() => lanes(dp, capacity, "f32"))
        : [],
      // Per tensor-parallel group: an fp32 lane (loss statistics, norms, checkpoint gathers), then
      // the activation lanes, fp16 on the wire when the job is fp16.
      tp: tp > 1
        ? tensorParallelGroups(layout).map(() => [
          createCommBuffer({ ranks: tp, capacity: Math.max(act, 4096), dtype: "f32" }),
          ...lanes(tp, Math.max(act, 4096), job.config.precision === "fp16" ? "f16" : "f32"),
        ])
        : [],
    };
    hit = { comms, users: 1 };
    runs.set(p.run, hit);
  }
  const t = p.rank % tp, d = Math.floor(p.rank / tp), c = hit.comms;
  return {
    control: c.control,
    grads: c.grads[t] ?? [],
    ...(c.weights.length ? { weights: c.weights[t] } : {}),
    ...(c.tp.length ? { tp: c.tp[d] } : {}),
  };
}

/** A rank is done with its run's communicators; the last one frees them. */
function releaseComm(run: string): void {
  const hit = runs.get(run);
  if (hit && --hit.users <= 0) runs.delete(run);
}

/** What the runner needs of a GPU's Worker (a local Worker thread, one inside the GPU host, or a test double). */
export interface WorkerPort {
  postMessage(msg: ToWorker): void;
  onmessage: ((e: MessageEvent<FromWorker>) => void) | null;
  onerror: ((e: ErrorEvent) => void) | null;
  terminate(): void;
}

/** Creates the port that drives GPU `gpu`. */
export type SpawnWorker = (gpu: number) => WorkerPort;

/** A Worker thread in this process, with its shared cancel/stop flags. */
export class LocalGpuPort implements WorkerPort {
  onmessage: ((e: MessageEvent<FromWorker>) => void) | null = null;
  onerror: ((e: ErrorEvent) => void) | null = null;
  readonly #worker: Worker;
  readonly #flagsBuffer = new SharedArrayBuffer(4 * FLAG_COUNT);
  readonly #flags = new Int32Array(this.#flagsBuffer);
  /** Bytes the Worker holds after init until `probeDone()` (see host/gpu_select.ts). */
  readonly #probeBytes: number;
  /** The data-parallel run this Worker is a rank of, while it runs. */
  #run: { id: string; job: string; comm: JobComm } | null = null;

  constructor(opts: { probeBytes?: number } = {}) {
    this.#probeBytes = opts.probeBytes ?? 0;
    this.#worker = new Worker(new URL("../worker/gpu_worker.ts", import.meta.url).href, { type: "module" });
    this.#worker.onmessage = (e: MessageEvent<FromWorker>) => {
      const msg = e.data;
      if (msg.type === "done" && this.#run?.job === msg.id) this.#leaveRun(false);
      this.onmessage?.(e);
    };
    this.#worker.onerror = (e: ErrorEvent) => {
      // The peers of a dead rank would wait for it: fail their communicators now.
      this.#leaveRun(true);
      if (this.onerror) this.onerror(e);
    };
  }

  #leaveRun(abort: boolean): void {
    const run = this.#run;
    if (!run) return;
    this.#run = null;
    if (abort) { for (const sab of [...run.comm.grads, run.comm.control]) abortCommBuffer(sab); }
    releaseComm(run.id);
  }

  postMessage(msg: ToWorker): void {
    switch (msg.type) {
      case "init": {
        const init: ToWorkerThread = { type: "init", gpu: msg.gpu, flags: this.#flagsBuffer };
        if (this.#probeBytes > 0) init.probe_bytes = this.#probeBytes;
        this.#worker.postMessage(init);
        return;
      }
      case "cancel":
        Atomics.store(this.#flags, CANCEL_FLAG, 1);
        return;
      case "stop":
        Atomics.store(this.#flags, STOP_FLAG, 1);
        return;
      case "train": {
        // A new job starts uncancelled; a stop (shutdown) stays raised.
        Atomics.store(this.#flags, CANCEL_FLAG, 0);
        const train: ToWorkerThread = { type: "train", job: msg.job };
        if (msg.job.parallel && msg.job.parallel.size > 1) {
          this.#leaveRun(true);
          train.comm = commOf(msg.job);
          this.#run = { id: msg.job.parallel.run, job: msg.job.id, comm: train.comm };
        }
        this.#worker.postMessage(train);
        return;
      }
      default:
        this.#worker.postMessage(msg);
    }
  }

  /** Lets the Worker free its placement probe buffer. */
  probeDone(): void {
    this.#worker.postMessage({ type: "probe_done" } satisfies ToWorkerThread);
  }

  terminate(): void {
    this.#leaveRun(true);
    this.#worker.terminate();
  }
}

/** Spawns a Worker thread in this process (tests, and the GPU host itself). */
export const spawnGpuWorker: SpawnWorker = () => new LocalGpuPort();
