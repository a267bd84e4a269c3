/**
 * The HTTP process's part of the start-up rehearsal, in one place (the Worker's part is
 * worker/warm_up.ts). A rehearsal is a generation request that goes the way a user's goes
 * (middleware, routing, body parsing, validation, tokenizing, the generation's events, text
 * decoding, the streamed response, and through the GPU host to an idle Worker and back) but names
 * no real model, uses no GPU or store, is answered with a few tokens of its own prompt, and is
 * counted nowhere: its use is the code it runs, which a first burst of users would otherwise meet
 * cold. Three parts:
 *
 * - Which requests rehearse: `markRehearsal` (createApp's first middleware) flags the server's own
 *   warm-up requests (made in memory by `warmUp`, or over the socket carrying this process's
 *   secret) and `isRehearsal` reads the flag: the token check lets them past, the stream limits
 *   count them apart, and the generation routes hold no quota for them and pass `rehearsal` on.
 *   Only this module sets the flag, and the secret never leaves the process but for its loopback
 *   connection to itself.
 * - What drives them at start-up: `warmUp` (main.ts).
 * - What the generation manager does with them: `Rehearsals` (the model they name, an idle GPU's
 *   Worker or an answer from this process, a shorter time limit, no statistics, how many went where).
 */

import { timingSafeEqual } from "node:crypto";
import type { Context, Hono } from "hono";
import { presetConfig } from "../model/config.ts";
import { epochMs, type FromWorkerGeneration, type ModelSource, type WorkerGeneration } from "../protocol.ts";
import { WILDCARD_HOSTS } from "./settings.ts";
import type { Generation } from "./generate/generation_manager.ts";
import type { GpuPool } from "./gpus/gpu_pool.ts";

// ---- Which requests rehearse ----

/** Requests made by {@link warmUp} in this process. */
const WARM_UPS = new WeakSet<Request>();
/** The model id of a warm-up request (job ids and model folders have no dots: it names no real model). */
const WARM_UP_MODEL = "warm-up.rehearsal";
/**
 * The warm-up's requests over the server's own socket carry this process's secret in this header
 * (the secret never leaves the process but for the loopback connection to itself).
 */
const WARM_UP_HEADER = "x-gpt2-warm-up";
const WARM_UP_SECRET = new TextEncoder().encode(
  [...crypto.getRandomValues(new Uint8Array(24))].map((b) => b.toString(16).padStart(2, "0")).join(""),
);
/** Context key set (true) by {@link markRehearsal}; nothing outside this module sets it. */
const REHEARSAL = "gpt2.warmUp";

/** Whether request `req` is one of this process's warm-up requests (in memory, or over the socket). */
function isWarmUp(req: Request): boolean {
  if (WARM_UPS.has(req)) return true;
  const v = req.headers.get(WARM_UP_HEADER);
  if (v === null) return false;
  const got = new TextEncoder().encode(v);
  return got.length === WARM_UP_SECRET.length && timingSafeEqual(got, WARM_UP_SECRET);
}

/**
 * Flags request `c` as a rehearsal when it is one of this process's warm-up requests (createApp's
 * first middleware); returns whether it is.
 */
export function markRehearsal(c: Context): boolean {
  const warm = isWarmUp(c.req.raw);
  if (warm) c.set(REHEARSAL as never, true as never);
  return warm;
}

/** Whether request `c` is one of the server's own warm-up requests (flagged by {@link markRehearsal}). */
export function isRehearsal(c: Context): boolean {
  return (c.get(REHEARSAL as never) as unknown) === true;
}

// ---- What drives them at start-up ----

/** Options of {@link warmUp}. */
export interface WarmUpOptions {
  host?: string;
  port?: number;
  /**
   * Rounds of `burst` (default 64) concurrent rehearsals sent to the server itself over its
   * socket on fresh connections, once it listens on `port`, so that the server's own handling
   * of connections and streamed responses is compiled too (default 6; 0 for none).
   */
  socketRounds?: number;
  burst?: number;
  /**
   * Resolves once a GPU's Worker can take rehearsals (GenerationManager.whenReady): the socket
   * rounds wait for it, so that they run the whole way through the GPU host and a Worker, as
   * users' requests do, not only this process's part.
   */
  ready?: () => Promise<unknown>;
}

/**
 * Runs the generation routes of `app` (made by createApp) `rounds` times on in-memory requests that
 * rehearse the whole request path (GenerateParams.rehearsal): middleware, routing, body parsing,
 * validation, tokenizing, the generation's events, text decoding and the streamed response, so
 * that V8 has compiled it before the first users' requests. No model is looked up and no GPU or
 * store is used: each generation answers a few tokens of its own prompt, from an idle GPU's Worker
 * when one is ready (through the GPU host, as users' requests go; the Worker answers without a
 * model, worker/warm_up.ts) and else from this process, and nothing is counted in /metrics. Without
 * it the first burst a server met took its HTTP process 30-42 ms to hand 16 requests to the GPU
 * host, against 4-7 ms once warm (tests/fakes' Worker), and on an H200 the first 16 or 64 streams'
 * first tokens came 1.3-2.3× later than the next round's. Returns the ms it took.
 */
export async function warmUp(app: Hono, opts: WarmUpOptions, rounds = 24): Promise<number> {
  const t0 = performance.now();
  const bound = opts.host ?? "127.0.0.1";
  const name = WILDCARD_HOSTS.has(bound.toLowerCase())
    ? "127.0.0.1"
    : bound.includes(":")
    ? `[${bound}]`
    : bound;
  const base = `http://${name}${opts.port ? `:${opts.port}` : ""}`;
  await inMemoryRounds(app, base, rounds);
  // Then over the socket: on an H200, 64 streams' first tokens on a fresh server still came 16 ms
  // later than on the next burst, beyond every stage the server times; Deno's own request and
  // response handling had not run for a burst of new connections. Once a GPU's Worker is ready
  // these go the whole way (GPU host, Worker, the reports back), in bursts of the engine's batch:
  // 6 × 16 rehearsals answered in this process left a burst of 64 users' requests (this process
  // over a scripted Worker, 2 cores) 25 ms to their headers against 14-18 ms for the next burst,
  // and 50 ms to the end against 30-40; after 6 × 64 through the Worker, 18-20 and 27-40.
  const socketRounds = opts.port ? opts.socketRounds ?? 6 : 0;
  if (socketRounds > 0) await opts.ready?.();
  await overSocketRounds(base, socketRounds, opts.burst ?? 64);
  return performance.now() - t0;
}

/** `rounds` rounds of a streamed /v1/completions and a /generate, in memory (app.fetch). */
async function inMemoryRounds(app: Hono, base: string, rounds: number): Promise<void> {
  const send = async (req: Request) => {
    WARM_UPS.add(req);
    const res = await app.fetch(req);
    const body = await res.text();
    if (res.status !== 200 || !body.includes("data:")) {
      throw new Error(
        `The warm-up's ${req.method} ${new URL(req.url).pathname} answered ${res.status}: ${body}`,
      );
    }
  };
  for (let i = 0; i < rounds; i++) {
    const body = {
      model: WARM_UP_MODEL,
      prompt: `The server rehearses its request path before users arrive, round ${i}.`,
      max_tokens: 8,
      stream: true,
      top_k: 40,
      seed: i,
    };
    await Promise.all([
      send(
        new Request(`${base}/v1/completions`, {
          method: "POST",
          headers: { "Content-Type": "application/json" },
          body: JSON.stringify(body),
        }),
      ),
      send(new Request(`${base}/generate?model=${WARM_UP_MODEL}&prompt=Warm+up+${i}&max_tokens=8&top_k=40`)),
    ]);
  }
}

/** `rounds` rounds of `burst` concurrent streams (3 of 4 /v1/completions), each on a fresh connection to `base`. */
async function overSocketRounds(base: string, rounds: number, burst: number): Promise<void> {
  for (let i = 0; i < rounds; i++) {
    await Promise.all(Array.from({ length: burst }, async (_, j) => {
      const headers = {
        [WARM_UP_HEADER]: new TextDecoder().decode(WARM_UP_SECRET),
        // A fresh connection per request: the first users' burst opens new ones too.
        Connection: "close",
      };
      const prompt = `Round ${i}, stream ${j}: the server rehearses its request path over its socket.`;
      const res = j % 4 === 3
        ? await fetch(
          `${base}/generate?model=${WARM_UP_MODEL}&prompt=${encodeURIComponent(prompt)}&max_tokens=8`,
          { headers },
        )
        : await fetch(`${base}/v1/completions`, {
          method: "POST",
          headers: { ...headers, "Content-Type": "application/json" },
          body: JSON.stringify({ model: WARM_UP_MODEL, prompt, max_tokens: 8, stream: true, top_k: 40 }),
        });
      const body = await res.text();
      if (res.status !== 200 || !body.includes("data:")) {
        throw new Error(
          `The warm-up's request over the socket answered ${res.status}: ${body.slice(0, 300)}`,
        );
      }
    }));
  }
}

// ---- What the generation manager does with them ----

type GenerationArgs = ConstructorParameters<typeof Generation>;
type StatsSink = NonNullable<GenerationArgs[2]>;

/** A rehearsal handed to a Worker ends by then (answered or not: the warm-up never waits longer). */
const REHEARSAL_TIMEOUT_MS = 10_000;
/** A rehearsal's statistics go nowhere (the manager's sink's shape, so the code warmed is the code used). */
const NO_STATS: StatsSink = { ttft: () => {}, itl: () => {}, stage: () => {} };

/**
 * The generation manager's rehearsals (GenerateParams.rehearsal): the model they name, where each
 * goes, the ones a Worker has not finished, and how many went where. A rehearsal takes the same
 * path as the generations it stands in for (a Generation, the GPU pool's messages, the Worker's
 * reports), uncounted.
 */
export class Rehearsals {
  #post: GpuPool["postGeneration"];
  #generation: (...args: GenerationArgs) => Generation;
  /** Rehearsals handed to a Worker and not finished. */
  #atWorker = new Map<string, Generation>();
  /** Rehearsals so far: answered by a GPU's Worker, and in this process (no GPU was ready). */
  #counts = { worker: 0, here: 0 };

  /**
   * `post` hands a message to a GPU's Worker (GpuPool.postGeneration); `generation` makes a
   * Generation (its constructor: the manager's, so that no import goes round in a circle).
   */
  constructor(
    post: GpuPool["postGeneration"],
    generation: (...args: GenerationArgs) => Generation,
  ) {
    this.#post = post;
    this.#generation = generation;
  }

  /** How many rehearsals went through a GPU's Worker, and how many were answered in this process. */
  get counts(): { worker: number; here: number } {
    return { ...this.#counts };
  }

  /** What a rehearsal generates with: GPT-2 small's shape, no weights anywhere. */
  model(id: string): ModelSource {
    return { id, kind: "safetensors", path: "", version: "rehearsal", config: presetConfig("gpt2-124M") };
  }

  /**
   * Starts rehearsal `request` as a Generation of `init` (what a user's request would get, its GPU
   * `init.gpu`): through that GPU's Worker, which answers it without a model, or, with no GPU
   * ready (`gpu` < 0), answered here. Its time limit is at most REHEARSAL_TIMEOUT_MS and its
   * statistics go nowhere.
   */
  start(init: GenerationArgs[0], request: WorkerGeneration): Generation {
    const { id, gpu } = init;
    const here = gpu < 0;
    const gen = this.#generation(
      { ...init, timeout_ms: Math.min(init.timeout_ms ?? Infinity, REHEARSAL_TIMEOUT_MS) },
      here ? () => {} : () => {
        try {
          this.#post(gpu, { type: "generate_cancel", id });
        } catch { /* worker gone */ }
      },
      NO_STATS,
    );
    request.sent_at = gen.markSent();
    if (here) {
      this.#counts.here++;
      answerHere(gen, request);
      return gen;
    }
    this.#counts.worker++;
    request.rehearsal = true;
    this.#atWorker.set(id, gen);
    this.#post(gpu, { type: "generate", request });
    return gen;
  }

  /** Hands a Worker's report to the rehearsal it is about (if any), which is forgotten once done. */
  report(msg: FromWorkerGeneration): void {
    const g = this.#atWorker.get(msg.id);
    if (!g) return;
    g.report(msg);
    if (msg.type === "gen_done") this.#atWorker.delete(msg.id);
  }

  /** GPU `gpu`'s Worker crashed: its rehearsals end with `msg`. */
  crashed(gpu: number, msg: { type: "gen_crash"; error: string }): void {
    for (const [id, g] of this.#atWorker) {
      if (g.gpu !== gpu) continue;
      this.#atWorker.delete(id);
      g.report(msg);
    }
  }
}

/**
 * Answers a rehearsal from this process as a Worker would, a message at a time in later tasks:
 * started, the prompt's first tokens back in two chunks (at most max_tokens), done.
 */
async function answerHere(gen: Generation, req: WorkerGeneration): Promise<void> {
  const turn = () => new Promise<void>((r) => queueMicrotask(r));
  await turn();
  const now = epochMs();
  gen.report({
    type: "gen_started",
    id: req.id,
    load_ms: 0,
    stamps: { sent_at: req.sent_at, relayed_at: now, received_at: now, admitted_at: now },
  });
  const tokens = req.prompt.slice(0, Math.min(req.max_tokens, 8));
  const half = Math.ceil(tokens.length / 2);
  for (const [i, chunk] of [tokens.slice(0, half), tokens.slice(half)].entries()) {
    await turn();
    if (chunk.length > 0) {
      gen.report({
        type: "gen_tokens",
        id: req.id,
        tokens: chunk,
        ...(i === 0 ? { first_at: epochMs() } : {}),
      });
    }
  }
  await turn();
  gen.report({
    type: "gen_done",
    id: req.id,
    reason: "length",
    error: null,
    completion_tokens: tokens.length,
  });
}
