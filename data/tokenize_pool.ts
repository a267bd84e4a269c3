/**
 * A pool of tokenize workers (one per core by default) with bounded work in flight and results
 * delivered in submission order, so output is deterministic and memory stays bounded whatever
 * the input size: at most `maxInFlight` batches exist at once.
 */
import type { MinHashParams } from "./minhash.ts";

/** Configuration sent to every worker once. */
export interface WorkerConfig {
  /** Documents with fewer tokens (before `<|endoftext|>`) are dropped. */
  minTokens: number;
  /** MinHash parameters, or null to skip signatures (dedup off). */
  minhash: MinHashParams | null;
}

/** A batch of raw documents. */
export interface WorkerBatch {
  /** Submission sequence number. */
  seq: number;
  /** Raw texts. */
  texts: string[];
}

/** A worker's answer for one batch. */
export interface WorkerResult {
  /** Sequence number of the batch. */
  seq: number;
  /** Per input document: its token count including `<|endoftext|>`, or 0 if dropped. */
  lengths: Uint32Array;
  /** Tokens of kept documents, each followed by 50256. */
  tokens: Uint16Array;
  /** MinHash signatures of kept documents (numPerm each), empty when dedup is off. */
  sigs: Uint32Array;
  /** Documents dropped for having fewer than minTokens tokens. */
  short: number;
  /** Documents empty after cleaning. */
  empty: number;
  /** Characters of kept documents after cleaning. */
  chars: number;
  /** Milliseconds the worker spent cleaning, tokenizing and computing signatures for this batch. */
  ms: [number, number, number];
}

/** A running pool of tokenize workers. */
export interface TokenizePool {
  /** Submit a batch; resolves once the pool has room (back-pressure). */
  submit(texts: string[]): Promise<void>;
  /** Wait for all submitted batches to be delivered. */
  drain(): Promise<void>;
  /** Terminate the workers. */
  close(): void;
}

/** Options of {@link createTokenizePool}. */
export interface PoolOptions {
  /** Workers (default: navigator.hardwareConcurrency). */
  workers?: number;
  /** Batches in flight at most (default 2 per worker). */
  maxInFlight?: number;
}

/**
 * Start a pool. `onResult` is called for each batch in submission order; an error it throws, or a
 * worker's error, rejects the next submit/drain.
 */
export function createTokenizePool(
  config: WorkerConfig,
  onResult: (r: WorkerResult) => void | Promise<void>,
  options: PoolOptions = {},
): TokenizePool {
  const count = Math.max(1, options.workers ?? navigator.hardwareConcurrency ?? 2);
  const maxInFlight = options.maxInFlight ?? count * 2;
  const workers = Array.from({ length: count }, () => {
    const w = new Worker(new URL("./tokenize_worker.ts", import.meta.url).href, { type: "module" });
    w.postMessage({ config });
    return w;
  });
  const pending = new Map<number, WorkerResult>();
  let nextSeq = 0, deliverSeq = 0, inFlight = 0, failure: Error | undefined;
  let waiters: (() => void)[] = [];
  let delivering = Promise.resolve();
  const wake = () => {
    const w = waiters;
    waiters = [];
    for (const f of w) f();
  };
  const deliver = () => {
    delivering = delivering.then(async () => {
      while (!failure && pending.has(deliverSeq)) {
        const r = pending.get(deliverSeq)!;
        pending.delete(deliverSeq);
        deliverSeq++;
        try {
          await onResult(r);
        } catch (e) {
          failure = e as Error;
        }
        inFlight--;
        wake();
      }
    });
  };
  for (const w of workers) {
    w.onmessage = (e: MessageEvent<WorkerResult & { error?: string }>) => {
      if (e.data.error) {
        failure ??= new Error(e.data.error);
        wake();
        return;
      }
      pending.set(e.data.seq, e.data);
      deliver();
    };
    w.onerror = (e) => {
      e.preventDefault();
      failure ??= new Error(`Tokenize worker failed: ${e.message}`);
      wake();
    };
  }
  const waitFor = async (cond: () => boolean) => {
    while (!failure && !cond()) await new Promise<void>((r) => waiters.push(r));
    if (failure) throw failure;
  };
  return {
    async submit(texts: string[]) {
      await waitFor(() => inFlight < maxInFlight);
      const seq = nextSeq++;
      inFlight++;
      workers[seq % count].postMessage({ batch: { seq, texts } });
    },
    async drain() {
      await waitFor(() => inFlight === 0);
      await delivering;
      if (failure) throw failure;
    },
    close() {
      for (const w of workers) w.terminate();
    },
  };
}
