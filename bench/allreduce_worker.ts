/**
 * A rank Worker of the allreduce benchmark (bench/allreduce_bench.ts). "ring": times the host
 * ring allreduce of `count` elements already in shared memory, slot by slot (the exchange fills
 * the slot straight from the GPU, so no copy in or out is timed). "exchange": opens this Worker's
 * own device, fills a GPU buffer and times `BucketExchange` over it bucket by bucket.
 * Each posts back its per-repetition milliseconds.
 */
/// <reference lib="deno.worker" />
import { openDevice } from "../engine/device.ts";
import { type CommDtype, RingComm } from "../engine/parallel/allreduce.ts";
import { BucketExchange, type ReducePath } from "../engine/parallel/exchange.ts";

/** A benchmark task for one rank. */
export interface BenchTask {
  kind: "ring" | "exchange";
  sab: SharedArrayBuffer;
  /** Exchange only: more communicator buffers, one lane each beside `sab`. */
  more?: SharedArrayBuffer[];
  rank: number;
  /** Elements per rank in all (several slots' worth when larger than the capacity). */
  count: number;
  reps: number;
  /** Exchange only. */
  path?: ReducePath;
  /** Exchange only: GPU buffer element type (default the communicator's). */
  bufferDtype?: CommDtype;
  stagingBytes?: number;
  inFlight?: number;
}

function ring(t: BenchTask): number[] {
  const comm = new RingComm(t.sab, t.rank);
  comm.acquireSync().fill(t.rank + 1);
  comm.allreduceSync(Math.min(comm.capacity, t.count)); // warm up (and page in the slots)
  const ms: number[] = [];
  for (let rep = 0; rep < t.reps; rep++) {
    comm.barrierSync();
    const t0 = performance.now();
    for (let at = 0; at < t.count; at += comm.capacity) {
      comm.acquireSync();
      comm.allreduceSync(Math.min(comm.capacity, t.count - at));
    }
    ms.push(performance.now() - t0);
  }
  return ms;
}

async function exchange(t: BenchTask): Promise<number[]> {
  const ctx = await openDevice();
  const comm = new RingComm(t.sab, t.rank);
  const comms = [comm, ...(t.more ?? []).map((sab) => new RingComm(sab, t.rank))];
  const elem = (t.bufferDtype ?? comm.dtype) === "f32" ? 4 : 2, bytes = t.count * elem;
  const buffer = ctx.device.createBuffer({
    label: "grads",
    size: bytes,
    usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST,
  });
  const x = await BucketExchange.create(ctx, comms, {
    path: t.path,
    bufferDtype: t.bufferDtype,
    stagingBytes: t.stagingBytes,
    inFlight: t.inFlight,
  });
  const run = async () => {
    const runs: Promise<unknown>[] = [];
    for (let at = 0; at < t.count; at += comm.capacity) {
      runs.push(x.run({ buffer, offset: at * elem, count: Math.min(comm.capacity, t.count - at) }));
      // Keep at most one bucket per lane in flight.
      if (runs.length >= comms.length) await runs[runs.length - comms.length];
    }
    await Promise.all(runs);
    await ctx.device.queue.onSubmittedWorkDone();
  };
  await run(); // warm up: bind groups, pages, pipelines
  const ms: number[] = [];
  for (let rep = 0; rep < t.reps; rep++) {
    await comm.barrier();
    const t0 = performance.now();
    await run();
    ms.push(performance.now() - t0);
  }
  x.destroy();
  buffer.destroy();
  ctx.device.destroy();
  return ms;
}

self.onmessage = async (e: MessageEvent<BenchTask>) => {
  try {
    const ms = e.data.kind === "ring" ? await ring(e.data) : await exchange(e.data);
    self.postMessage({ ok: true, ms });
  } catch (err) {
    self.postMessage({ ok: false, error: String(err) });
  }
};
