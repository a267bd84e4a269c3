/**
 * Chunks: what a step queues on the GPU and reads back. A chunk runs, in one go, the state remap
 * (the GPU's state is authoritative: the remap moves rows, writes new rows' state and resets the
 * rest, so the CPU never reads the state back before queueing more), the pending prompts'
 * prefill, `steps` decode steps for every row, and the copy of each row's state, tokens and
 * logprobs into a staging buffer. One readback returns every stream's tokens.
 *
 * Running ahead: a step can leave the next chunk running on the GPU while it returns, queued a
 * piece at a time from a timer; when the chunks were read through the canvas path, that chunk is
 * queued by `runAhead` instead, once the caller has handed out the tokens, and for a lone stream
 * it is recorded (prerecorded) while the GPU still runs the chunk being read.
 */

import { checkDevice, stagingFor } from "../device.ts";
import { encodeOps } from "../ops.ts";
import { REMAP_NEW, REMAP_WORDS } from "../kernels/decode.ts";
import { LP_WORDS, PARAM_WORDS, STATE_WORDS } from "../kernels/sample.ts";
import type { StepTiming, StreamOutput, TokenLogprobs } from "./gen_types.ts";
import type { GenBuffers } from "./gen_buffers.ts";
import type { KvSlots, Pending } from "./kv_slots.ts";
import type { PrefillPlans } from "./prefill_plans.ts";
import type { DecodePlans } from "./decode_plans.ts";

/** A chunk queued on the GPU whose results are not read yet. */
interface Chunk {
  /** What it produced: the rows' state, their tokens, and their logprobs when any row asked. */
  staging: GPUBuffer;
  /** Byte offsets of those three in `staging`. */
  offsets: number[];
  /**
   * The streams of its rows, with their epoch (a stream released since has a newer one) and the
   * tokens queued for each.
   */
  rows: { slot: number; epoch: number; tokens: number }[];
  /** Each row's logprobs + 1 (0: none). */
  nlp: number[];
  wantLp: boolean;
  /** Decode steps it ran. */
  steps: number;
  /** Read back through `GeneratorOptions.readback`'s canvas path (staging is a COPY_SRC buffer). */
  fast: boolean;
}

/** What a chunk reads back, and how (see #chunkOutput). */
interface ChunkOutput {
  staged: ReturnType<typeof stagingFor>;
  nlp: number[];
  wantLp: boolean;
  fast: boolean;
}

/** A chunk of decode steps recorded ahead, to be submitted while the rows are as they were. */
interface Recorded {
  commands: GPUCommandBuffer;
  rows: number[];
  src: number[];
  steps: number;
  out: ChunkOutput;
}

/** Queues chunks for the rows of `slots`, runs ahead, and reads what they produced. */
export class ChunkScheduler {
  /** Where the last `step` spent its time. */
  timing: StepTiming = { encodeMs: 0, waitMs: 0, mapMs: 0, steps: 0, blocked: false };
  #buf: GenBuffers;
  #slots: KvSlots;
  #prefill: PrefillPlans;
  #decode: DecodePlans;
  /** Chunks queued and not read back, oldest first. */
  #inflight: Chunk[] = [];
  /**
   * The rest of a chunk run ahead (its later steps and its copy into the staging buffer), queued
   * a piece at a time from a timer (`#schedule`), the remainder by `flush` when the generator is
   * next used, so a step returns soon after its readback (see `step`).
   */
  #rest: (() => boolean) | null = null;
  /**
   * The chunk a step read through the canvas path is to run ahead (its `ahead` and whether it
   * admitted), queued by `runAhead` once the caller has handed out the tokens, or before anything
   * else is queued or read.
   */
  #later: { ahead: number; admitted: boolean } | null = null;
  /** That chunk, recorded while the GPU ran the one being read (GeneratorOptions.prerecord). */
  #recorded: Recorded | null = null;
  #timer: ReturnType<typeof setTimeout> | null = null;

  constructor(buf: GenBuffers, slots: KvSlots, prefill: PrefillPlans, decode: DecodePlans) {
    this.#buf = buf;
    this.#slots = slots;
    this.#prefill = prefill;
    this.#decode = decode;
  }

  /**
   * The body of Generator.step (its arguments checked): prefills `pending` (taken from the slots'
   * queue before anything else), runs `steps` decode steps and reads back every chunk queued.
   */
  async step(pending: Pending[], steps: number, ahead: number): Promise<Map<number, StreamOutput>> {
    const rows = this.#slots.rows;
    await this.flush();
    this.#slots.adopt(pending);
    const t0 = performance.now();
    if (rows.length > 0 && (pending.length > 0 || this.#inflight.length === 0)) {
      await this.#submitChunk(pending, steps);
    }
    const t1 = performance.now();
    const chunks = this.#inflight.splice(0);
    const admitted = pending.length > 0;
    if (chunks.length > 0 && chunks.every((c) => c.fast)) {
      return await this.#stepFast(chunks, ahead, t0, t1, admitted);
    }
    // The first mapAsync blocks until the GPU has run everything queued; the rest find it done.
    const maps = chunks.map((c) => c.fast ? null : c.staging.mapAsync(GPUMapMode.READ));
    const t2 = performance.now();
    if (ahead > 0 && rows.length > 0) {
      const n = this.#aheadSteps(ahead);
      if (n > 0) await this.#submitChunk([], n, true, admitted);
    }
    const t3 = performance.now();
    const res = new Map<number, StreamOutput>();
    try {
      await Promise.all(maps);
      checkDevice(this.#buf.ctx);
      for (const c of chunks) {
        this.#collect(
          c,
          c.fast ? await this.#buf.opts.readback!.read(c.staging) : c.staging.getMappedRange(),
          res,
        );
      }
    } finally {
      for (const c of chunks) c.staging.destroy();
    }
    this.timing = {
      encodeMs: t1 - t0 + (t3 - t2),
      waitMs: performance.now() - t3 + (t2 - t1),
      mapMs: t2 - t1,
      steps: chunks.reduce((a, c) => a + c.steps, 0),
      blocked: chunks.some((c) => c.fast),
    };
    return res;
  }

  /**
   * The end of `step` when its chunks are read through the canvas path, which waits for the GPU on
   * this thread: the chunks are read first and the chunk run ahead is left for `runAhead`, so
   * nothing queued behind the copy delays the read and its encoding does not delay the tokens.
   */
  async #stepFast(
    chunks: Chunk[],
    ahead: number,
    t0: number,
    t1: number,
    admitted: boolean,
  ): Promise<Map<number, StreamOutput>> {
    const res = new Map<number, StreamOutput>();
    const bufs: ArrayBuffer[] = [];
    const rows = this.#slots.rows, opts = this.#buf.opts;
    // The next chunk of a lone stream, recorded while the GPU runs these (GeneratorOptions.prerecord).
    const n = ahead > 0 && !admitted && rows.length > 0 ? this.#aheadSteps(ahead) : 0;
    if (opts.prerecord && n > 0 && chunks.reduce((a, c) => a + c.steps, 0) >= n) {
      this.#recorded = this.#record(n);
    }
    const tr = performance.now();
    try {
      for (const c of chunks) bufs.push(await opts.readback!.read(c.staging));
    } finally {
      for (const c of chunks) c.staging.destroy();
    }
    const t2 = performance.now();
    // The chunk run ahead is queued by runAhead, once the caller has handed these tokens out.
    if (ahead > 0 && rows.length > 0) this.#later = { ahead, admitted };
    chunks.forEach((c, i) => this.#collect(c, bufs[i], res));
    this.timing = {
      encodeMs: t1 - t0 + (tr - t1),
      waitMs: t2 - tr,
      mapMs: 0,
      steps: chunks.reduce((a, c) => a + c.steps, 0),
      blocked: true,
    };
    return res;
  }

  /**
   * Queues one chunk: the state remap (rows moved, new rows' state, padding rows and the spare row
   * reset), the pending prompts' prefill, `steps` decode steps, and the copy of what the chunk
   * produced into its own staging buffer for a later readback.
   */
  async #submitChunk(pending: Pending[], steps: number, defer = false, afterAdmit = false): Promise<void> {
    const { ctx, state, prevState, opts } = this.#buf, slots = this.#slots;
    const R = slots.rows.length, Rb = this.#decode.bucket(R);
    const dev = ctx.device, q = dev.queue;
    this.#writeRemap(pending);
    const remap = await this.#decode.remap();
    const enc = dev.createCommandEncoder();
    enc.copyBufferToBuffer(state, 0, prevState, 0, state.size);
    encodeOps(enc, [remap]);
    q.submit([enc.finish()]);
    slots.src = slots.rows.map((_, r) => r);
    for (const batch of this.#prefill.batches(pending)) await this.#prefill.submit(batch);
    const ops = steps > 0 ? await this.#decode.plan(Rb) : [], every = opts.submitEvery;
    const out = this.#chunkOutput(R === 1 || pending.length > 0 || afterAdmit);
    let next = 0;
    /** Queues the next `submitEvery` steps in one submission, or the copy once all are; true when done. */
    const piece = (): boolean => {
      const e = dev.createCommandEncoder();
      const done = next >= steps;
      if (done) out.staged.copy(e);
      for (const end = Math.min(steps, next + every); next < end; next++) encodeOps(e, ops);
      q.submit([e.finish()]);
      return done;
    };
    if (defer) {
      piece();
      this.#rest = piece;
      this.#schedule();
    } else while (!piece());
    this.#book(steps, pending, out);
  }

  /**
   * Writes the state remap's table for the rows as they stand (each from its source row, or a new
   * stream's state from `pending`; padding rows and the spare row reset) and the rows' sampling.
   */
  #writeRemap(pending: Pending[]): void {
    const { rows, src, paramsCpu } = this.#slots;
    const R = rows.length, Rb = this.#decode.bucket(R), N = this.#buf.opts.maxStreams + 1;
    const fresh = new Map(pending.map((p) => [p.slot, p.state]));
    const table = new Uint32Array(N * REMAP_WORDS);
    for (let j = 0; j < N; j++) {
      const e = j * REMAP_WORDS;
      if (j < R && src[j] >= 0) table[e] = src[j];
      else if (j < R) {
        table[e] = REMAP_NEW;
        table.set(fresh.get(rows[j])!, e + STATE_WORDS);
      } // Padding rows and the spare row: greedy, in the scratch slot at position 0.
      else if (j < Rb || j === N - 1) table[e] = REMAP_NEW;
      else table[e] = j;
    }
    paramsCpu.fill(0, R * PARAM_WORDS, Rb * PARAM_WORDS);
    const q = this.#buf.ctx.device.queue;
    q.writeBuffer(this.#buf.table, 0, table);
    q.writeBuffer(this.#buf.sampling, 0, paramsCpu);
  }

  /** What a chunk over the rows as they stand reads back (their state, tokens, logprobs if any asked), and how. */
  #chunkOutput(urgent: boolean): ChunkOutput {
    const { ctx, opts } = this.#buf, { rows, paramsCpu } = this.#slots;
    const R = rows.length, chunk = opts.chunk;
    const nlp = rows.map((_, r) => paramsCpu[r * PARAM_WORDS + 3]);
    const wantLp = nlp.some((n) => n > 0);
    const ranges = [
      { buffer: this.#buf.state, bytes: R * STATE_WORDS * 4 },
      { buffer: this.#buf.out, bytes: R * chunk * 4 },
      ...(wantLp ? [{ buffer: this.#buf.lp, bytes: R * chunk * LP_WORDS * 4 }] : []),
    ];
    // Through the canvas: a lone stream's chunks, the chunk that carries admitted prompts' first
    // tokens (requests wait on them) and the short one run ahead of it (so that requests arriving
    // next are not held behind a mapAsync). Otherwise mapAsync, whose chunk run ahead keeps the GPU
    // busier (H200, 124M, 16 streams over HTTP: 2,389 tokens/s with every chunk read through the
    // canvas, 7,338 with mapAsync).
    const fast = urgent && opts.readback?.pathFor(ranges.reduce((a, r) => a + r.bytes, 0)) === "canvas";
    const staged = stagingFor(
      ctx,
      ranges,
      fast ? GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST : undefined,
    );
    return { staged, nlp, wantLp, fast };
  }

  /** Books a chunk just queued: the tokens queued for its rows, and the chunk to read. */
  #book(steps: number, pending: Pending[], out: ChunkOutput): void {
    const { rows, queued, epochs } = this.#slots;
    const isNew = new Set(pending.map((p) => p.slot));
    const booked = rows.map((slot) => ({
      slot,
      epoch: epochs[slot],
      tokens: steps + (isNew.has(slot) ? 1 : 0),
    }));
    for (const r of booked) queued[r.slot] += r.tokens;
    this.#inflight.push({
      staging: out.staged.buffer,
      offsets: out.staged.offsets,
      rows: booked,
      nlp: out.nlp,
      wantLp: out.wantLp,
      steps,
      fast: out.fast,
    });
  }

  /**
   * Records (and finishes, without submitting) a chunk of `steps` decode steps for the rows as they
   * stand, with its state remap and its copy for the readback; null when its plans are not built.
   */
  #record(steps: number): Recorded | null {
    const { rows, src } = this.#slots, { ctx, state, prevState } = this.#buf;
    const R = rows.length, ops = this.#decode.built(this.#decode.bucket(R)), remap = this.#decode.builtRemap;
    if (R === 0 || steps < 1 || !ops || !remap) return null;
    const out = this.#chunkOutput(R === 1);
    const enc = ctx.device.createCommandEncoder();
    enc.copyBufferToBuffer(state, 0, prevState, 0, state.size);
    encodeOps(enc, [remap]);
    for (let i = 0; i < steps; i++) encodeOps(enc, ops);
    out.staged.copy(enc);
    return { commands: enc.finish(), rows: [...rows], src: [...src], steps, out };
  }

  /**
   * Queues one more piece of the chunk run ahead from a timer, so the pieces go to the GPU while
   * `step` awaits its readback and while the caller handles the tokens.
   */
  #schedule(): void {
    this.#timer = setTimeout(() => {
      this.#timer = null;
      if (this.#rest?.()) this.#rest = null;
      else if (this.#rest) this.#schedule();
    }, 0);
  }

  /** The rest of the chunk run ahead, taken from the timer (null when none is left). */
  #takeRest(): (() => boolean) | null {
    if (this.#timer !== null) clearTimeout(this.#timer);
    this.#timer = null;
    const rest = this.#rest;
    this.#rest = null;
    return rest;
  }

  /**
   * Queues the chunk run ahead that the last step left for later (see `runAhead`) and what is left
   * of one queued a piece at a time, if any (before anything else is queued or read).
   */
  async flush(): Promise<void> {
    await this.runAhead();
    const rest = this.#takeRest();
    if (rest) { while (!rest()); }
  }

  /**
   * Queues the chunk the last step read through the canvas path is to run ahead, if any (see
   * Generator.runAhead).
   */
  async runAhead(): Promise<void> {
    const later = this.#later, rec = this.#recorded, slots = this.#slots;
    this.#later = null;
    this.#recorded = null;
    if (!later || slots.rows.length === 0) {
      rec?.out.staged.buffer.destroy();
      return;
    }
    const n = this.#aheadSteps(later.ahead);
    const same = (a: number[], b: number[]) => a.length === b.length && a.every((x, i) => x === b[i]);
    if (rec && rec.steps === n && same(rec.rows, slots.rows) && same(rec.src, slots.src)) {
      // Recorded while the GPU ran the last chunk: only its table and the submission are left.
      this.#writeRemap([]);
      this.#buf.ctx.device.queue.submit([rec.commands]);
      slots.src = slots.rows.map((_, r) => r);
      this.#book(n, [], rec.out);
      return;
    }
    rec?.out.staged.buffer.destroy();
    if (n > 0) await this.#submitChunk([], n, true, later.admitted);
  }

  /** Steps a chunk run ahead gets: `ahead`, but no further than any row may still be asked for. */
  #aheadSteps(ahead: number): number {
    const slots = this.#slots;
    return Math.min(ahead, Math.max(0, ...slots.rows.map((slot) => slots.left(slot))));
  }

  /**
   * No stream is left: the rest of a chunk run ahead is not queued, and the chunks still queued
   * are not read (their staging buffers go once the GPU is done with them).
   */
  dropAhead(): void {
    this.#later = null;
    this.#recorded?.out.staged.buffer.destroy();
    this.#recorded = null;
    this.#takeRest();
    for (const c of this.#inflight.splice(0)) c.staging.destroy();
  }

  /**
   * Adds what chunk `c` produced (its staging buffer mapped as `buf`) to `res`, for streams still
   * running, each within what it may still be handed out (KvSlots.budget).
   */
  #collect(c: Chunk, buf: ArrayBuffer, res: Map<number, StreamOutput>): void {
    const chunk = this.#buf.opts.chunk, R = c.rows.length;
    const [stateAt, outAt, lpAt] = c.offsets;
    const state = new Uint32Array(buf, stateAt, R * STATE_WORDS);
    const out = new Uint32Array(buf, outAt, R * chunk);
    const lpf = c.wantLp ? new Float32Array(buf, lpAt, R * chunk * LP_WORDS) : null;
    const lpu = c.wantLp ? new Uint32Array(buf, lpAt, R * chunk * LP_WORDS) : null;
    const { epochs, budget, queued } = this.#slots;
    for (let r = 0; r < R; r++) {
      const { slot, epoch } = c.rows[r];
      if (epochs[slot] !== epoch) continue; // released since
      const n = Math.min(state[r * STATE_WORDS + 3], chunk, budget[slot]);
      budget[slot] -= n;
      queued[slot] -= c.rows[r].tokens;
      const tokens = Array.from(out.subarray(r * chunk, r * chunk + n));
      const nlp = c.nlp[r];
      let logprobs: TokenLogprobs[] | null = null;
      if (nlp > 0 && lpf && lpu) {
        logprobs = [];
        for (let i = 0; i < n; i++) {
          const o = (r * chunk + i) * LP_WORDS;
          const top = [];
          for (let k = 0; k < nlp - 1; k++) top.push({ id: lpu[o + 2 + 2 * k], logprob: lpf[o + 3 + 2 * k] });
          logprobs.push({ logprob: lpf[o], top });
        }
      }
      const have = res.get(slot);
      if (!have) res.set(slot, { tokens, logprobs, left: budget[slot] });
      else {
        have.tokens.push(...tokens);
        if (logprobs) have.logprobs = [...(have.logprobs ?? []), ...logprobs];
        have.left = budget[slot];
      }
    }
  }
}
