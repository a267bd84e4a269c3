/**
 * The runner's writes while the job store is away. A PostgreSQL restart, a network cut or SQLite's
 * full disk must not stop training or freeze the runner: a write that finds the store unreachable
 * ({@link isStoreUnavailable}) is kept, with every write after it, in order, and they are applied
 * once the store answers again. While it is away the store is tried with a growing pause (0.5 s
 * doubling to 1 s) through its readiness probe, so no request thread waits on it more than once
 * per try; {@link StoreBacklog.state} is what `/health` shows.
 *
 * A write is a function: it may read and write the store, and writes it makes in turn run inside
 * it (in place, not queued behind it). A write that throws anything but an unreachable store is
 * logged and dropped, so one bad write never holds the ones after it.
 */

import { isStoreUnavailable, StoreUnavailableError } from "./store_schema.ts";

/** The store as the runner last found it (`/health`'s `store`). */
export interface StoreState {
  state: "ok" | "unreachable";
  /** When it was found unreachable (ISO), while it is. */
  since: string | null;
  /** Why, while it is. */
  error: string | null;
  /** Writes waiting for it. */
  pending: number;
  /** Metric writes dropped because the backlog was full (the oldest go first). */
  dropped: number;
}

/** Options of {@link StoreBacklog}. */
export interface StoreBacklogOptions {
  /** Whether the store takes a write now: null, or why not (the store's `writeError`). */
  probe: () => string | null;
  /** First pause between tries while the store is away, ms (default 500); doubles up to `maxRetryMs`. */
  retryMs?: number;
  /** Longest pause between tries, ms (default 1000). */
  maxRetryMs?: number;
  /** Most writes kept (default 100,000); past it the oldest metric points are dropped. */
  limit?: number;
  /** The store answers again and every kept write has been applied. */
  onRecovered?: (downMs: number) => void;
  /** The store was found unreachable (once per outage). */
  onLost?: (error: string) => void;
}

/** What a kept write is: metric points may be dropped when the backlog is full, the rest never. */
export type WriteKind = "metric" | "other";

interface Kept {
  kind: WriteKind;
  fn: () => void;
}

/** Writes in order, kept while the store is away. */
export class StoreBacklog {
  #opts: StoreBacklogOptions;
  #queue: Kept[] = [];
  #since: number | null = null;
  #error: string | null = null;
  #dropped = 0;
  #depth = 0;
  #timer: ReturnType<typeof setTimeout> | null = null;
  #pauseMs: number;
  #stopped = false;

  constructor(opts: StoreBacklogOptions) {
    this.#opts = opts;
    this.#pauseMs = opts.retryMs ?? 500;
  }

  /** Whether the store answered last time it was asked (and nothing waits for it). */
  get reachable(): boolean {
    return this.#since === null;
  }

  state(): StoreState {
    return {
      state: this.#since === null ? "ok" : "unreachable",
      since: this.#since === null ? null : new Date(this.#since).toISOString(),
      error: this.#error,
      pending: this.#queue.length,
      dropped: this.#dropped,
    };
  }

  /**
   * Runs `fn` now, or keeps it behind the writes already kept. An unreachable store keeps it (and
   * starts the tries); any other error is thrown. Inside another write it runs in place.
   */
  write(fn: () => void, kind: WriteKind = "other"): void {
    if (this.#depth > 0) return fn();
    if (this.#since !== null || this.#queue.length > 0) return this.#keep({ kind, fn });
    try {
      this.#run(fn);
    } catch (e) {
      if (!this.failed(e)) throw e;
      this.#keep({ kind, fn });
    }
  }

  /**
   * A call found the store unreachable (reads too): the state changes and tries begin. Returns
   * whether `e` was such an error; other errors change nothing.
   */
  failed(e: unknown): boolean {
    if (!isStoreUnavailable(e)) return false;
    this.#error = (e as Error).message;
    if (this.#since === null) {
      this.#since = Date.now();
      this.#opts.onLost?.(this.#error);
    }
    this.#schedule();
    return true;
  }

  /** Tries the store now: applies the kept writes in order, or probes it when none wait. */
  flush(): void {
    this.#timer = null;
    if (this.#stopped) return;
    if (this.#queue.length === 0) {
      const why = this.#probe();
      if (why !== null) {
        this.failed(new StoreUnavailableError(why));
        return;
      }
    }
    while (this.#queue.length > 0) {
      const head = this.#queue[0];
      try {
        this.#run(head.fn);
      } catch (e) {
        if (this.failed(e)) return;
        console.error(`Job store: a kept write failed and is dropped: ${(e as Error).message}`);
      }
      this.#queue.shift();
    }
    if (this.#since !== null) {
      const downMs = Date.now() - this.#since;
      this.#since = null;
      this.#error = null;
      this.#pauseMs = this.#opts.retryMs ?? 500;
      this.#opts.onRecovered?.(downMs);
    }
  }

  /** Stops the tries (the server is stopping); kept writes stay unapplied. */
  stop(): void {
    this.#stopped = true;
    if (this.#timer !== null) clearTimeout(this.#timer);
    this.#timer = null;
  }

  #probe(): string | null {
    try {
      return this.#opts.probe();
    } catch (e) {
      return (e as Error).message;
    }
  }

  #run(fn: () => void): void {
    this.#depth++;
    try {
      fn();
    } finally {
      this.#depth--;
    }
  }

  #keep(kept: Kept): void {
    this.#queue.push(kept);
    const limit = this.#opts.limit ?? 100_000;
    if (this.#queue.length > limit) {
      const i = this.#queue.findIndex((k) => k.kind === "metric");
      if (i >= 0) {
        this.#queue.splice(i, 1);
        this.#dropped++;
      }
    }
    this.#schedule();
  }

  #schedule(): void {
    if (this.#timer !== null || this.#stopped) return;
    const pause = this.#pauseMs;
    this.#pauseMs = Math.min(this.#opts.maxRetryMs ?? 1000, pause * 2);
    this.#timer = setTimeout(() => this.flush(), pause);
  }
}
