/**
 * A rank Worker for the exchange tests: opens its own WebGPU device (once), uploads the buffer it
 * is sent, sums the named bucket over the ranks with `BucketExchange` (as three buckets issued at
 * once, or reduce-scatter then all-gather), and posts the whole buffer back as read from the GPU.
 */
/// <reference lib="deno.worker" />
import { type GpuContext, openDevice, readBuffer } from "../engine/device.ts";
import { type CommDtype, RingComm } from "../engine/parallel/allreduce.ts";
import { BucketExchange, type ReducePath } from "../engine/parallel/exchange.ts";

/** One exchange to run on this rank. */
export interface ExchangeTask {
  /** One communicator buffer per lane. */
  sabs: SharedArrayBuffer[];
  /** "allreduce": `run` on the bucket cut in three, issued at once; "rsag": reduceScatter then allGather. */
  op: "allreduce" | "rsag";
  rank: number;
  path: ReducePath;
  /** Element type of the GPU buffer (fp32 with a 16-bit communicator: packed on the GPU). */
  bufferDtype: CommDtype;
  /** Initial contents of the GPU buffer. */
  data: Uint8Array;
  /** Bucket byte offset and element count. */
  offset: number;
  count: number;
  stagingBytes: number;
  inFlight: number;
}

let ctx: Promise<GpuContext> | null = null;

self.onmessage = async (e: MessageEvent<ExchangeTask>) => {
  const t = e.data;
  try {
    const gpu = await (ctx ??= openDevice());
    const buffer = gpu.device.createBuffer({
      label: "grads",
      size: t.data.byteLength,
      usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST,
    });
    gpu.device.queue.writeBuffer(buffer, 0, t.data as Uint8Array<ArrayBuffer>);
    const comms = t.sabs.map((sab) => new RingComm(sab, t.rank, { timeoutMs: 30_000 }));
    const x = await BucketExchange.create(gpu, comms, {
      path: t.path,
      bufferDtype: t.bufferDtype,
      stagingBytes: t.stagingBytes,
      inFlight: t.inFlight,
    });
    if (t.op === "rsag") {
      await x.reduceScatter({ buffer, offset: t.offset, count: t.count });
      await x.allGather({ buffer, offset: t.offset, count: t.count });
    } else {
      const elem = t.bufferDtype === "f32" ? 4 : 2, third = Math.floor(t.count / 6) * 2;
      const parts = [third, third, t.count - 2 * third];
      await Promise.all(
        parts.map((count, i) => x.run({ buffer, offset: t.offset + i * third * elem, count })),
      );
      await x.run({ buffer, offset: t.offset, count: 0 });
    }
    const out = new Uint8Array(await readBuffer(gpu, buffer));
    x.destroy();
    buffer.destroy();
    self.postMessage({ ok: true, data: out });
  } catch (err) {
    self.postMessage({ ok: false, error: String(err) });
  }
};
