/**
 * The end-to-end preparation: source → (URLs → download) → merge → clean → min-token filter →
 * MinHash/LSH dedup → GPT-2 tokens → train/valid/test split → `<root>/datasets/<id>/`.
 *
 * Streaming throughout, in bounded memory: documents flow in batches through a worker pool
 * (clean, tokenize and signature per core) while the main thread keeps only the LSH index (typed
 * arrays, a fixed number of bytes per kept document; see minhash.ts); tokens, token counts and
 * fingerprints of kept documents go straight to disk. Everything is written in a work folder that
 * is committed shard by shard (so a killed preparation resumes where it stopped) and renamed into
 * place at the end, so nothing already prepared is lost or corrupted by a failure half-way.
 */
import { createHash } from "node:crypto";
import { join, relative } from "node:path";
import { BUILTIN_DEFAULT_SPLIT, type BuiltinName, isBuiltinName } from "./builtin.ts";
import type { DownloadOptions } from "./download.ts";
import type { FileIssue } from "./merge.ts";
import { DEFAULT_MINHASH, LshIndex, type MinHashParams } from "./minhash.ts";
import { CHAT_DEFAULT_SPLIT, type ChatOnError, prepareChatDataset } from "./chat_dataset.ts";
import { DEFAULT_SPLIT, parseSplitWeights, splitSizes } from "./split.ts";
import {
  checkDatasetId,
  datasetDir,
  type DatasetInfo,
  datasetsDir,
  getDataset,
  resolveUnderRoot,
  type SplitCounts,
  SPLITS,
} from "./store.ts";
import {
  copyRange,
  diskFull,
  hashFile,
  treeFingerprint,
  writeAtomic,
  writeDocumentIndex,
} from "./prepare_io.ts";
import { openSource } from "./prepare_sources.ts";
import {
  type Journal,
  type LoadedJournal,
  loadJournal,
  type Stats,
  tokenizeShards,
} from "./prepare_shards.ts";

/** Where a dataset's documents come from: exactly one of these. */
export type DatasetSource =
  | { builtin: BuiltinName }
  | { path: string }
  | { urls: string[] }
  | { url_list: string }
  | { texts: string[] };

/** Options of {@link prepareDataset} (snake_case, as in the HTTP body). */
export interface PrepareOptions {
  /** Dataset id (default: the built-in's name, or derived from the source and options). */
  id?: string;
  /** Documents with fewer GPT-2 tokens are dropped (default 128, as in the seed). */
  min_tokens?: number;
  /** Jaccard similarity at or above which a document is a near-duplicate (default 0.8); 1 keeps all but exact shingle matches. */
  dedup_threshold?: number;
  /** Turn near-duplicate removal off (default true: on). */
  dedup?: boolean;
  /** MinHash hash functions (default 128). */
  num_perm?: number;
  /** Words per shingle (default 5). */
  shingle_size?: number;
  /** Split weights train, valid, test (default "949,50,1"; "98,1,1" for the small built-in moby-dick). */
  split?: string | number[];
  /** Every split with positive weight must hold one window of seq_len + 1 tokens (default DEFAULT_PREPARE_SEQ_LEN, 1024). */
  seq_len?: number;
  /** Read at most this many source documents (a quick subset, e.g. for tests). */
  max_documents?: number;
  /** Tokenize workers (default: all cores). */
  workers?: number;
  /** Prepare again even if a dataset with the same id, source and options exists. */
  force?: boolean;
  /** Domains dropped from URL sources (default: the built-in blacklist). */
  blacklist?: string[];
  /** Download settings for URL sources. */
  download?: DownloadOptions;
  /** Largest `.txt` file or JSON line read, in bytes (default 64 MiB). */
  max_document_bytes?: number;
  /** Accept `path` / `url_list` sources outside the root (the CLI's choice; never set from HTTP). */
  allow_any_path?: boolean;
  /** The folder `path` / `url_list` sources must lie in, and are recorded relative to (default: the root). */
  sources_root?: string;
  /**
   * Time one source file may spend being decoded and parsed, in ms (default 60000; waiting for the
   * tokenizer does not count). A file over it is cut: the preparation fails unless `allow_partial`.
   */
  max_file_ms?: number;
  /**
   * Publish a dataset even when a source file was cut (the documents read before the cut), marked
   * `partial: true` with the `cut` files in its manifest (default false: the preparation fails).
   */
  allow_partial?: boolean;
  /** Source characters per committed shard, the unit a resumed preparation restarts from (default 64 Mi). */
  shard_chars?: number;
  /**
   * "chat": the `path` source is a JSONL file of conversations (data/chat_dataset.ts), split by
   * conversations (default "90,10,0"); the text pipeline's cleaning, dedup and token options do
   * not apply. Default "text".
   */
  format?: "text" | "chat";
  /** Chat datasets: bad lines are left out ("skip") or fail the preparation ("refuse", the default). */
  on_error?: ChatOnError;
}

/** Progress of a preparation. */
export interface Progress {
  /** The dataset id. */
  id: string;
  /** Current stage. */
  stage: "urls" | "download" | "tokenize" | "split" | "done";
  /** Units done in this stage (bytes for tokenize, URLs for download). */
  done: number;
  /** Units in this stage, when known. */
  total?: number;
  /** Source documents read so far. */
  documents_read: number;
  /** Documents kept so far. */
  documents: number;
  /** Tokens kept so far. */
  tokens: number;
  /** Source bytes (characters for in-memory sources) per second in this run, in the tokenize stage. */
  rate?: number;
  /** Seconds left in the tokenize stage at that rate. */
  eta_s?: number;
  /** Shards committed: a preparation interrupted now would resume after the last one. */
  shards?: number;
  /** Source bytes done by an earlier, interrupted run that this one resumed from. */
  resumed_bytes?: number;
}

/** Source characters per committed shard (the unit of resumption). */
const SHARD_CHARS = 1 << 26;
/**
 * The window a prepared split must hold at least one of by default (seq_len + 1 tokens): GPT-2's
 * context, so a dataset prepared with defaults serves training and evaluation at any sequence
 * length a GPT-2 model takes. A check on the data, not a training or evaluation default (those are
 * in job/job_config.ts); part of every dataset's options, so changing it renames and re-prepares
 * datasets (a built-in keeps its plain name only with default options).
 */
export const DEFAULT_PREPARE_SEQ_LEN = 1024;

/** A short SHA-256 hex digest of a string. */
function shortHash(s: string): string {
  return createHash("sha256").update(s).digest("hex").slice(0, 10);
}

/** Normalised options, defaults applied. */
function resolveOptions(o: PrepareOptions, defaultSplit: readonly number[] = DEFAULT_SPLIT) {
  const min_tokens = o.min_tokens ?? 128;
  if (!Number.isInteger(min_tokens) || min_tokens < 0) {
    throw new RangeError(`min_tokens must be a non-negative integer, got ${min_tokens}`);
  }
  const dedup_threshold = o.dedup_threshold ?? 0.8;
  if (!(dedup_threshold > 0 && dedup_threshold <= 1)) {
    throw new RangeError(`dedup_threshold must be in (0, 1], got ${dedup_threshold}`);
  }
  const seq_len = o.seq_len ?? DEFAULT_PREPARE_SEQ_LEN;
  if (!Number.isInteger(seq_len) || seq_len < 1) {
    throw new RangeError(`seq_len must be a positive integer, got ${seq_len}`);
  }
  const num_perm = o.num_perm ?? DEFAULT_MINHASH.numPerm;
  const shingle_size = o.shingle_size ?? DEFAULT_MINHASH.shingleSize;
  if (!Number.isInteger(num_perm) || num_perm < 8 || num_perm > 1024) {
    throw new RangeError(`num_perm must be an integer in [8, 1024], got ${num_perm}`);
  }
  if (!Number.isInteger(shingle_size) || shingle_size < 1 || shingle_size > 32) {
    throw new RangeError(`shingle_size must be an integer in [1, 32], got ${shingle_size}`);
  }
  const max_file_ms = o.max_file_ms;
  if (max_file_ms !== undefined && !(Number.isFinite(max_file_ms) && max_file_ms >= 0)) {
    throw new RangeError(`max_file_ms must be a non-negative number, got ${max_file_ms}`);
  }
  const max_documents = o.max_documents;
  if (max_documents !== undefined && (!Number.isInteger(max_documents) || max_documents < 1)) {
    throw new RangeError(`max_documents must be a positive integer, got ${max_documents}`);
  }
  return {
    min_tokens,
    dedup: o.dedup ?? true,
    dedup_threshold,
    num_perm,
    shingle_size,
    split: parseSplitWeights(o.split ?? defaultSplit),
    seq_len,
    ...(max_documents !== undefined ? { max_documents } : {}),
    // Only when set, so that default ids and cache keys stay as they were.
    ...(max_file_ms !== undefined ? { max_file_ms } : {}),
    ...(o.allow_partial ? { allow_partial: true } : {}),
  };
}

/** Which single key a source uses, validated. */
function sourceKind(source: DatasetSource): "builtin" | "path" | "urls" | "url_list" | "texts" {
  const keys = Object.keys(source ?? {});
  if (keys.length !== 1) {
    throw new Error(
      `Source must name exactly one of "builtin", "path", "urls", "url_list", "texts"; got ${
        JSON.stringify(source)
      }`,
    );
  }
  return keys[0] as ReturnType<typeof sourceKind>;
}

/** A resolved preparation: what {@link planDataset} decides before any work starts. */
export interface DatasetPlan {
  /** The dataset id. */
  id: string;
  /** Which source key is used. */
  kind: "builtin" | "path" | "urls" | "url_list" | "texts";
  /** A stable description of the source (recorded in the manifest). */
  describe: Record<string, unknown>;
  /** Real path of a `path` or `url_list` source. */
  resolvedPath?: string;
  /** Hash of source and options: a dataset with the same key is reused. */
  sourceKey: string;
  /** Options with defaults applied. */
  opts: ReturnType<typeof resolveOptions>;
}

/**
 * Validate a source and options and decide the dataset id, without preparing anything. Throws
 * {@link PathOutsideRootError} for a path outside the root and a clear error for bad options.
 */
export async function planDataset(
  root: string,
  source: DatasetSource,
  options: PrepareOptions = {},
): Promise<DatasetPlan> {
  const kind = sourceKind(source);
  const builtinName = (source as { builtin?: string })?.builtin;
  const chat = options.format === "chat";
  if (chat && kind !== "path") {
    throw new Error(`Chat datasets are read from a JSONL file of conversations: use "path", not "${kind}"`);
  }
  const defaultSplit = chat
    ? CHAT_DEFAULT_SPLIT
    : builtinName && isBuiltinName(builtinName)
    ? BUILTIN_DEFAULT_SPLIT[builtinName]
    : DEFAULT_SPLIT;
  const opts = resolveOptions(options, defaultSplit);
  // Describe the source stably (for the id and cache key) and resolve paths under the root.
  let describe: Record<string, unknown>;
  let resolvedPath: string | undefined;
  let baseName: string;
  if (kind === "builtin") {
    const name = (source as { builtin: string }).builtin;
    if (!isBuiltinName(name)) {
      throw new Error(`Unknown built-in dataset "${name}": expected "sotu" or "moby-dick"`);
    }
    describe = { builtin: name };
    baseName = name;
  } else if (kind === "path" || kind === "url_list") {
    const p = (source as Record<string, string>)[kind];
    if (typeof p !== "string" || !p) throw new Error(`Source "${kind}" must be a non-empty string`);
    resolvedPath = options.allow_any_path
      ? await Deno.realPath(p).catch((e) => {
        throw new Error(`Cannot read "${p}": ${(e as Error).message}`);
      })
      : await resolveUnderRoot(options.sources_root ?? root, p);
    const rootReal = await Deno.realPath(options.sources_root ?? root).catch(() =>
      options.sources_root ?? root
    );
    const rel = options.allow_any_path && relative(rootReal, resolvedPath).startsWith("..")
      ? resolvedPath
      : relative(rootReal, resolvedPath) || ".";
    // The fingerprint makes an edited file or folder a different source (not a stale cache hit).
    describe = { [kind]: rel, fingerprint: await treeFingerprint(resolvedPath) };
    baseName = rel.split(/[\\/]/).filter(Boolean).pop()?.replace(/\.[^.]*$/, "") || "data";
  } else if (kind === "urls" || kind === "texts") {
    const list = (source as Record<string, unknown>)[kind];
    if (!Array.isArray(list) || list.some((x) => typeof x !== "string")) {
      throw new Error(`Source "${kind}" must be an array of strings`);
    }
    if (list.length === 0) throw new Error(`Source "${kind}" is empty`);
    describe = {
      [kind]: list.length,
      sha256: createHash("sha256").update(JSON.stringify(list)).digest("hex"),
    };
    baseName = kind;
  } else {
    throw new Error(`Unknown source "${kind}": expected "builtin", "path", "urls", "url_list" or "texts"`);
  }
  const keyOptions = {
    ...opts,
    blacklist: options.blacklist ?? null,
    ...(chat ? { format: "chat", on_error: options.on_error ?? "refuse" } : {}),
  };
  const sourceKey = shortHash(JSON.stringify({ describe, keyOptions }));
  const defaults = JSON.stringify(resolveOptions({}, defaultSplit)) === JSON.stringify(opts) &&
    !options.blacklist;
  const id = options.id ??
    (kind === "builtin" && defaults
      ? baseName
      : `${baseName.replace(/[^A-Za-z0-9._-]/g, "_").slice(0, 40) || "data"}-${sourceKey.slice(0, 8)}`);
  checkDatasetId(id);
  if (options.id !== undefined && kind !== "builtin" && isBuiltinName(options.id)) {
    throw new DatasetExistsError(
      options.id,
      `Dataset id "${options.id}" is a built-in dataset's: choose another id`,
    );
  }

  return { id, kind, describe, ...(resolvedPath ? { resolvedPath } : {}), sourceKey, opts };
}

/** A named dataset id that holds other data (or a built-in's): preparing over it needs `force`. */
export class DatasetExistsError extends Error {
  constructor(readonly id: string, message: string) {
    super(message);
    this.name = "DatasetExistsError";
  }
}

/**
 * Refuses to replace dataset `id`, named by the caller, when it was prepared from another source
 * or with other options (`force` replaces it): jobs that read it, or will resume on it, would
 * silently train on other data. A derived id names its source, so it is prepared again as before.
 */
export function checkReplace(
  id: string,
  named: boolean,
  existing: object | undefined,
  sourceKey: string,
  force: boolean | undefined,
): void {
  const key = (existing as { source_key?: string } | undefined)?.source_key;
  if (!named || force || existing === undefined || key === sourceKey) return;
  throw new DatasetExistsError(
    id,
    `Dataset "${id}" exists, prepared from another source or with other options: choose another id, ` +
      `or set force (--force) to replace it`,
  );
}

/** The work folder of a preparation: stable for one id and source key, so a rerun finds it. */
export function workDir(root: string, id: string, sourceKey: string): string {
  return join(datasetsDir(root), `.work-${id}-${sourceKey}`);
}

/**
 * Remove the work folders of dataset `id` other than `keep` (left by an interrupted preparation of
 * the same id with another source or options, which a preparation of `keep` would never resume),
 * unless a running preparation holds their lock.
 */
async function removeStaleWork(root: string, id: string, keep: string): Promise<void> {
  const prefix = `.work-${id}-`;
  const entries = await Array.fromAsync(Deno.readDir(datasetsDir(root))).catch(() => []);
  for (const e of entries) {
    const dir = join(datasetsDir(root), e.name);
    if (!e.isDirectory || !e.name.startsWith(prefix) || dir === keep) continue;
    // The id is what follows ".work-" up to the 10-hex-digit key: another id sharing the prefix
    // (id "a" and id "a-b") is not this one's.
    if (!/^[0-9a-f]{10}$/.test(e.name.slice(prefix.length))) continue;
    try {
      using lock = await Deno.open(join(dir, "lock"), { write: true, create: true });
      if (await lock.tryLock(true)) await Deno.remove(dir, { recursive: true });
    } catch {
      // Gone already, or not ours to remove: leave it.
    }
  }
}

/**
 * Prepare a dataset from `source` under `<root>/datasets/<id>/` and return its manifest. A dataset
 * with the same id, source and options is reused as it is (unless `force`); `{builtin: "sotu"}`
 * with default options has the id "sotu". Throws with a clear message when nothing is left to
 * train on, a split is too small for one sequence, or a source file was cut (unless
 * `allow_partial`).
 *
 * Work happens in `<root>/datasets/.work-<id>-<key>/` in stages: tokens, token counts and dedup
 * fingerprints of kept documents are appended to files, and every `shard_chars` characters of
 * source a journal records their committed lengths with the reader's position and the counts. A
 * preparation killed at any point (crash, SIGKILL, out of memory, full disk) and started again
 * with the same source and options resumes from its last committed shard, rebuilding the dedup
 * index from the fingerprints, and publishes the same bytes as an uninterrupted run. A failure for
 * any other cause removes the work folder. A file lock keeps two preparations off one folder: a
 * second one waits for the first, then returns what it published.
 */
export async function prepareDataset(
  root: string,
  source: DatasetSource,
  options: PrepareOptions = {},
  onProgress?: (p: Progress) => void,
): Promise<DatasetInfo> {
  const started = performance.now();
  const plan = await planDataset(root, source, options);
  const { id, resolvedPath, sourceKey, describe, opts } = plan;
  const existing = await getDataset(root, id).catch(() => undefined);
  checkReplace(
    id,
    options.id !== undefined,
    existing as { source_key?: string } | undefined,
    sourceKey,
    options.force,
  );
  if (options.format === "chat") {
    const file = (source as { path: string }).path;
    const chat = { id, resolvedPath: resolvedPath!, file, sourceKey, describe, split: opts.split };
    return await prepareChatDataset(root, { ...chat, onError: options.on_error ?? "refuse" }, options.force);
  }
  if (!options.force && existing && (existing as { source_key?: string }).source_key === sourceKey) {
    return existing;
  }
  const shardChars = shardCharsOf(options);

  const progress: Progress = { id, stage: "tokenize", done: 0, documents_read: 0, documents: 0, tokens: 0 };
  const report = () => onProgress?.({ ...progress });
  const work = workDir(root, id, sourceKey), out = join(work, "out");
  await removeStaleWork(root, id, work);
  await Deno.mkdir(out, { recursive: true });
  using lock = await Deno.open(join(work, "lock"), { write: true, create: true });
  if (!(await lock.tryLock(true))) {
    // Another preparation of the same dataset is running (two jobs asking for a builtin dataset at
    // once, say): wait for it, then take what it published, or carry on from its work if it failed.
    await lock.lock(true);
    await lock.unlock();
    return await prepareDataset(root, source, options, onProgress);
  }
  let lsh: LshIndex | undefined;
  try {
    const journalPath = join(work, "journal.json");
    const journal = await loadJournal(journalPath, sourceKey);
    const { state, stats, cuts } = journal;
    const commit = () => writeAtomic(journalPath, JSON.stringify(state));

    // Stages 1-3: turn the source into a document stream (resuming after the committed position).
    const run = { journal, commit, progress, report };
    const { docs, position, totalBytes } = await openSource({ ...run, source, plan, options, out });
    startTokenizeProgress(progress, journal, totalBytes);
    report();

    // Stages 4-6: clean, filter, dedup, tokenize (workers) and append tokens (here), in shards.
    const minhash: MinHashParams | null = opts.dedup
      ? { numPerm: opts.num_perm, shingleSize: opts.shingle_size, seed: DEFAULT_MINHASH.seed }
      : null;
    lsh = minhash ? openLsh(minhash, opts, work, stats) : undefined;
    const allPath = join(out, "all.bin"), lengthsPath = join(work, "lengths.u32");
    // Resuming: rebuild the index from the committed documents' fingerprints and band keys.
    if (lsh && state.documents > 0) lsh.restore(state.documents);
    if (state.stage === "tokenize" && !state.read_done) {
      await tokenizeShards({
        ...run,
        docs,
        position,
        countChars: plan.kind === "texts" || plan.kind === "builtin",
        totalBytes,
        allPath,
        lengthsPath,
        lsh,
        minhash,
        minTokens: opts.min_tokens,
        maxDocuments: opts.max_documents,
        workers: options.workers,
        shardChars,
      });
    }
    lsh?.close();
    lsh = undefined;
    stats.documents_read = state.documents_read;
    if (state.documents === 0) throw noDocumentsError(stats, opts.min_tokens);

    // Stage 7: split (throws naming a split too small for one sequence).
    progress.stage = "split";
    report();
    const sizes: SplitCounts = splitSizes(state.tokens, opts.split, opts.seq_len);
    await splitTokens(state, commit, sizes, allPath, out);
    await writeDocumentIndex(lengthsPath, state.documents, join(out, "documents.idx"));
    const info = await writeManifest(out, plan, state, stats, cuts, sizes, started);
    await publishDataset(root, id, sourceKey, out);
    await Deno.remove(work, { recursive: true }).catch(() => {});
    progress.stage = "done";
    report();
    return info;
  } catch (e) {
    lsh?.close();
    if (!diskFull(e)) await Deno.remove(work, { recursive: true }).catch(() => {});
    throw e;
  }
}

/** Source characters per committed shard, validated. */
function shardCharsOf(options: PrepareOptions): number {
  const shardChars = options.shard_chars ?? SHARD_CHARS;
  if (!(Number.isInteger(shardChars) && shardChars > 0)) {
    throw new RangeError(`shard_chars must be a positive integer, got ${shardChars}`);
  }
  return shardChars;
}

/** Progress at the start of the tokenize stage: the journal's committed counts. */
function startTokenizeProgress(
  progress: Progress,
  journal: LoadedJournal,
  totalBytes: number | undefined,
): void {
  const { state } = journal;
  progress.stage = "tokenize";
  progress.done = state.bytes_done;
  progress.total = totalBytes;
  progress.documents_read = state.documents_read;
  progress.documents = state.documents;
  progress.tokens = state.tokens;
  progress.shards = state.shards;
  if (journal.resumed) progress.resumed_bytes = state.bytes_done;
}

/** The dedup index of a preparation, its shape recorded in `stats.lsh`. */
function openLsh(
  minhash: MinHashParams,
  opts: DatasetPlan["opts"],
  work: string,
  stats: Stats,
): LshIndex {
  const lsh = new LshIndex(minhash.numPerm, opts.dedup_threshold, { dir: work });
  stats.lsh = {
    bands: lsh.bands,
    rows: lsh.rows,
    num_perm: opts.num_perm,
    shingle_size: opts.shingle_size,
    bytes_per_document: lsh.bytesPerDocument,
  };
  return lsh;
}

/** The error when every document read was dropped: the counts, and the files skipped or bad. */
function noDocumentsError(stats: Stats, minTokens: number): Error {
  const files = stats.file_issues ?? [];
  const listed = files.slice(0, 10).map((i) => `"${i.file}": ${i.reason}`).join("; ");
  return new Error(
    `No documents left to train on: ${stats.documents_read} read, ${stats.empty_after_cleaning} empty ` +
      `after cleaning, ${stats.under_min_tokens} under ${minTokens} tokens, ` +
      `${stats.near_duplicates} near-duplicates` +
      (files.length
        ? `; files skipped or bad: ${listed}${files.length > 10 ? ` and ${files.length - 10} more` : ""}`
        : ""),
  );
}

/**
 * Split the token file: valid.bin and test.bin are copied from the end of all.bin (once, recorded
 * by the journal's stage), then all.bin is cut to the train part and renamed train.bin.
 */
async function splitTokens(
  state: Journal,
  commit: () => Promise<void>,
  sizes: SplitCounts,
  allPath: string,
  out: string,
): Promise<void> {
  if (state.stage === "tokenize") {
    using allFile = await Deno.open(allPath, { read: true });
    await copyRange(allFile, sizes.train, sizes.valid, join(out, "valid.bin"));
    await copyRange(allFile, sizes.train + sizes.valid, sizes.test, join(out, "test.bin"));
    state.stage = "split";
    await commit();
  }
  if (await Deno.stat(allPath).then(() => true, () => false)) {
    await Deno.truncate(allPath, sizes.train * 2);
    await Deno.rename(allPath, join(out, "train.bin"));
  }
}

/** Checksum the prepared files and write `manifest.json` into `out`; returns the manifest. */
async function writeManifest(
  out: string,
  plan: DatasetPlan,
  state: Journal,
  stats: Stats,
  cuts: FileIssue[],
  sizes: SplitCounts,
  started: number,
): Promise<DatasetInfo> {
  const { id, describe, sourceKey, opts } = plan;
  const all = createHash("sha256");
  const files: Record<string, { bytes: number; sha256: string }> = {};
  for (const s of SPLITS) files[`${s}.bin`] = await hashFile(join(out, `${s}.bin`), all);
  files["documents.idx"] = await hashFile(join(out, "documents.idx"), createHash("sha256"));
  const info: DatasetInfo & { source_key: string; partial?: boolean; cut?: FileIssue[] } = {
    id,
    documents: state.documents,
    tokens: state.tokens,
    splits: sizes,
    format: "gpt2-webgpu-dataset/1",
    source: describe,
    tokenizer: { name: "gpt2 (r50k_base)", vocab_size: 50257, eot: 50256, dtype: "uint16" },
    options: { ...opts, split: opts.split.join(",") },
    ...(cuts.length > 0 ? { partial: true, cut: cuts } : {}),
    stats: stats as unknown as Record<string, unknown>,
    files,
    checksum: all.digest("hex"),
    created_at: new Date().toISOString(),
    seconds: Math.round((performance.now() - started) / 10) / 100,
    source_key: sourceKey,
  };
  await Deno.writeTextFile(join(out, "manifest.json"), JSON.stringify(info, null, 2) + "\n");
  return info;
}

/** Publish atomically: rename the finished folder `out` into place, moving any older one aside first. */
async function publishDataset(root: string, id: string, sourceKey: string, out: string): Promise<void> {
  const final = datasetDir(root, id);
  const old = join(datasetsDir(root), `.old-${id}-${sourceKey}`); // removed at server start if left
  let hadOld = false;
  try {
    await Deno.rename(final, old);
    hadOld = true;
  } catch (e) {
    if (!(e instanceof Deno.errors.NotFound)) throw e;
  }
  try {
    await Deno.rename(out, final);
  } catch (e) {
    if (hadOld) await Deno.rename(old, final).catch(() => {});
    throw new Error(`Cannot publish dataset "${id}": ${(e as Error).message}`);
  }
  if (hadOld) await Deno.remove(old, { recursive: true }).catch(() => {});
}
