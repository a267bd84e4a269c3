/**
 * Generation inside a GPU Worker. One engine per loaded model holds a gpu/ Generator with a few
 * stream slots; requests for that model take a free slot (prefill), and all active slots are
 * decoded together, a chunk of tokens per submission, each chunk posted as it arrives. A request
 * ends at its token budget, at `<|endoftext|>`, or when cancelled (checked between chunks).
 *
 * Engines run on their own async loop next to a training job: both await the GPU, so the event
 * loop alternates between training steps and generation chunks, and neither waits for the other
 * to finish. Idle engines beyond `maxModels` are unloaded when another model is needed.
 */

import { EOT_TOKEN } from "../gpu/config.ts";
import type { GpuContext } from "../gpu/device.ts";
import { Generator } from "../gpu/generator.ts";
import type { FromWorker, FromWorkerGeneration, WorkerGeneration } from "./messages.ts";
import { loadWeights } from "./model_source.ts";

/** Sizing of each engine. */
export interface GenerationServiceOptions {
  /** Stream slots decoded together per model. */
  streams: number;
  /** Tokens per stream per submission. */
  chunk: number;
  /** Models kept loaded when idle. */
  maxModels: number;
}

/** Defaults: four concurrent streams per model, sixteen tokens per submission, two models loaded. */
export const DEFAULT_GENERATION_OPTIONS: GenerationServiceOptions = { streams: 4, chunk: 16, maxModels: 2 };

type Done = Extract<FromWorkerGeneration, { type: "gen_done" }>;

interface Active {
  req: WorkerGeneration;
  produced: number;
  cancelled: boolean;
}

/** One model on the GPU and the requests using it. */
class Engine {
  readonly key: string;
  #ctx: GpuContext;
  #post: (msg: FromWorker) => void;
  #opts: GenerationServiceOptions;
  #gen: Promise<Generator>;
  #loadMs = 0;
  #waiting: WorkerGeneration[] = [];
  #slots: (Active | null)[];
  #running = false;
  #dead = false;
  #onIdle: () => void;

  constructor(
    ctx: GpuContext,
    first: WorkerGeneration,
    post: (msg: FromWorker) => void,
    opts: GenerationServiceOptions,
    onIdle: () => void,
  ) {
    this.key = keyOf(first);
    this.#ctx = ctx;
    this.#post = post;
    this.#opts = opts;
    this.#onIdle = onIdle;
    this.#slots = new Array(opts.streams).fill(null);
    const t0 = performance.now();
    this.#gen = loadWeights(first.model).then((params) =>
      Generator.create(ctx, first.model.config, params, { streams: opts.streams, chunk: opts.chunk })
    ).then((g) => {
      this.#loadMs = performance.now() - t0;
      return g;
    });
    this.#gen.catch(() => {}); // reported through the requests waiting on it
  }

  /** Whether this engine can take requests (its device alive, its load not failed). */
  get usable(): boolean {
    return !this.#dead && !this.#ctx.lostReason;
  }

  get idle(): boolean {
    return !this.#running && this.#waiting.length === 0;
  }

  add(req: WorkerGeneration): void {
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
    const a = this.#slots.find((s) => s?.req.id === id);
    if (a) a.cancelled = true;
    return a !== undefined;
  }

  async destroy(): Promise<void> {
    this.#dead = true;
    (await this.#gen.catch(() => null))?.destroy();
  }

  #done(id: string, reason: Done["reason"], error: string | null, completion_tokens: number): void {
    this.#post({ type: "gen_done", id, reason, error, completion_tokens });
  }

  async #run(): Promise<void> {
    this.#running = true;
    try {
      const gen = await this.#gen;
      while (this.#waiting.length > 0 || this.#slots.some((s) => s !== null)) await this.#step(gen);
    } catch (e) {
      this.#dead = true;
      const message = (e as Error).message || String(e);
      for (const r of this.#waiting.splice(0)) this.#done(r.id, "error", message, 0);
      for (const [i, s] of this.#slots.entries()) {
        if (s) this.#done(s.req.id, "error", message, s.produced);
        this.#slots[i] = null;
      }
    } finally {
      this.#running = false;
      this.#onIdle();
    }
  }

  /** Admits waiting requests into free slots, decodes one chunk, posts what each stream produced. */
  async #step(gen: Generator): Promise<void> {
    const chunk = this.#opts.chunk;
    for (const [i, s] of this.#slots.entries()) {
      if (s?.cancelled) {
        this.#done(s.req.id, "cancelled", null, s.produced);
        this.#slots[i] = null;
      }
    }
    let prefilled = false;
    for (let i = 0; i < this.#slots.length && this.#waiting.length > 0; i++) {
      if (this.#slots[i]) continue;
      const req = this.#waiting.shift()!;
      try {
        await gen.prefill(i, req.prompt, req);
      } catch (e) {
        this.#done(req.id, "error", (e as Error).message, 0);
        continue;
      }
      this.#slots[i] = { req, produced: 0, cancelled: false };
      this.#post({ type: "gen_started", id: req.id, load_ms: this.#loadMs });
      prefilled = true;
    }
    const active = this.#slots.filter((s): s is Active => s !== null);
    if (active.length === 0) return;
    // After a prefill, read its first token back at once (time to first token); otherwise enough
    // steps for the stream needing most, within one chunk.
    const need = Math.max(...active.map((s) => s.req.max_tokens - s.produced));
    const steps = prefilled ? 0 : Math.max(0, Math.min(chunk, need));
    const out = await gen.decode(steps);
    for (const [i, s] of this.#slots.entries()) {
      if (!s) continue;
      if (s.cancelled) {
        this.#done(s.req.id, "cancelled", null, s.produced);
        this.#slots[i] = null;
        continue;
      }
      const room = s.req.max_tokens - s.produced;
      let tokens = Array.from(out[i].subarray(0, room));
      const eos = s.req.stop_at_eos ? tokens.indexOf(EOT_TOKEN) : -1;
      if (eos >= 0) tokens = tokens.slice(0, eos);
      s.produced += tokens.length;
      if (tokens.length > 0) this.#post({ type: "gen_tokens", id: s.req.id, tokens });
      if (eos >= 0 || s.produced >= s.req.max_tokens) {
        this.#done(s.req.id, eos >= 0 ? "eos" : "length", null, s.produced);
        this.#slots[i] = null;
      }
    }
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
  #engines = new Map<string, Engine>();
  /** Cancels that arrived while their request was still being routed to an engine. */
  #early = new Set<string>();

  /** `open` returns the Worker's device (opening it again if lost); `post` sends to the HTTP thread. */
  constructor(
    open: () => Promise<GpuContext>,
    post: (msg: FromWorker) => void,
    opts: GenerationServiceOptions = DEFAULT_GENERATION_OPTIONS,
  ) {
    this.#open = open;
    this.#post = post;
    this.#opts = opts;
  }

  /** Starts a request on its model's engine, loading the model first if needed. */
  async generate(req: WorkerGeneration): Promise<void> {
    const key = keyOf(req);
    let engine = this.#engines.get(key);
    if (engine && !engine.usable && engine.idle) {
      this.#engines.delete(key);
      await engine.destroy();
      engine = undefined;
    }
    if (!engine) {
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
      engine = new Engine(ctx, req, this.#post, this.#opts, () => this.#evict(this.#opts.maxModels));
      this.#engines.set(key, engine);
    }
    if (this.#early.delete(req.id)) {
      this.#post({ type: "gen_done", id: req.id, reason: "cancelled", error: null, completion_tokens: 0 });
      return;
    }
    engine.add(req);
  }

  /** Cancels a request wherever it is; a request already finished is ignored. */
  cancel(id: string): void {
    for (const e of this.#engines.values()) if (e.cancel(id)) return;
    if (this.#early.size > 1000) this.#early.clear(); // cancels of finished requests land here too
    this.#early.add(id);
  }

  /** Unloads every model. */
  async destroy(): Promise<void> {
    for (const e of this.#engines.values()) await e.destroy();
    this.#engines.clear();
  }

  /** Unloads idle engines while more than `limit` are loaded (oldest first), and broken idle ones. */
  async #evict(limit: number): Promise<void> {
    for (const [key, e] of this.#engines) {
      if (!e.idle) continue;
      if (this.#engines.size > limit || !e.usable) {
        this.#engines.delete(key);
        await e.destroy();
      }
    }
  }
}
