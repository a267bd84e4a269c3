/**
 * The communicators of the parallel runs in this GPU host: for each run (a data- and/or
 * tensor-parallel job), the SharedArrayBuffers its rank Workers share, made by the first rank's
 * port and handed to every rank with the lanes of its groups. The control buffer, the gradient
 * and distributed-optimizer lanes of each data-parallel group, and the lanes of each
 * tensor-parallel group (an fp32 one, then activation lanes) — see engine/parallel/ for how a
 * Worker opens them.
 */

import type { JobComm, WorkerJob } from "../protocol.ts";
import { paramLayout } from "../model/config.ts";
import { shardLayout } from "../model/shard.ts";
import { trainingModel } from "../job/job_config.ts";
import { createCommBuffer, createControlBuffer, wireDtype } from "../engine/parallel/allreduce.ts";
import { dataParallelGroups, parallelLayout, tensorParallelGroups } from "../engine/parallel/groups.ts";

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
export function jobComm(job: WorkerJob): JobComm {
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
export function releaseJobComm(run: string): void {
  const hit = runs.get(run);
  if (hit && --hit.users <= 0) runs.delete(run);
}
