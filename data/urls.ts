/**
 * Stage 1: URL lists. Normalises, deduplicates and filters URLs (blacklisted domains, non-text
 * extensions), reporting the count after every step.
 *
 * The seed's URL script once wrote an empty list without complaint; here an empty result is an
 * error that carries the counts, so the cause (all blacklisted? all invalid?) is visible.
 */

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
