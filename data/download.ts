/**
 * Stage 2: download. Fetches URLs with bounded concurrency, per-request timeouts, retries with
 * backoff, a size cap and an honest user agent; extracts main text from HTML and writes one JSON
 * line per document (`{"text", "url"}`).
 *
 * A failure (unreachable host, timeout, HTTP error, oversized or non-text body) is recorded with
 * its reason and counted, never thrown: one dead link must not sink a crawl of thousands.
 *
 * Only http(s) URLs whose host resolves to public addresses are fetched, checked again on every
 * redirect hop (redirects are followed by hand for that), unless `allowPrivate`; and all URLs of
 * one run share a byte budget (`maxTotalBytes`), after which the rest fail without a request.
 */
import { extractMainText } from "./extract.ts";
import { decodeUtf8, looksBinary } from "./text.ts";
import { checkPublicUrl, type PublicUrlOptions } from "./urls.ts";

/** The User-Agent sent with every request: says what we are and why. */
export const DEFAULT_USER_AGENT = "gpt2-webgpu-data/1.0 (dataset builder for GPT-2 training; Deno fetch)";

/** Options of {@link downloadUrls}. */
export interface DownloadOptions {
  /** Requests in flight at once (default 8). */
  concurrency?: number;
  /** Timeout of one attempt in milliseconds, body included (default 15000). */
  timeoutMs?: number;
  /** Extra attempts after a retryable failure: network error, timeout, 429 or 5xx (default 2). */
  retries?: number;
  /** Delay before the first retry in ms, doubled each time (default 500). */
  retryDelayMs?: number;
  /** Largest body accepted, in bytes (default 5 MiB). */
  maxBytes?: number;
  /** User-Agent header (default {@link DEFAULT_USER_AGENT}). */
  userAgent?: string;
  /** Documents with fewer characters than this after extraction are failures "too little text" (default 1). */
  minChars?: number;
  /** Fetch loopback, private, link-local and multicast addresses too (default false). */
  allowPrivate?: boolean;
  /** Host names or addresses exempt from the public-address check. */
  allowHosts?: string[];
  /** Resolves host names for the address check (default: DNS A and AAAA records). */
  resolve?: (host: string) => Promise<string[]>;
  /** Redirects followed per URL (default 5). */
  maxRedirects?: number;
  /** Body bytes of all URLs together (default: unbounded). */
  maxTotalBytes?: number;
  /** How failures name the budget's setting (default "maxTotalBytes"). */
  budgetSetting?: string;
}

/** A downloaded document: one JSON line of the download stage's output. */
export interface WebDocument {
  /** Extracted main text. */
  text: string;
  /** The URL it came from. */
  url: string;
}

/** One failed URL and why. */
export interface DownloadFailure {
  /** The URL. */
  url: string;
  /** What went wrong, e.g. `HTTP 404` or `Timed out after 15000 ms`. */
  error: string;
  /** Attempts made. */
  attempts: number;
}

/** Counts of a download run. */
export interface DownloadCounts {
  /** URLs tried. */
  urls: number;
  /** Documents produced. */
  ok: number;
  /** URLs that failed (see the failure list). */
  failed: number;
  /** Retries made in total. */
  retries: number;
  /** Body bytes received for successful documents. */
  bytes: number;
}

/** Progress of a download run. */
export interface DownloadProgress {
  /** URLs finished (ok or failed). */
  done: number;
  /** URLs in all. */
  total: number;
  /** Documents so far. */
  ok: number;
  /** Failures so far. */
  failed: number;
}

/** An error that another attempt may cure. */
class RetryableError extends Error {}

/** Bytes left to the whole run. */
interface Budget {
  left: number;
  total: number;
  setting: string;
}

/** The error of a spent budget. */
function budgetError(b: Budget): Error {
  return new Error(`Download budget of ${b.total} bytes for this dataset is spent (${b.setting})`);
}

/** Read a body up to `maxBytes`, throwing past it; every chunk is taken from `budget`. */
async function readCapped(res: Response, maxBytes: number, budget: Budget): Promise<Uint8Array> {
  const declared = Number(res.headers.get("content-length") ?? "NaN");
  if (declared > maxBytes) {
    await res.body?.cancel();
    throw new Error(`Body of ${declared} bytes exceeds the ${maxBytes}-byte cap`);
  }
  if (!res.body) return new Uint8Array(0);
  const chunks: Uint8Array[] = [];
  let size = 0;
  const reader = res.body.getReader();
  while (true) {
    const { done, value } = await reader.read();
    if (done) break;
    size += value.length;
    budget.left -= value.length;
    if (size > maxBytes) {
      await reader.cancel();
      throw new Error(`Body exceeds the ${maxBytes}-byte cap`);
    }
    if (budget.left < 0) {
      await reader.cancel();
      throw budgetError(budget);
    }
    chunks.push(value);
  }
  const out = new Uint8Array(size);
  let off = 0;
  for (const c of chunks) {
    out.set(c, off);
    off += c.length;
  }
  return out;
}

/** Decode a body with the charset of its content type (UTF-8 by default). */
function decodeBody(bytes: Uint8Array, contentType: string): string {
  const charset = /charset=["']?([\w-]+)/i.exec(contentType)?.[1]?.toLowerCase();
  if (charset && charset !== "utf-8" && charset !== "utf8") {
    try {
      return new TextDecoder(charset).decode(bytes);
    } catch {
      // Unknown label: fall back to UTF-8.
    }
  }
  return decodeUtf8(bytes).text;
}

type Resolved = Required<Omit<DownloadOptions, "resolve" | "allowHosts">> & PublicUrlOptions;

const REDIRECTS = new Set([301, 302, 303, 307, 308]);

/** Fetches `url`, following redirects by hand so each hop's address is checked first. */
async function fetchChecked(url: string, o: Resolved, signal: AbortSignal): Promise<Response> {
  let current = url;
  for (let hop = 0;; hop++) {
    await checkPublicUrl(current, o);
    let res: Response;
    try {
      res = await fetch(current, {
        headers: { "user-agent": o.userAgent, accept: "text/html,application/xhtml+xml,text/plain;q=0.9" },
        redirect: "manual",
        signal,
      });
    } catch (e) {
      throw new RetryableError(
        signal.aborted ? `Timed out after ${o.timeoutMs} ms` : `Cannot fetch: ${(e as Error).message}`,
      );
    }
    if (!REDIRECTS.has(res.status)) return res;
    await res.body?.cancel();
    const location = res.headers.get("location");
    if (!location) throw new Error(`HTTP ${res.status} redirect without a Location`);
    if (hop >= o.maxRedirects) throw new Error(`More than ${o.maxRedirects} redirects`);
    try {
      current = new URL(location, current).href;
    } catch {
      throw new Error(`Invalid redirect Location "${location.slice(0, 200)}"`);
    }
  }
}

/** One attempt at one URL. */
async function fetchOnce(
  url: string,
  o: Resolved,
  budget: Budget,
): Promise<{ doc: WebDocument; bytes: number }> {
  if (budget.left <= 0) throw budgetError(budget);
  const signal = AbortSignal.timeout(o.timeoutMs);
  const res = await fetchChecked(url, o, signal);
  if (!res.ok) {
    await res.body?.cancel();
    const msg = `HTTP ${res.status}`;
    throw res.status === 429 || res.status >= 500 ? new RetryableError(msg) : new Error(msg);
  }
  const type = (res.headers.get("content-type") ?? "").toLowerCase();
  const isHtml = type.includes("text/html") || type.includes("application/xhtml");
  if (type && !isHtml && !type.startsWith("text/plain")) {
    await res.body?.cancel();
    throw new Error(`Unsupported content type "${type}"`);
  }
  let bytes: Uint8Array;
  try {
    bytes = await readCapped(res, o.maxBytes, budget);
  } catch (e) {
    if (signal.aborted) throw new RetryableError(`Timed out after ${o.timeoutMs} ms`);
    throw e;
  }
  if (looksBinary(bytes)) throw new Error("Body is binary");
  const raw = decodeBody(bytes, type);
  const text = isHtml || (!type && /^\s*</.test(raw)) ? extractMainText(raw, url).text : raw.trim();
  if (text.length < o.minChars) throw new Error("Too little text");
  return { doc: { text, url }, bytes: bytes.length };
}

/**
 * Download URLs and hand each document to `onDocument` (in completion order). Failures are
 * collected and counted, never thrown.
 */
export async function downloadUrls(
  urls: readonly string[],
  options: DownloadOptions,
  onDocument: (doc: WebDocument) => void | Promise<void>,
  onProgress?: (p: DownloadProgress) => void,
): Promise<{ counts: DownloadCounts; failures: DownloadFailure[] }> {
  const o: Resolved = {
    concurrency: options.concurrency ?? 8,
    timeoutMs: options.timeoutMs ?? 15000,
    retries: options.retries ?? 2,
    retryDelayMs: options.retryDelayMs ?? 500,
    maxBytes: options.maxBytes ?? 5 * 1024 * 1024,
    userAgent: options.userAgent ?? DEFAULT_USER_AGENT,
    minChars: options.minChars ?? 1,
    allowPrivate: options.allowPrivate ?? false,
    allowHosts: options.allowHosts ?? [],
    resolve: options.resolve,
    maxRedirects: options.maxRedirects ?? 5,
    maxTotalBytes: options.maxTotalBytes ?? Infinity,
    budgetSetting: options.budgetSetting ?? "maxTotalBytes",
  };
  const budget: Budget = { left: o.maxTotalBytes, total: o.maxTotalBytes, setting: o.budgetSetting };
  const counts: DownloadCounts = { urls: urls.length, ok: 0, failed: 0, retries: 0, bytes: 0 };
  const failures: DownloadFailure[] = [];
  let next = 0;
  const worker = async () => {
    while (next < urls.length) {
      const url = urls[next++];
      let attempts = 0;
      while (true) {
        attempts++;
        let got: { doc: WebDocument; bytes: number };
        try {
          got = await fetchOnce(url, o, budget);
        } catch (e) {
          if (e instanceof RetryableError && attempts <= o.retries) {
            counts.retries++;
            await new Promise((r) => setTimeout(r, o.retryDelayMs * 2 ** (attempts - 1)));
            continue;
          }
          counts.failed++;
          failures.push({ url, error: (e as Error).message, attempts });
          break;
        }
        counts.ok++;
        counts.bytes += got.bytes;
        await onDocument(got.doc); // A sink failure (disk full) is fatal, unlike a URL failure.
        break;
      }
      onProgress?.({
        done: counts.ok + counts.failed,
        total: urls.length,
        ok: counts.ok,
        failed: counts.failed,
      });
    }
  };
  await Promise.all(Array.from({ length: Math.max(1, Math.min(o.concurrency, urls.length)) }, worker));
  return { counts, failures };
}
