/**
 * Stage 3: merge. Reads a file or a folder tree of `.txt` files and `.jsonl` / loose-JSON files
 * into one stream of documents, and can write that stream as loose JSON (one `{"text", ...}`
 * object per line, the format Megatron's preprocessing reads).
 *
 * Bad input never stops the stream: empty files, binary files, invalid UTF-8, lines over the size
 * cap, malformed JSON lines, JSON nested too deep and files that take too long are skipped (or
 * decoded lossily), counted in {@link MergeCounts} and reported one {@link FileIssue} per file
 * with the reason (line numbers included) through `onIssue`. Lines are read in bounded chunks, so
 * an enormous line costs at most the cap in memory; nesting depth is measured by a linear scan
 * before `JSON.parse`, so a file of deeply nested arrays is refused in time linear in its size.
 *
 * The time bound counts only the time spent decoding and parsing a file's own lines, never the
 * time the consumer takes between documents (tokenizing, waiting for workers) or I/O, so a
 * legitimate large file is never cut because the rest of the pipeline is slow. A file that is cut
 * (the rest of it dropped) is marked with `cut` in its issue, so the caller can refuse to call
 * the result whole. The stream reports where it stands ({@link ReadPosition}) and can start again
 * from such a position, which is how an interrupted preparation resumes without re-reading.
 */
import { basename, extname, join, relative } from "node:path";
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
  /** JSON lines or files nested deeper than the bound, skipped. */
  too_deep: number;
  /** Files abandoned for taking longer than the time bound. */
  timed_out: number;
}

/** One file that was skipped, or partly bad, and why. */
export interface FileIssue {
  /** The file, relative to the folder read (its name for a single file). */
  file: string;
  /** What was wrong, e.g. `binary (NUL bytes)` or `malformed JSON on lines 3, 7`. */
  reason: string;
  /** Set when the rest of the file was dropped: the line (or array item, from 0) it stopped at. */
  cut?: { line: number } | { item: number };
}

/**
 * Where a document stream stands, just after the last document it produced: the file (relative
 * to the folder read, or its name) and, in it, the byte offset and number of the next line (loose
 * JSON) or the items read (a JSON array). `file` is "" before the first document.
 */
export interface ReadPosition {
  /** The file of the last document produced. */
  file: string;
  /** Byte offset of the next line, in a loose-JSON file. */
  offset: number;
  /** Lines read so far, in a loose-JSON file. */
  line: number;
  /** Items read so far, in a JSON array file. */
  item: number;
}

/** A position before any document. */
export function startPosition(): ReadPosition {
  return { file: "", offset: 0, line: 0, item: 0 };
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
    too_deep: 0,
    timed_out: 0,
  };
}

/** Options of {@link readDocuments}. */
export interface MergeOptions {
  /** Largest line or `.txt` file accepted, in bytes (default 64 MiB). */
  maxDocumentBytes?: number;
  /** Called with bytes read so far (for progress). */
  onBytes?: (bytes: number) => void;
  /** Deepest JSON nesting accepted in a line or file (default {@link DEFAULT_MAX_JSON_DEPTH}). */
  maxJsonDepth?: number;
  /** Time one file may spend being decoded and parsed, in ms, before the rest of it is dropped (default 60000). */
  maxFileMs?: number;
  /** Updated in place as documents are produced (see {@link ReadPosition}). */
  position?: ReadPosition;
  /** Start just after this position (from `position` of an earlier, interrupted read). */
  resumeFrom?: ReadPosition;
  /** Called once per skipped or partly bad file, with the reason. */
  onIssue?: (issue: FileIssue) => void;
}

/** Default bound on JSON nesting: documents are `{"text": ...}` objects, so 64 is generous. */
export const DEFAULT_MAX_JSON_DEPTH = 64;

/**
 * Whether the JSON text nests arrays and objects deeper than `max`, by one linear scan that
 * skips strings (JSON.parse and JSON.stringify are superlinear on deep nesting).
 */
export function jsonTooDeep(text: string, max: number): boolean {
  // Most lines hold few brackets: when the openers alone cannot reach `max`, skip the scan (indexOf
  // runs natively, several times faster than the scan below).
  let opens = 0;
  for (const ch of ["[", "{"]) {
    for (let i = text.indexOf(ch); i >= 0 && opens <= max; i = text.indexOf(ch, i + 1)) opens++;
  }
  if (opens <= max) return false;
  let depth = 0, inString = false;
  for (let i = 0; i < text.length; i++) {
    const ch = text.charCodeAt(i);
    if (inString) {
      if (ch === 92) i++; // backslash: skip the escaped character
      else if (ch === 34) inString = false;
    } else if (ch === 34) inString = true;
    else if (ch === 91 || ch === 123) {
      if (++depth > max) return true;
    } else if (ch === 93 || ch === 125) depth--;
  }
  return false;
}

/** "3, 7, 9" or "3, 7, 9 and 12 more": line numbers for a reason. */
function lineList(lines: number[], total: number): string {
  return lines.join(", ") + (total > lines.length ? ` and ${total - lines.length} more` : "");
}

/** Collects line numbers per kind of problem in one file, up to 10 each. */
class LineProblems {
  #lines = new Map<string, { first: number[]; total: number }>();
  add(kind: string, line: number): void {
    let e = this.#lines.get(kind);
    if (!e) this.#lines.set(kind, e = { first: [], total: 0 });
    e.total++;
    if (e.first.length < 10) e.first.push(line);
  }
  /** The reason, or "" when nothing went wrong. */
  reason(): string {
    return [...this.#lines].map(([kind, e]) =>
      `${kind} on line${e.total > 1 ? "s" : ""} ${lineList(e.first, e.total)}`
    )
      .join("; ");
  }
}

/** Extensions read as one document per file. */
export const TEXT_EXTENSIONS: ReadonlySet<string> = new Set([".txt", ".text", ".md"]);
/** Extensions read as loose JSON (one object or string per line). */
export const JSON_EXTENSIONS: ReadonlySet<string> = new Set([".jsonl", ".json", ".ndjson"]);

/**
 * Stream the lines of a file as bytes, in bounded memory: lines over `maxBytes` are skipped and
 * reported through `onOversized`. With `at`, reading starts at byte `at.offset` and `at.offset`
 * is set, before each line is produced, to the offset just past it. With `views`, a line that
 * lies within one read is a view into the read buffer, valid only until the next line is asked
 * for (no copy: for a consumer that decodes each line at once); otherwise every line is a copy.
 */
export async function* readLineBytes(
  path: string,
  maxBytes: number,
  onOversized: () => void,
  onBytes?: (n: number) => void,
  at?: { offset: number },
  views = false,
): AsyncGenerator<Uint8Array> {
  using file = await Deno.open(path, { read: true });
  const buf = new Uint8Array(1 << 20);
  let parts: Uint8Array[] = [];
  let partLen = 0, skipping = false, total = at?.offset ?? 0;
  if (total > 0) await file.seek(total, Deno.SeekMode.Start);
  while (true) {
    const n = await file.read(buf);
    if (n === null) break;
    const chunkBase = total;
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
          if (at) at.offset = chunkBase + nl + 1;
          yield views ? chunk.subarray(start, end) : chunk.slice(start, end);
        } else {
          parts.push(chunk.slice(start, end));
          partLen += end - start;
        }
      }
      if (nl < 0) break;
      if (!skipping && parts.length > 0) {
        if (at) at.offset = chunkBase + nl + 1;
        yield concat(parts, partLen);
        parts = [];
        partLen = 0;
      }
      skipping = false;
      start = nl + 1;
    }
  }
  if (!skipping && partLen > 0) {
    if (at) at.offset = total;
    yield concat(parts, partLen);
  }
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
  return docFromValue(v);
}

/** A document from a parsed JSON value: a string, or an object with a string `text`. */
function docFromValue(v: unknown): SourceDocument | undefined {
  if (typeof v === "string") return { text: v };
  if (v && typeof v === "object" && typeof (v as { text?: unknown }).text === "string") {
    const o = v as { text: string; url?: unknown };
    return typeof o.url === "string" ? { text: o.text, url: o.url } : { text: o.text };
  }
  return undefined;
}

/** What reading one file needs: counts, bounds, where issues go and where the stream stands. */
interface FileContext {
  counts: MergeCounts;
  max: number;
  maxDepth: number;
  maxMs: number;
  issue: (reason: string, cut?: FileIssue["cut"]) => void;
  onBytes?: (n: number) => void;
  /** The stream's position, updated before each document (file already set). */
  pos: ReadPosition;
  /** Resuming inside this file: start after this position. */
  from?: ReadPosition;
}

/** Read a loose-JSON file (or a JSON array file) into documents. */
async function* readJsonFile(path: string, f: FileContext): AsyncGenerator<SourceDocument> {
  const head = new Uint8Array(64);
  let first = "";
  {
    using file = await Deno.open(path, { read: true });
    const n = (await file.read(head)) ?? 0;
    first = new TextDecoder().decode(head.subarray(0, n)).trimStart();
  }
  if (first.startsWith("[")) yield* readJsonArray(path, f);
  else yield* readJsonLines(path, f);
}

/*
 * Only decoding and parsing count towards a file's time bound (FileContext.maxMs): the clock runs
 * in the synchronous work on each line or item, and stops while the consumer holds a document or
 * a read is awaited.
 */

/** Read a file holding a single JSON array of documents. */
async function* readJsonArray(path: string, f: FileContext): AsyncGenerator<SourceDocument> {
  const { counts, pos } = f;
  let busy = 0;
  const late = () => busy >= f.maxMs;
  const size = (await Deno.stat(path)).size;
  if (size > f.max) {
    counts.oversized++;
    return f.issue(`oversized: ${size} bytes, over the ${f.max}-byte cap`);
  }
  const bytes = await Deno.readFile(path);
  f.onBytes?.(bytes.length);
  const t0 = performance.now();
  const { text, invalid } = decodeUtf8(bytes);
  if (invalid && !f.from) counts.invalid_utf8++;
  if (jsonTooDeep(text, f.maxDepth)) {
    counts.too_deep++;
    return f.issue(`too deep: JSON nested more than ${f.maxDepth} levels`);
  }
  let arr: unknown;
  try {
    arr = JSON.parse(text);
  } catch (e) {
    counts.malformed_json++;
    return f.issue(`malformed JSON: ${(e as Error).message}`);
  }
  busy += performance.now() - t0;
  if (!Array.isArray(arr)) {
    counts.malformed_json++;
    return f.issue("malformed JSON: not an array of documents");
  }
  const bad: number[] = [];
  let badTotal = 0;
  for (let i = f.from?.item ?? 0; i < arr.length; i++) {
    if (late()) {
      counts.timed_out++;
      return f.issue(`timed out: parsing took longer than ${f.maxMs} ms, stopped at item ${i}`, {
        item: i,
      });
    }
    const doc = docFromValue(arr[i]);
    if (doc) {
      pos.item = i + 1;
      yield doc;
    } else {
      counts.malformed_json++;
      if (badTotal++ < 10) bad.push(i);
    }
  }
  const reasons = [
    ...(invalid ? ["invalid UTF-8 (decoded with U+FFFD)"] : []),
    ...(badTotal ? [`malformed documents at item${badTotal > 1 ? "s" : ""} ${lineList(bad, badTotal)}`] : []),
  ];
  if (reasons.length) f.issue(reasons.join("; "));
}

/** Read a loose-JSON file: one document per line. */
async function* readJsonLines(path: string, f: FileContext): AsyncGenerator<SourceDocument> {
  const { counts, pos } = f;
  let busy = 0;
  const late = () => busy >= f.maxMs;
  let sawLine = !!f.from, line = f.from?.line ?? 0;
  const problems = new LineProblems();
  const oversized = () => {
    counts.oversized++;
    problems.add(`over the ${f.max}-byte cap`, ++line);
  };
  const at = { offset: f.from?.offset ?? 0 };
  // Each line is decoded before the next is read: views into the read buffer, not copies.
  for await (const bytes of readLineBytes(path, f.max, oversized, f.onBytes, at, true)) {
    line++;
    if (late()) {
      counts.timed_out++;
      const rest = problems.reason();
      return f.issue(
        `timed out: parsing took longer than ${f.maxMs} ms, stopped at line ${line}${
          rest ? `; ${rest}` : ""
        }`,
        { line },
      );
    }
    if (bytes.length === 0 || (bytes.length === 1 && bytes[0] === 13)) continue;
    sawLine = true;
    const t0 = performance.now();
    const { text, invalid } = decodeUtf8(bytes);
    if (!text.trim()) continue;
    if (jsonTooDeep(text, f.maxDepth)) {
      counts.too_deep++;
      problems.add(`JSON nested more than ${f.maxDepth} levels`, line);
      continue;
    }
    const doc = parseJsonLine(text);
    busy += performance.now() - t0;
    if (!doc) {
      counts.malformed_json++;
      problems.add("malformed JSON", line);
      continue;
    }
    if (invalid) {
      counts.invalid_utf8++;
      problems.add("invalid UTF-8", line);
    }
    pos.offset = at.offset;
    pos.line = line;
    yield doc;
  }
  if (!sawLine) counts.empty_files++;
  const reason = problems.reason();
  if (reason) f.issue(reason);
  else if (!sawLine) f.issue("empty");
}

/** Read one file by extension. */
async function* readFile(path: string, f: FileContext): AsyncGenerator<SourceDocument> {
  const { counts } = f;
  const ext = extname(path).toLowerCase();
  if (JSON_EXTENSIONS.has(ext)) {
    if (!f.from) counts.files++;
    yield* readJsonFile(path, f);
    return;
  }
  if (f.from) return; // a one-document file whose document was read before the interruption
  if (!TEXT_EXTENSIONS.has(ext)) {
    counts.skipped_files++;
    return f.issue(ext ? `unsupported extension "${ext}"` : "unsupported file: no extension");
  }
  counts.files++;
  const size = (await Deno.stat(path)).size;
  if (size > f.max) {
    counts.oversized++;
    return f.issue(`oversized: ${size} bytes, over the ${f.max}-byte cap`);
  }
  const bytes = await Deno.readFile(path);
  f.onBytes?.(bytes.length);
  if (bytes.length === 0) {
    counts.empty_files++;
    return f.issue("empty");
  }
  if (looksBinary(bytes)) {
    counts.binary_files++;
    return f.issue("binary (NUL bytes)");
  }
  const { text, invalid } = decodeUtf8(bytes);
  if (invalid) {
    counts.invalid_utf8++;
    f.issue("invalid UTF-8 (decoded with U+FFFD)");
  }
  if (!text.trim()) {
    counts.empty_files++;
    return f.issue("empty (whitespace only)");
  }
  yield { text, url: basename(path) };
}

/**
 * Stream documents from a file or a folder tree (sorted, hidden entries and symlinks skipped).
 * Counts are updated in place as the stream advances, and so is `options.position`; with
 * `options.resumeFrom` (a position saved earlier, counts restored by the caller) files before its
 * file are skipped unread and that file is read on from just after it.
 */
export async function* readDocuments(
  path: string,
  counts: MergeCounts,
  options: MergeOptions = {},
): AsyncGenerator<SourceDocument> {
  const max = options.maxDocumentBytes ?? 64 * 1024 * 1024;
  let base = 0;
  const onBytes = options.onBytes ? (n: number) => options.onBytes!(base + n) : undefined;
  const top = await Deno.lstat(path);
  const nameOf = (p: string) => top.isDirectory ? relative(path, p) : basename(p);
  const pos = options.position ?? startPosition();
  let skipTo = options.resumeFrom?.file || undefined;
  const context = (p: string, from?: ReadPosition): FileContext => ({
    counts,
    max,
    maxDepth: options.maxJsonDepth ?? DEFAULT_MAX_JSON_DEPTH,
    maxMs: options.maxFileMs ?? 60_000,
    issue: (reason, cut) => options.onIssue?.({ file: nameOf(p), reason, ...(cut ? { cut } : {}) }),
    onBytes,
    pos,
    ...(from ? { from } : {}),
  });
  const walk = async function* (p: string): AsyncGenerator<SourceDocument> {
    const info = await Deno.lstat(p);
    if (skipTo !== undefined && !info.isDirectory) {
      // Resuming: files before the saved position were read (and counted) already.
      if (nameOf(p) !== skipTo) {
        base += info.isFile ? info.size : 0;
        return;
      }
      skipTo = undefined;
      Object.assign(pos, options.resumeFrom!);
      for await (const doc of readFile(p, context(p, options.resumeFrom!))) {
        counts.documents++;
        yield doc;
      }
      base += info.size;
      return;
    }
    if (info.isSymlink) {
      counts.skipped_files++;
      context(p).issue("symlink (not followed)");
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
      context(p).issue("not a regular file");
      return;
    }
    Object.assign(pos, { file: nameOf(p), offset: 0, line: 0, item: 0 });
    for await (const doc of readFile(p, context(p))) {
      counts.documents++;
      yield doc;
    }
    base += info.size;
  };
  yield* walk(path);
  if (skipTo !== undefined) {
    throw new Error(`Cannot resume reading "${path}": file "${skipTo}" is no longer there`);
  }
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
