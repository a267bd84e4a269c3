/**
 * On-disk layout of prepared datasets and read access to it.
 *
 * `<root>/datasets/<id>/` holds `manifest.json`, `train.bin`, `valid.bin`, `test.bin` (raw
 * little-endian uint16 tokens, each document followed by 50256) and `documents.idx` (uint64 LE
 * start offsets of every document in the concatenation train ++ valid ++ test, then the total).
 * A dataset directory appears only by an atomic rename of a finished temporary directory, so a
 * reader never sees a half-written dataset and a failed preparation never damages an old one.
 */
import { isAbsolute, join, relative, resolve } from "node:path";

/** Names of the three splits. */
export const SPLITS = ["train", "valid", "test"] as const;
/** One split's name. */
export type SplitName = typeof SPLITS[number];

/** Token counts per split. */
export interface SplitCounts {
  /** Training tokens. */
  train: number;
  /** Validation tokens. */
  valid: number;
  /** Test tokens. */
  test: number;
}

/** A prepared dataset, as `manifest.json` records it and the API reports it. */
export interface DatasetInfo {
  /** Dataset id: its folder name under `<root>/datasets/`. */
  id: string;
  /** Documents kept (after cleaning, the token minimum and dedup). */
  documents: number;
  /** Tokens in all splits, `<|endoftext|>` separators included. */
  tokens: number;
  /** Tokens per split. */
  splits: SplitCounts;
  /** Manifest format version. */
  format?: string;
  /** The source, described (e.g. `{"builtin": "sotu"}`, `{"path": "web/"}`). */
  source?: Record<string, unknown>;
  /** Tokenizer facts: name, vocabulary size, end-of-text id, dtype. */
  tokenizer?: { name: string; vocab_size: number; eot: number; dtype: "uint16" };
  /** The options the dataset was prepared with. */
  options?: Record<string, unknown>;
  /** Counts of every stage: URLs, downloads, merge, clean, dedup. */
  stats?: Record<string, unknown>;
  /** Per file: bytes and SHA-256. */
  files?: Record<string, { bytes: number; sha256: string }>;
  /** SHA-256 over the three split files' checksums, in order train, valid, test. */
  checksum?: string;
  /** When it was prepared (ISO 8601). */
  created_at?: string;
  /** Seconds spent preparing. */
  seconds?: number;
}

/** Valid dataset ids: letters, digits, `-`, `_`, `.` (not leading), at most 64 characters. */
export const DATASET_ID_RE = /^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$/;

/** Throw unless `id` is a valid dataset id. */
export function checkDatasetId(id: string): void {
  if (!DATASET_ID_RE.test(id) || id.includes("..")) {
    throw new Error(`Invalid dataset id "${id}": use 1-64 letters, digits, ".", "-" or "_"`);
  }
}

/** The folder holding all datasets. */
export function datasetsDir(root: string): string {
  return join(root, "datasets");
}

/** The folder of dataset `id`. */
export function datasetDir(root: string, id: string): string {
  checkDatasetId(id);
  return join(datasetsDir(root), id);
}

/** Raised when a path escapes the data root (the HTTP layer answers 403). */
export class PathOutsideRootError extends Error {
  /** The offending path as given. */
  readonly path: string;
  /** An error naming `path`. */
  constructor(path: string, root: string) {
    super(`Path "${path}" is outside the data root "${root}"`);
    this.name = "PathOutsideRootError";
    this.path = path;
  }
}

/**
 * Resolve `path` (relative to `root`, or absolute) and check that it lies under `root`, symlinks
 * resolved. Throws {@link PathOutsideRootError} if not, and a "Cannot read" error if it is missing.
 */
export async function resolveUnderRoot(root: string, path: string): Promise<string> {
  const rootReal = await Deno.realPath(root).catch(() => resolve(root));
  const candidate = isAbsolute(path) ? resolve(path) : resolve(rootReal, path);
  const inside = (p: string) => {
    const rel = relative(rootReal, p);
    return rel === "" || (!rel.startsWith("..") && !isAbsolute(rel));
  };
  if (!inside(candidate)) throw new PathOutsideRootError(path, root);
  let real: string;
  try {
    real = await Deno.realPath(candidate);
  } catch (e) {
    throw new Error(`Cannot read "${path}": ${(e as Error).message}`);
  }
  if (!inside(real)) throw new PathOutsideRootError(path, root);
  return real;
}

/** Read the manifest of dataset `id`, or undefined if it does not exist. */
export async function getDataset(root: string, id: string): Promise<DatasetInfo | undefined> {
  if (!DATASET_ID_RE.test(id)) return undefined;
  let text: string;
  try {
    text = await Deno.readTextFile(join(datasetDir(root, id), "manifest.json"));
  } catch (e) {
    if (e instanceof Deno.errors.NotFound) return undefined;
    throw new Error(`Cannot read manifest of dataset "${id}": ${(e as Error).message}`);
  }
  try {
    return JSON.parse(text) as DatasetInfo;
  } catch (e) {
    throw new Error(`Cannot parse manifest of dataset "${id}": ${(e as Error).message}`);
  }
}

/** All prepared datasets under `root`, sorted by id. Unreadable entries are skipped. */
export async function listDatasets(root: string): Promise<DatasetInfo[]> {
  const out: DatasetInfo[] = [];
  let entries: Deno.DirEntry[] = [];
  try {
    entries = await Array.fromAsync(Deno.readDir(datasetsDir(root)));
  } catch (e) {
    if (e instanceof Deno.errors.NotFound) return [];
    throw e;
  }
  for (const e of entries.sort((a, b) => a.name.localeCompare(b.name))) {
    if (!e.isDirectory || e.name.startsWith(".")) continue;
    const info = await getDataset(root, e.name).catch(() => undefined);
    if (info) out.push(info);
  }
  return out;
}

/** Load one split's tokens. Throws an error naming the dataset and split if it is missing. */
export async function loadSplit(root: string, id: string, split: SplitName): Promise<Uint16Array> {
  if (!(SPLITS as readonly string[]).includes(split)) {
    throw new Error(`Unknown split "${split}": expected "train", "valid" or "test"`);
  }
  if (!DATASET_ID_RE.test(id)) throw new Error(`Dataset "${id}" not found under "${root}"`);
  const path = join(datasetDir(root, id), `${split}.bin`);
  let bytes: Uint8Array;
  try {
    bytes = await Deno.readFile(path);
  } catch (e) {
    if (e instanceof Deno.errors.NotFound) {
      throw new Error(`Split "${split}" of dataset "${id}" not found at "${path}"`);
    }
    throw new Error(`Cannot read split "${split}" of dataset "${id}" at "${path}": ${(e as Error).message}`);
  }
  if (bytes.byteLength % 2 !== 0) {
    throw new Error(`Split "${split}" of dataset "${id}" is corrupt: odd byte length ${bytes.byteLength}`);
  }
  // Deno.readFile returns an exactly sized, 0-offset buffer; the platform is little-endian like the file.
  return new Uint16Array(bytes.buffer, bytes.byteOffset, bytes.byteLength / 2);
}

/** Load the document index: start offsets of documents in train ++ valid ++ test, then the total. */
export async function loadDocumentIndex(root: string, id: string): Promise<BigUint64Array> {
  const bytes = await Deno.readFile(join(datasetDir(root, id), "documents.idx"));
  return new BigUint64Array(bytes.buffer, bytes.byteOffset, bytes.byteLength / 8);
}
