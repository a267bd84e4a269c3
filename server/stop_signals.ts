/**
 * How the server reads stop signals. One Ctrl-C or one `kill -TERM` often arrives more than once:
 * `deno task serve` forwards the signal its process group got to the server, which got it from
 * the terminal (or systemd, or `kill -TERM -PGID`) already. So a signal within
 * {@link DUPLICATE_SIGNAL_MS} of the first one is the same request, and only a later one, sent on
 * purpose after the "press Ctrl-C again" line, means "exit now".
 */

/** Signals this close to the first one are copies of it (a forward by `deno task`, a group signal). */
export const DUPLICATE_SIGNAL_MS = 1000;

/** What one received signal asks for. */
export type SignalAction = "stop" | "duplicate" | "exit";

/** Counts stop signals once: the first stops gracefully, its copies are ignored, a deliberate second one exits. */
export class StopSignals {
  #first: number | null = null;
  #windowMs: number;

  constructor(windowMs = DUPLICATE_SIGNAL_MS) {
    this.#windowMs = windowMs;
  }

  /** Whether a graceful stop has begun. */
  get stopping(): boolean {
    return this.#first !== null;
  }

  /** The action for a signal received at `now` (ms, any monotonic clock). */
  receive(now: number): SignalAction {
    if (this.#first === null) {
      this.#first = now;
      return "stop";
    }
    return now - this.#first < this.#windowMs ? "duplicate" : "exit";
  }
}

/** The line printed when a graceful stop begins: what happens, and how to exit at once instead. */
export function stoppingLine(signal: Deno.Signal, shutdownSeconds: number): string {
  const again = signal === "SIGINT" ? "press Ctrl-C again" : `send ${signal} again`;
  return `${signal}: stopping; running jobs save a checkpoint at their current step (at most ${shutdownSeconds} s). ` +
    `To exit now instead, ${again} (jobs then resume from their newest checkpoint)`;
}
