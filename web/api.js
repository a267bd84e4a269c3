/**
 * Talking to the server from the page: the bearer token (typed once, kept in sessionStorage),
 * JSON requests whose failures carry the API's own messages, and a job's event stream followed
 * with fetch (EventSource cannot send headers), resumed with Last-Event-ID after a break.
 */

import { errorInfo, estimateBytes, estimateGpu } from "./shapes.js";
import { readSse } from "./sse.js";

const TOKEN_KEY = "gpt2.token";
const unauthorizedListeners = new Set();

/** The stored bearer token, or "". */
export function getToken() {
  return sessionStorage.getItem(TOKEN_KEY) ?? "";
}

/** Stores (or, when empty, forgets) the bearer token for this browser tab's session. */
export function setToken(token) {
  if (token) sessionStorage.setItem(TOKEN_KEY, token);
  else sessionStorage.removeItem(TOKEN_KEY);
}

/** Calls `fn` whenever the server answers 401. */
export function onUnauthorized(fn) {
  unauthorizedListeners.add(fn);
}

/** A failed request: HTTP status, the API's message and its per-field messages. */
export class ApiError extends Error {
  constructor(status, body) {
    const info = errorInfo(body, status);
    super(info.message);
    this.status = status;
    this.fields = info.fields;
    this.body = body;
  }
}

/** fetch() with the token; throws ApiError for a non-2xx answer. */
export async function apiFetch(path, init = {}) {
  const headers = new Headers(init.headers);
  const token = getToken();
  if (token) headers.set("Authorization", `Bearer ${token}`);
  const res = await fetch(path, { ...init, headers });
  if (res.ok) return res;
  if (res.status === 401) { for (const fn of unauthorizedListeners) fn(); }
  let body = null;
  try {
    body = await res.json();
  } catch { /* not JSON */ }
  throw new ApiError(res.status, body);
}

let me = null;

/** The caller as the server knows them (`GET /auth/me`), or null when it cannot say (401, older server). */
export async function fetchMe(signal) {
  try {
    me = await getJson("/auth/me", { signal });
  } catch {
    me = null;
  }
  return me;
}

/** The caller {@link fetchMe} last found (null: not known yet), for views hiding what it may not do. */
export function knownMe() {
  return me;
}

/** GET `path` as JSON. */
export async function getJson(path, init = {}) {
  return await (await apiFetch(path, init)).json();
}

/** POST `body` as JSON; resolves to `{status, body}`. */
export async function postJson(path, body) {
  const res = await apiFetch(path, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body ?? {}),
  });
  return { status: res.status, body: await res.json() };
}

/**
 * The estimator's answer (`GET /estimate`) for a training config: its total bytes and the GPU it
 * planned for (estimateGpu()), or null when the server has no estimator (404) or it refused the
 * config. `base` prefixes the path (tests).
 */
export async function fetchEstimateAnswer(config, signal, base = "") {
  const q = new URLSearchParams();
  q.set("model", typeof config.model === "string" ? config.model : JSON.stringify(config.model));
  for (const k of ["batch_size", "seq_len", "precision", "checkpoint_activations", "checkpoint_num_layers"]) {
    if (config[k] !== undefined && config[k] !== null && config[k] !== "") q.set(k, String(config[k]));
  }
  try {
    const res = await apiFetch(`${base}/estimate?${q}`, { signal });
    const body = await res.json();
    const bytes = estimateBytes(body);
    return bytes === null ? null : { bytes, gpu: estimateGpu(body) };
  } catch {
    return null;
  }
}

/** The estimator's total bytes for a training config, or null (see fetchEstimateAnswer()). */
export async function fetchEstimate(config, signal, base = "") {
  return (await fetchEstimateAnswer(config, signal, base))?.bytes ?? null;
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/**
 * Follows a job's events from after `lastEventId` until `onEvent` returns true or `signal` aborts.
 * A stream that breaks (server restart, network) is reopened with `Last-Event-ID`, so no event
 * is lost or repeated; a 4xx ends it with the ApiError.
 */
export async function followEvents(path, { onEvent, signal, lastEventId = 0, onState = () => {} }) {
  let last = lastEventId;
  let delay = 500;
  while (!signal.aborted) {
    try {
      const headers = last > 0 ? { "Last-Event-ID": String(last) } : {};
      const res = await apiFetch(path, { headers, signal });
      onState("live");
      delay = 500;
      const stopped = await readSse(res, (e) => {
        if (e.id !== null) last = Number(e.id);
        let data = null;
        try {
          data = JSON.parse(e.data);
        } catch { /* keep null */ }
        return onEvent(e.event, data, last) === true;
      });
      if (stopped) return;
    } catch (e) {
      if (signal.aborted) return;
      if (e instanceof ApiError && e.status < 500) throw e;
    }
    onState("reconnecting");
    await sleep(delay);
    delay = Math.min(delay * 2, 5000);
  }
}
