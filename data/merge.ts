/**
 * Stage 3: merge. Reads a file or a folder tree of `.txt` files and `.jsonl` / loose-JSON files
 * into one stream of documents, and can write that stream as loose JSON (one `{"text", ...}`
 * object per line, the format Megatron's preprocessing reads).
 *
 * Bad input never stops the stream: empty files, binary files, invalid UTF-8, lines over the size
 * cap and malformed JSON lines are skipped (or decoded lossily) and counted in {@link MergeCounts}.
 * Lines are read in bounded chunks, so an enormous line costs at most the cap in memory.
 */
import { basename, extname, join } from "node:path";
import { decodeUtf8, looksBinary } from "./text.ts";

/** A document from any source. */
export interface SourceDocument {
  /** Raw text (cleaned later). */
  text: string;
  /** Where it came from: a URL or a file path, when known. */
  url?: string;
}

/** What {@link readDocuments} read and skipped. */
export interface MergeCounts {
  /** Files read. */
  files: number;
  /** Documents produced. */
  documents: number;
  /** Empty files and blank JSON lines. */
  empty_files: number;
  /** Files skipped as binary (NUL bytes). */
  binary_files: number;
  /** Files with unsupported extensions, and symlinks, skipped. */
  skipped_files: number;
  /** Documents or lines that were not valid UTF-8 (decoded with U+FFFD, which cleaning strips). */
  invalid_utf8: number;
  /** JSON lines that did not parse or had no string `text`. */
  malformed_json: number;
  /** Lines or files over the size cap, skipped. */
  oversized: number;
}

/** A fresh zeroed {@link MergeCounts}. */
export function emptyMergeCounts(): MergeCounts {
  return {
    files: 0,
    documents: 0,
    empty_files: 0,
    binary_files: 0,
    skipped_files: 0,
    invalid_utf8: 0,
    malformed_json: 0,
    oversized: 0,
  };
}

/** Options of {@link readDocuments}. */
export interface MergeOptions {
  /** Largest line or `.txt` file accepted, in bytes (default 64 MiB). */
  maxDocumentBytes?: number;
  /** Called with bytes read so far (for progress). */
  onBytes?: (bytes: number) => void;
}

/** Extensions read as one document per file. */
export const TEXT_EXTENSIONS: ReadonlySet<string> = new Set([".txt", ".text", ".md"]);
/** Extensions read as loose JSON (one object or string per line). */
export const JSON_EXTENSIONS: ReadonlySet<string> = new Set([".jsonl", ".json", ".ndjson"]);

/**
 * Stream the lines of a file as bytes, in bounded memory: lines over `maxBytes` are skipped and
 * reported through `onOversized`.
 */
export async function* readLineBytes(
  path: string,
  maxBytes: number,
  onOversized: () => void,
  onBytes?: (n: number) => void,
): AsyncGenerator<Uint8Array> {
  using file = await Deno.open(path, { read: true });
  const buf = new Uint8Array(1 << 20);
  let parts: Uint8Array[] = [];
  let partLen = 0, skipping = false, total = 0;
  while (true) {
    const n = await file.read(buf);
    if (n === null) break;
    total += n;
    onBytes?.(total);
    const chunk = buf.subarray(0, n);
    let start = 0;
    while (start < n) {
      const nl = chunk.indexOf(10, start);
      const end = nl < 0 ? n : nl;
      if (!skipping) {
        if (partLen + end - start > maxBytes) {
          skipping = true;
          parts = [];
          partLen = 0;
          onOversized();
        } else if (nl >= 0 && partLen === 0) {
          yield chunk.slice(start, end);
        } else {
          parts.push(chunk.slice(start, end));
          partLen += end - start;
        }
      }
      if (nl < 0) break;
      if (!skipping && parts.length > 0) {
        yield concat(parts, partLen);
        parts = [];
        partLen = 0;
      }
      skipping = false;
      start = nl + 1;
    }
  }
  if (!skipping && partLen > 0) yield concat(parts, partLen);
}

/** Concatenate byte chunks. */
function concat(parts: Uint8Array[], len: number): Uint8Array {
  if (parts.length === 1) return parts[0];
  const out = new Uint8Array(len);
  let off = 0;
  for (const p of parts) {
    out.set(p, off);
    off += p.length;
  }
  return out;
}

/**
 * Parse one loose-JSON line: an object with a string `text` (and optional `url`), or a bare JSON
 * string. Returns undefined when malformed.
 */
export function parseJsonLine(line: string): SourceDocument | undefined {
  let v: unknown;
  try {
    v = JSON.parse(line);
  } catch {
    return undefined;
  }
  if (typeof v === "string") return { text: v };
  if (v && typeof v === "object" && typeof (v as { text?: unknown }).text === "string") {
    const o = v as { text: string; url?: unknown };
    return typeof o.url === "string" ? { text: o.text, url: o.url } : { text: o.text };
  }
  return undefined;
}

/** Read a loose-JSON file (or a JSON array file) into documents. */
async function* readJsonFile(path: string, counts: MergeCounts, max: number, onBytes?: (n: number) => void) {
  const head = new Uint8Array(64);
  let first = "";
  {
    using f = await Deno.open(path, { read: true });
    const n = (await f.read(head)) ?? 0;
    first = new TextDecoder().decode(head.subarray(0, n)).trimStart();
  }
  if (first.startsWith("[")) {
    // A single JSON array of documents.
    const size = (await Deno.stat(path)).size;
    if (size > max) {
      counts.oversized++;
      return;
    }
    const bytes = await Deno.readFile(path);
    const { text, invalid } = decodeUtf8(bytes);
    if (invalid) counts.invalid_utf8++;
    let arr: unknown;
    try {
      arr = JSON.parse(text);
    } catch {
      counts.malformed_json++;
      return;
    }
    if (!Array.isArray(arr)) {
      counts.malformed_json++;
      return;
    }
    for (const item of arr) {
      const doc = parseJsonLine(JSON.stringify(item));
      if (doc) yield doc;
      else counts.malformed_json++;
    }
    return;
  }
  let sawLine = false;
  for await (const bytes of readLineBytes(path, max, () => counts.oversized++, onBytes)) {
    if (bytes.length === 0 || (bytes.length === 1 && bytes[0] === 13)) continue;
    sawLine = true;
    const { text, invalid } = decodeUtf8(bytes);
    if (!text.trim()) continue;
    const doc = parseJsonLine(text);
    if (!doc) {
      counts.malformed_json++;
      continue;
    }
    if (invalid) counts.invalid_utf8++;
    yield doc;
  }
  if (!sawLine) counts.empty_files++;
}

/** Read one file by extension. */
async function* readFile(path: string, counts: MergeCounts, max: number, onBytes?: (n: number) => void) {
  const ext = extname(path).toLowerCase();
  if (JSON_EXTENSIONS.has(ext)) {
    counts.files++;
    yield* readJsonFile(path, counts, max, onBytes);
    return;
  }
  if (!TEXT_EXTENSIONS.has(ext)) {
    counts.skipped_files++;
    return;
  }
  counts.files++;
  const size = (await Deno.stat(path)).size;
  if (size > max) {
    counts.oversized++;
    return;
  }
  const bytes = await Deno.readFile(path);
  onBytes?.(bytes.length);
  if (bytes.length === 0) {
    counts.empty_files++;
    return;
  }
  if (looksBinary(bytes)) {
    counts.binary_files++;
    return;
  }
  const { text, invalid } = decodeUtf8(bytes);
  if (invalid) counts.invalid_utf8++;
  if (!text.trim()) {
    counts.empty_files++;
    return;
  }
  yield { text, url: basename(path) };
}

/**
 * Stream documents from a file or a folder tree (sorted, hidden entries and symlinks skipped).
 * Counts are updated in place as the stream advances.
 */
export async function* readDocuments(
  path: string,
  counts: MergeCounts,
  options: MergeOptions = {},
): AsyncGenerator<SourceDocument> {
  const max = options.maxDocumentBytes ?? 64 * 1024 * 1024;
  let base = 0;
  const onBytes = options.onBytes ? (n: number) => options.onBytes!(base + n) : undefined;
  const walk = async function* (p: string): AsyncGenerator<SourceDocument> {
    const info = await Deno.lstat(p);
    if (info.isSymlink) {
      counts.skipped_files++;
      return;
    }
    if (info.isDirectory) {
      const names: string[] = [];
      for await (const e of Deno.readDir(p)) if (!e.name.startsWith(".")) names.push(e.name);
      names.sort();
      for (const name of names) yield* walk(join(p, name));
      return;
    }
    if (!info.isFile) {
      counts.skipped_files++;
      return;
    }
    for await (const doc of readFile(p, counts, max, onBytes)) {
      counts.documents++;
      yield doc;
    }
    base += info.size;
  };
  yield* walk(path);
}

/**
 * Merge files and folders into one loose-JSON file at `outPath` (written to a temporary name and
 * renamed, so a failed merge leaves any previous file intact). Returns the counts.
 */
export async function mergeToLooseJson(
  paths: readonly string[],
  outPath: string,
  options: MergeOptions = {},
): Promise<MergeCounts> {
  const counts = emptyMergeCounts();
  const tmp = `${outPath}.tmp-${crypto.randomUUID().slice(0, 8)}`;
  const enc = new TextEncoder();
  try {
    using file = await Deno.open(tmp, { write: true, create: true, truncate: true });
    let pending: string[] = [], size = 0;
    const flush = async () => {
      const bytes = enc.encode(pending.join(""));
      for (let off = 0; off < bytes.length;) off += await file.write(bytes.subarray(off));
      pending = [];
      size = 0;
    };
    for (const p of paths) {
      for await (const doc of readDocuments(p, counts, options)) {
        const line = JSON.stringify(doc) + "\n";
        pending.push(line);
        size += line.length;
        if (size > 1 << 22) await flush();
      }
    }
    await flush();
  } catch (e) {
    await Deno.remove(tmp).catch(() => {});
    throw e;
  }
  await Deno.rename(tmp, outPath);
  return counts;
}
