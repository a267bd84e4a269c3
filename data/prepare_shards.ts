/**
 * Stages 4-6 of a dataset preparation (data/prepare.ts): documents are batched to a pool of
 * tokenize workers (clean, min-token filter, tokens, MinHash signatures), and the kept ones'
 * tokens, token counts and dedup fingerprints are appended to the work folder's files. Every
 * `shard_chars` characters of source the journal records their committed lengths with the
 * reader's position and the counts, which is what a killed preparation resumes from.
 */
import {
  emptyMergeCounts,
  type FileIssue,
  type MergeCounts,
  type ReadPosition,
  type SourceDocument,
  startPosition,
} from "./merge.ts";
import type { LshIndex, MinHashParams } from "./minhash.ts";
import type { DownloadCounts } from "./download.ts";
import type { Progress } from "./prepare.ts";
import { openAt, Writer } from "./prepare_io.ts";
import { createTokenizePool, type TokenizePool, type WorkerResult } from "./tokenize_pool.ts";
import type { UrlCounts } from "./urls.ts";

/** Stage counts recorded in the manifest's `stats`. */
export interface Stats {
  urls?: UrlCounts;
  download?: DownloadCounts & { failures_file?: string };
  merge: MergeCounts;
  /** Skipped or partly bad source files and why (the first 100). */
  file_issues?: FileIssue[];
  documents_read: number;
  empty_after_cleaning: number;
  under_min_tokens: number;
  near_duplicates: number;
  characters: number;
  /** Worker milliseconds spent cleaning, tokenizing and computing signatures (summed over workers). */
  worker_ms: { clean: number; tokenize: number; signatures: number };
  lsh?: {
    bands: number;
    rows: number;
    num_perm: number;
    shingle_size: number;
    /** Bytes of the index per kept document: fingerprints, and band tables at their lowest and highest load. */
    bytes_per_document: { signature: number; tablesMin: number; tablesMax: number; keys: number };
  };
}

/** Characters per batch sent to a worker. */
const BATCH_CHARS = 1 << 19;

/** What a work folder's journal records at each committed shard: enough to resume from there. */
export interface Journal {
  format: typeof WORK_FORMAT;
  source_key: string;
  /** "tokenize" while reading; "split" once valid.bin and test.bin are written. */
  stage: "tokenize" | "split";
  /** The source was read to its end (or to max_documents) and everything read is committed. */
  read_done: boolean;
  /** URL sources: the download finished (out/downloads.jsonl is complete). */
  downloaded: boolean;
  /** Committed shards. */
  shards: number;
  /** Reader state just after the last committed document. */
  position: ReadPosition;
  documents_read: number;
  chars_read: number;
  bytes_done: number;
  /** Kept documents and their tokens: the committed lengths of all.bin, lengths.u32 and kept.sig. */
  documents: number;
  tokens: number;
  stats: Stats;
  cut: FileIssue[];
}

/** Format of a work folder (a different one is discarded, not resumed). */
export const WORK_FORMAT = "gpt2-webgpu-work/1";

/** Where the reader stood when a batch was submitted: what a commit after that batch records. */
export interface ReaderSnapshot {
  position: ReadPosition;
  documents_read: number;
  chars_read: number;
  bytes_done: number;
  merge: MergeCounts;
  file_issues: FileIssue[] | undefined;
  cut: FileIssue[];
}

/** Counts of a fresh preparation. */
function emptyStats(): Stats {
  return {
    merge: emptyMergeCounts(),
    documents_read: 0,
    empty_after_cleaning: 0,
    under_min_tokens: 0,
    near_duplicates: 0,
    characters: 0,
    worker_ms: { clean: 0, tokenize: 0, signatures: 0 },
  };
}

/** A work folder's journal as loaded (or started afresh), with its counts as they were loaded. */
export interface LoadedJournal {
  /** The journal, updated in place at each committed shard. */
  state: Journal;
  /** The counts the preparation updates (a commit records a copy of them in `state`). */
  stats: Stats;
  /** Source files cut so far (a commit records a copy of them in `state`). */
  cuts: FileIssue[];
  /** An earlier run committed a shard or finished downloading: this one resumes from it. */
  resumed: boolean;
}

/** Read the journal at `path`, or start a new one when there is none for this format and source key. */
export async function loadJournal(path: string, sourceKey: string): Promise<LoadedJournal> {
  let journal = await Deno.readTextFile(path).then((t) => JSON.parse(t) as Journal).catch(() => undefined);
  if (journal && (journal.format !== WORK_FORMAT || journal.source_key !== sourceKey)) journal = undefined;
  const resumed = journal !== undefined && (journal.shards > 0 || journal.downloaded);
  const stats: Stats = journal?.stats ?? emptyStats();
  const cuts: FileIssue[] = journal?.cut ?? [];
  const state: Journal = journal ?? {
    format: WORK_FORMAT,
    source_key: sourceKey,
    stage: "tokenize",
    read_done: false,
    downloaded: false,
    shards: 0,
    position: startPosition(),
    documents_read: 0,
    chars_read: 0,
    bytes_done: 0,
    documents: 0,
    tokens: 0,
    stats,
    cut: cuts,
  };
  return { state, stats, cuts, resumed };
}

/** What the tokenize stage works on. */
export interface ShardRun {
  /** The journal (updated in place at each committed shard), its counts, and how to write it. */
  journal: LoadedJournal;
  commit: () => Promise<void>;
  /** The documents left to read, and the reader position they update. */
  docs: AsyncIterable<SourceDocument> | Iterable<SourceDocument>;
  position: ReadPosition;
  /** Progress counts characters here (in-memory sources), not the reader's bytes. */
  countChars: boolean;
  /** Source bytes in all, when known (for the rate's ETA). */
  totalBytes: number | undefined;
  progress: Progress;
  report: () => void;
  /** The token file and the token-count file of kept documents. */
  allPath: string;
  lengthsPath: string;
  /** The dedup index and its parameters, or undefined and null when dedup is off. */
  lsh: LshIndex | undefined;
  minhash: MinHashParams | null;
  minTokens: number;
  maxDocuments: number | undefined;
  workers: number | undefined;
  /** Source characters per committed shard. */
  shardChars: number;
}

/**
 * Read the rest of the source through the tokenize workers, append what is kept, and commit a
 * shard every `shardChars` characters and at the end (the journal's `read_done` then set).
 */
export async function tokenizeShards(run: ShardRun): Promise<void> {
  let pool: TokenizePool | undefined;
  try {
    using allFile = await openAt(run.allPath, run.journal.state.tokens * 2);
    using lengthsFile = await openAt(run.lengthsPath, run.journal.state.documents * 4);
    const sink = new ShardSink(run, new Writer(allFile), new Writer(lengthsFile));
    pool = createTokenizePool(
      { minTokens: run.minTokens, minhash: run.minhash },
      (r) => sink.add(r),
      { workers: run.workers },
    );
    const feeder = new BatchFeeder(run, sink);
    await feeder.feed(pool);
    await pool.drain();
    pool.close();
    pool = undefined;
    run.journal.state.read_done = true;
    await sink.commitShard(feeder.snapshot());
  } catch (e) {
    pool?.close();
    throw e;
  }
}

/** The appending side: workers' results in submission order, written out and committed by shard. */
class ShardSink {
  #run: ShardRun;
  #tokenWriter: Writer;
  #lengthWriter: Writer;
  #docCount: number;
  #tokenCount: number;
  #lengthBuf = new Uint32Array(1);
  #lengthBytes = new Uint8Array(this.#lengthBuf.buffer);
  #runStart = performance.now();
  #runFrom: number;
  /** Per submitted batch in order: the reader's snapshot to commit after it, or null. */
  #pendingCommits: (ReaderSnapshot | null)[] = [];

  constructor(run: ShardRun, tokenWriter: Writer, lengthWriter: Writer) {
    this.#run = run;
    this.#tokenWriter = tokenWriter;
    this.#lengthWriter = lengthWriter;
    this.#docCount = run.journal.state.documents;
    this.#tokenCount = run.journal.state.tokens;
    this.#runFrom = run.journal.state.bytes_done;
  }

  /** A batch was submitted: commit `snap` once its result is appended (null: no commit). */
  expect(snap: ReaderSnapshot | null): void {
    this.#pendingCommits.push(snap);
  }

  /** Flush the files and record them, with the reader's snapshot, in the journal. */
  async commitShard(snap: ReaderSnapshot): Promise<void> {
    const { state, stats } = this.#run.journal;
    await this.#tokenWriter.flush();
    await this.#lengthWriter.flush();
    this.#run.lsh?.flush();
    Object.assign(state, {
      shards: state.shards + 1,
      position: snap.position,
      documents_read: snap.documents_read,
      chars_read: snap.chars_read,
      bytes_done: snap.bytes_done,
      documents: this.#docCount,
      tokens: this.#tokenCount,
      stats: { ...stats, merge: snap.merge, file_issues: snap.file_issues },
      cut: snap.cut,
    });
    await this.#run.commit();
    this.#run.progress.shards = state.shards;
  }

  /** Append one batch's kept documents (near-duplicates dropped), then commit if the batch ends a shard. */
  async add(r: WorkerResult): Promise<void> {
    const { stats } = this.#run.journal;
    const { lsh, minhash, progress } = this.#run;
    stats.under_min_tokens += r.short;
    stats.worker_ms.clean += Math.round(r.ms[0]);
    stats.worker_ms.tokenize += Math.round(r.ms[1]);
    stats.worker_ms.signatures += Math.round(r.ms[2]);
    stats.empty_after_cleaning += r.empty;
    let tokOff = 0, sigIdx = 0;
    const n = minhash?.numPerm ?? 0;
    for (let i = 0; i < r.lengths.length; i++) {
      const len = r.lengths[i];
      if (len === 0) continue;
      const toks = r.tokens.subarray(tokOff, tokOff + len);
      tokOff += len;
      const sig = lsh ? r.sigs.subarray(sigIdx * n, sigIdx * n + n) : undefined;
      sigIdx++;
      if (lsh && lsh.addUnlessDuplicate(sig!)) {
        stats.near_duplicates++;
        continue;
      }
      this.#docCount++;
      this.#tokenCount += len;
      this.#lengthBuf[0] = len;
      await this.#lengthWriter.write(this.#lengthBytes);
      await this.#tokenWriter.write(new Uint8Array(toks.buffer, toks.byteOffset, toks.byteLength));
    }
    stats.characters += r.chars;
    progress.documents = this.#docCount;
    progress.tokens = this.#tokenCount;
    const snap = this.#pendingCommits.shift();
    if (snap) await this.commitShard(snap);
    this.#updateRate();
    this.#run.report();
  }

  /** Progress's rate and ETA from this run's bytes so far. */
  #updateRate(): void {
    const { progress, totalBytes } = this.#run;
    const seconds = (performance.now() - this.#runStart) / 1000;
    if (seconds > 0 && progress.done > this.#runFrom) {
      progress.rate = Math.round((progress.done - this.#runFrom) / seconds);
      if (totalBytes !== undefined && progress.rate > 0) {
        progress.eta_s = Math.round(Math.max(0, totalBytes - progress.done) / progress.rate);
      }
    }
  }
}

/** The reading side: documents batched to the pool, a shard ended every `shardChars` characters. */
class BatchFeeder {
  #run: ShardRun;
  #sink: ShardSink;
  #batch: string[] = [];
  #batchChars = 0;
  #shardChars = 0;
  #read: number;
  #charsRead: number;

  constructor(run: ShardRun, sink: ShardSink) {
    this.#run = run;
    this.#sink = sink;
    this.#read = run.journal.state.documents_read;
    this.#charsRead = run.journal.state.chars_read;
  }

  /** Where the reader stands now: what a commit after the batches submitted so far records. */
  snapshot(): ReaderSnapshot {
    const { stats, cuts } = this.#run.journal;
    return {
      position: { ...this.#run.position },
      documents_read: this.#read,
      chars_read: this.#charsRead,
      bytes_done: this.#run.progress.done,
      merge: { ...stats.merge },
      file_issues: stats.file_issues ? [...stats.file_issues] : undefined,
      cut: [...cuts],
    };
  }

  /** Submit every document left (up to max_documents), the last batch ending a shard. */
  async feed(pool: TokenizePool): Promise<void> {
    const { progress, maxDocuments, shardChars } = this.#run;
    for await (const doc of this.#run.docs as AsyncIterable<SourceDocument>) {
      if (maxDocuments !== undefined && this.#read >= maxDocuments) break;
      this.#read++;
      this.#batch.push(doc.text);
      this.#batchChars += doc.text.length;
      this.#shardChars += doc.text.length;
      if (this.#run.countChars) progress.done = this.#charsRead += doc.text.length;
      progress.documents_read = this.#read;
      if (this.#batchChars >= BATCH_CHARS || this.#shardChars >= shardChars) {
        const ends = this.#shardChars >= shardChars;
        if (ends) this.#shardChars = 0;
        await this.#submit(pool, ends);
      }
    }
    if (this.#batch.length > 0) await this.#submit(pool, true);
  }

  async #submit(pool: TokenizePool, endsShard: boolean): Promise<void> {
    this.#sink.expect(endsShard ? this.snapshot() : null);
    await pool.submit(this.#batch);
    this.#batch = [];
    this.#batchChars = 0;
  }
}
