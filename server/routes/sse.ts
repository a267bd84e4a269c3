/**
 * Server-sent events of one job: first the stored events after `Last-Event-ID` (so a client that
 * reconnects misses nothing), read from the job store a page at a time so a long history never
 * sits in memory whole, then live ones until `done`. A new event (from this host's runner, or
 * from any host through the store: several hosts share one PostgreSQL) only wakes the stream,
 * which reads what follows its last id from the store, so events arrive in id order whichever
 * host wrote them. Each event carries its store id. A comment line every 15 s keeps proxies from
 * closing idle streams.
 *
 * Also the bound on open streams ({@link streamLimit}): per client and in all, since each one
 * holds a connection and, for generation, a GPU slot. A client is its API token when auth is on
 * (by the token's SHA-256, never the token), else its address: the socket's, or the one a
 * trusted proxy forwards ({@link clientKey}).
 */

import type { Context, MiddlewareHandler } from "hono";
import { streamSSE } from "hono/streaming";
import { type PathAlias, scrubPaths } from "./api_errors.ts";
import {
  AddressRanges,
  formatAddress,
  forwardedClient,
  forwardedFor,
  parseAddress,
  xForwardedFor,
} from "../addresses.ts";
import { isFinished, type JobEvent, type JobRunner, LimitError } from "../jobs/mod.ts";
import { limitName, type Limits } from "../settings.ts";

const KEEPALIVE_MS = 15_000;
/** Stored events read per query while replaying. */
export const REPLAY_PAGE = 256;

/** A checkpoint's path as the API shows it: relative to the data directory. */
export function checkpointPath(jobId: string, name: string): string {
  return `checkpoints/${jobId}/${name}`;
}

/** An event's data as sent: checkpoint paths relative to the data directory, `aliases` cut from text. */
function publicData(e: JobEvent, aliases: readonly PathAlias[]): string {
  const data = e.type === "checkpoint" && typeof e.data.name === "string"
    ? { ...e.data, path: checkpointPath(e.job_id, e.data.name) }
    : e.data;
  return scrubPaths(JSON.stringify(data), aliases.map(([p, name]) => [JSON.stringify(p).slice(1, -1), name]));
}

/** Streams job `id`'s events after `afterId`; `aliases` are cut from the events' text. */
export function streamJobEvents(
  c: Context,
  runner: JobRunner,
  id: string,
  afterId: number,
  aliases: readonly PathAlias[] = [],
): Response {
  return streamSSE(c, async (stream) => {
    const pending: JobEvent[] = [];
    let wake: (() => void) | null = null;
    let aborted = false;
    const heard = (e: JobEvent) => {
      if (e.job_id !== id) return;
      pending.push(e);
      wake?.();
    };
    const unsubscribe = runner.subscribe(id, heard);
    const unsubscribeStore = runner.store.onEvent(heard);
    stream.onAbort(() => {
      aborted = true;
      wake?.();
    });
    let last = afterId;
    /** Sends the stored events after `last`; true once `done` was sent. */
    const catchUp = async (): Promise<boolean> => {
      for (;;) {
        const page = await runner.store.eventsAfter(id, last, REPLAY_PAGE);
        for (const e of page) {
          last = e.id;
          await stream.writeSSE({ id: String(e.id), event: e.type, data: publicData(e, aliases) });
          if (e.type === "done") return true;
        }
        if (page.length < REPLAY_PAGE || aborted) return false;
      }
    };
    try {
      // Subscribed before reading the backlog, so nothing falls between the two.
      if (await catchUp()) return;
      if (isFinished((await runner.store.getJob(id))?.status ?? "cancelled")) return;
      while (!aborted) {
        if (pending.length > 0) {
          const shutdown = pending.find((e) => e.type === "shutdown");
          pending.length = 0;
          if (await catchUp()) return;
          if (shutdown) {
            // Not stored: sent without an id, so a client's Last-Event-ID stays valid across the restart.
            await stream.writeSSE({ event: shutdown.type, data: JSON.stringify(shutdown.data) });
            return;
          }
          continue;
        }
        let timer: ReturnType<typeof setTimeout> | undefined;
        const woke = await new Promise<boolean>((resolve) => {
          wake = () => resolve(true);
          timer = setTimeout(() => resolve(false), KEEPALIVE_MS);
        });
        clearTimeout(timer);
        wake = null;
        if (!woke && !aborted) await stream.write(": keepalive\n\n");
      }
    } finally {
      unsubscribe();
      unsubscribeStore();
    }
  });
}

const TOKEN_CLIENT = "gpt2.tokenClient";
const NO_PROXIES = new AddressRanges([]);

/** Marks a request as the holder of a verified API token, known by `digest` (the token's SHA-256). */
export function identifyByToken(c: Context, digest: Uint8Array): void {
  const hex = Array.from(digest.subarray(0, 16), (b) => b.toString(16).padStart(2, "0")).join("");
  c.set(TOKEN_CLIENT, `token:${hex}`);
}

/**
 * The client a request comes from: its verified API token ({@link identifyByToken}), else its
 * address. That is the socket's peer under Deno.serve ("local" without one), unless the peer is
 * in `trusted`: then the right-most address of `X-Forwarded-For` (or, without it, `Forwarded`)
 * that is not a trusted proxy itself (server/addresses.ts).
 */
export function clientKey(c: Context, trusted: AddressRanges = NO_PROXIES): string {
  const token: string | undefined = c.get(TOKEN_CLIENT);
  if (token !== undefined) return token;
  const env = c.env as { remoteAddr?: { hostname?: string } } | undefined;
  const host = env?.remoteAddr?.hostname;
  if (host === undefined) return "local";
  const peer = parseAddress(host);
  if (peer === null) return host;
  if (trusted.size === 0 || !trusted.has(peer)) return formatAddress(peer);
  const xff = c.req.header("X-Forwarded-For");
  const fwd = c.req.header("Forwarded");
  const hops = xff?.trim() ? xForwardedFor(xff) : fwd ? forwardedFor(fwd) : [];
  return formatAddress(forwardedClient(peer, hops, trusted));
}

/** Open streams, counted per client and in all (one counter per app). */
export interface StreamCounter {
  total: number;
  perClient: Map<string, number>;
}

/**
 * Middleware bounding open response streams: past `maxStreamsPerClient` from one client (`key`,
 * default {@link clientKey} without trusted proxies) or `maxStreams` in all, 429 naming the
 * limit. A slot is held until the streamed body ends or the client goes away; an answer that is
 * not a stream frees it at once.
 */
export function streamLimit(
  limits: Limits,
  counter: StreamCounter,
  key: (c: Context) => string = (c) => clientKey(c),
): MiddlewareHandler {
  return async (c, next) => {
    const client = key(c);
    const mine = counter.perClient.get(client) ?? 0;
    if (mine >= limits.maxStreamsPerClient) {
      throw new LimitError(
        429,
        `Too many open streams from this client: ${mine} (limit ${limitName(limits, "maxStreamsPerClient")})`,
      );
    }
    if (counter.total >= limits.maxStreams) {
      throw new LimitError(
        429,
        `Too many open streams: ${counter.total} (limit ${limitName(limits, "maxStreams")})`,
      );
    }
    counter.total++;
    counter.perClient.set(client, mine + 1);
    let released = false;
    const release = () => {
      if (released) return;
      released = true;
      counter.total--;
      const n = (counter.perClient.get(client) ?? 1) - 1;
      if (n <= 0) counter.perClient.delete(client);
      else counter.perClient.set(client, n);
    };
    try {
      await next();
    } catch (e) {
      release();
      throw e;
    }
    const res = c.res;
    if (!res.body || !(res.headers.get("Content-Type") ?? "").startsWith("text/event-stream")) {
      release();
      return;
    }
    const reader = res.body.getReader();
    const body = new ReadableStream<Uint8Array>({
      async pull(ctl) {
        try {
          const { done, value } = await reader.read();
          if (done) {
            release();
            ctl.close();
          } else ctl.enqueue(value);
        } catch (e) {
          release();
          ctl.error(e);
        }
      },
      cancel(reason) {
        release();
        return reader.cancel(reason);
      },
    });
    c.res = new Response(body, res);
  };
}
