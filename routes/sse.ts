/**
 * Server-sent events of one job: first the stored events after `Last-Event-ID` (so a client that
 * reconnects misses nothing), then live ones as the runner records them, until `done`. Each
 * event carries its store id. A comment line every 15 s keeps proxies from closing idle streams.
 */

import type { Context } from "hono";
import { streamSSE } from "hono/streaming";
import { isFinished, type JobEvent, type JobRunner } from "../jobs/mod.ts";

const KEEPALIVE_MS = 15_000;

/** Streams job `id`'s events after `afterId`. */
export function streamJobEvents(c: Context, runner: JobRunner, id: string, afterId: number): Response {
  return streamSSE(c, async (stream) => {
    const pending: JobEvent[] = [];
    let wake: (() => void) | null = null;
    let aborted = false;
    const unsubscribe = runner.subscribe(id, (e) => {
      pending.push(e);
      wake?.();
    });
    stream.onAbort(() => {
      aborted = true;
      wake?.();
    });
    let last = afterId;
    const send = async (e: JobEvent) => {
      last = e.id;
      await stream.writeSSE({ id: String(e.id), event: e.type, data: JSON.stringify(e.data) });
    };
    try {
      // Subscribed before reading the backlog, so nothing falls between the two; ids dedupe.
      for (const e of runner.store.eventsAfter(id, afterId)) {
        await send(e);
        if (e.type === "done") return;
      }
      if (isFinished(runner.get(id).status)) return;
      while (!aborted) {
        while (pending.length > 0) {
          const e = pending.shift()!;
          if (e.type === "shutdown") {
            // Not stored: sent without an id, so a client's Last-Event-ID stays valid across the restart.
            await stream.writeSSE({ event: e.type, data: JSON.stringify(e.data) });
            return;
          }
          if (e.id <= last) continue;
          await send(e);
          if (e.type === "done") return;
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
    }
  });
}
