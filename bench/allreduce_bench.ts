/**
 * Allreduce benchmark (issue 10): what the host path of data parallelism costs, to design the
 * bucketed gradient exchange from measurements rather than from the 1.1 GB/s first seen.
 *
 *  1. Host allreduce between 2..4 Workers over shared memory, GB/s per rank (payload bytes per
 *     rank / time; "bus" is that × 2(N−1)/N, NCCL's bus bandwidth), ring and direct algorithms,
 *     fp32 and bf16 payloads.
 *  2. On the GPU (skipped without an adapter): readback GB/s by staging-buffer size and maps in
 *     flight, and writeBuffer GB/s by piece size.
 *  3. The full bucket exchange for 2 Workers sharing one GPU (each its own device), host-ring path
 *     against GPU peer-add path, one lane or two (pipelined buckets), fp32 gradients sent as fp32
 *     or packed to bf16 on the GPU; GB/s of fp32 gradients reduced per rank.
 *
 *   deno task bench allreduce            small sizes, for the CPU (lavapipe)
 *   deno task bench allreduce --full     sizes up to 1.42 GB (gpt2-345M's fp32 gradients), for the H200
 *   options: --part ring,gpu,exchange   --reps N   --step-ms T (DP=1 micro-batch time for the
 *            DP=2 speed-up estimate printed after the exchange; default 644.3, 345M fp32 on the H200)
 */
import { createStorage, describeDevice, type GpuContext, openDevice } from "../engine/device.ts";
import { type CommAlgorithm, type CommDtype, createCommBuffer } from "../engine/parallel/allreduce.ts";
import { type ReducePath, sharedSource, Stager } from "../engine/parallel/exchange.ts";
import type { BenchTask } from "./allreduce_worker.ts";

const args = Deno.args;
const opt = (name: string) => (args.includes(name) ? args[args.indexOf(name) + 1] : undefined);
const full = args.includes("--full");
const parts = (opt("--part") ?? "ring,gpu,exchange").split(",");
const reps = Number(opt("--reps") ?? 3);
/** DP=1 time of one micro-batch (forward + backward + optimizer) for the speed-up estimate: 345M fp32, 8 × 1024 on the H200. */
const stepMs = Number(opt("--step-ms") ?? 644.3);
const MB = 1 << 20, GRADS_345M = 1.42e9;

/** Sizes (bytes of fp32 payload per rank) and slot capacity (elements) of each scale. */
const ringBytes = full ? [16 * MB, 256 * MB, GRADS_345M] : [1 * MB, 16 * MB, 64 * MB];
const capacity = full ? 64 * MB : 4 * MB; // elements: 256 MB fp32 slots on the H200, 16 MB here
const gpuBytes = full ? GRADS_345M : 64 * MB;
const stagingSizes = (full ? [1, 4, 16, 64, 256] : [1, 4, 16]).map((m) => m * MB);
const inFlights = [1, 2, 4, 8];

const gbps = (bytes: number, ms: number) => (bytes / ms / 1e6).toFixed(2);
const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];
const fmtBytes = (b: number) => (b >= 1e9 ? `${(b / 1e9).toFixed(2)} GB` : `${(b / MB).toFixed(0)} MiB`);

/** Runs one task per rank in fresh Workers; returns each repetition's time, slowest rank. */
async function onRanks(n: number, task: (rank: number) => BenchTask): Promise<number[]> {
  const workers = Array.from(
    { length: n },
    () => new Worker(new URL("./allreduce_worker.ts", import.meta.url).href, { type: "module" }),
  );
  try {
    const res = await Promise.all(
      workers.map((w, rank) =>
        new Promise<{ ok: boolean; ms?: number[]; error?: string }>((resolve) => {
          w.onmessage = (e) => resolve(e.data);
          w.postMessage(task(rank));
        })
      ),
    );
    const bad = res.find((r) => !r.ok);
    if (bad) throw new Error(`Rank failed: ${bad.error}`);
    return res[0].ms!.map((_, i) => Math.max(...res.map((r) => r.ms![i])));
  } finally {
    for (const w of workers) w.terminate();
  }
}

async function ringPart(): Promise<void> {
  console.log(
    `\nHost ring allreduce, slots of ${capacity} elements, median of ${reps} (GB/s per rank; bus GB/s)`,
  );
  console.log("ranks  algorithm  dtype  payload/rank      ms    GB/s    bus");
  const cases: [CommAlgorithm, CommDtype][] = [["ring", "f32"], ["direct", "f32"], ["ring", "bf16"], [
    "direct",
    "bf16",
  ]];
  for (const n of [2, 3, 4]) {
    for (const [algorithm, dtype] of cases) {
      const sab = createCommBuffer({ ranks: n, capacity, dtype, algorithm });
      for (const fp32Bytes of ringBytes) {
        const count = Math.floor(fp32Bytes / 4), bytes = count * (dtype === "f32" ? 4 : 2);
        const ms = median(await onRanks(n, (rank) => ({ kind: "ring", sab, rank, count, reps })));
        const bus = (bytes * 2 * (n - 1)) / n;
        console.log(
          `${String(n).padStart(5)}  ${algorithm.padEnd(9)}  ${dtype.padEnd(5)}  ${
            fmtBytes(bytes).padStart(12)
          }  ${ms.toFixed(1).padStart(7)}` +
            `  ${gbps(bytes, ms).padStart(6)}  ${gbps(bus, ms).padStart(5)}`,
        );
      }
    }
  }
}

async function gpuPart(ctx: GpuContext): Promise<void> {
  const bytes = Math.min(gpuBytes, ctx.limits.maxBufferSize) & ~3;
  const src = await createStorage(ctx, "bench grads", bytes);
  const dst = new Uint8Array(new SharedArrayBuffer(bytes));
  ctx.device.queue.writeBuffer(src, 0, new Uint8Array(bytes).fill(7));
  await ctx.device.queue.onSubmittedWorkDone();
  console.log(
    `\nReadback into shared memory, median of ${reps} (GB/s; ${
      fmtBytes(bytes)
    }, or 256 staging buffers' worth ` +
      `when less, so that small pieces stay quick)`,
  );
  console.log(`staging    ${inFlights.map((k) => `${k} in flight`.padStart(12)).join("")}`);
  for (const size of stagingSizes) {
    const row: string[] = [], total = Math.min(bytes, 256 * size);
    for (const inFlight of inFlights) {
      try {
        const stager = new Stager(ctx, { stagingBytes: size, inFlight });
        await stager.readInto(src, 0, Math.min(total, size * inFlight), dst); // warm up
        const ms: number[] = [];
        for (let r = 0; r < reps; r++) {
          const t0 = performance.now();
          await stager.readInto(src, 0, total, dst);
          ms.push(performance.now() - t0);
        }
        stager.destroy();
        row.push(gbps(total, median(ms)).padStart(12));
      } catch (err) {
        console.log(`staging ${fmtBytes(size)} × ${inFlight} failed: ${(err as Error).message}`);
        row.push("failed".padStart(12));
      }
    }
    console.log(`${fmtBytes(size).padStart(8)}  ${row.join("")}`);
  }
  console.log(`\nwriteBuffer of ${fmtBytes(bytes)} from shared memory, median of ${reps} (GB/s)`);
  for (const piece of [...new Set([4 * MB, 64 * MB, bytes].filter((p) => p <= bytes))]) {
    const ms: number[] = [];
    for (let r = 0; r <= reps; r++) {
      const t0 = performance.now();
      for (let at = 0; at < bytes; at += piece) {
        ctx.device.queue.writeBuffer(
          src,
          at,
          sharedSource(dst),
          at,
          Math.min(piece, bytes - at),
        );
      }
      await ctx.device.queue.onSubmittedWorkDone();
      if (r > 0) ms.push(performance.now() - t0);
    }
    console.log(`pieces of ${fmtBytes(piece).padStart(8)}: ${gbps(bytes, median(ms))}`);
  }
  src.destroy();
}

async function exchangePart(ctx: GpuContext): Promise<void> {
  const results: { name: string; ms: number }[] = [];
  const bucket = full ? 64 * MB : 1 * MB; // elements per bucket (the slot capacity)
  const best = full ? { stagingBytes: 64 * MB, inFlight: 4 } : { stagingBytes: 1 * MB, inFlight: 4 };
  const elems = full ? Math.floor(Math.min(gpuBytes, ctx.limits.maxBufferSize) / 4) : 4 * MB;
  console.log(
    `\nBucket exchange, 2 Workers sharing one GPU, ${elems} gradients in buckets of ${bucket}, ` +
      `staging ${fmtBytes(best.stagingBytes)} × ${best.inFlight}, median of ${reps} (GB/s per rank)`,
  );
  console.log("path  lanes  wire   grads/rank      ms  grads GB/s");
  for (const path of ["host", "gpu"] as ReducePath[]) {
    for (const lanes of [1, 2]) {
      for (const wire of ["f32", "bf16"] as CommDtype[]) {
        const [sab, ...more] = Array.from(
          { length: lanes },
          () => createCommBuffer({ ranks: 2, capacity: bucket, dtype: wire }),
        );
        const ms = median(
          await onRanks(2, (rank) => ({
            kind: "exchange",
            sab,
            more,
            rank,
            count: elems,
            reps,
            path,
            bufferDtype: "f32",
            ...best,
          })),
        );
        const bytes = elems * 4, cols = [path.padEnd(4), String(lanes).padStart(5), wire.padEnd(5)];
        cols.push(fmtBytes(bytes).padStart(10), ms.toFixed(1).padStart(7), gbps(bytes, ms).padStart(10));
        console.log(cols.join("  "));
        results.push({ name: `${path}, ${lanes} lane(s), ${wire} wire`, ms: (ms * GRADS_345M) / bytes });
      }
    }
  }
  estimate(results);
}

/**
 * DP=2 on 2 GPUs against DP=1 at the same global batch of A micro-batches: DP=1 takes A·t, DP=2
 * takes (A/2)·t + c with c the exchange of 345M's 1.42 GB of fp32 gradients (scaled from the
 * measured size). Speed-up A·t / (A·t/2 + c) passes 1.8 from A = 18·c / t. With the exchange
 * hidden under the last micro-batch's backward (about 2/3 of t), c shrinks to max(0, c − 2t/3).
 * Two Workers sharing one GPU also share its PCIe link, so c measured here is pessimistic.
 */
function estimate(results: { name: string; ms: number }[]): void {
  const best = results.reduce((a, b) => (b.ms < a.ms ? b : a));
  const t = stepMs, c = best.ms, hidden = Math.max(0, c - (2 * t) / 3);
  const speedup = (a: number, cc: number) => (a * t) / ((a * t) / 2 + cc);
  const passAt = (cc: number) => Math.max(2, Math.ceil((18 * cc) / t / 2) * 2);
  console.log(
    `\nDP=2 estimate with the best exchange (${best.name}): 1.42 GB of gradients in ${c.toFixed(0)} ms, ` +
      `micro-batch ${t} ms (--step-ms)`,
  );
  for (const a of [2, 4, 8, 16, 32]) {
    console.log(
      `  global batch ${String(a).padStart(2)} micro-batches: ${speedup(a, c).toFixed(2)}× ` +
        `(${speedup(a, hidden).toFixed(2)}× with the exchange under the last backward)`,
    );
  }
  console.log(
    `  passes 1.8× from ${passAt(c)} micro-batches per global batch (${passAt(hidden)} when overlapped)`,
  );
}

const started = performance.now();
console.log(
  `Allreduce bench (${full ? "full sizes" : "CPU sizes"}), ${navigator.hardwareConcurrency} CPU threads`,
);
if (parts.includes("ring")) await ringPart();
if (parts.includes("gpu") || parts.includes("exchange")) {
  const ctx = await openDevice().catch((e) => {
    console.log(`\nNo GPU part: ${e.message}`);
    return null;
  });
  if (ctx) {
    console.log(`\n${describeDevice(ctx)}`);
    if (parts.includes("gpu")) await gpuPart(ctx);
    if (parts.includes("exchange")) await exchangePart(ctx);
    ctx.device.destroy();
  }
}
console.log(`\nBench took ${((performance.now() - started) / 1000).toFixed(0)} s`);
