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
 *
 * An fp32 bucket can travel as fp16 or bf16 (`allreduce_dtype`; `bufferDtype: "f32"` with a
 * 16-bit communicator): a kernel packs it into a per-lane 16-bit copy, which is read back (half
 * the bytes); the host path unpacks the rounded sum, the GPU path sums every rank's rounded
 * values straight into fp32.
 */

import { createPipeline, createStorage, type GpuContext } from "../device.ts";
import { type CommDtype, type RingComm, shardRange } from "./allreduce.ts";
import { EXCHANGE_WG, packWgsl, peerAddCastWgsl, peerAddWgsl, unpackWgsl } from "./exchange_kernels.ts";

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

/** A bucket: `count` elements (of the exchange's buffer dtype) at byte `offset` of `buffer`. */
export interface Bucket {
  buffer: GPUBuffer;
  offset: number;
  count: number;
  /** False: this rank contributes zeros instead of reading the bucket back (a broadcast from the ranks that do). */
  source?: boolean;
  /** False: the sum is not written back on this rank (a reduction to the ranks that do). */
  writeBack?: boolean;
}

/** Where the time of one exchange went, in ms (GPU work of the "gpu" path is only queued, not awaited). */
export interface ExchangeTiming {
  readMs: number;
  reduceMs: number;
  writeMs: number;
  /** Payload bytes sent per rank (16-bit when the bucket travels packed). */
  bytes: number;
}

/** Options of {@link BucketExchange}. */
export interface ExchangeOptions extends StagerOptions {
  /** Reduction path (default "host"). */
  path?: ReducePath;
  /**
   * Element type of the buckets in GPU memory (default: the communicator's). "f32" with a 16-bit
   * communicator packs each bucket on the GPU before it travels.
   */
  bufferDtype?: CommDtype;
}

/** Kernels of an exchange, compiled once. */
interface Kernels {
  add?: GPUComputePipeline;
  pack?: GPUComputePipeline;
  unpack?: GPUComputePipeline;
}

/** Parameters and bind groups of one bucket on one lane, built on first use. */
interface BucketBinding {
  add?: GPUBindGroup;
  pack?: GPUBindGroup;
  unpack?: GPUBindGroup;
  workgroups: number;
}

/** One pipeline lane: a communicator with its own staging ring and GPU buffers, one bucket at a time. */
interface Lane {
  comm: RingComm;
  stager: Stager;
  /** The peers' slots uploaded (GPU path). */
  scratch: GPUBuffer | null;
  /** The packed 16-bit copy of an fp32 bucket (cast mode). */
  packed: GPUBuffer | null;
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
  /** Element type of the buckets in GPU memory. */
  readonly bufferDtype: CommDtype;
  /** Element type on the wire (the communicators'). */
  readonly wireDtype: CommDtype;
  #ctx: GpuContext;
  #lanes: Lane[];
  #next = 0;
  #kernels: Kernels = {};
  #bindings = new WeakMap<GPUBuffer, Map<string, BucketBinding>>();

  private constructor(ctx: GpuContext, comms: RingComm[], opts: ExchangeOptions) {
    this.#ctx = ctx;
    this.path = opts.path ?? "host";
    this.wireDtype = comms[0].dtype;
    this.bufferDtype = opts.bufferDtype ?? this.wireDtype;
    this.#lanes = comms.map((comm) => ({
      comm,
      stager: new Stager(ctx, opts),
      scratch: null,
      packed: null,
      tail: Promise.resolve(),
    }));
  }

  /**
   * An exchange for this rank on `ctx` over one communicator, or several (lanes: all of the same
   * ranks, dtype and capacity, in the same order on every rank). Compiles the kernels its path
   * needs and allocates the lanes' GPU buffers.
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
    const buf = opts.bufferDtype ?? c0.dtype;
    if (buf !== c0.dtype && !(buf === "f32" && c0.dtype !== "f32")) {
      throw new RangeError(
        `bufferDtype "${buf}" cannot travel as "${c0.dtype}": only fp32 buckets may be sent as fp16 or bf16`,
      );
    }
    const x = new BucketExchange(ctx, list, opts);
    const wire = c0.dtype, cast = x.#cast, gpu = x.path === "gpu" && c0.size > 1;
    if (cast) {
      const w = wire as "f16" | "bf16";
      x.#kernels.pack = await createPipeline(ctx, `exchange pack ${w}`, packWgsl(w));
      if (gpu) x.#kernels.add = await createPipeline(ctx, `exchange add ${w} to f32`, peerAddCastWgsl(w));
      else x.#kernels.unpack = await createPipeline(ctx, `exchange unpack ${w}`, unpackWgsl(w));
    } else if (gpu) {
      x.#kernels.add = await createPipeline(ctx, `exchange add ${wire}`, peerAddWgsl(wire));
    }
    for (const [i, lane] of x.#lanes.entries()) {
      if (gpu) {
        lane.scratch = await createStorage(ctx, `exchange peers ${i}`, (c0.size - 1) * c0.capacity * x.#wire);
      }
      if (cast) lane.packed = await createStorage(ctx, `exchange packed ${i}`, c0.capacity * 2);
    }
    return x;
  }

  /** Number of lanes. */
  get lanes(): number {
    return this.#lanes.length;
  }

  /** Whether buckets are packed to 16 bits on the GPU before they travel. */
  get #cast(): boolean {
    return this.bufferDtype !== this.wireDtype;
  }

  /** Bytes per element on the wire. */
  get #wire(): number {
    return this.wireDtype === "f32" ? 4 : 2;
  }

  /** Bytes per element in GPU memory. */
  get #elem(): number {
    return this.bufferDtype === "f32" ? 4 : 2;
  }

  /**
   * Sums `bucket` over the ranks in place; every rank calls it with its own buffer, the same
   * counts, in the same order. A failure aborts the communicator, so peers fail too instead of
   * waiting. Calls may be issued without awaiting the previous one; they rotate over the lanes.
   */
  run(bucket: Bucket): Promise<ExchangeTiming> {
    return this.#queue(bucket, false, (lane) => this.#allreduce(lane, bucket));
  }

  /**
   * Records into `enc` the copy of this rank's part of `bucket` into `dst` from byte `at` (packed to
   * 16 bits first when it travels so): the read half of `runFrom`, for a caller that reads it back
   * itself, e.g. while the GPU goes on with other work.
   */
  encodeRead(enc: GPUCommandEncoder, bucket: Bucket, dst: GPUBuffer, at = 0): void {
    const lane = this.#lanes[0];
    this.#check(bucket, lane.comm, false);
    const bytes = bucket.count * this.#wire;
    if (bytes === 0) return;
    if (this.#cast) {
      const b = this.#binding(lane, bucket);
      encodePass(enc, this.#kernels.pack!, b.pack!, b.workgroups);
      enc.copyBufferToBuffer(lane.packed!, 0, dst, at, bytes);
    } else {
      enc.copyBufferToBuffer(bucket.buffer, bucket.offset, dst, at, bytes);
    }
  }

  /**
   * `run` for a bucket whose bytes on the wire (as `encodeRead` wrote them) this rank has read
   * back already: `mine` holds them; the exchange and write-back are the same.
   */
  runFrom(bucket: Bucket, mine: Uint8Array): Promise<ExchangeTiming> {
    if (mine.byteLength !== bucket.count * this.#wire) {
      return Promise.reject(
        new RangeError(`runFrom got ${mine.byteLength} bytes for a bucket of ${bucket.count * this.#wire}`),
      );
    }
    return this.#queue(bucket, false, (lane) => this.#allreduce(lane, bucket, mine));
  }

  /**
   * Reduce-scatter of a bucket (host path, for the distributed optimizer): afterwards this rank's
   * shard `shardRange(count, ranks, rank)` of the bucket holds the sum over ranks; the rest of the
   * bucket is left as it was. A 16-bit bucket needs a count divisible by 2 × ranks.
   */
  async reduceScatter(bucket: Bucket): Promise<[number, number]> {
    let shard: [number, number] = [0, 0];
    await this.#queue(bucket, true, async (lane) => {
      const e = this.#elem,
        bytes = bucket.count * e,
        t0 = performance.now(),
        slot = await lane.comm.acquire();
      await lane.stager.readInto(bucket.buffer, bucket.offset, bytes, bytesOf(slot, 0, bytes));
      const t1 = performance.now();
      shard = await lane.comm.reduceScatter(bucket.count);
      const t2 = performance.now(), [a, b] = shard;
      this.#ctx.device.queue.writeBuffer(
        bucket.buffer,
        bucket.offset + a * e,
        bytesOf(slot, a * e, (b - a) * e),
      );
      return { readMs: t1 - t0, reduceMs: t2 - t1, writeMs: performance.now() - t2, bytes };
    });
    return shard;
  }

  /**
   * All-gather of a bucket (host path): each rank's shard `shardRange(count, ranks, rank)` is
   * read back and every rank's bucket ends holding all shards (e.g. the weights each rank updated).
   */
  allGather(bucket: Bucket): Promise<ExchangeTiming> {
    return this.#queue(bucket, true, async (lane) => {
      const comm = lane.comm, e = this.#elem, bytes = bucket.count * e;
      const [a, b] = shardRange(bucket.count, comm.size, comm.rank);
      const t0 = performance.now(), slot = await comm.acquire();
      await lane.stager.readInto(
        bucket.buffer,
        bucket.offset + a * e,
        (b - a) * e,
        bytesOf(slot, a * e, (b - a) * e),
      );
      const t1 = performance.now();
      await comm.allGather(bucket.count);
      const t2 = performance.now();
      this.#ctx.device.queue.writeBuffer(bucket.buffer, bucket.offset, bytesOf(slot, 0, bytes));
      return { readMs: t1 - t0, reduceMs: t2 - t1, writeMs: performance.now() - t2, bytes };
    });
  }

  /** Checks a bucket, then runs `op` on the next lane once that lane's previous operation ended. */
  #queue(
    bucket: Bucket,
    sharded: boolean,
    op: (lane: Lane) => Promise<ExchangeTiming>,
  ): Promise<ExchangeTiming> {
    const lane = this.#lanes[this.#next], comm = lane.comm;
    try {
      this.#check(bucket, comm, sharded);
    } catch (err) {
      return Promise.reject(err);
    }
    this.#next = (this.#next + 1) % this.#lanes.length;
    const run = lane.tail.then(() => op(lane)).catch((err) => {
      comm.abort(String(err));
      throw err;
    });
    lane.tail = run.catch(() => {});
    return run;
  }

  #check(bucket: Bucket, comm: RingComm, sharded: boolean): void {
    const { count } = bucket;
    if (!Number.isInteger(count) || count < 0 || count > comm.capacity) {
      throw new RangeError(`count must be an integer in [0, ${comm.capacity}], got "${count}"`);
    }
    if (this.#wire === 2 && count % 2 !== 0) {
      throw new RangeError(`A bucket sent as 16-bit needs an even count, got "${count}"`);
    }
    if (sharded && this.#cast) {
      throw new RangeError(`Reduce-scatter and all-gather need buckets in "${this.wireDtype}", not "f32"`);
    }
    if (sharded && this.#wire === 2 && count % (2 * comm.size) !== 0) {
      throw new RangeError(
        `A sharded 16-bit bucket needs a count divisible by ${2 * comm.size}, got "${count}"`,
      );
    }
    if (bucket.source === false && this.path === "gpu") {
      throw new RangeError('A broadcast (a bucket with "source: false") needs the "host" path');
    }
    checkRange(bucket.buffer, bucket.offset, count * this.#elem);
  }

  async #allreduce(lane: Lane, bucket: Bucket, mine?: Uint8Array): Promise<ExchangeTiming> {
    const comm = lane.comm, queue = this.#ctx.device.queue, bytes = bucket.count * this.#wire;
    const b = bytes > 0 && (this.#cast || (this.path === "gpu" && comm.size > 1))
      ? this.#binding(lane, bucket)
      : null;
    const t0 = performance.now();
    const slot = await comm.acquire();
    const source = bucket.source ?? true, writeBack = bucket.writeBack ?? true;
    if (b?.pack && source && !mine) this.#dispatch(this.#kernels.pack!, b.pack, b.workgroups);
    const [src, at] = b?.pack ? [lane.packed!, 0] : [bucket.buffer, bucket.offset];
    if (mine) bytesOf(slot, 0, bytes).set(mine);
    else if (source) await lane.stager.readInto(src, at, bytes, bytesOf(slot, 0, bytes));
    else bytesOf(slot, 0, bytes).fill(0);
    const t1 = performance.now();
    if (this.path === "host" || comm.size === 1 || bytes === 0) {
      await comm.allreduce(bucket.count);
      const t2 = performance.now();
      if (writeBack) {
        queue.writeBuffer(src, at, bytesOf(slot, 0, bytes));
        if (b?.unpack) this.#dispatch(this.#kernels.unpack!, b.unpack, b.workgroups);
      }
      return { readMs: t1 - t0, reduceMs: t2 - t1, writeMs: performance.now() - t2, bytes };
    }
    const slots = await comm.gather();
    const t2 = performance.now();
    if (writeBack) {
      for (let q = 0, j = 0; q < comm.size; q++) {
        if (q !== comm.rank) queue.writeBuffer(lane.scratch!, j++ * bytes, bytesOf(slots[q], 0, bytes));
      }
    }
    comm.release();
    if (writeBack) this.#dispatch(this.#kernels.add!, b!.add!, b!.workgroups);
    return { readMs: t1 - t0, reduceMs: t2 - t1, writeMs: performance.now() - t2, bytes };
  }

  #dispatch(pipeline: GPUComputePipeline, group: GPUBindGroup, workgroups: number): void {
    const enc = this.#ctx.device.createCommandEncoder();
    encodePass(enc, pipeline, group, workgroups);
    this.#ctx.device.queue.submit([enc.finish()]);
  }

  /** The bind groups of a bucket on a lane: its buffer bound from the 256-byte boundary below its offset. */
  #binding(lane: Lane, bucket: Bucket): BucketBinding {
    let perBuffer = this.#bindings.get(bucket.buffer);
    if (!perBuffer) this.#bindings.set(bucket.buffer, perBuffer = new Map());
    const key = `${this.#lanes.indexOf(lane)}:${bucket.offset}:${bucket.count}`;
    const hit = perBuffer.get(key);
    if (hit) return hit;
    const { device } = this.#ctx, comm = lane.comm, wireBytes = bucket.count * this.#wire;
    const words = wireBytes / 4, bindAt = Math.floor(bucket.offset / 256) * 256;
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
    const entries = {
      0: { buffer: bucket.buffer, offset: bindAt, size: bucket.offset - bindAt + bucket.count * this.#elem },
      1: { buffer: lane.scratch!, offset: 0, size: Math.max(4, (comm.size - 1) * wireBytes) },
      2: { buffer: params },
      3: { buffer: lane.packed!, offset: 0, size: Math.max(4, wireBytes) },
    };
    const group = (pipeline: GPUComputePipeline | undefined, bindings: (0 | 1 | 2 | 3)[]) =>
      pipeline && device.createBindGroup({
        layout: pipeline.getBindGroupLayout(0),
        entries: bindings.map((binding) => ({ binding, resource: entries[binding] })),
      });
    const k = this.#kernels, cast = this.#cast;
    const b: BucketBinding = {
      add: this.path === "gpu" && comm.size > 1 ? group(k.add, [0, 1, 2]) : undefined,
      pack: cast ? group(k.pack, [0, 2, 3]) : undefined,
      unpack: cast ? group(k.unpack, [0, 2, 3]) : undefined,
      workgroups: Math.max(1, Math.min(Math.ceil(words / EXCHANGE_WG), 4096)),
    };
    perBuffer.set(key, b);
    return b;
  }

  /** Frees the staging rings and the lanes' GPU buffers. */
  destroy(): void {
    for (const lane of this.#lanes) {
      lane.stager.destroy();
      lane.scratch?.destroy();
      lane.packed?.destroy();
    }
  }
}

/** Records one compute pass of one dispatch into `enc`. */
function encodePass(
  enc: GPUCommandEncoder,
  pipeline: GPUComputePipeline,
  group: GPUBindGroup,
  workgroups: number,
): void {
  const pass = enc.beginComputePass();
  pass.setPipeline(pipeline);
  pass.setBindGroup(0, group);
  pass.dispatchWorkgroups(workgroups);
  pass.end();
}

/** `bytes` bytes of a shared slot from byte `at`, as a writeBuffer or readInto argument. */
function bytesOf(slot: Uint16Array | Float32Array, at: number, bytes: number): Uint8Array<ArrayBuffer> {
  return sharedSource(new Uint8Array(slot.buffer, slot.byteOffset + at, bytes));
}
