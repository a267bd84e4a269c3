/**
 * The shared-memory ring allreduce between the Workers of one GPU host. One SharedArrayBuffer
 * per group (made by `createCommBuffer`, posted to each member) holds a header of step counters
 * and one slot per rank. A rank fills its own slot, then the ring runs in place: N−1
 * reduce-scatter steps (at each, a rank adds its predecessor's running sum of one segment into
 * its own) and N−1 all-gather steps (it copies the finished segment from its predecessor). A
 * rank only ever reads its predecessor's slot, so every step moves 1/N of the payload per rank
 * through memory once, and the result is bitwise identical on every rank.
 *
 * Shared memory lets every rank read every slot, so the buffer can instead be made for the
 * "direct" algorithm: reduce-scatter is one step (rank i sums segment i of all N slots, in rank
 * order) and all-gather one step (it copies every other finished segment from its owner): two
 * synchronisations instead of 2(N−1), and (N+1)/N instead of 3(N−1)/N of the payload read and
 * written per rank in the reduction. The bench measures both.
 *
 * Payloads are fp32, fp16 or bf16; sums are always fp32: for 16-bit payloads each slot has an
 * fp32 accumulator beside it and only the finished segment is rounded (round to nearest even).
 *
 * Synchronisation is one Int32 step counter per rank (on its own cache line). Every operation is
 * a "fill" step followed by its ring steps; before step k a rank waits until both ring neighbours
 * have finished step k−1 (its predecessor produced the data, its successor has consumed what the
 * step overwrites), and before refilling its slot it waits until every rank finished the
 * previous operation. Waits are `Atomics.wait` (Workers only) or `Atomics.waitAsync` (keeps the
 * event loop, e.g. for mapAsync callbacks); both drive the same step generator.
 *
 * Larger arrays than a slot go through `allreduceArray` chunk by chunk; reduce-scatter and
 * all-gather work on one slot (one bucket), as Megatron's distributed optimizer shards each
 * bucket: rank i owns `shardRange(count, N, i)`.
 */

/** Element type of a payload. Sums are done in fp32 whatever the payload. */
export type CommDtype = "f32" | "f16" | "bf16";

/** A rank's payload view: fp32 values, or the raw bits of fp16 / bf16 values. */
export type Payload = Float32Array | Uint16Array;

/** Shape of one communicator buffer. */
export interface CommShape {
  /** Ranks in the group. */
  ranks: number;
  /** Elements per rank slot (the largest bucket one operation can reduce). */
  capacity: number;
  /** Payload element type. */
  dtype: CommDtype;
  /** "ring" (default) or "direct" (see the file header). */
  algorithm?: CommAlgorithm;
}

/** How reduce-scatter and all-gather move data between the slots. */
export type CommAlgorithm = "ring" | "direct";

const MAGIC = 0x52494e47; // "RING"
const VERSION = 1;
const LINE = 64; // bytes: one cache line per counter, so ranks never share one
const W_RANKS = 2, W_CAPACITY = 3, W_DTYPE = 4, W_ABORT = 5, W_ALGORITHM = 6;
const DTYPES: CommDtype[] = ["f32", "f16", "bf16"];
const ALGORITHMS: CommAlgorithm[] = ["ring", "direct"];
const BLOCK = 4096; // elements summed at a time in a local scratch by the direct reduction

const align = (n: number) => Math.ceil(n / LINE) * LINE;
const elemBytes = (d: CommDtype) => d === "f32" ? 4 : 2;
const counterWord = (i: number) => (LINE / 4) * (i + 1);
const headerBytes = (ranks: number) => LINE * (ranks + 1);
const slotStride = (s: CommShape) =>
  align(s.capacity * elemBytes(s.dtype)) + (s.dtype === "f32" ? 0 : align(s.capacity * 4));

/** Bytes of the SharedArrayBuffer `createCommBuffer` makes for this shape. */
export function commBufferBytes(shape: CommShape): number {
  return headerBytes(shape.ranks) + shape.ranks * slotStride(shape);
}

/** A new communicator buffer for a group; post it to every member and wrap it with `RingComm`. */
export function createCommBuffer(shape: CommShape): SharedArrayBuffer {
  const { ranks, capacity, dtype, algorithm = "ring" } = shape;
  if (!Number.isInteger(ranks) || ranks < 1 || ranks > 1024) {
    throw new RangeError(`ranks must be an integer in [1, 1024], got "${ranks}"`);
  }
  if (!Number.isInteger(capacity) || capacity < 1 || capacity > 2 ** 31 - 1) {
    throw new RangeError(`capacity must be a positive integer below 2^31, got "${capacity}"`);
  }
  if (!DTYPES.includes(dtype)) {
    throw new RangeError(`dtype must be one of ${DTYPES.join(", ")}, got "${dtype}"`);
  }
  if (!ALGORITHMS.includes(algorithm)) {
    throw new RangeError(`algorithm must be one of ${ALGORITHMS.join(", ")}, got "${algorithm}"`);
  }
  const sab = new SharedArrayBuffer(commBufferBytes(shape));
  const h = new Int32Array(sab, 0, headerBytes(ranks) / 4);
  h.set([MAGIC, VERSION, ranks, capacity, DTYPES.indexOf(dtype), 0, ALGORITHMS.indexOf(algorithm)]);
  return sab;
}

/** Elements `[start, end)` of segment `i` of `count` split into `n` near-equal parts (earlier parts never larger). */
export function shardRange(count: number, n: number, i: number): [number, number] {
  return [Math.floor((i * count) / n), Math.floor(((i + 1) * count) / n)];
}

/** W_ABORT value of an abort from outside the group (`abortCommBuffer`). */
const BY_HOST = 0x7fffffff;

/**
 * Fails a group from outside it (e.g. the GPU host when one rank's Worker died): every member's
 * current or next wait throws "Communicator aborted by the host" instead of waiting for the dead rank.
 */
export function abortCommBuffer(sab: SharedArrayBuffer): void {
  const head = new Int32Array(sab, 0, 8);
  if (head[0] !== MAGIC) throw new RangeError(`Not a communicator buffer (magic "${head[0]}")`);
  const counters = new Int32Array(sab, 0, headerBytes(head[W_RANKS]) / 4);
  Atomics.compareExchange(counters, W_ABORT, 0, BY_HOST);
  for (let i = 0; i < head[W_RANKS]; i++) Atomics.notify(counters, counterWord(i));
}

/** Raised in every rank when one rank aborts or a wait times out; the group is unusable after it. */
export class CommError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "CommError";
  }
}

// 16-bit decoding tables (256 KiB each, built on first use) and fp32 -> 16-bit rounding.
let f16Table: Float32Array | null = null, bf16Table: Float32Array | null = null;

function decodeTable(dtype: "f16" | "bf16"): Float32Array {
  if (dtype === "bf16") {
    if (!bf16Table) {
      bf16Table = new Float32Array(65536);
      const bits = new Uint32Array(bf16Table.buffer);
      for (let h = 0; h < 65536; h++) bits[h] = h << 16;
    }
    return bf16Table;
  }
  if (!f16Table) {
    f16Table = new Float32Array(65536);
    for (let h = 0; h < 65536; h++) {
      const e = (h >> 10) & 0x1f, m = h & 0x3ff, s = h & 0x8000 ? -1 : 1;
      f16Table[h] = e === 0
        ? s * m * 2 ** -24
        : e === 31
        ? (m ? NaN : s * Infinity)
        : s * (1024 + m) * 2 ** (e - 25);
    }
  }
  return f16Table;
}

/** fp32 bits to fp16 bits, round to nearest even (overflow to infinity, NaN kept quiet). */
export function f32BitsToF16(x: number): number {
  const sign = (x >>> 16) & 0x8000;
  const e = ((x >>> 23) & 0xff) - 112;
  let m = x & 0x7fffff;
  if (e === 143) return sign | 0x7c00 | (m ? 0x200 : 0);
  if (e >= 31) return sign | 0x7c00;
  if (e <= 0) {
    if (e < -10) return sign;
    m |= 0x800000;
    const shift = 14 - e, half = 1 << (shift - 1), rem = m & ((half << 1) - 1);
    const h = m >>> shift;
    return sign | (rem > half || (rem === half && (h & 1)) ? h + 1 : h);
  }
  const h = (e << 10) | (m >>> 13), rem = m & 0x1fff;
  return sign | (rem > 0x1000 || (rem === 0x1000 && (h & 1)) ? h + 1 : h);
}

/** fp32 bits to bf16 bits, round to nearest even (NaN kept quiet). */
export function f32BitsToBf16(x: number): number {
  if ((x & 0x7f800000) === 0x7f800000 && (x & 0x7fffff)) return ((x >>> 16) | 0x40) & 0xffff;
  return ((x + 0x7fff + ((x >>> 16) & 1)) >>> 16) & 0xffff;
}

/** A wait request of the step generator: until counter of `peer` reaches `target`. */
type Wait = { peer: number; target: number };

/** Options of {@link RingComm}. */
export interface RingCommOptions {
  /** Longest wait for a peer before the group fails with a CommError (default 120 s). */
  timeoutMs?: number;
}

/** One rank's handle on a communicator buffer. All ranks of the group must run the same operations in order. */
export class RingComm {
  /** Ranks in the group. */
  readonly size: number;
  /** This rank's position in the group. */
  readonly rank: number;
  /** Elements per slot. */
  readonly capacity: number;
  /** Payload element type. */
  readonly dtype: CommDtype;
  /** Reduce-scatter and all-gather algorithm. */
  readonly algorithm: CommAlgorithm;
  /** Longest wait for a peer, in ms. */
  readonly timeoutMs: number;
  #counters: Int32Array;
  #header: Int32Array;
  #slots: Payload[];
  #accs: Float32Array[];
  #accBits: Uint32Array[];
  /** Steps this rank has completed (the value of its counter, without wrapping). */
  #done = 0;
  /** When the current wait gives up (performance.now() ms). */
  #deadline = 0;
  /** The reason this rank aborted with, if it did. */
  #aborted: string | null = null;
  /** Local block of the direct reduction (not shared). */
  #scratch: Float32Array | null = null;

  /** Wraps `sab` (from `createCommBuffer`) as rank `rank` of its group. */
  constructor(sab: SharedArrayBuffer, rank: number, opts: RingCommOptions = {}) {
    const head = new Int32Array(sab, 0, 8);
    if (head[0] !== MAGIC || head[1] !== VERSION) {
      throw new RangeError(`Not a communicator buffer (magic "${head[0]}", version "${head[1]}")`);
    }
    this.size = head[W_RANKS];
    this.capacity = head[W_CAPACITY];
    this.dtype = DTYPES[head[W_DTYPE]];
    this.algorithm = ALGORITHMS[head[W_ALGORITHM]];
    if (!Number.isInteger(rank) || rank < 0 || rank >= this.size) {
      throw new RangeError(`rank must be in [0, ${this.size}), got "${rank}"`);
    }
    this.rank = rank;
    this.timeoutMs = opts.timeoutMs ?? 120_000;
    this.#header = new Int32Array(sab, 0, headerBytes(this.size) / 4);
    this.#counters = this.#header;
    // Only this rank advances its counter, so a new handle on a used buffer continues where the old one stopped.
    this.#done = Atomics.load(this.#counters, counterWord(rank));
    const shape = { ranks: this.size, capacity: this.capacity, dtype: this.dtype };
    const stride = slotStride(shape), base = headerBytes(this.size), n = this.capacity;
    this.#slots = [];
    this.#accs = [];
    this.#accBits = [];
    for (let i = 0; i < this.size; i++) {
      const at = base + i * stride;
      const slot = this.dtype === "f32" ? new Float32Array(sab, at, n) : new Uint16Array(sab, at, n);
      const acc = slot instanceof Float32Array ? slot : new Float32Array(sab, at + align(n * 2), n);
      this.#slots.push(slot);
      this.#accs.push(acc);
      this.#accBits.push(new Uint32Array(acc.buffer, acc.byteOffset, n));
    }
  }

  /** This rank's slot (payload dtype, `capacity` elements). Write it only after `acquire`. */
  get slot(): Payload {
    return this.#slots[this.rank];
  }

  /**
   * This rank's fp32 accumulator: after `reduceScatter`, its shard holds the unrounded fp32 sum
   * (for an fp32 payload it is the slot itself).
   */
  get accumulator(): Float32Array {
    return this.#accs[this.rank];
  }

  /** Waits (blocking) until no peer still reads this rank's slot; returns the slot to fill. */
  acquireSync(): Payload {
    this.#runSync(this.#acquire());
    return this.slot;
  }

  /** Waits (async) until no peer still reads this rank's slot; returns the slot to fill. */
  async acquire(): Promise<Payload> {
    await this.#runAsync(this.#acquire());
    return this.slot;
  }

  /** Sums the first `count` elements of every rank's slot into every slot (blocking). */
  allreduceSync(count: number): void {
    this.#runSync(this.#allreduce(count));
  }

  /** Sums the first `count` elements of every rank's slot into every slot (async). */
  allreduce(count: number): Promise<void> {
    return this.#runAsync(this.#allreduce(count));
  }

  /**
   * Reduce-scatter of the first `count` elements (blocking): afterwards this rank's slot holds the
   * sum over ranks of its shard `shardRange(count, size, rank)`, which it returns; the rest of the
   * slot is scratch.
   */
  reduceScatterSync(count: number): [number, number] {
    this.#runSync(this.#reduceScatter(count));
    return shardRange(count, this.size, this.rank);
  }

  /** Reduce-scatter (async); see `reduceScatterSync`. */
  async reduceScatter(count: number): Promise<[number, number]> {
    await this.#runAsync(this.#reduceScatter(count));
    return shardRange(count, this.size, this.rank);
  }

  /**
   * All-gather of `count` elements (blocking): each rank has written its shard
   * `shardRange(count, size, rank)` of its slot (after `acquire`, or straight after
   * `reduceScatter`); afterwards every slot holds all shards.
   */
  allGatherSync(count: number): void {
    this.#runSync(this.#allGather(count));
  }

  /** All-gather (async); see `allGatherSync`. */
  allGather(count: number): Promise<void> {
    return this.#runAsync(this.#allGather(count));
  }

  /**
   * Publishes this rank's filled slot and waits until every rank has (async). Returns every
   * rank's slot, read-only until `release()`, for reductions done elsewhere (e.g. on the GPU).
   */
  async gather(): Promise<Payload[]> {
    await this.#runAsync(this.#gather());
    return this.#slots;
  }

  /** Ends a `gather`: this rank no longer reads its peers' slots. */
  release(): void {
    this.#step();
  }

  /** Waits until every rank reaches this point (blocking). */
  barrierSync(): void {
    this.#runSync(this.#barrier());
  }

  /** Waits until every rank reaches this point (async). */
  barrier(): Promise<void> {
    return this.#runAsync(this.#barrier());
  }

  /** Sums a whole array over the ranks in place, chunk by chunk through the slot (blocking). */
  allreduceArraySync(data: Payload): void {
    this.#checkArray(data);
    for (let at = 0; at < data.length; at += this.capacity) {
      const n = Math.min(this.capacity, data.length - at);
      this.acquireSync().set(data.subarray(at, at + n));
      this.allreduceSync(n);
      data.set(this.slot.subarray(0, n), at);
    }
  }

  /** Sums a whole array over the ranks in place, chunk by chunk through the slot (async). */
  async allreduceArray(data: Payload): Promise<void> {
    this.#checkArray(data);
    for (let at = 0; at < data.length; at += this.capacity) {
      const n = Math.min(this.capacity, data.length - at);
      (await this.acquire()).set(data.subarray(at, at + n));
      await this.allreduce(n);
      data.set(this.slot.subarray(0, n), at);
    }
  }

  /** Fails the group: every rank's current or next wait throws a CommError naming this rank and `reason`. */
  abort(reason: string): void {
    Atomics.compareExchange(this.#header, W_ABORT, 0, this.rank + 1);
    for (let i = 0; i < this.size; i++) Atomics.notify(this.#counters, counterWord(i));
    this.#aborted = reason;
  }

  #checkArray(data: Payload): void {
    const want = this.dtype === "f32" ? "Float32Array" : "Uint16Array";
    if (data.constructor.name !== want) {
      throw new TypeError(`A "${this.dtype}" communicator reduces a ${want}, got a ${data.constructor.name}`);
    }
  }

  #checkCount(count: number): void {
    if (!Number.isInteger(count) || count < 0 || count > this.capacity) {
      throw new RangeError(`count must be an integer in [0, ${this.capacity}], got "${count}"`);
    }
  }

  /** Marks one step done and wakes the neighbours waiting on it. */
  #step(): void {
    this.#done++;
    const w = counterWord(this.rank);
    Atomics.add(this.#counters, w, 1);
    Atomics.notify(this.#counters, w);
  }

  *#acquire(): Generator<Wait> {
    for (let p = 0; p < this.size; p++) if (p !== this.rank) yield { peer: p, target: this.#done };
  }

  /** Optional reduce-scatter, then optional all-gather, after the fill step. */
  *#ring(count: number, reduce: boolean, gather: boolean): Generator<Wait> {
    this.#checkCount(count);
    yield* this.#acquire();
    this.#step(); // fill done
    if (this.algorithm === "direct") {
      yield* this.#direct(count, reduce, gather);
      return;
    }
    const n = this.size, r = this.rank, prev = (r + n - 1) % n, next = (r + 1) % n;
    const ringStep = (): Wait[] => [{ peer: prev, target: this.#done }, { peer: next, target: this.#done }];
    if (reduce) {
      for (let s = 0; s < n - 1; s++) {
        for (const w of ringStep()) yield w;
        this.#addSegment(shardRange(count, n, (((r - s - 2) % n) + n) % n), prev, s === 0);
        // The finished shard is rounded before the step is announced: the successor copies it next.
        if (s === n - 2 && this.dtype !== "f32") this.#round(shardRange(count, n, r));
        this.#step();
      }
    }
    if (gather) {
      for (let t = 0; t < n - 1; t++) {
        for (const w of ringStep()) yield w;
        const [a, b] = shardRange(count, n, (((r - t - 1) % n) + n) % n);
        this.#slots[r].set(this.#slots[prev].subarray(a, b), a);
        this.#step();
      }
    }
  }

  /** The direct algorithm: one all-ranks step for the reduction, one for the gather. */
  *#direct(count: number, reduce: boolean, gather: boolean): Generator<Wait> {
    const n = this.size, r = this.rank;
    if (reduce) {
      for (let p = 0; p < n; p++) if (p !== r) yield { peer: p, target: this.#done };
      this.#sumSegment(shardRange(count, n, r));
      this.#step();
    }
    if (gather) {
      for (let p = 0; p < n; p++) if (p !== r) yield { peer: p, target: this.#done };
      for (let q = 0; q < n; q++) {
        if (q === r) continue;
        const [a, b] = shardRange(count, n, q);
        this.#slots[r].set(this.#slots[q].subarray(a, b), a);
      }
      this.#step();
    }
  }

  /**
   * acc[a..b) = sum over ranks q in order of slot[q][a..b) in fp32; 16-bit slots get it rounded.
   * Up to 4 ranks the loops are written out (one pass, monomorphic, and safe although the fp32
   * accumulator is this rank's own slot); more ranks sum through a local block.
   */
  #sumSegment([a, b]: [number, number]): void {
    const n = this.size, acc = this.#accs[this.rank];
    if (this.dtype === "f32") {
      const [x0, x1, x2, x3] = this.#slots as Float32Array[];
      if (n === 2) { for (let i = a; i < b; i++) acc[i] = x0[i] + x1[i]; }
      else if (n === 3) { for (let i = a; i < b; i++) acc[i] = x0[i] + x1[i] + x2[i]; }
      else if (n === 4) { for (let i = a; i < b; i++) acc[i] = x0[i] + x1[i] + x2[i] + x3[i]; }
      else this.#sumBlocks(a, b, null);
      return;
    }
    const t = decodeTable(this.dtype), [y0, y1, y2, y3] = this.#slots as Uint16Array[];
    if (n === 2) { for (let i = a; i < b; i++) acc[i] = t[y0[i]] + t[y1[i]]; }
    else if (n === 3) { for (let i = a; i < b; i++) acc[i] = t[y0[i]] + t[y1[i]] + t[y2[i]]; }
    else if (n === 4) { for (let i = a; i < b; i++) acc[i] = t[y0[i]] + t[y1[i]] + t[y2[i]] + t[y3[i]]; }
    else this.#sumBlocks(a, b, t);
    this.#round([a, b]);
  }

  /** The general case of `#sumSegment`: blocks of BLOCK elements summed in a local scratch. */
  #sumBlocks(a: number, b: number, t: Float32Array | null): void {
    const acc = this.#accs[this.rank], scratch = this.#scratch ??= new Float32Array(BLOCK);
    for (let at = a; at < b; at += BLOCK) {
      const len = Math.min(BLOCK, b - at);
      for (let q = 0; q < this.size; q++) {
        const x = this.#slots[q];
        if (t) {
          if (q === 0) { for (let j = 0; j < len; j++) scratch[j] = t[x[at + j]]; }
          else for (let j = 0; j < len; j++) scratch[j] += t[x[at + j]];
        } else if (q === 0) { for (let j = 0; j < len; j++) scratch[j] = x[at + j]; }
        else for (let j = 0; j < len; j++) scratch[j] += x[at + j];
      }
      acc.set(len === BLOCK ? scratch : scratch.subarray(0, len), at);
    }
  }

  *#allreduce(count: number): Generator<Wait> {
    yield* this.#ring(count, true, true);
  }

  *#reduceScatter(count: number): Generator<Wait> {
    yield* this.#ring(count, true, false);
  }

  *#allGather(count: number): Generator<Wait> {
    yield* this.#ring(count, false, true);
  }

  *#gather(): Generator<Wait> {
    yield* this.#acquire();
    this.#step();
    for (let p = 0; p < this.size; p++) if (p !== this.rank) yield { peer: p, target: this.#done };
  }

  *#barrier(): Generator<Wait> {
    this.#step();
    for (let p = 0; p < this.size; p++) if (p !== this.rank) yield { peer: p, target: this.#done };
  }

  /** acc[a..b) = (first ? slot[prev] : acc[prev]) + slot[me], in fp32. */
  #addSegment([a, b]: [number, number], prev: number, first: boolean): void {
    const me = this.rank, acc = this.#accs[me];
    if (this.dtype === "f32") {
      const x = this.#slots[prev] as Float32Array, y = this.#slots[me] as Float32Array;
      for (let i = a; i < b; i++) acc[i] = x[i] + y[i];
      return;
    }
    const t = decodeTable(this.dtype), y = this.#slots[me] as Uint16Array;
    if (first) {
      const x = this.#slots[prev] as Uint16Array;
      for (let i = a; i < b; i++) acc[i] = t[x[i]] + t[y[i]];
    } else {
      const x = this.#accs[prev];
      for (let i = a; i < b; i++) acc[i] = x[i] + t[y[i]];
    }
  }

  /** slot[a..b) = round(acc[a..b)) for a 16-bit payload. */
  #round([a, b]: [number, number]): void {
    // The common cases are written out: V8 did not inline the helpers here (3-4× slower).
    const bits = this.#accBits[this.rank], out = this.#slots[this.rank] as Uint16Array;
    if (this.dtype === "bf16") {
      for (let i = a; i < b; i++) {
        const x = bits[i];
        out[i] = (x & 0x7fffffff) > 0x7f800000 ? f32BitsToBf16(x) : (x + 0x7fff + ((x >>> 16) & 1)) >>> 16;
      }
      return;
    }
    for (let i = a; i < b; i++) {
      const x = bits[i], e = ((x >>> 23) & 0xff) - 112;
      if (e > 0 && e < 31) {
        // Normal fp16: a carry out of the mantissa rounds up the exponent (to infinity at the top), as it should.
        const h = (e << 10) | ((x >>> 13) & 0x3ff), rem = x & 0x1fff;
        out[i] = ((x >>> 16) & 0x8000) | (rem > 0x1000 || (rem === 0x1000 && (h & 1)) ? h + 1 : h);
      } else out[i] = f32BitsToF16(x);
    }
  }

  #ready(w: Wait): boolean {
    return ((Atomics.load(this.#counters, counterWord(w.peer)) - w.target) | 0) >= 0;
  }

  #checkAbort(w: Wait, timed = true): void {
    const by = Atomics.load(this.#header, W_ABORT);
    if (by === BY_HOST) throw new CommError("Communicator aborted by the host");
    if (by) {
      throw new CommError(
        `Communicator aborted by rank "${by - 1}"${
          this.#aborted && by - 1 === this.rank ? `: ${this.#aborted}` : ""
        }`,
      );
    }
    if (timed && performance.now() > this.#deadline) {
      this.abort(`timed out waiting for rank "${w.peer}"`);
      throw new CommError(
        `Communicator timed out after ${this.timeoutMs} ms: rank "${this.rank}" waited for rank "${w.peer}" to finish step ${w.target}`,
      );
    }
  }

  #runSync(steps: Generator<Wait>): void {
    for (const w of steps) {
      this.#deadline = performance.now() + this.timeoutMs;
      for (let spin = 0; !this.#ready(w); spin++) {
        this.#checkAbort(w);
        if (spin < 64) continue;
        const word = counterWord(w.peer), seen = Atomics.load(this.#counters, word);
        if (((seen - w.target) | 0) >= 0) break;
        Atomics.wait(this.#counters, word, seen, Math.max(1, this.#deadline - performance.now()));
      }
      this.#checkAbort(w, false);
    }
  }

  async #runAsync(steps: Generator<Wait>): Promise<void> {
    for (const w of steps) {
      this.#deadline = performance.now() + this.timeoutMs;
      while (!this.#ready(w)) {
        this.#checkAbort(w);
        const word = counterWord(w.peer), seen = Atomics.load(this.#counters, word);
        if (((seen - w.target) | 0) >= 0) break;
        const left = Math.max(1, this.#deadline - performance.now());
        const r = Atomics.waitAsync(this.#counters, word, seen, left);
        if (!r.async) continue;
        // A pending waitAsync does not keep Deno's event loop alive; the timer does (and bounds the wait).
        let timer: ReturnType<typeof setTimeout> | undefined;
        await Promise.race([r.value, new Promise((wake) => timer = setTimeout(wake, left + 1))]);
        clearTimeout(timer);
      }
      this.#checkAbort(w, false);
    }
  }
}

/** Floats one `RankControl` exchange can carry per rank. */
export const CONTROL_WORDS = 16;

/** Creates the buffer of a job's control communicator. */
export function createControlBuffer(ranks: number): SharedArrayBuffer {
  return createCommBuffer({ ranks, capacity: CONTROL_WORDS * ranks, dtype: "f32", algorithm: "direct" });
}

/** The comm dtype of an `allreduce_dtype` job setting. */
export function wireDtype(setting: "fp32" | "fp16" | "bf16" | undefined): CommDtype {
  return setting === "fp16" ? "f16" : setting === "bf16" ? "bf16" : "f32";
}
