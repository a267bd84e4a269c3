/**
 * Stage 1: URL lists. Normalises, deduplicates and filters URLs (blacklisted domains, non-text
 * extensions), reporting the count after every step.
 *
 * The seed's URL script once wrote an empty list without complaint; here an empty result is an
 * error that carries the counts, so the cause (all blacklisted? all invalid?) is visible.
 */

import { parseIpv4, parseIpv6 } from "./ip.ts";

/** Domains dropped by default: media hosts, social networks and link shorteners (as OpenWebText's filter). */
export const DEFAULT_BLACKLIST: readonly string[] = [
  "youtube.com",
  "youtu.be",
  "imgur.com",
  "gfycat.com",
  "giphy.com",
  "reddit.com",
  "redd.it",
  "twitter.com",
  "x.com",
  "facebook.com",
  "instagram.com",
  "tiktok.com",
  "pinterest.com",
  "flickr.com",
  "vimeo.com",
  "twitch.tv",
  "streamable.com",
  "soundcloud.com",
  "spotify.com",
  "bit.ly",
  "goo.gl",
  "t.co",
  "tinyurl.com",
  "amazon.com",
  "ebay.com",
];

/** File extensions that are never text: images, video, audio, archives, executables, binary documents. */
export const NON_TEXT_EXTENSIONS: ReadonlySet<string> = new Set([
  "jpg",
  "jpeg",
  "png",
  "gif",
  "gifv",
  "webp",
  "bmp",
  "tif",
  "tiff",
  "svg",
  "ico",
  "heic",
  "avif",
  "mp4",
  "m4v",
  "webm",
  "mkv",
  "avi",
  "mov",
  "wmv",
  "flv",
  "mpg",
  "mpeg",
  "3gp",
  "mp3",
  "wav",
  "ogg",
  "flac",
  "aac",
  "m4a",
  "opus",
  "zip",
  "gz",
  "tgz",
  "bz2",
  "xz",
  "7z",
  "rar",
  "tar",
  "zst",
  "iso",
  "dmg",
  "exe",
  "msi",
  "apk",
  "deb",
  "rpm",
  "bin",
  "dll",
  "so",
  "jar",
  "pkg",
  "appimage",
  "pdf",
  "doc",
  "docx",
  "xls",
  "xlsx",
  "ppt",
  "pptx",
  "odt",
  "psd",
  "ttf",
  "woff",
  "woff2",
]); // deno-fmt-ignore

/** Counts after each step of {@link filterUrls}. */
export interface UrlCounts {
  /** Non-blank input lines. */
  input: number;
  /** Lines that were not absolute http(s) URLs. */
  invalid: number;
  /** URLs equal to an earlier one after normalisation. */
  duplicates: number;
  /** URLs on a blacklisted domain (or one of its subdomains). */
  blacklisted: number;
  /** URLs whose path ends in a non-text extension. */
  non_text: number;
  /** URLs kept. */
  kept: number;
}

/** Options of {@link filterUrls}. */
export interface UrlFilterOptions {
  /** Domains to drop, subdomains included (default {@link DEFAULT_BLACKLIST}). */
  blacklist?: readonly string[];
  /** Extensions to drop, without dot (default {@link NON_TEXT_EXTENSIONS}). */
  extensions?: ReadonlySet<string>;
}

/** Tracking query parameters removed by {@link normalizeUrl}. */
const TRACKING_PARAM_RE = /^(utm_[a-z]+|fbclid|gclid|ref_src)$/i;

/**
 * Normalise a URL for deduplication: http(s) only, lower-case host without `www.`, default port,
 * fragment and tracking parameters removed, trailing slash dropped. Returns undefined if invalid.
 */
export function normalizeUrl(raw: string): string | undefined {
  const s = raw.trim();
  if (!s) return undefined;
  let u: URL;
  try {
    u = new URL(s);
  } catch {
    return undefined;
  }
  if (u.protocol !== "http:" && u.protocol !== "https:") return undefined;
  if (!u.hostname || u.username || u.password) return undefined;
  u.hash = "";
  u.hostname = u.hostname.toLowerCase().replace(/^www\./, "").replace(/\.$/, "");
  for (const key of [...u.searchParams.keys()]) if (TRACKING_PARAM_RE.test(key)) u.searchParams.delete(key);
  if (u.pathname.length > 1 && u.pathname.endsWith("/")) u.pathname = u.pathname.replace(/\/+$/, "");
  let out = u.toString();
  if (out.endsWith("?")) out = out.slice(0, -1);
  return out;
}

/** Whether `host` is `domain` or one of its subdomains. */
function onDomain(host: string, domain: string): boolean {
  return host === domain || host.endsWith("." + domain);
}

/** The lower-case extension of a URL's last path segment, or "" if none. */
export function urlExtension(url: string): string {
  const path = new URL(url).pathname;
  const last = path.slice(path.lastIndexOf("/") + 1);
  const dot = last.lastIndexOf(".");
  return dot > 0 ? last.slice(dot + 1).toLowerCase() : "";
}

/**
 * Filter URL lines: normalise, deduplicate, drop blacklisted domains and non-text extensions.
 * Throws (with the counts in the message) when nothing is left: an empty list is never a result.
 */
export function filterUrls(
  lines: Iterable<string>,
  options: UrlFilterOptions = {},
): { urls: string[]; counts: UrlCounts } {
  const blacklist = (options.blacklist ?? DEFAULT_BLACKLIST).map((d) =>
    d.toLowerCase().replace(/^www\./, "")
  );
  const extensions = options.extensions ?? NON_TEXT_EXTENSIONS;
  const counts: UrlCounts = { input: 0, invalid: 0, duplicates: 0, blacklisted: 0, non_text: 0, kept: 0 };
  const seen = new Set<string>();
  const urls: string[] = [];
  for (const line of lines) {
    const trimmed = line.trim();
    if (!trimmed || trimmed.startsWith("#")) continue;
    counts.input++;
    const url = normalizeUrl(trimmed);
    if (url === undefined) {
      counts.invalid++;
      continue;
    }
    if (seen.has(url)) {
      counts.duplicates++;
      continue;
    }
    seen.add(url);
    const host = new URL(url).hostname;
    if (blacklist.some((d) => onDomain(host, d))) {
      counts.blacklisted++;
      continue;
    }
    if (extensions.has(urlExtension(url))) {
      counts.non_text++;
      continue;
    }
    urls.push(url);
  }
  counts.kept = urls.length;
  if (urls.length === 0) {
    throw new Error(
      `No URLs left after filtering: ${counts.input} input, ${counts.invalid} invalid, ${counts.duplicates} duplicates, ` +
        `${counts.blacklisted} blacklisted, ${counts.non_text} non-text`,
    );
  }
  return { urls, counts };
}

// ---------------------------------------------------------------------------------------------
// Public addresses only: URL sources are fetched by the server, so a URL (or a redirect) naming
// loopback, a private network or the cloud metadata address would turn the server into a proxy
// into its own network (server-side request forgery).

function ipv4Range(b: number[]): string | null {
  const [a, c] = [b[0], b[1]];
  if (a === 0) return "unspecified";
  if (a === 127) return "loopback";
  if (a === 10 || (a === 172 && c >= 16 && c < 32) || (a === 192 && c === 168)) return "private";
  if (a === 100 && c >= 64 && c < 128) return "private (shared address space)";
  if (a === 169 && c === 254) return "link-local";
  if (a === 198 && (c === 18 || c === 19)) return "private (benchmarking)";
  if (a >= 224 && a < 240) return "multicast";
  if (a >= 240) return "reserved";
  if (a === 192 && c === 0 && (b[2] === 0 || b[2] === 2)) return "reserved";
  if ((a === 198 && c === 51 && b[2] === 100) || (a === 203 && c === 0 && b[2] === 113)) return "reserved";
  return null;
}

/**
 * Why `ip` (IPv4 or IPv6, brackets allowed) is not a public address: "loopback", "private",
 * "link-local", "multicast", "unspecified" or "reserved"; null when it is public. IPv4 mapped
 * into IPv6 (::ffff:a.b.c.d, NAT64, 6to4) is judged as the IPv4 address. Not an address: "invalid".
 */
export function nonPublicRange(ip: string): string | null {
  const bare = ip.replace(/^\[|\]$/g, "").replace(/%.*$/, "");
  const v4 = parseIpv4(bare);
  if (v4) return ipv4Range(v4);
  const g = parseIpv6(bare);
  if (!g) return "invalid";
  const embedded = (hi: number, lo: number) => ipv4Range([hi >> 8, hi & 255, lo >> 8, lo & 255]);
  if (g.slice(0, 7).every((x) => x === 0)) {
    return g[7] === 1 ? "loopback" : g[7] === 0 ? "unspecified" : "reserved";
  }
  if (g.slice(0, 5).every((x) => x === 0) && g[5] === 0xffff) return embedded(g[6], g[7]);
  if (g[0] === 0x64 && g[1] === 0xff9b && g.slice(2, 6).every((x) => x === 0)) return embedded(g[6], g[7]);
  if (g[0] === 0x2002) return embedded(g[1], g[2]);
  if ((g[0] & 0xfe00) === 0xfc00) return "private";
  if ((g[0] & 0xffc0) === 0xfe80) return "link-local";
  if ((g[0] & 0xffc0) === 0xfec0) return "private";
  if ((g[0] & 0xff00) === 0xff00) return "multicast";
  if (g[0] === 0x2001 && g[1] === 0x0db8) return "reserved";
  return null;
}

/** A URL the download stage refuses to fetch, with the reason. */
export class UrlRefusedError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "UrlRefusedError";
  }
}

/** How {@link checkPublicUrl} decides. */
export interface PublicUrlOptions {
  /** Skip the address check entirely (GPT2_ALLOW_PRIVATE_URLS=1). */
  allowPrivate?: boolean;
  /** Host names or addresses exempt from the check (e.g. one internal mirror). */
  allowHosts?: readonly string[];
  /** Resolves a host name to its addresses (default: Deno.resolveDns, A and AAAA). */
  resolve?: (host: string) => Promise<string[]>;
}

/** A and AAAA records of `host`; throws when it has neither. */
export async function resolveHost(host: string): Promise<string[]> {
  const [a, aaaa] = await Promise.allSettled([Deno.resolveDns(host, "A"), Deno.resolveDns(host, "AAAA")]);
  const out = [
    ...(a.status === "fulfilled" ? a.value : []),
    ...(aaaa.status === "fulfilled" ? aaaa.value : []),
  ];
  if (out.length === 0) {
    const why = a.status === "rejected" ? (a.reason as Error).message : "no A or AAAA records";
    throw new UrlRefusedError(`Cannot resolve "${host}": ${why}`);
  }
  return out;
}

/**
 * Throws {@link UrlRefusedError} unless `url` is http(s) and its host resolves only to public
 * addresses. Called on every redirect hop. (A name that resolves differently between this check
 * and the fetch can still slip through; refusing every private answer keeps that window small.)
 */
export async function checkPublicUrl(url: string, options: PublicUrlOptions = {}): Promise<void> {
  let u: URL;
  try {
    u = new URL(url);
  } catch {
    throw new UrlRefusedError(`Invalid URL "${url}"`);
  }
  if (u.protocol !== "http:" && u.protocol !== "https:") {
    throw new UrlRefusedError(
      `Unsupported scheme "${u.protocol.slice(0, -1)}": only http and https are fetched`,
    );
  }
  if (options.allowPrivate) return;
  const host = u.hostname.replace(/^\[|\]$/g, "").toLowerCase();
  if (options.allowHosts?.some((h) => h.toLowerCase().replace(/^\[|\]$/g, "") === host)) return;
  if (host === "localhost" || host.endsWith(".localhost")) {
    throw new UrlRefusedError(
      `Refusing "${u.host}": a loopback name (set GPT2_ALLOW_PRIVATE_URLS=1 to allow)`,
    );
  }
  const literal = nonPublicRange(host);
  const addresses = literal === "invalid" ? await (options.resolve ?? resolveHost)(host) : [host];
  for (const ip of addresses) {
    const range = nonPublicRange(ip);
    if (range !== null) {
      throw new UrlRefusedError(
        `Refusing "${u.host}"${ip === host ? "" : ` (resolves to ${ip})`}: a ${range} address ` +
          `(set GPT2_ALLOW_PRIVATE_URLS=1 to allow)`,
      );
    }
  }
}
