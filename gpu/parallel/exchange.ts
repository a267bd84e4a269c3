/**
 * The GPU <-> host path of one gradient bucket. The host path is the whole cost of data
 * parallelism across Workers (readback ~1 GB/s, writeBuffer a few GB/s, and every mapAsync waits
 * for all work queued before it), so this file keeps it short:
 *
 *  - `Stager` reads a byte range of a GPU buffer back through a ring of MAP_READ staging buffers
 *    with several maps in flight: while the host copies one mapped piece straight into the shared
 *    slot, the GPU already copies the next ones.
 *  - `BucketExchange` sums a bucket over the ranks of a `RingComm`, by one of two paths:
 *    "host": read back into the slot, ring-allreduce on the CPU, `writeBuffer` the sum back;
 *    "gpu": read back into the slot, wait until every rank has, upload the peers' slots and add
 *    them on the GPU (in rank order, so every rank gets the same bits), no CPU arithmetic.
 *  Both leave the bucket holding the sum over ranks in its own dtype (fp32, or fp16 / bf16 bits);
 *  the bench compares them. Given several communicators (lanes), successive buckets pipeline:
 *  one is read back while the one before is reduced and written. `reduceScatter` and
 *  `allGather` are the distributed optimizer's halves (host path).
 */

import { createPipeline, createStorage, type GpuContext } from "../device.ts";
import { type CommDtype, type RingComm, shardRange } from "./allreduce.ts";

/** Options of {@link Stager}. */
export interface StagerOptions {
  /** Bytes per staging buffer (a multiple of 4; default 8 MiB). */
  stagingBytes?: number;
  /** Staging buffers, i.e. maps in flight (default 4). */
  inFlight?: number;
}

/** A ring of MAP_READ staging buffers, created once, reused for every readback. */
export class Stager {
  /** Bytes per staging buffer. */
  readonly stagingBytes: number;
  /** Maps in flight. */
  readonly inFlight: number;
  #ctx: GpuContext;
  #bufs: GPUBuffer[];

  /** Creates `inFlight` staging buffers of `stagingBytes` each on `ctx`. */
  constructor(ctx: GpuContext, opts: StagerOptions = {}) {
    const stagingBytes = opts.stagingBytes ?? 8 << 20, inFlight = opts.inFlight ?? 4;
    if (!Number.isInteger(stagingBytes) || stagingBytes < 4 || stagingBytes % 4 !== 0) {
      throw new RangeError(`stagingBytes must be a positive multiple of 4, got "${stagingBytes}"`);
    }
    if (!Number.isInteger(inFlight) || inFlight < 1 || inFlight > 64) {
      throw new RangeError(`inFlight must be an integer in [1, 64], got "${inFlight}"`);
    }
    this.#ctx = ctx;
    this.stagingBytes = stagingBytes;
    this.inFlight = inFlight;
    this.#bufs = Array.from({ length: inFlight }, (_, i) =>
      ctx.device.createBuffer({
        label: `staging ${i}`,
        size: stagingBytes,
        usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST,
      }));
  }

  /**
   * Copies `bytes` bytes of `src` from byte `offset` into `dst` (e.g. a view of a shared slot),
   * piece by piece, `inFlight` pieces queued at once. Offset and length must be multiples of 4.
   */
  async readInto(src: GPUBuffer, offset: number, bytes: number, dst: Uint8Array): Promise<void> {
    checkRange(src, offset, bytes);
    if (dst.byteLength < bytes) {
      throw new RangeError(`Destination of ${dst.byteLength} bytes cannot hold ${bytes} bytes`);
    }
    const { device } = this.#ctx, size = this.stagingBytes, pieces = Math.ceil(bytes / size);
    const pending: Promise<void>[] = [];
    const issue = (i: number) => {
      const buf = this.#bufs[i % this.inFlight], len = Math.min(size, bytes - i * size);
      const enc = device.createCommandEncoder();
      enc.copyBufferToBuffer(src, offset + i * size, buf, 0, len);
      device.queue.submit([enc.finish()]);
      pending[i] = buf.mapAsync(GPUMapMode.READ, 0, len).then(() => {
        dst.set(new Uint8Array(buf.getMappedRange(0, len)), i * size);
        buf.unmap();
      });
    };
    for (let i = 0; i < Math.min(pieces, this.inFlight); i++) issue(i);
    for (let i = 0; i < pieces; i++) {
      await pending[i];
      if (i + this.inFlight < pieces) issue(i + this.inFlight);
    }
  }

  /** Frees the staging buffers. */
  destroy(): void {
    for (const b of this.#bufs) b.destroy();
  }
}

/**
 * A view of shared memory typed as writeBuffer's argument: the spec (and Deno) take an
 * AllowSharedBufferSource, @webgpu/types only BufferSource. Avoids a copy out of the shared slot.
 */
export const sharedSource = (v: Uint8Array): Uint8Array<ArrayBuffer> => v as Uint8Array<ArrayBuffer>;

function checkRange(buffer: GPUBuffer, offset: number, bytes: number): void {
  if (!Number.isInteger(offset) || offset < 0 || offset % 4 !== 0) {
    throw new RangeError(`offset must be a non-negative multiple of 4 bytes, got "${offset}"`);
  }
  if (!Number.isInteger(bytes) || bytes < 0 || bytes % 4 !== 0) {
    throw new RangeError(`Bucket length must be a multiple of 4 bytes, got "${bytes}"`);
  }
  if (offset + bytes > buffer.size) {
    throw new RangeError(
      `Range [${offset}, ${offset + bytes}) exceeds buffer "${buffer.label}" of ${buffer.size} bytes`,
    );
  }
}

/** How the bucket is summed: on the CPU by the ring, or on the GPU from the peers' uploaded slots. */
export type ReducePath = "host" | "gpu";

/** A bucket: `count` elements of the communicator's dtype at byte `offset` of `buffer`. */
export interface Bucket {
  buffer: GPUBuffer;
  offset: number;
  count: number;
}

/** Where the time of one exchange went, in ms (GPU work of the "gpu" path is only queued, not awaited). */
export interface ExchangeTiming {
  readMs: number;
  reduceMs: number;
  writeMs: number;
  /** Payload bytes of the bucket. */
  bytes: number;
}

/** Options of {@link BucketExchange}. */
export interface ExchangeOptions extends StagerOptions {
  /** Reduction path (default "host"). */
  path?: ReducePath;
}

/** WGSL of the peer-add kernel: own[i] = sum over ranks q (in order) of rank q's word i, in fp32. */
export function peerAddWgsl(dtype: CommDtype): string {
  const codec = {
    f32: `fn dec(w: u32) -> vec2<f32> { return vec2<f32>(bitcast<f32>(w), 0.0); }
fn enc(s: vec2<f32>) -> u32 { return bitcast<u32>(s.x); }`,
    f16: `fn dec(w: u32) -> vec2<f32> { return unpack2x16float(w); }
fn enc(s: vec2<f32>) -> u32 { return pack2x16float(s); }`,
    bf16:
      `fn dec(w: u32) -> vec2<f32> { return vec2<f32>(bitcast<f32>(w << 16u), bitcast<f32>(w & 0xffff0000u)); }
fn rne(x: f32) -> u32 { let b = bitcast<u32>(x); return (b + 0x7fffu + ((b >> 16u) & 1u)) >> 16u; }
fn enc(s: vec2<f32>) -> u32 { return rne(s.x) | (rne(s.y) << 16u); }`,
  }[dtype];
  return `${codec}
struct Params { words: u32, shift: u32, me: u32, ranks: u32 }
@group(0) @binding(0) var<storage, read_write> own: array<u32>;
@group(0) @binding(1) var<storage, read> peers: array<u32>;
@group(0) @binding(2) var<uniform> p: Params;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
  for (var i = gid.x; i < p.words; i += nw.x * 256u) {
    var s = vec2<f32>(0.0);
    for (var q = 0u; q < p.ranks; q++) {
      if (q == p.me) {
        s += dec(own[p.shift + i]);
      } else {
        s += dec(peers[select(q - 1u, q, q < p.me) * p.words + i]);
      }
    }
    own[p.shift + i] = enc(s);
  }
}`;
}

/** Bind group and parameters of one bucket for the GPU path, built on first use. */
interface BucketBinding {
  group: GPUBindGroup;
  workgroups: number;
}

/** One pipeline lane: a communicator with its own staging ring and GPU scratch, used by one bucket at a time. */
interface Lane {
  comm: RingComm;
  stager: Stager;
  scratch: GPUBuffer | null;
  /** The last operation queued on this lane. */
  tail: Promise<unknown>;
}

/**
 * Sums GPU buckets over the ranks of a communicator: readback, reduction, write-back. With
 * several communicators (lanes), successive calls rotate over them and may run concurrently: the
 * readback of one bucket overlaps the reduction and write-back of the one before.
 */
export class BucketExchange {
  /** The reduction path. */
  readonly path: ReducePath;
  #ctx: GpuContext;
  #lanes: Lane[];
  #next = 0;
  #elem: number;
  #pipeline: GPUComputePipeline | null = null;
  #bindings = new WeakMap<GPUBuffer, Map<string, BucketBinding>>();

  private constructor(ctx: GpuContext, comms: RingComm[], opts: ExchangeOptions) {
    this.#ctx = ctx;
    this.path = opts.path ?? "host";
    this.#elem = comms[0].dtype === "f32" ? 4 : 2;
    this.#lanes = comms.map((comm) => ({
      comm,
      stager: new Stager(ctx, opts),
      scratch: null,
      tail: Promise.resolve(),
    }));
  }

  /**
   * An exchange for this rank on `ctx` over one communicator, or several (lanes: all of the same
   * ranks, dtype and capacity, in the same order on every rank). The "gpu" path compiles its
   * kernel and allocates a scratch buffer for the peers' slots per lane.
   */
  static async create(
    ctx: GpuContext,
    comms: RingComm | RingComm[],
    opts: ExchangeOptions = {},
  ): Promise<BucketExchange> {
    if (opts.path !== undefined && opts.path !== "host" && opts.path !== "gpu") {
      throw new RangeError(`path must be "host" or "gpu", got "${opts.path}"`);
    }
    const list = Array.isArray(comms) ? comms : [comms];
    if (list.length === 0) throw new RangeError("An exchange needs at least one communicator");
    const c0 = list[0];
    for (const c of list) {
      if (c.size !== c0.size || c.rank !== c0.rank || c.dtype !== c0.dtype || c.capacity !== c0.capacity) {
        throw new RangeError(
          `Lanes must match: ranks, rank, dtype and capacity "${c.size}/${c.rank}/${c.dtype}/${c.capacity}" ` +
            `differ from "${c0.size}/${c0.rank}/${c0.dtype}/${c0.capacity}"`,
        );
      }
    }
    const x = new BucketExchange(ctx, list, opts);
    if (x.path === "gpu" && c0.size > 1) {
      x.#pipeline = await createPipeline(ctx, `peer add ${c0.dtype}`, peerAddWgsl(c0.dtype));
      for (const [i, lane] of x.#lanes.entries()) {
        lane.scratch = await createStorage(ctx, `exchange peers ${i}`, (c0.size - 1) * c0.capacity * x.#elem);
      }
    }
    return x;
  }

  /** Number of lanes. */
  get lanes(): number {
    return this.#lanes.length;
  }

  /**
   * Sums `bucket` over the ranks in place; every rank calls it with its own buffer, the same
   * counts, in the same order. A failure aborts the communicator, so peers fail too instead of
   * waiting. Calls may be issued without awaiting the previous one; they rotate over the lanes.
   */
  run(bucket: Bucket): Promise<ExchangeTiming> {
    return this.#queue(bucket, (lane, bytes) => this.#allreduce(lane, bucket, bytes));
  }

  /**
   * Reduce-scatter of a bucket (host path, for the distributed optimizer): afterwards this rank's
   * shard `shardRange(count, ranks, rank)` of the bucket holds the sum over ranks; the rest of the
   * bucket is left as it was. A 16-bit bucket needs a count divisible by 2 × ranks.
   */
  async reduceScatter(bucket: Bucket): Promise<[number, number]> {
    let shard: [number, number] = [0, 0];
    await this.#queue(bucket, async (lane, bytes) => {
      const t0 = performance.now(), slot = await lane.comm.acquire();
      await lane.stager.readInto(
        bucket.buffer,
        bucket.offset,
        bytes,
        new Uint8Array(slot.buffer, slot.byteOffset, bytes),
      );
      const t1 = performance.now();
      shard = await lane.comm.reduceScatter(bucket.count);
      const t2 = performance.now(), [a, b] = shard, e = this.#elem;
      this.#ctx.device.queue.writeBuffer(
        bucket.buffer,
        bucket.offset + a * e,
        sharedSource(new Uint8Array(slot.buffer, slot.byteOffset + a * e, (b - a) * e)),
      );
      return { readMs: t1 - t0, reduceMs: t2 - t1, writeMs: performance.now() - t2, bytes };
    }, true);
    return shard;
  }

  /**
   * All-gather of a bucket (host path): each rank's shard `shardRange(count, ranks, rank)` is
   * read back and every rank's bucket ends holding all shards (e.g. the weights each rank updated).
   */
  allGather(bucket: Bucket): Promise<ExchangeTiming> {
    return this.#queue(bucket, async (lane, bytes) => {
      const comm = lane.comm, e = this.#elem, [a, b] = shardRange(bucket.count, comm.size, comm.rank);
      const t0 = performance.now(), slot = await comm.acquire();
      await lane.stager.readInto(
        bucket.buffer,
        bucket.offset + a * e,
        (b - a) * e,
        new Uint8Array(slot.buffer, slot.byteOffset + a * e, (b - a) * e),
      );
      const t1 = performance.now();
      await comm.allGather(bucket.count);
      const t2 = performance.now();
      this.#ctx.device.queue.writeBuffer(
        bucket.buffer,
        bucket.offset,
        sharedSource(new Uint8Array(slot.buffer, slot.byteOffset, bytes)),
      );
      return { readMs: t1 - t0, reduceMs: t2 - t1, writeMs: performance.now() - t2, bytes };
    }, true);
  }

  /** Checks a bucket, then runs `op` on the next lane once that lane's previous operation ended. */
  #queue(
    bucket: Bucket,
    op: (lane: Lane, bytes: number) => Promise<ExchangeTiming>,
    sharded = false,
  ): Promise<ExchangeTiming> {
    const lane = this.#lanes[this.#next], comm = lane.comm, bytes = bucket.count * this.#elem;
    if (!Number.isInteger(bucket.count) || bucket.count < 0 || bucket.count > comm.capacity) {
      return Promise.reject(
        new RangeError(`count must be an integer in [0, ${comm.capacity}], got "${bucket.count}"`),
      );
    }
    if (bytes % 4 !== 0 || (sharded && this.#elem === 2 && bucket.count % (2 * comm.size) !== 0)) {
      return Promise.reject(
        new RangeError(
          sharded
            ? `A sharded 16-bit bucket needs a count divisible by ${2 * comm.size}, got "${bucket.count}"`
            : `A 16-bit bucket needs an even count, got "${bucket.count}"`,
        ),
      );
    }
    try {
      checkRange(bucket.buffer, bucket.offset, bytes);
    } catch (err) {
      return Promise.reject(err);
    }
    this.#next = (this.#next + 1) % this.#lanes.length;
    const run = lane.tail.then(() => op(lane, bytes)).catch((err) => {
      comm.abort(String(err));
      throw err;
    });
    lane.tail = run.catch(() => {});
    return run;
  }

  async #allreduce(lane: Lane, bucket: Bucket, bytes: number): Promise<ExchangeTiming> {
    const comm = lane.comm;
    const t0 = performance.now();
    const slot = await comm.acquire();
    const slotBytes = new Uint8Array(slot.buffer, slot.byteOffset, bytes);
    await lane.stager.readInto(bucket.buffer, bucket.offset, bytes, slotBytes);
    const t1 = performance.now();
    const queue = this.#ctx.device.queue;
    if (this.path === "host" || comm.size === 1 || bytes === 0) {
      await comm.allreduce(bucket.count);
      const t2 = performance.now();
      queue.writeBuffer(bucket.buffer, bucket.offset, sharedSource(slotBytes));
      return { readMs: t1 - t0, reduceMs: t2 - t1, writeMs: performance.now() - t2, bytes };
    }
    const slots = await comm.gather();
    const t2 = performance.now();
    for (let q = 0, j = 0; q < comm.size; q++) {
      if (q === comm.rank) continue;
      queue.writeBuffer(
        lane.scratch!,
        j++ * bytes,
        sharedSource(new Uint8Array(slots[q].buffer, slots[q].byteOffset, bytes)),
      );
    }
    comm.release();
    const b = this.#binding(lane, bucket);
    const enc = this.#ctx.device.createCommandEncoder();
    const pass = enc.beginComputePass();
    pass.setPipeline(this.#pipeline!);
    pass.setBindGroup(0, b.group);
    pass.dispatchWorkgroups(b.workgroups);
    pass.end();
    queue.submit([enc.finish()]);
    return { readMs: t1 - t0, reduceMs: t2 - t1, writeMs: performance.now() - t2, bytes };
  }

  /** The bind group of a bucket: its buffer bound from the 256-byte boundary below its offset. */
  #binding(lane: Lane, bucket: Bucket): BucketBinding {
    let perBuffer = this.#bindings.get(bucket.buffer);
    if (!perBuffer) this.#bindings.set(bucket.buffer, perBuffer = new Map());
    const key = `${this.#lanes.indexOf(lane)}:${bucket.offset}:${bucket.count}`;
    const hit = perBuffer.get(key);
    if (hit) return hit;
    const { device } = this.#ctx, comm = lane.comm, bytes = bucket.count * this.#elem;
    const words = bytes / 4, bindAt = Math.floor(bucket.offset / 256) * 256;
    const params = device.createBuffer({
      label: "exchange params",
      size: 16,
      usage: GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST,
    });
    device.queue.writeBuffer(
      params,
      0,
      Uint32Array.of(words, (bucket.offset - bindAt) / 4, comm.rank, comm.size),
    );
    const group = device.createBindGroup({
      layout: this.#pipeline!.getBindGroupLayout(0),
      entries: [
        {
          binding: 0,
          resource: { buffer: bucket.buffer, offset: bindAt, size: bucket.offset - bindAt + bytes },
        },
        {
          binding: 1,
          resource: { buffer: lane.scratch!, offset: 0, size: Math.max(4, (comm.size - 1) * bytes) },
        },
        { binding: 2, resource: { buffer: params } },
      ],
    });
    const b = { group, workgroups: Math.max(1, Math.min(Math.ceil(words / 256), 4096)) };
    perBuffer.set(key, b);
    return b;
  }

  /** Frees the staging rings and scratch buffers. */
  destroy(): void {
    for (const lane of this.#lanes) {
      lane.stager.destroy();
      lane.scratch?.destroy();
    }
  }
}
