/**
 * Generation inside a GPU Worker, with continuous batching. One batcher per loaded model holds a
 * Generator (engine/generator.ts: up to `maxStreams` streams, its KV cache grown by need). At every
 * step the batcher drops cancelled streams, admits waiting requests into free slots (batching.ts),
 * and runs their prefill and a chunk of decode steps for all streams in one go, posting each
 * stream's tokens as they arrive. A request ends at its token budget, at `<|endoftext|>`, or when
 * cancelled (the slot is freed at the next step). Requests beyond the slots wait in order.
 *
 * Beside training on the same GPU: the train loop asks `busy` after each step; while generation
 * is busy it keeps one step in flight and hands the GPU over through `turn`, which returns after
 * generation has had its share of the time, so neither side's readback waits on a deep queue of
 * the other's work. Idle batchers beyond `maxModels` are unloaded, least recently used first.
 * The warm-up at a load and the answer to the server's start-up rehearsal live in warm_up.ts.
 */

import { EOT_TOKEN } from "../model/config.ts";
import { describeDevice, type GpuContext } from "../engine/device.ts";
import { Generator, isCpuAdapter } from "../engine/generator.ts";
import { createReadback, type Readback } from "../engine/readback.ts";
import { compileReporter } from "./compile_report.ts";
import {
  epochMs,
  type FromWorker,
  type FromWorkerGeneration,
  type WorkerGeneration,
  type WorkerLogprobs,
} from "../protocol.ts";
import { loadWeights } from "../checkpoint/model_source.ts";
import { planStep, type SchedulerLimits } from "./batching.ts";
import { answerRehearsal, warmAtLoad, warmDeferred } from "./warm_up.ts";

/** Sizing of each batcher. */
export interface GenerationServiceOptions extends SchedulerLimits {
  /** Most streams decoded together per model. */
  maxStreams: number;
  /** Models kept loaded when idle. */
  maxModels: number;
  /** Share of GPU time training keeps while generations run beside it (0 … 1). */
  trainShare: number;
  /**
   * Queue the next chunk of decode steps before handing out the tokens of the last one (see
   * Generator.step's `ahead`): the GPU keeps decoding through the readback's latency. Unset: on
   * GPUs only (a CPU adapter runs work as it is submitted, so running ahead there mostly delays
   * the tokens already read: the demo's first token came after 529 ms instead of 320).
   */
  runAhead?: boolean;
  /**
   * Most ms an idle batcher waits before its first step, so requests sent together (a burst of
   * users, or `n` choices) are prefilled together rather than one first and the rest a chunk
   * later. With `inbox` it waits only while requests are on their way to the thread, so a lone
   * request does not wait; without, a millisecond at a time until one passes with none.
   */
  admitWindowMs: number;
  /** The driver's shader cache is disabled (MESA_SHADER_CACHE_DISABLE): said in compile reports. */
  driverCacheDisabled?: boolean;
  /**
   * Read each chunk's tokens back through the canvas path where it works (engine/readback.ts: well
   * under a millisecond on an H200 against mapAsync's 10 ms floor); default true,
   * GPT2_FAST_READBACK=0 turns it off.
   */
  fastReadback?: boolean;
  /**
   * Get ready for every request when the model loads (Generator.warm): compile the decode kernels
   * of every batch size and every prefill shape, allocate the KV cache for `maxStreams` streams
   * (as much of it as fits), and run each plan once, so the first request at any concurrency or
   * prompt length finds nothing to compile, allocate or launch for the first time. Default: on
   * GPUs (an H200 with an empty driver cache: about 85 ms a pipeline, one at a time); CPU adapters
   * compile far slower, so there each kernel compiles on first use and the cache grows by need.
   */
  warmAtLoad?: boolean;
  /**
   * Messages posted to this thread and not taken in yet (worker/gpu_worker.ts counts them through
   * the shared flags). With it, serving waits for the event loop (a timer, about 2 ms in Deno)
   * only when one is on its way; without it, whenever a readback blocked the thread and to gather
   * a burst.
   */
  inbox?: () => number;
  /**
   * Blocks this thread until a message is posted to it or `ms` pass (Atomics.wait on the shared
   * counter behind `inbox`); returns whether one was. With `admitQuietMs`, an idle batcher's
   * gathering uses it to tell a lone request from the first of a burst.
   */
  awaitPosted?: (ms: number) => boolean;
  /**
   * How long an idle batcher that has taken in a request waits for the next one of a burst before
   * its first step (ms; default 1, 0 for none, GPT2_GEN_ADMIT_QUIET_MS): a lone request pays it
   * once; requests of a burst arriving within it of each other are prefilled together, up to
   * admitWindowMs in all.
   */
  admitQuietMs?: number;
  /**
   * Most ms training waits, after a step, for a model that is loading beside it (GPT2_GEN_LOAD_HOLD_MS,
   * default 20 s): a load is one-off work of many short GPU rounds (the warm-up runs each plan
   * once), and each would otherwise queue behind a whole training step (H200, 345M training: a
   * 124M model's first token came 13 s after its request).
   */
  loadHoldMs?: number;
}

/**
 * Defaults: 64 streams per model, 32 tokens per step (4 when admitting; a readback costs about
 * 10 ms on a real GPU, so fewer, longer steps; on GPUs each is queued while the one before is read back)
 * and at most 250 ms per step, 2048 prompt tokens prefilled per step, an idle batcher gathering a
 * burst for up to 4 ms while its requests come within 1 ms of each other, two models loaded,
 * training keeps 70% of a shared GPU.
 */
/** A training step this recent means a job trains on this GPU (see GenerationService.trainingStep). */
const TRAINING_RECENT_MS = 10_000;

export const DEFAULT_GENERATION_OPTIONS: GenerationServiceOptions = {
  maxStreams: 64,
  chunk: 32,
  firstChunk: 4,
  prefillTokens: 2048,
  stepBudgetMs: 250,
  maxModels: 2,
  trainShare: 0.7,
  admitWindowMs: 4,
  admitQuietMs: 1,
  loadHoldMs: 20_000,
};

/**
 * Resolves in a later task (a message on a channel: unlike a timer, never clamped to 4 ms when
 * nested), so the event loop runs what is queued first.
 */
function nextTask(): Promise<void> {
  const { port1, port2 } = new MessageChannel();
  return new Promise((resolve) => {
    port1.onmessage = () => {
      port1.close();
      resolve();
    };
    port2.postMessage(null);
  });
}

type Done = Extract<FromWorkerGeneration, { type: "gen_done" }>;

interface Active {
  req: WorkerGeneration;
  handle: number;
  /** Tokens posted to the client (its completion_tokens); the generator counts max_tokens. */
  sent: number;
  cancelled: boolean;
}

/** One model on the GPU and the requests using it: the continuous-batching loop of that model. */
class Batcher {
  readonly key: string;
  #ctx: GpuContext;
  #post: (msg: FromWorker) => void;
  #opts: GenerationServiceOptions;
  #gen: Promise<Generator>;
  #loadMs = 0;
  /** Requests that arrived before the model was loaded: only they report its load time. */
  #waitedForLoad = new Set<string>();
  /** Until the model is loaded (or its load failed), and again while a deferred warm-up runs. */
  #loading = true;
  /** Settles when the load (or the deferred warm-up) is done. */
  #ready: Promise<unknown>;
  /**
   * The full warm-up, deferred at a load beside training until the batcher is first idle; until it
   * is done the batcher counts as loading (training's turn waits for it, bounded).
   */
  #warmLater: PromiseWithResolvers<void> | null = null;
  #waiting: WorkerGeneration[] = [];
  #active: Active[] = [];
  #running = false;
  /** Reads the chunks back (engine/readback.ts), made with the generator. */
  #readback: Readback | null = null;
  #dead = false;
  #onIdle: () => void;
  #onStep: (ms: number) => void;
  /** Whether steps run ahead of their readback (GenerationServiceOptions.runAhead). */
  #runAhead: boolean;
  /** Measured ms per decode step (moving average), for the scheduler's time budget. */
  #msPerStep: number | undefined;

  constructor(
    ctx: GpuContext,
    first: WorkerGeneration,
    post: (msg: FromWorker) => void,
    opts: GenerationServiceOptions,
    hooks: { idle: () => void; step: (ms: number) => void; training: () => boolean },
  ) {
    this.key = keyOf(first);
    this.#ctx = ctx;
    this.#post = post;
    this.#opts = opts;
    this.#runAhead = opts.runAhead ?? !isCpuAdapter(ctx);
    this.#onIdle = hooks.idle;
    this.#onStep = hooks.step;
    const t0 = performance.now();
    const build = JSON.stringify({
      generate: first.model.config,
      streams: opts.maxStreams,
      chunk: opts.chunk,
      prefill: opts.prefillTokens,
    });
    this.#gen = Promise.all([
      loadWeights(first.model),
      compileReporter({
        root: first.root ?? null,
        adapter: ctx.adapterInfo.description || ctx.adapterInfo.vendor,
        description: describeDevice(ctx),
        build,
        cacheDisabled: opts.driverCacheDisabled ?? false,
        send: (r) => post({ type: "compile", id: null, model: first.model.id, ...r }),
      }),
      createReadback(ctx, { canvas: opts.fastReadback ?? true }),
    ]).then(([params, onCompile, readback]) => {
      this.#readback = readback;
      return Generator.create(ctx, first.model.config, params, {
        maxStreams: opts.maxStreams,
        chunk: opts.chunk,
        prefillTokens: opts.prefillTokens,
        onCompile,
        readback,
      });
    }).then(async (g) => {
      // Every kernel before the first request, or beside training the rest once idle (warm_up.ts).
      const warmed = await warmAtLoad(ctx, g, { warmAtLoad: opts.warmAtLoad, training: hooks.training() });
      if (warmed === "deferred") this.#warmLater = Promise.withResolvers<void>();
      this.#loadMs = performance.now() - t0;
      return g;
    });
    // Errors reach the requests waiting on the load.
    this.#ready = this.#gen.catch(() => {}).then(() => {
      this.#loading = false;
      return this.#warmLater?.promise;
    });
  }

  /** Whether the model is still loading (or finishing a deferred warm-up); `loaded` settles when it is done. */
  get loading(): boolean {
    return this.#loading || this.#warmLater !== null;
  }

  get loaded(): Promise<unknown> {
    return this.#ready;
  }

  /** The deferred warm-up, with the batcher idle: requests arriving meanwhile wait for it, as at a load. */
  async #warmDeferred(gen: Generator): Promise<void> {
    const later = this.#warmLater!;
    try {
      await warmDeferred(gen);
    } finally {
      this.#warmLater = null;
      later.resolve();
    }
  }

  /** Whether this batcher can take requests (its device alive, its load not failed). */
  get usable(): boolean {
    return !this.#dead && !this.#ctx.lostReason;
  }

  get idle(): boolean {
    return !this.#running && this.#waiting.length === 0;
  }

  add(req: WorkerGeneration): void {
    if (this.#loadMs === 0) this.#waitedForLoad.add(req.id);
    this.#waiting.push(req);
    if (!this.#running) this.#run();
  }

  /** Cancels request `id` if it is here; returns whether it was. */
  cancel(id: string): boolean {
    const w = this.#waiting.findIndex((r) => r.id === id);
    if (w >= 0) {
      this.#waiting.splice(w, 1);
      this.#done(id, "cancelled", null, 0);
      return true;
    }
    const a = this.#active.find((s) => s.req.id === id);
    if (a) a.cancelled = true;
    return a !== undefined;
  }

  async destroy(): Promise<void> {
    this.#dead = true;
    (await this.#gen.catch(() => null))?.destroy();
    this.#readback?.destroy();
  }

  #done(id: string, reason: Done["reason"], error: string | null, completion_tokens: number): void {
    this.#waitedForLoad.delete(id);
    this.#post({ type: "gen_done", id, reason, error, completion_tokens });
  }

  /**
   * Waits while requests keep arriving: a millisecond at a time, until one passes with no new
   * request or admitWindowMs is over. Only a timer lets messages from the GPU host in: a
   * MessageChannel round trip did not (H200: requests sent together were admitted 140 ms apart).
   */
  async #gather(): Promise<void> {
    const end = performance.now() + this.#opts.admitWindowMs;
    const sleep = () => new Promise((r) => setTimeout(r, Math.min(1, Math.max(0, end - performance.now()))));
    if (this.#inbox() !== null) {
      const quiet = this.#opts.admitQuietMs ?? 0, posted = this.#opts.awaitPosted;
      for (;;) {
        // Requests already on their way to this thread (sent together): take them in.
        while ((this.#inbox() ?? 0) > 0 && performance.now() < end) await sleep();
        // The rest of a burst may still be on its way through the GPU host, a fraction of a
        // millisecond behind: wait that long for the next one on the shared counter (no turn of
        // the event loop, which costs a timer), and stop once none comes. Without it a burst's
        // first request was prefilled alone, the others waiting for that step (H200, 16 streams
        // sent together: 3-5 ms each).
        if (!posted || quiet <= 0 || performance.now() >= end || !posted(quiet)) return;
      }
    }
    for (let seen = -1; seen !== this.#waiting.length && performance.now() < end;) {
      seen = this.#waiting.length;
      await sleep();
    }
  }

  /** Messages on their way to this thread (GenerationServiceOptions.inbox), or null when nobody counts them. */
  #inbox(): number | null {
    const n = this.#opts.inbox?.();
    return n === undefined || n < 0 ? null : n;
  }

  async #run(): Promise<void> {
    this.#running = true;
    try {
      const gen = await this.#gen;
      for (;;) {
        if (this.#waiting.length === 0 && this.#active.length === 0) {
          if (!this.#warmLater) break;
          await this.#warmDeferred(gen);
          continue;
        }
        if (this.#active.length === 0 && this.#opts.admitWindowMs > 0) await this.#gather();
        // A step read through the canvas path waited on this thread and may never leave the
        // microtask queue: let messages (a cancel, a new request) in before the next, through a
        // timer (a MessageChannel round trip left them waiting until a lone stream had finished:
        // H200, requests joining a lone stream waited 140 ms), when one is on its way (inbox) or
        // none can tell. Otherwise a cheaper yield for timers.
        const blocked = await this.#step(gen);
        if (blocked && (this.#inbox() ?? 1) > 0) await new Promise((r) => setTimeout(r, 0));
        else await nextTask();
      }
    } catch (e) {
      this.#dead = true;
      const message = (e as Error).message || String(e);
      for (const r of this.#waiting.splice(0)) this.#done(r.id, "error", message, 0);
      for (const s of this.#active.splice(0)) this.#done(s.req.id, "error", message, s.sent);
    } finally {
      this.#running = false;
      this.#onIdle();
    }
  }

  #finish(gen: Generator, s: Active, reason: Done["reason"]): void {
    gen.release(s.handle);
    this.#active.splice(this.#active.indexOf(s), 1);
    this.#done(s.req.id, reason, null, s.sent);
  }

  /**
   * Drops cancelled streams, admits what fits, runs one step, posts what each stream produced.
   * Returns whether its readback waited on this thread (StepTiming.blocked).
   */
  async #step(gen: Generator): Promise<boolean> {
    for (const s of [...this.#active]) if (s.cancelled) this.#finish(gen, s, "cancelled");
    const plan = planStep(
      this.#waiting.map((r) => ({ promptTokens: r.prompt.length, maxTokens: r.max_tokens })),
      gen.free,
      this.#active.map((s) => gen.remaining(s.handle)),
      this.#opts,
      this.#msPerStep,
    );
    for (const req of this.#waiting.splice(0, plan.admit)) {
      const admitted_at = epochMs();
      try {
        const handle = await gen.admit(
          req.prompt,
          { ...req, logprobs: req.logprobs ?? undefined },
          req.max_tokens,
        );
        this.#active.push({ req, handle, sent: 0, cancelled: false });
        const { sent_at, relayed_at, received_at } = req;
        this.#post({
          type: "gen_started",
          id: req.id,
          load_ms: this.#waitedForLoad.delete(req.id) ? this.#loadMs : 0,
          stamps: { sent_at, relayed_at, received_at, admitted_at },
        });
      } catch (e) {
        this.#done(req.id, "error", (e as Error).message, 0);
      }
    }
    if (this.#active.length === 0) return false;
    const t0 = performance.now();
    const out = await gen.step(plan.steps, this.#runAhead ? plan.ahead : 0);
    const ms = performance.now() - t0, ran = gen.timing.steps;
    this.#onStep(ms);
    if (ran > 0 && plan.admit === 0) {
      const per = ms / ran;
      this.#msPerStep = this.#msPerStep === undefined ? per : 0.7 * this.#msPerStep + 0.3 * per;
    }
    for (const s of [...this.#active]) {
      const o = out.get(s.handle);
      if (!o) continue;
      if (s.cancelled) {
        this.#finish(gen, s, "cancelled");
        continue;
      }
      // The generator hands out at most max_tokens (admit's maxTokens); o.left is what remains.
      let tokens = o.tokens;
      const eos = s.req.stop_at_eos ? tokens.indexOf(EOT_TOKEN) : -1;
      if (eos >= 0) tokens = tokens.slice(0, eos);
      s.sent += tokens.length;
      if (tokens.length > 0) {
        const logprobs: WorkerLogprobs[] | undefined = o.logprobs?.slice(0, tokens.length).map((l) => ({
          logprob: l.logprob,
          top: l.top.map((t) => [t.id, t.logprob] as [number, number]),
        }));
        const first = s.sent === tokens.length ? { first_at: epochMs() } : {};
        this.#post({ type: "gen_tokens", id: s.req.id, tokens, ...(logprobs ? { logprobs } : {}), ...first });
      }
      if (eos >= 0 || o.left <= 0) this.#finish(gen, s, eos >= 0 ? "eos" : "length");
    }
    // The tokens are on their way: now the chunk the step runs ahead, when it left it for later.
    await gen.runAhead();
    return gen.timing.blocked;
  }
}

function keyOf(req: WorkerGeneration): string {
  return `${req.model.path}@${req.model.version}`;
}

/** The generation side of a GPU Worker. */
export class GenerationService {
  #open: () => Promise<GpuContext>;
  #post: (msg: FromWorker) => void;
  #opts: GenerationServiceOptions;
  /** Loaded batchers, least recently used first. */
  #batchers = new Map<string, Batcher>();
  /** Cancels that arrived while their request was still being routed to a batcher. */
  #early = new Set<string>();
  /** Generation time owed to training's turn, and who waits for it. */
  #turn: { left: number; resolve: () => void } | null = null;
  /** When training last handed over a turn (a job trains on this GPU if that was recent). */
  #trainedAt = -Infinity;

  /** `open` returns the Worker's device (opening it again if lost); `post` sends to the HTTP thread. */
  constructor(
    open: () => Promise<GpuContext>,
    post: (msg: FromWorker) => void,
    opts: Partial<GenerationServiceOptions> = {},
  ) {
    this.#open = open;
    this.#post = post;
    this.#opts = { ...DEFAULT_GENERATION_OPTIONS, ...opts };
  }

  /**
   * Whether a model is loaded here (idle or not): requests may come at any moment, and each waits
   * for the training steps queued before it on the GPU.
   */
  get resident(): boolean {
    return this.#batchers.size > 0;
  }

  /** Whether any model has requests running or waiting. */
  get busy(): boolean {
    for (const e of this.#batchers.values()) if (!e.idle) return true;
    return false;
  }

  /**
   * Training's hand-over after a step that took `trainMs`: resolves once generation has run for
   * its share (trainMs · (1 − trainShare) / trainShare, at most 2 s), or at once when idle.
   */
  /** Training took a step on this GPU: a model that loads while it does is loaded beside training. */
  trainingStep(): void {
    this.#trainedAt = performance.now();
  }

  turn(trainMs: number): Promise<void> {
    if (!this.busy) return Promise.resolve();
    const loads = [...this.#batchers.values()].filter((e) => e.loading && !e.idle).map((e) => e.loaded);
    if (loads.length > 0) {
      // A model loading for a waiting request has the GPU to itself until it is ready (bounded), then the share.
      let timer: ReturnType<typeof setTimeout> | undefined;
      const hold = new Promise((r) => timer = setTimeout(r, this.#opts.loadHoldMs ?? 20_000));
      return Promise.race([Promise.all(loads), hold]).then(() => {
        clearTimeout(timer);
        return this.#shareTurn(trainMs);
      });
    }
    return this.#shareTurn(trainMs);
  }

  #shareTurn(trainMs: number): Promise<void> {
    if (!this.busy) return Promise.resolve();
    this.#turn?.resolve();
    const share = Math.min(0.95, Math.max(0.05, this.#opts.trainShare));
    const left = Math.min(2000, (trainMs * (1 - share)) / share);
    return new Promise((resolve) => {
      // Never longer than the share plus a second (a model still loading takes no steps).
      const timer = setTimeout(() => this.#releaseTurn(), left + 1000);
      this.#turn = {
        left,
        resolve: () => {
          clearTimeout(timer);
          resolve();
        },
      };
    });
  }

  #stepped(ms: number): void {
    if (!this.#turn) return;
    this.#turn.left -= ms;
    if (this.#turn.left <= 0) this.#releaseTurn();
  }

  #releaseTurn(): void {
    const t = this.#turn;
    this.#turn = null;
    t?.resolve();
  }

  /** Starts a request on its model's batcher, loading the model first if needed. */
  async generate(req: WorkerGeneration): Promise<void> {
    req.received_at = epochMs();
    if (req.rehearsal === true) return answerRehearsal(this.#post, req, nextTask);
    const key = keyOf(req);
    let batcher = this.#batchers.get(key);
    if (batcher && !batcher.usable && batcher.idle) {
      this.#batchers.delete(key);
      await batcher.destroy();
      batcher = undefined;
    }
    if (!batcher) {
      let ctx: GpuContext;
      try {
        ctx = await this.#open();
      } catch (e) {
        this.#post({
          type: "gen_done",
          id: req.id,
          reason: "error",
          error: `Cannot open the GPU: ${(e as Error).message}`,
          completion_tokens: 0,
        });
        return;
      }
      await this.#evict(this.#opts.maxModels - 1);
      batcher = new Batcher(ctx, req, this.#post, this.#opts, {
        idle: () => {
          if (!this.busy) this.#releaseTurn();
          this.#evict(this.#opts.maxModels);
        },
        step: (ms) => this.#stepped(ms),
        training: () => performance.now() - this.#trainedAt < TRAINING_RECENT_MS,
      });
    }
    // Most recently used last.
    this.#batchers.delete(key);
    this.#batchers.set(key, batcher);
    if (this.#early.delete(req.id)) {
      this.#post({ type: "gen_done", id: req.id, reason: "cancelled", error: null, completion_tokens: 0 });
      return;
    }
    batcher.add(req);
  }

  /** Cancels a request wherever it is; a request already finished is ignored. */
  cancel(id: string): void {
    for (const e of this.#batchers.values()) if (e.cancel(id)) return;
    if (this.#early.size > 1000) this.#early.clear(); // cancels of finished requests land here too
    this.#early.add(id);
  }

  /** Unloads every model. */
  async destroy(): Promise<void> {
    for (const e of this.#batchers.values()) await e.destroy();
    this.#batchers.clear();
    this.#releaseTurn();
  }

  /** Unloads idle batchers while more than `limit` are loaded (least recently used first), and broken idle ones. */
  async #evict(limit: number): Promise<void> {
    for (const [key, e] of this.#batchers) {
      if (!e.idle) continue;
      if (this.#batchers.size > limit || !e.usable) {
        this.#batchers.delete(key);
        await e.destroy();
      }
    }
  }
}
