/**
 * The HTTP thread's side of generation: resolve the model, tokenize and fit the prompt (text or
 * token ids), pick the GPU (by role, preferring one not training, then the one already holding
 * the model, then the least loaded), hand the request to its Worker (n choices as n streams with
 * seeds seed, seed+1, …), and turn the token ids it posts back into text events: one per token
 * (with logprobs when asked), then a final event with the finish reason, token counts and
 * timings. Stop sequences are matched here (the Worker is then told to cancel); a client that
 * goes away cancels through `Generation.cancel()`; a request past its time limit ends with
 * "timeout". Requests waiting for a stream slot are capped (GenerationOverloadedError: 429).
 * `stats()` keeps vLLM-style serving statistics for /metrics.
 */

import { EOT_TOKEN } from "../../model/config.ts";
import { GpuUnavailableError, InvalidJobError } from "../../job/errors.ts";
import {
  epochMs,
  type FromWorkerGeneration,
  type GenerationStamps,
  type ModelSource,
  type WorkerGeneration,
  type WorkerLogprobs,
} from "../../protocol.ts";
import {
  listModelSources,
  type ModelInfo,
  modelSourceStamp,
  resolveModelSource,
} from "../../checkpoint/model_source.ts";
import { readChatTemplate } from "../../checkpoint/checkpoint.ts";
import { generationGpus, type GpuRoles } from "../gpus/roles.ts";
import type { GenerationReport, GpuPool } from "../gpus/gpu_pool.ts";
import { encodePrompt, fitPromptTokens, TextStream } from "./text_stream.ts";
import { Rehearsals } from "../rehearsal.ts";

/** A generation request, validated by the routes (ranges), not yet against the model. */
export interface GenerateParams {
  /** Model id: "<job id>", "<job id>/iter_N" or a directory name under models/. */
  model: string;
  /** Text, or GPT-2 token ids. */
  prompt: string | number[];
  /** New tokens at most; default min(64, context / 2). Must leave room for one prompt token. */
  max_tokens?: number;
  /** 0 is greedy. */
  temperature: number;
  /** 0 disables. */
  top_k: number;
  /** 1 disables. */
  top_p: number;
  /** Default: random (reported in the final event). */
  seed?: number;
  stop: string[];
  /** Keep going past `<|endoftext|>` (it then appears as text). */
  ignore_eos: boolean;
  /** Log-probabilities per token: null or absent for none, else the count of top ones (0 … 5). */
  logprobs?: number | null;
  /**
   * What a prompt too long for the context beside max_tokens names when it may not be cut (a
   * 400 naming this parameter); absent: the prompt is cut from the left, and the cut is reported.
   */
  whole?: string;
  /** When the request reached this process (performance.now()); default: when it is started. */
  arrived?: number;
  /**
   * A rehearsal of the request path (the server's start-up warm-up, server/rehearsal.ts): no model
   * is looked up and no GPU work is done; an idle GPU's Worker (or, with none ready, this process)
   * answers a few tokens of its own prompt, and nothing is counted in the statistics.
   */
  rehearsal?: boolean;
}

/** Why a generation ended. */
export type FinishReason = "length" | "stop" | "eos" | "cancelled" | "error" | "timeout";

/**
 * One generated token and the text it completed (may be empty while a character or stop is
 * pending). `id` is null for text released only at the end (held back for a stop sequence, or
 * an incomplete character, which becomes U+FFFD).
 */
export interface TokenEvent {
  type: "token";
  id: number | null;
  text: string;
  /** When asked for: this token's log-probability and the top ones as [id, logprob]. */
  logprobs?: WorkerLogprobs;
}

/** The last event of a generation. */
export interface DoneEvent {
  type: "done";
  finish_reason: FinishReason;
  error: string | null;
  /** Tokens fed to the model (after truncation). */
  prompt_tokens: number;
  completion_tokens: number;
  /** Prompt tokens dropped from the left to fit the context. */
  truncated_tokens: number;
  seed: number;
  /** Time from the request to the first token, in ms. */
  ttft_ms: number | null;
  /** Completion tokens per second from the request to the end. */
  tokens_per_s: number | null;
  total_ms: number;
  /** Time to load the model on the GPU (0 when it was loaded already). */
  load_ms: number;
}

/** Events of a generation, in order. */
export type GenerationEvent = TokenEvent | DoneEvent;

/** A running generation: its resolved settings, its events, and cancel. */
export class Generation {
  readonly id: string;
  /** The checkpoint or model actually used. */
  readonly model: ModelSource;
  readonly prompt_tokens: number;
  readonly truncated_tokens: number;
  readonly max_tokens: number;
  readonly seed: number;
  readonly gpu: number;
  /** The prompt's token ids as fed to the model. */
  readonly prompt: readonly number[];
  /** Which choice of its request this is (0 … n−1). */
  readonly index: number;
  #queue: GenerationEvent[] = [];
  #wake: (() => void) | null = null;
  #text: TextStream;
  #t0: number;
  #first: number | null = null;
  #completion = 0;
  #loadMs = 0;
  #finished = false;
  #started = false;
  #last: number | null = null;
  #cancel: () => void;
  #timer: ReturnType<typeof setTimeout> | null = null;
  #stats: StatsSink | null;
  /** When the request was handed to the GPU host (epochMs), and the Worker's stamps. */
  #sentAt = 0;
  #stamps: GenerationStamps | null = null;
  #written = false;

  constructor(
    init: {
      id: string;
      model: ModelSource;
      prompt: number[];
      truncated_tokens: number;
      max_tokens: number;
      seed: number;
      gpu: number;
      stop: string[];
      index?: number;
      /** Ends the generation with "timeout" after this many ms. */
      timeout_ms?: number;
      /** When the request reached this process (performance.now()). */
      arrived?: number;
    },
    cancel: () => void,
    stats: StatsSink | null = null,
  ) {
    this.id = init.id;
    this.model = init.model;
    this.prompt = init.prompt;
    this.index = init.index ?? 0;
    this.prompt_tokens = init.prompt.length;
    this.truncated_tokens = init.truncated_tokens;
    this.max_tokens = init.max_tokens;
    this.seed = init.seed;
    this.gpu = init.gpu;
    this.#text = new TextStream(init.stop);
    this.#t0 = init.arrived ?? performance.now();
    this.#cancel = cancel;
    this.#stats = stats;
    const limit = init.timeout_ms;
    if (limit !== undefined && Number.isFinite(limit)) {
      this.#timer = setTimeout(() => {
        this.#timer = null;
        if (this.#finished) return;
        this.#cancel();
        this.#end("timeout", `Generation exceeded the time limit of ${limit / 1000} s`);
      }, limit);
    }
  }

  /** Stamps the moment the request is handed to the GPU host; returns the stamp (epochMs). */
  markSent(): number {
    return (this.#sentAt = epochMs());
  }

  /** Whether the final event has been produced. */
  get finished(): boolean {
    return this.#finished;
  }

  /** Whether its Worker has given it a stream slot. */
  get started(): boolean {
    return this.#started;
  }

  /** Stops the generation (client gone); the Worker drops it at its next chunk. */
  cancel(): void {
    if (this.#finished) return;
    this.#cancel();
    this.#end("cancelled", null);
  }

  /** Events until (and including) the final one. */
  async *events(): AsyncGenerator<GenerationEvent> {
    for await (const batch of this.batches()) yield* batch;
  }

  /**
   * The same events, each time as all that have come since the last batch (the tokens of a chunk
   * arrive together): a stream writes them at once instead of one write, and one turn of the
   * streams behind it, per token. The last batch ends with the final event.
   */
  async *batches(): AsyncGenerator<GenerationEvent[]> {
    for (;;) {
      if (this.#queue.length > 0) {
        const batch = this.#queue;
        this.#queue = [];
        const end = batch.findIndex((e) => e.type === "done");
        if (end >= 0) {
          yield batch.slice(0, end + 1);
          return;
        }
        yield batch;
        continue;
      }
      await new Promise<void>((r) => (this.#wake = r));
      this.#wake = null;
    }
  }

  /** Collects the whole generation: its text and final event. */
  async collect(): Promise<{ text: string; done: DoneEvent }> {
    let text = "";
    for await (const e of this.events()) {
      if (e.type === "token") text += e.text;
      else return { text, done: e };
    }
    throw new Error("Generation ended without a final event");
  }

  /** Handles a Worker report for this generation. */
  report(msg: FromWorkerGeneration | { type: "gen_crash"; error: string }): void {
    if (this.#finished) return;
    switch (msg.type) {
      case "gen_started":
        this.#loadMs = msg.load_ms;
        this.#started = true;
        this.#stamps = msg.stamps ?? null;
        return;
      case "gen_tokens": {
        const now = performance.now();
        if (this.#first === null) {
          this.#first = now;
          this.#stats?.ttft((now - this.#t0) / 1000);
          this.#stageTimes(now, msg.first_at);
        } else if (this.#last !== null && msg.tokens.length > 0) {
          this.#stats?.itl((now - this.#last) / 1000 / msg.tokens.length, msg.tokens.length);
        }
        this.#last = now;
        for (const [i, id] of msg.tokens.entries()) {
          this.#completion++;
          const step = this.#text.push(id);
          const lp = msg.logprobs?.[i];
          this.#push({ type: "token", id, text: step.text, ...(lp ? { logprobs: lp } : {}) });
          if (step.stopped) {
            this.#cancel();
            this.#end("stop", null);
            return;
          }
        }
        return;
      }
      case "gen_done": {
        const tail = this.#text.finish();
        if (tail.text) this.#push({ type: "token", id: null, text: tail.text });
        const reason: FinishReason = tail.stopped ? "stop" : msg.reason;
        this.#end(reason, msg.error);
        return;
      }
      case "gen_crash":
        this.#end("error", msg.error);
        return;
    }
  }

  /**
   * Reports where the time to the first token went, hop by hop (GenerationStamps), when every
   * hop stamped the request: this process (arrival to the GPU host's pipe), the pipe to the GPU
   * host, the host to the Worker's thread, waiting in the Worker (a slot, the model's load, the
   * gathering of a burst), the prefill and first token, and the way back.
   */
  #stageTimes(now: number, firstAt: number | undefined): void {
    const st = this.#stamps;
    if (!this.#stats || !st || firstAt === undefined || this.#sentAt === 0) return;
    const { relayed_at, received_at, admitted_at } = st;
    if (relayed_at === undefined || received_at === undefined || admitted_at === undefined) return;
    const back = performance.timeOrigin + now;
    const ms: Record<Exclude<GenerationStage, "write">, number> = {
      http: this.#sentAt - (performance.timeOrigin + this.#t0),
      to_host: relayed_at - this.#sentAt,
      to_worker: received_at - relayed_at,
      queue: admitted_at - received_at,
      prefill: firstAt - admitted_at,
      back: back - firstAt,
    };
    for (const [stage, v] of Object.entries(ms)) {
      this.#stats.stage(stage as GenerationStage, Math.max(0, v) / 1000);
    }
  }

  /** The route wrote a token's event to the response: the first one ends the `write` stage. */
  markWritten(): void {
    if (this.#written || this.#first === null) return;
    this.#written = true;
    this.#stats?.stage("write", Math.max(0, performance.now() - this.#first) / 1000);
  }

  #push(e: GenerationEvent): void {
    this.#queue.push(e);
    this.#wake?.();
  }

  #end(finish_reason: FinishReason, error: string | null): void {
    if (this.#finished) return;
    this.#finished = true;
    if (this.#timer !== null) clearTimeout(this.#timer);
    const total_ms = performance.now() - this.#t0;
    this.#push({
      type: "done",
      finish_reason,
      error,
      prompt_tokens: this.prompt_tokens,
      completion_tokens: this.#completion,
      truncated_tokens: this.truncated_tokens,
      seed: this.seed,
      ttft_ms: this.#first === null ? null : this.#first - this.#t0,
      tokens_per_s: this.#completion > 0 ? this.#completion / (total_ms / 1000) : null,
      total_ms,
      load_ms: this.#loadMs,
    });
  }
}

/** How long a request waits for a GPU Worker that is still starting. */
const READY_TIMEOUT_MS = 60_000;

type FromWorkerDone = Extract<FromWorkerGeneration, { type: "gen_done" }>;

/** A cumulative histogram: counts[i] observations ≤ buckets[i] (the last bucket is +Inf). */
export interface Histogram {
  buckets: number[];
  counts: number[];
  sum: number;
  count: number;
}

/** Serving statistics, named after vLLM's metrics (see server/routes/health.ts for the exposition). */
export interface GenerationStats {
  /** Requests (choices) handed to a Worker: `gpt2_generations_started`. */
  started: number;
  /** Finished by the Workers, by reason (a stop sequence shows as "cancelled"): `vllm:request_success_total`. */
  finished: Record<FromWorkerDone["reason"], number>;
  /** Tokens the Workers generated: `vllm:generation_tokens_total`. */
  tokens: number;
  /** Prompt tokens fed to the Workers: `vllm:prompt_tokens_total`. */
  prompt_tokens: number;
  /** Streams decoding now: `vllm:num_requests_running`. */
  running: number;
  /** Streams waiting for a slot (or the model to load): `vllm:num_requests_waiting`. */
  waiting: number;
  /** Seconds from request to first token: `vllm:time_to_first_token_seconds`. */
  ttft: Histogram;
  /** Seconds between tokens (per token of each arriving chunk): `vllm:inter_token_latency_seconds`. */
  itl: Histogram;
  /** Seconds of each stage on the way to the first token: `gpt2_generation_stage_seconds`. */
  stages: Record<GenerationStage, Histogram>;
}

/**
 * Where a request's time to its first token goes (Generation's stamps): `http` this process, from
 * arrival to the GPU host's pipe (routing, validation, tokenizing, the model lookup); `to_host` the
 * pipe to the GPU host process; `to_worker` from the host to the Worker's thread taking it in;
 * `queue` waiting in the Worker for a stream slot, the model's load or a burst's gathering;
 * `prefill` the prompt's prefill and first token, read back; `back` from the Worker's post to this
 * process; `write` from there to the first token's event written to the response (the route's
 * turn, text decoding, the event's encoding). Hops in different processes are timed by the wall
 * clock (the same machine's).
 */
export const GENERATION_STAGES = [
  "http",
  "to_host",
  "to_worker",
  "queue",
  "prefill",
  "back",
  "write",
] as const;
export type GenerationStage = (typeof GENERATION_STAGES)[number];

/** Where a Generation reports its latencies. */
interface StatsSink {
  ttft(seconds: number): void;
  itl(seconds: number, tokens: number): void;
  stage(stage: GenerationStage, seconds: number): void;
}

const TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10];
const STAGE_BUCKETS = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 10];
const ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1];

function histogram(buckets: number[]): Histogram {
  return { buckets: [...buckets, Infinity], counts: new Array(buckets.length + 1).fill(0), sum: 0, count: 0 };
}

function observe(h: Histogram, v: number, times = 1): void {
  for (let i = 0; i < h.buckets.length; i++) if (v <= h.buckets[i]) h.counts[i] += times;
  h.sum += v * times;
  h.count += times;
}

/** Raised when too many requests wait for a stream slot; the route answers 429 with Retry-After. */
export class GenerationOverloadedError extends Error {
  /** Seconds a client should wait before retrying. */
  readonly retryAfter: number;
  constructor(waiting: number, limit: number) {
    super(`Too many generation requests are waiting: ${waiting} of at most ${limit}, retry later`);
    this.name = "GenerationOverloadedError";
    this.retryAfter = 1;
  }
}

/** Limits and placement of the generation manager. */
export interface GenerationManagerOptions {
  /** GPU roles (server/gpus/roles.ts); absent: every GPU may generate. */
  roles?: GpuRoles;
  /** Most requests waiting for a slot, over all GPUs (default 256). */
  maxWaiting?: number;
  /** Time limit of one request in ms (default 10 minutes). */
  timeoutMs?: number;
}

/** How long a model lookup serves later requests for the same id (GenerationManager #resolve). */
const MODEL_CACHE_MS = 250;
/** Past MODEL_CACHE_MS a lookup is reused while its files' signature holds (modelSourceStamp), up to this age. */
const MODEL_STAMP_MS = 30_000;

/** Starts generations on the pool's GPU Workers and routes their reports back. */
export class GenerationManager {
  #pool: GpuPool;
  #root: string;
  #opts: Required<Omit<GenerationManagerOptions, "roles">> & { roles: GpuRoles | null };
  /** Generations whose Worker has not reported them finished (cancelled ones included). */
  #live = new Map<string, Generation>();
  /** The start-up warm-up's generations (server/rehearsal.ts): uncounted, see startChoices. */
  #rehearsals = new Rehearsals(
    (gpu, msg) => this.#pool.postGeneration(gpu, msg),
    (...args) => new Generation(...args),
  );
  /** Chat templates read, by model lookup (a new lookup after its files change reads again). */
  #templates = new WeakMap<ModelSource, Promise<string | undefined>>();
  /** Model lookups of the last MODEL_CACHE_MS, by id (see #resolve). */
  #resolved = new Map<
    string,
    { at: number; made: number; stamp: string | null; model: Promise<ModelSource> }
  >();
  #stats: Omit<GenerationStats, "running" | "waiting"> = {
    started: 0,
    finished: { length: 0, eos: 0, cancelled: 0, error: 0 },
    tokens: 0,
    prompt_tokens: 0,
    ttft: histogram(TTFT_BUCKETS),
    itl: histogram(ITL_BUCKETS),
    stages: Object.fromEntries(GENERATION_STAGES.map((s) => [s, histogram(STAGE_BUCKETS)])) as Record<
      GenerationStage,
      Histogram
    >,
  };
  #sink: StatsSink = {
    ttft: (s) => observe(this.#stats.ttft, s),
    itl: (s, n) => observe(this.#stats.itl, s, n),
    stage: (stage, s) => observe(this.#stats.stages[stage], s),
  };
  /** Where each loaded model (path@version) went last, to batch its requests on one GPU. */
  #placed = new Map<string, number>();

  /**
   * `pool` holds the GPU Workers (shared with the job runner); `root` is the data directory
   * (checkpoints/ and models/ under it).
   */
  constructor(pool: GpuPool, root: string, opts: GenerationManagerOptions = {}) {
    this.#pool = pool;
    this.#root = root;
    this.#opts = {
      roles: opts.roles ?? null,
      maxWaiting: opts.maxWaiting ?? 256,
      timeoutMs: opts.timeoutMs ?? 600_000,
    };
    pool.onGeneration((gpu, msg) => this.#onReport(gpu, msg));
  }

  /** Generations still running on a GPU (a cancelled one until its Worker confirms). */
  get active(): number {
    return this.#live.size;
  }

  /** How many rehearsals (the start-up warm-up) went through a GPU's Worker, and how many were answered here. */
  get rehearsed(): { worker: number; here: number } {
    return this.#rehearsals.counts;
  }

  /** Serving statistics (a copy). */
  get stats(): GenerationStats {
    const { running, waiting } = this.#counts();
    return { ...structuredClone(this.#stats), running, waiting };
  }

  /** Live generations decoding (given a slot) and waiting for one. */
  #counts(): { running: number; waiting: number } {
    let running = 0, waiting = 0;
    for (const g of this.#live.values()) {
      if (g.finished) continue;
      if (g.started) running++;
      else waiting++;
    }
    return { running, waiting };
  }

  /** Models that can be loaded. */
  models(): Promise<ModelInfo[]> {
    return listModelSources(this.#root);
  }

  /**
   * One model by id (ModelNotFoundError: 404), under the id asked for (a job's id as `models()`
   * lists it, or one of its checkpoints), created when it was saved.
   */
  async model(id: string): Promise<ModelInfo> {
    const m = await resolveModelSource(this.#root, id);
    const listed = (await listModelSources(this.#root)).find((x) => x.id === id || x.id === m.id);
    if (listed) return { ...listed, id };
    const saved = m.kind === "checkpoint" ? Date.parse(m.version) : Number(m.version);
    const created = Math.floor((Number.isFinite(saved) ? saved : Date.now()) / 1000);
    return { id, kind: m.kind, created, config: m.config };
  }

  /**
   * The chat template of a model (its folder's `tokenizer_config.json`), or undefined without one.
   * ModelNotFoundError (404) for an unknown model. Read once per lookup of the model (#resolve):
   * a file read per request waits its turn behind a whole burst's (16 chat streams on an H200 saw
   * their first token 1.6× later than /v1/completions' with it).
   */
  async chatTemplateOf(id: string): Promise<string | undefined> {
    const model = await this.#resolve(id);
    let template = this.#templates.get(model);
    if (!template) {
      template = readChatTemplate(model.path);
      this.#templates.set(model, template);
      template.catch(() => this.#templates.get(model) === template && this.#templates.delete(model));
    }
    return await template;
  }

  /** Resolves a model's context length (for /tokenize). */
  async contextOf(id: string): Promise<number> {
    return (await this.#resolve(id)).config.n_positions;
  }

  /**
   * resolveModelSource, shared: a burst of requests for one model reads its folder once instead of
   * four file operations each (64 requests sent together waited for 256 of them before the first
   * reached the GPU). Within MODEL_CACHE_MS of its last check a lookup is reused as it is; past
   * that, while the signature of its files (modelSourceStamp: a few synchronous stats) is
   * unchanged, for up to MODEL_STAMP_MS. The asynchronous lookup's file operations each wait a
   * turn of the event loop behind the rest of a burst's requests: on an H200 the first burst of
   * 16 after an idle spell took this process 8.6-11.4 ms per request against 1.4-3.0 with the
   * lookup reused. A new checkpoint shows at once past MODEL_CACHE_MS, within it at the next
   * check; a failed lookup is not kept.
   */
  #resolve(id: string): Promise<ModelSource> {
    const now = performance.now(), hit = this.#resolved.get(id);
    if (hit && now - hit.at < MODEL_CACHE_MS) return hit.model;
    if (hit && hit.stamp !== null && now - hit.made < MODEL_STAMP_MS) {
      if (modelSourceStamp(this.#root, id) === hit.stamp) {
        hit.at = now;
        return hit.model;
      }
    }
    if (this.#resolved.size > 256) this.#resolved.clear();
    const stamp = modelSourceStamp(this.#root, id);
    const model = resolveModelSource(this.#root, id);
    this.#resolved.set(id, { at: now, made: now, stamp, model });
    model.catch(() => this.#resolved.get(id)?.model === model && this.#resolved.delete(id));
    return model;
  }

  /** Starts one generation (see {@link startChoices}). */
  async start(p: GenerateParams): Promise<Generation> {
    return (await this.startChoices(p, 1))[0];
  }

  /**
   * Resolves the model (ModelNotFoundError: 404), checks max_tokens against its context
   * (InvalidJobError: 400), fits the prompt, and hands `n` streams of it (seeds seed … seed+n−1)
   * to a GPU Worker. Throws GenerationOverloadedError when too many requests wait already.
   */
  async startChoices(p: GenerateParams, n: number): Promise<Generation[]> {
    const rehearsal = p.rehearsal === true;
    const model = rehearsal ? this.#rehearsals.model(p.model) : await this.#resolve(p.model);
    const ctxLen = model.config.n_positions;
    const max_tokens = p.max_tokens ?? Math.min(64, Math.floor(ctxLen / 2));
    if (max_tokens > ctxLen - 1) {
      throw new InvalidJobError(
        "max_tokens",
        `max_tokens ${max_tokens} leaves no room for the prompt: model "${model.id}" has a context of ${ctxLen} tokens`,
      );
    }
    const prompt = typeof p.prompt === "string"
      ? encodePrompt(p.prompt, ctxLen - max_tokens)
      : fitPromptTokens(p.prompt, ctxLen - max_tokens);
    if (p.whole !== undefined && prompt.truncated > 0) {
      const len = prompt.tokens.length + prompt.truncated;
      throw new InvalidJobError(
        p.whole,
        `${p.whole} take ${len} tokens, but model "${model.id}" has a context of ${ctxLen} tokens and ` +
          `max_tokens ${max_tokens} leaves ${
            ctxLen - max_tokens
          } for them: shorten the ${p.whole} or lower max_tokens`,
      );
    }
    const bad = prompt.tokens.find((t) => !(Number.isInteger(t) && t >= 0 && t <= EOT_TOKEN));
    if (bad !== undefined) {
      throw new InvalidJobError("prompt", `Prompt token ${bad} is outside the vocabulary`);
    }
    const { waiting } = this.#counts();
    if (waiting + n > this.#opts.maxWaiting) {
      throw new GenerationOverloadedError(waiting, this.#opts.maxWaiting);
    }
    // A rehearsal goes the whole way through a ready GPU's Worker when there is one (which answers
    // it without a model), else it is answered here.
    const gpu = rehearsal ? this.#idleGpu() : await this.#pickGpu(`${model.path}@${model.version}`);
    const seed = p.seed ?? crypto.getRandomValues(new Uint32Array(1))[0];
    const base = `gen_${crypto.randomUUID().replaceAll("-", "").slice(0, 12)}`;
    const out: Generation[] = [];
    for (let i = 0; i < n; i++) {
      const id = n === 1 ? base : `${base}_${i}`;
      const s = (seed + i) >>> 0;
      const request: WorkerGeneration = {
        id,
        model,
        prompt: prompt.tokens,
        max_tokens,
        temperature: p.temperature,
        top_k: p.top_k,
        top_p: p.top_p,
        seed: s,
        stop_at_eos: !p.ignore_eos,
        logprobs: p.logprobs ?? null,
        root: this.#root,
      };
      const init = {
        id,
        model,
        prompt: prompt.tokens,
        truncated_tokens: prompt.truncated,
        max_tokens,
        seed: s,
        gpu,
        stop: p.stop,
        index: i,
        timeout_ms: this.#opts.timeoutMs,
        arrived: p.arrived,
      };
      if (rehearsal) {
        out.push(this.#rehearsals.start(init, request));
        continue;
      }
      const gen = new Generation(init, () => {
        try {
          this.#pool.postGeneration(gpu, { type: "generate_cancel", id });
        } catch { /* worker gone */ }
      }, this.#sink);
      request.sent_at = gen.markSent();
      out.push(gen);
      this.#live.set(id, gen);
      this.#pool.postGeneration(gpu, { type: "generate", request });
      this.#stats.started++;
      this.#stats.prompt_tokens += prompt.tokens.length;
    }
    return out;
  }

  /** A GPU whose Worker is ready and idle (not training) and may generate, or -1: where a rehearsal goes. */
  #idleGpu(): number {
    const allowed = this.#opts.roles ? new Set(generationGpus(this.#opts.roles)) : null;
    const idle = this.#pool.gpuStates().find((g) => g.state === "idle" && (!allowed || allowed.has(g.index)));
    return idle?.index ?? -1;
  }

  /**
   * Resolves true once a GPU that may generate is ready and idle (rehearsals then go through its
   * Worker), false when none is still starting or `timeoutMs` passed.
   */
  async whenReady(timeoutMs: number): Promise<boolean> {
    const allowed = this.#opts.roles ? new Set(generationGpus(this.#opts.roles)) : null;
    for (const end = Date.now() + timeoutMs;;) {
      if (this.#idleGpu() >= 0) return true;
      const gpus = this.#pool.gpuStates().filter((g) => !allowed || allowed.has(g.index));
      if (!gpus.some((g) => g.state === "starting") || Date.now() > end) return false;
      await new Promise((r) => setTimeout(r, 50));
    }
  }

  /**
   * The GPU for a model: among the ready GPUs whose role allows generation, one not training,
   * then the one already holding the model, then the fewest live generations.
   */
  async #pickGpu(key: string): Promise<number> {
    const allowed = this.#opts.roles ? new Set(generationGpus(this.#opts.roles)) : null;
    for (const end = Date.now() + READY_TIMEOUT_MS;;) {
      const gpus = this.#pool.gpuStates().filter((g) => !allowed || allowed.has(g.index));
      const ready = gpus.filter((g) => g.state === "idle" || g.state === "busy");
      if (ready.length === 1) {
        this.#placed.set(key, ready[0].index);
        return ready[0].index;
      }
      if (ready.length > 0) {
        const placed = this.#placed.get(key);
        const live = new Map<number, number>();
        for (const g of this.#live.values()) live.set(g.gpu, (live.get(g.gpu) ?? 0) + 1);
        const score = (g: (typeof ready)[number]) =>
          (g.state === "busy" ? 1e6 : 0) + (g.index === placed ? 0 : 1e3) + (live.get(g.index) ?? 0);
        const best = ready.reduce((a, b) => (score(b) < score(a) ? b : a)).index;
        this.#placed.set(key, best);
        return best;
      }
      if (!gpus.some((g) => g.state === "starting") || Date.now() > end) {
        const why = gpus.map((g) => g.error).filter(Boolean).join("; ");
        throw new GpuUnavailableError(`No GPU can generate now${why ? `: ${why}` : ""}`);
      }
      await new Promise((r) => setTimeout(r, 50));
    }
  }

  #onReport(gpu: number, msg: GenerationReport): void {
    if (msg.type === "gen_crash") {
      for (const [id, g] of this.#live) {
        if (g.gpu !== gpu) continue;
        this.#live.delete(id);
        g.report(msg);
      }
      this.#rehearsals.crashed(gpu, msg);
      for (const [key, i] of this.#placed) if (i === gpu) this.#placed.delete(key);
      return;
    }
    const g = this.#live.get(msg.id);
    if (!g) return this.#rehearsals.report(msg);
    g.report(msg);
    if (msg.type === "gen_done") {
      this.#live.delete(msg.id);
      this.#stats.finished[msg.reason]++;
      this.#stats.tokens += msg.completion_tokens;
    }
  }
}
