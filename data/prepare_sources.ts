/**
 * Stages 1-3 of a dataset preparation (data/prepare.ts): the source as a stream of documents,
 * resumed after the journal's committed position. URL sources are filtered and downloaded into
 * the work folder first; files and downloads are read and merged by data/merge.ts.
 */
import { join } from "node:path";
import { builtinDocuments, type BuiltinName } from "./builtin.ts";
import { type DownloadFailure, downloadUrls } from "./download.ts";
import {
  type FileIssue,
  readDocuments,
  type ReadPosition,
  type SourceDocument,
  startPosition,
} from "./merge.ts";
import type { DatasetPlan, DatasetSource, PrepareOptions, Progress } from "./prepare.ts";
import { treeSize, Writer } from "./prepare_io.ts";
import type { LoadedJournal, Stats } from "./prepare_shards.ts";
import { filterUrls } from "./urls.ts";

/** What {@link openSource} reads from. */
export interface SourceRun {
  source: DatasetSource;
  plan: DatasetPlan;
  options: PrepareOptions;
  /** The journal: where to resume, and the counts and cut files to update. */
  journal: LoadedJournal;
  commit: () => Promise<void>;
  /** The work folder's output folder (URL sources download into it). */
  out: string;
  progress: Progress;
  report: () => void;
}

/** The documents left to read, the position the reader updates, and the source's size when known. */
export interface OpenedSource {
  docs: AsyncIterable<SourceDocument> | Iterable<SourceDocument>;
  position: ReadPosition;
  totalBytes: number | undefined;
}

/**
 * Open the source for reading after the committed position (URL sources are downloaded first,
 * unless the journal says they were). A cut source file fails the preparation unless
 * `allow_partial`, in which case it is recorded in the journal's cut files.
 */
export async function openSource(run: SourceRun): Promise<OpenedSource> {
  const { source, options, journal: { state, stats, cuts }, progress } = run;
  const { id, kind, resolvedPath, opts } = run.plan;
  let docs: AsyncIterable<SourceDocument> | Iterable<SourceDocument> = [];
  let totalBytes: number | undefined;
  const position = startPosition();
  const onIssue = (issue: FileIssue) => {
    if (issue.cut) {
      const at = "line" in issue.cut ? `line ${issue.cut.line}` : `item ${issue.cut.item}`;
      if (!opts.allow_partial) {
        throw new Error(
          `Cannot prepare dataset "${id}": source file "${issue.file}" was cut at ${at} (${issue.reason}); ` +
            `nothing was published. Set allow_partial (--allow-partial) to publish the documents read as a partial dataset`,
        );
      }
      cuts.push(issue);
    }
    console.warn(`Dataset "${id}": file "${issue.file}": ${issue.reason}`);
    const issues = stats.file_issues ??= [];
    if (issues.length < 100) issues.push(issue);
  };
  const readOptions = {
    maxDocumentBytes: options.max_document_bytes,
    maxFileMs: opts.max_file_ms,
    onBytes: (n: number) => (progress.done = n),
    onIssue,
    position,
    ...(state.shards > 0 ? { resumeFrom: state.position } : {}),
  };
  if (kind === "builtin") {
    const list = await builtinDocuments((source as { builtin: BuiltinName }).builtin);
    docs = list.slice(state.documents_read);
    totalBytes = list.reduce((s, d) => s + d.text.length, 0);
  } else if (kind === "texts") {
    const list = (source as { texts: string[] }).texts;
    docs = list.slice(state.documents_read).map((text) => ({ text }));
    totalBytes = list.reduce((s, t) => s + t.length, 0);
  } else if (kind === "path") {
    totalBytes = await treeSize(resolvedPath!);
    if (!state.read_done) docs = readDocuments(resolvedPath!, stats.merge, readOptions);
  } else {
    const outPath = join(run.out, "downloads.jsonl");
    if (!state.downloaded) {
      await download(source, kind, resolvedPath, options, outPath, stats, progress, run.report);
    }
    state.downloaded = true;
    await run.commit();
    totalBytes = (await Deno.stat(outPath)).size;
    if (!state.read_done) docs = readDocuments(outPath, stats.merge, { ...readOptions, onIssue });
  }
  return { docs, position, totalBytes };
}

/** Stages 1-2 of URL sources: filter the URLs and download them into `outPath` (loose JSON). */
async function download(
  source: DatasetSource,
  kind: "urls" | "url_list",
  resolvedPath: string | undefined,
  options: PrepareOptions,
  outPath: string,
  stats: Stats,
  progress: Progress,
  report: () => void,
): Promise<void> {
  let lines: string[];
  if (kind === "urls") lines = (source as { urls: string[] }).urls;
  else {
    try {
      lines = (await Deno.readTextFile(resolvedPath!)).split(/\r?\n/);
    } catch (e) {
      throw new Error(`Cannot read "${(source as { url_list: string }).url_list}": ${(e as Error).message}`);
    }
  }
  progress.stage = "urls";
  report();
  const { urls, counts } = filterUrls(lines, { blacklist: options.blacklist });
  stats.urls = counts;
  progress.stage = "download";
  progress.total = urls.length;
  report();
  const failures: DownloadFailure[] = [];
  {
    using out = await Deno.open(outPath, { write: true, create: true, truncate: true });
    const writer = new Writer(out);
    const enc = new TextEncoder();
    const res = await downloadUrls(
      urls,
      options.download ?? {},
      (doc) => writer.write(enc.encode(JSON.stringify(doc) + "\n")),
      (p) => {
        progress.done = p.done;
        report();
      },
    );
    await writer.flush();
    failures.push(...res.failures);
    stats.download = res.counts;
  }
  if (failures.length > 0) {
    await Deno.writeTextFile(
      join(outPath, "..", "failures.jsonl"),
      failures.map((f) => JSON.stringify(f)).join("\n") + "\n",
    );
    stats.download!.failures_file = "failures.jsonl";
  }
  if (stats.download!.ok === 0) {
    throw new Error(
      `No documents downloaded: all ${urls.length} URLs failed (first: "${failures[0]?.url}": ${
        failures[0]?.error
      })`,
    );
  }
}
