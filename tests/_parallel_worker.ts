/**
 * A rank Worker for the allreduce tests: each message names a communicator buffer, this rank's
 * position, a task and its input; the Worker runs it (blocking or async waits, as asked) and
 * posts the rank's result back, or the error message.
 */
/// <reference lib="deno.worker" />
import { type Payload, RingComm } from "../engine/parallel/allreduce.ts";

/** A task for one rank. */
export interface RankTask {
  sab: SharedArrayBuffer;
  rank: number;
  /** "allreduce": sum `data` in place; "rsag": reduce-scatter, halve the shard, all-gather; "abort"; "idle". */
  task: "allreduce" | "rsag" | "abort" | "idle";
  data: Payload;
  async: boolean;
  timeoutMs?: number;
}

self.onmessage = async (e: MessageEvent<RankTask>) => {
  const t = e.data;
  try {
    // A posted SharedArrayBuffer arrives as a new object each time: a new handle continues from the shared counters.
    const comm = new RingComm(t.sab, t.rank, { timeoutMs: t.timeoutMs });
    if (t.task === "allreduce") {
      if (t.async) await comm.allreduceArray(t.data);
      else comm.allreduceArraySync(t.data);
    } else if (t.task === "rsag") {
      const slot = t.async ? await comm.acquire() : comm.acquireSync();
      slot.set(t.data);
      const [a, b] = t.async
        ? await comm.reduceScatter(t.data.length)
        : comm.reduceScatterSync(t.data.length);
      const acc = comm.accumulator;
      if (slot instanceof Float32Array) { for (let i = a; i < b; i++) slot[i] = acc[i] * 0.5; }
      else throw new Error("rsag runs on fp32 payloads only");
      if (t.async) await comm.allGather(t.data.length);
      else comm.allGatherSync(t.data.length);
      t.data.set(slot.subarray(0, t.data.length));
    } else if (t.task === "abort") {
      comm.abort("test abort");
    }
    self.postMessage({ ok: true, data: t.data });
  } catch (err) {
    self.postMessage({ ok: false, error: String(err) });
  }
};
