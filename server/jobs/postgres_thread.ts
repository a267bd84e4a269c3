/**
 * The thread behind server/jobs/postgres_bridge.ts: holds the PostgreSQL engine (async,
 * postgres.js) and answers the HTTP thread's calls one at a time, each answer posted on the call
 * port and then signalled through a shared counter the HTTP thread waits on. Events announced by
 * any host (NOTIFY) go out on the events port, which the HTTP thread reads as ordinary messages.
 */

import { type MessagePort, workerData } from "node:worker_threads";
import { PostgresJobStore } from "./postgres_store.ts";
import { isStoreUnavailable } from "./store_schema.ts";

/** What the HTTP thread hands this thread at start. */
export interface BridgeData {
  url: string;
  calls: MessagePort;
  events: MessagePort;
  /** Answers posted so far; the HTTP thread waits for it to move. */
  answered: Int32Array;
}

/** A call, and its answer (an error travels as its name, message and lease). */
export interface BridgeCall {
  id: number;
  method: string;
  args: unknown[];
  /** How long the caller waits: past it the answer is an unreachable store, and the next call runs. */
  timeoutMs?: number;
}

/** The answer to call `id`. */
export type BridgeAnswer =
  & { id: number }
  & ({ ok: true; value: unknown } | { ok: false; error: { name: string; message: string; lease?: unknown } });

const { url, calls, events, answered } = workerData as BridgeData;
let store: PostgresJobStore | null = null;
let chain = Promise.resolve();
/**
 * Set when postgres.js threw outside any call (seen during a database's immediate shutdown: a write
 * on a socket it had already dropped): its connections are not trusted any more, and the next call
 * opens a fresh pool first. Without this catch the exception ended the thread, and the HTTP thread
 * waited on calls nobody would answer.
 */
let broken: string | null = null;

function strayError(e: unknown): void {
  broken = (e as Error)?.message ?? String(e);
  console.error(`Job store thread: postgres.js failed outside a call (${broken}); reconnecting`);
}
globalThis.addEventListener("error", (e) => {
  e.preventDefault();
  strayError(e.error ?? e.message);
});
globalThis.addEventListener("unhandledrejection", (e) => {
  e.preventDefault();
  strayError(e.reason);
});

async function openStore(): Promise<PostgresJobStore> {
  const fresh = await PostgresJobStore.open(url);
  fresh.onEvent((e) => events.postMessage(e));
  return fresh;
}

async function answer(call: BridgeCall): Promise<BridgeAnswer> {
  try {
    if (call.method === "open") {
      store = await openStore();
      return { id: call.id, ok: true, value: store.schemaVersion };
    }
    if (!store) throw new Error(`Cannot run "${call.method}": the PostgreSQL job store is not open`);
    if (broken !== null && call.method !== "close") {
      // A fresh pool (failing as an unreachable database while it cannot connect); the old one is
      // ended in the background.
      const old = store;
      store = await openStore();
      broken = null;
      old.close().catch(() => {});
    }
    if (call.method === "close") {
      await store.close();
      store = null;
      return { id: call.id, ok: true, value: undefined };
    }
    // deno-lint-ignore no-explicit-any
    const fn = (store as any)[call.method];
    if (typeof fn !== "function") throw new Error(`Cannot run "${call.method}": no such job store method`);
    return { id: call.id, ok: true, value: await fn.apply(store, call.args) };
  } catch (e) {
    const err = e as Error & { lease?: unknown };
    // A connection that is gone travels as such: the HTTP thread treats it as a passing state.
    const name = isStoreUnavailable(err) ? "StoreUnavailableError" : err.name;
    return { id: call.id, ok: false, error: { name, message: err.message, lease: err.lease } };
  }
}

/**
 * The call's answer, or an unreachable store once the caller stopped waiting: a query postgres.js
 * leaves hanging (seen after a transaction failed to connect) must not hold every call after it.
 */
async function answerWithin(call: BridgeCall): Promise<BridgeAnswer> {
  if (!call.timeoutMs) return await answer(call);
  let timer: ReturnType<typeof setTimeout> | undefined;
  const late = new Promise<BridgeAnswer>((resolve) => {
    timer = setTimeout(() =>
      resolve({
        id: call.id,
        ok: false,
        error: { name: "StoreUnavailableError", message: `no answer to "${call.method}" in time` },
      }), call.timeoutMs);
  });
  try {
    return await Promise.race([answer(call), late]);
  } finally {
    clearTimeout(timer);
  }
}

calls.on("message", (call: BridgeCall) => {
  chain = chain.then(async () => {
    calls.postMessage(await answerWithin(call));
    Atomics.add(answered, 0, 1);
    Atomics.notify(answered, 0);
  });
});
