/**
 * The HTTP thread's side of generation: resolve the model, tokenize and fit the prompt, pick the
 * GPU (the one already holding the model, else the least loaded), hand the request to its Worker,
 * and turn the token ids it posts back into text events: one per token, then a final event with
 * the finish reason, token counts and timings. Stop sequences are matched here (the Worker is
 * then told to cancel); a client that goes away cancels through `Generation.cancel()`.
 */

import { EOT_TOKEN } from "../gpu/config.ts";
import { GpuUnavailableError, InvalidJobError } from "./errors.ts";
import type { FromWorkerGeneration, ModelSource, WorkerGeneration } from "./messages.ts";
import { listModelSources, type ModelInfo, resolveModelSource } from "./model_source.ts";
import type { GenerationReport, JobRunner } from "./runner.ts";
import { encodePrompt, TextStream } from "./text_stream.ts";

/** A generation request, validated by the routes (ranges), not yet against the model. */
export interface GenerateParams {
  /** Model id: "<job id>", "<job id>/iter_N" or a directory name under models/. */
  model: string;
  prompt: string;
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
}

/** Why a generation ended. */
export type FinishReason = "length" | "stop" | "eos" | "cancelled" | "error";

/**
 * One generated token and the text it completed (may be empty while a character or stop is
 * pending). `id` is null for text released only at the end (held back for a stop sequence, or
 * an incomplete character, which becomes U+FFFD).
 */
export interface TokenEvent {
  type: "token";
  id: number | null;
  text: string;
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
  #queue: GenerationEvent[] = [];
  #wake: (() => void) | null = null;
  #text: TextStream;
  #t0: number;
  #first: number | null = null;
  #completion = 0;
  #loadMs = 0;
  #finished = false;
  #cancel: () => void;

  constructor(
    init: {
      id: string;
      model: ModelSource;
      prompt_tokens: number;
      truncated_tokens: number;
      max_tokens: number;
      seed: number;
      gpu: number;
      stop: string[];
    },
    cancel: () => void,
  ) {
    this.id = init.id;
    this.model = init.model;
    this.prompt_tokens = init.prompt_tokens;
    this.truncated_tokens = init.truncated_tokens;
    this.max_tokens = init.max_tokens;
    this.seed = init.seed;
    this.gpu = init.gpu;
    this.#text = new TextStream(init.stop);
    this.#t0 = performance.now();
    this.#cancel = cancel;
  }

  /** Whether the final event has been produced. */
  get finished(): boolean {
    return this.#finished;
  }

  /** Stops the generation (client gone); the Worker drops it at its next chunk. */
  cancel(): void {
    if (this.#finished) return;
    this.#cancel();
    this.#end("cancelled", null);
  }

  /** Events until (and including) the final one. */
  async *events(): AsyncGenerator<GenerationEvent> {
    for (;;) {
      while (this.#queue.length > 0) {
        const e = this.#queue.shift()!;
        yield e;
        if (e.type === "done") return;
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
        return;
      case "gen_tokens":
        this.#first ??= performance.now();
        for (const id of msg.tokens) {
          this.#completion++;
          const step = this.#text.push(id);
          this.#push({ type: "token", id, text: step.text });
          if (step.stopped) {
            this.#cancel();
            this.#end("stop", null);
            return;
          }
        }
        return;
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

  #push(e: GenerationEvent): void {
    this.#queue.push(e);
    this.#wake?.();
  }

  #end(finish_reason: FinishReason, error: string | null): void {
    if (this.#finished) return;
    this.#finished = true;
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

/** Counters over this manager's life, as the Workers reported them. */
export interface GenerationStats {
  started: number;
  /** Generations the Workers finished, by their reason (a stop sequence shows as "cancelled"). */
  finished: Record<FromWorkerDone["reason"], number>;
  /** Tokens the Workers generated. */
  tokens: number;
}

type FromWorkerDone = Extract<FromWorkerGeneration, { type: "gen_done" }>;

/** Starts generations on the runner's GPU Workers and routes their reports back. */
export class GenerationManager {
  #runner: JobRunner;
  #root: string;
  /** Generations whose Worker has not reported them finished (cancelled ones included). */
  #live = new Map<string, Generation>();
  #stats: GenerationStats = {
    started: 0,
    finished: { length: 0, eos: 0, cancelled: 0, error: 0 },
    tokens: 0,
  };
  /** Where each loaded model (path@version) went last, to batch its requests on one GPU. */
  #placed = new Map<string, number>();

  /** `root` is the data directory (checkpoints/ and models/ under it). */
  constructor(runner: JobRunner, root: string) {
    this.#runner = runner;
    this.#root = root;
    runner.onGeneration((gpu, msg) => this.#onReport(gpu, msg));
  }

  /** Generations still running on a GPU (a cancelled one until its Worker confirms). */
  get active(): number {
    return this.#live.size;
  }

  /** Counters of started and finished generations. */
  get stats(): GenerationStats {
    return structuredClone(this.#stats);
  }

  /** Models that can be loaded. */
  models(): Promise<ModelInfo[]> {
    return listModelSources(this.#root);
  }

  /**
   * Resolves the model (ModelNotFoundError: 404), checks max_tokens against its context
   * (InvalidJobError: 400), fits the prompt, and hands the request to a GPU Worker.
   */
  async start(p: GenerateParams): Promise<Generation> {
    const model = await resolveModelSource(this.#root, p.model);
    const ctxLen = model.config.n_positions;
    const max_tokens = p.max_tokens ?? Math.min(64, Math.floor(ctxLen / 2));
    if (max_tokens > ctxLen - 1) {
      throw new InvalidJobError(
        "max_tokens",
        `max_tokens ${max_tokens} leaves no room for the prompt: model "${model.id}" has a context of ${ctxLen} tokens`,
      );
    }
    const prompt = encodePrompt(p.prompt, ctxLen - max_tokens);
    const bad = prompt.tokens.find((t) => t > EOT_TOKEN);
    if (bad !== undefined) {
      throw new InvalidJobError("prompt", `Prompt token ${bad} is outside the vocabulary`);
    }
    const gpu = await this.#pickGpu(`${model.path}@${model.version}`);
    const seed = p.seed ?? crypto.getRandomValues(new Uint32Array(1))[0];
    const id = `gen_${crypto.randomUUID().replaceAll("-", "").slice(0, 12)}`;
    const request: WorkerGeneration = {
      id,
      model,
      prompt: prompt.tokens,
      max_tokens,
      temperature: p.temperature,
      top_k: p.top_k,
      top_p: p.top_p,
      seed,
      stop_at_eos: !p.ignore_eos,
    };
    const gen = new Generation(
      {
        id,
        model,
        prompt_tokens: prompt.tokens.length,
        truncated_tokens: prompt.truncated,
        max_tokens,
        seed,
        gpu,
        stop: p.stop,
      },
      () => {
        try {
          this.#runner.postGeneration(gpu, { type: "generate_cancel", id });
        } catch { /* worker gone */ }
      },
    );
    this.#live.set(id, gen);
    this.#runner.postGeneration(gpu, { type: "generate", request });
    this.#stats.started++;
    return gen;
  }

  async #pickGpu(key: string): Promise<number> {
    for (const end = Date.now() + READY_TIMEOUT_MS;;) {
      const gpus = this.#runner.gpus();
      const ready = gpus.filter((g) => g.state === "idle" || g.state === "busy");
      if (ready.length > 0) {
        const placed = this.#placed.get(key);
        if (placed !== undefined && ready.some((g) => g.index === placed)) return placed;
        const load = (i: number) =>
          [...this.#live.values()].filter((g) => g.gpu === i).length +
          (gpus[i].state === "busy" ? 4 : 0);
        const best = ready.reduce((a, b) => (load(b.index) < load(a.index) ? b : a)).index;
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
      for (const [key, i] of this.#placed) if (i === gpu) this.#placed.delete(key);
      return;
    }
    const g = this.#live.get(msg.id);
    if (!g) return;
    g.report(msg);
    if (msg.type === "gen_done") {
      this.#live.delete(msg.id);
      this.#stats.finished[msg.reason]++;
      this.#stats.tokens += msg.completion_tokens;
    }
  }
}
