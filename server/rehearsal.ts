/**
 * The HTTP process's part of the start-up rehearsal, in one place (the Worker's part is
 * worker/warm_up.ts). A rehearsal is a generation request that goes the way a user's goes
 * (middleware, routing, body parsing, validation, tokenizing, the generation's events, text
 * decoding, the streamed response, and through the GPU host to an idle Worker and back) but names
 * no real model, uses no GPU or store, is answered with a few tokens of its own prompt, and is
 * counted nowhere: its use is the code it runs, which a first burst of users would otherwise meet
 * cold. Two parts:
 *
 * - Which requests rehearse: `markRehearsal` (createApp's first middleware) flags the server's own
 *   warm-up requests (made in memory by `warmUp`, or over the socket carrying this process's
 *   secret) and `isRehearsal` reads the flag: the token check lets them past, the stream limits
 *   count them apart, and the generation routes hold no quota for them and pass `rehearsal` on.
 *   Only this module sets the flag, and the secret never leaves the process but for its loopback
 *   connection to itself.
 * - What drives them at start-up: `warmUp` (main.ts).
 */

import { timingSafeEqual } from "node:crypto";
import type { Context, Hono } from "hono";
import { WILDCARD_HOSTS } from "./settings.ts";

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
