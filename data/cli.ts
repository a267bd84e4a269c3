/**
 * `deno task data`: the data pipeline from the command line.
 *
 *   prepare (--builtin sotu | --path P | --texts-file F | --url-list F | --urls-file F) [options]
 *   list | info ID
 *   urls FILE [--out F]           stage 1 alone: filter a URL list, print counts
 *   download FILE --out F.jsonl   stage 2 alone: URLs to loose JSON
 *   merge PATH... --out F.jsonl   stage 3 alone: files and folders to loose JSON
 *
 * Options of prepare: --min-tokens N, --dedup-threshold X, --no-dedup, --split 949,50,1,
 * --seq-len N, --max-documents N, --id ID, --force, --workers N, --root DIR (default $GPT2_HOME
 * or ./.gpt2), --max-file-ms N, --allow-partial, --shard-chars N, --progress-json, --format chat (the
 * path is a JSONL file of conversations, see data/chat_dataset.ts) with --on-error skip|refuse. Long work shows
 * a progress bar on a terminal (a line every few seconds otherwise), with rate and ETA; with
 * --progress-json every progress event is one JSON line on stderr instead. A preparation that was
 * killed resumes when the same command is run again.
 */
import { parseArgs } from "node:util";
import { resolve } from "node:path";
import {
  type DatasetSource,
  downloadUrls,
  filterUrls,
  getDataset,
  listDatasets,
  mergeToLooseJson,
  parseJsonLine,
  prepareDataset,
  type PrepareOptions,
  type Progress,
} from "./mod.ts";

const USAGE = `Usage: deno task data <command> [options]
  prepare --builtin sotu|moby-dick | --path P | --texts-file F | --url-list F
          [--min-tokens 128] [--dedup-threshold 0.8] [--no-dedup] [--split 949,50,1] [--seq-len 1024]
          [--max-documents N] [--id ID] [--force] [--workers N] [--root DIR]
          [--max-file-ms 60000] [--allow-partial] [--shard-chars N] [--progress-json]
          [--format text|chat] [--on-error refuse|skip]   (chat: --path is a JSONL file of conversations)
  list [--root DIR]
  info ID [--root DIR]
  urls FILE [--out F]
  download FILE --out F.jsonl [--concurrency 8] [--timeout-ms 15000]
  merge PATH... --out F.jsonl`;

/** A progress renderer: a bar on a terminal, a periodic line otherwise. */
function progressPrinter(): { update: (p: Progress) => void; end: () => void } {
  const tty = Deno.stderr.isTerminal();
  const enc = new TextEncoder();
  const t0 = performance.now();
  let last = 0, shown = false;
  const render = (p: Progress) => {
    const secs = (performance.now() - t0) / 1000;
    const frac = p.total ? Math.min(1, p.done / p.total) : undefined;
    const width = 24;
    const bar = frac === undefined
      ? ""
      : `[${"#".repeat(Math.round(frac * width)).padEnd(width, "-")}] ${
        (frac * 100).toFixed(0).padStart(3)
      }% `;
    const amount = p.stage === "download"
      ? `${p.done}/${p.total ?? "?"} URLs`
      : `${(p.done / 1e6).toFixed(1)}${p.total ? `/${(p.total / 1e6).toFixed(1)}` : ""} MB`;
    const rate = p.rate !== undefined && p.stage === "tokenize"
      ? `, ${(p.rate / 1e6).toFixed(1)} MB/s${p.eta_s !== undefined ? `, ETA ${p.eta_s} s` : ""}`
      : "";
    return `${bar}${p.stage} ${amount}, ${p.documents} docs, ${(p.tokens / 1e6).toFixed(2)}M tokens, ${
      secs.toFixed(1)
    } s${rate}`;
  };
  return {
    update(p) {
      const now = performance.now();
      if (now - last < (tty ? 100 : 5000) && p.stage !== "done") return;
      last = now;
      const line = render(p);
      if (tty) {
        Deno.stderr.writeSync(enc.encode(`\r\x1b[K${line}`));
        shown = true;
      } else console.error(line);
    },
    end() {
      if (tty && shown) Deno.stderr.writeSync(enc.encode("\n"));
    },
  };
}

/** Read a texts file: a JSON array of strings, or loose JSON (one object with "text", or string, per line). */
async function readTextsFile(path: string): Promise<string[]> {
  let raw: string;
  try {
    raw = await Deno.readTextFile(path);
  } catch (e) {
    throw new Error(`Cannot read "${path}": ${(e as Error).message}`);
  }
  if (raw.trimStart().startsWith("[")) {
    const arr = JSON.parse(raw);
    if (!Array.isArray(arr) || arr.some((x) => typeof x !== "string")) {
      throw new Error(`Cannot use "${path}": expected a JSON array of strings`);
    }
    return arr;
  }
  const texts: string[] = [];
  let bad = 0;
  for (const line of raw.split("\n")) {
    if (!line.trim()) continue;
    const doc = parseJsonLine(line);
    if (doc) texts.push(doc.text);
    else bad++;
  }
  if (bad > 0) console.error(`Skipped ${bad} malformed lines in "${path}"`);
  return texts;
}

/** The command line parsed: the flags, and the command with its arguments. */
function parseCli(args: string[]) {
  return parseArgs({
    args,
    allowPositionals: true,
    options: {
      builtin: { type: "string" },
      path: { type: "string" },
      "texts-file": { type: "string" },
      "url-list": { type: "string" },
      "urls-file": { type: "string" },
      "min-tokens": { type: "string" },
      "dedup-threshold": { type: "string" },
      "no-dedup": { type: "boolean" },
      split: { type: "string" },
      "seq-len": { type: "string" },
      "max-documents": { type: "string" },
      id: { type: "string" },
      force: { type: "boolean" },
      workers: { type: "string" },
      root: { type: "string" },
      out: { type: "string" },
      concurrency: { type: "string" },
      "timeout-ms": { type: "string" },
      "max-file-ms": { type: "string" },
      "allow-partial": { type: "boolean" },
      "shard-chars": { type: "string" },
      "progress-json": { type: "boolean" },
      format: { type: "string" },
      "on-error": { type: "string" },
      help: { type: "boolean", short: "h" },
    },
  });
}

/** The flags given. */
type CliValues = ReturnType<typeof parseCli>["values"];

/** Flag `name`'s number, or undefined when not given. */
function num(name: string, v: string | undefined): number | undefined {
  if (v === undefined) return undefined;
  const n = Number(v);
  if (!Number.isFinite(n)) throw new Error(`Invalid --${name} "${v}": expected a number`);
  return n;
}

/** Flag `name`'s value, one of `allowed`. */
function choice<T extends string>(name: string, v: string, allowed: readonly T[]): T {
  if (!(allowed as readonly string[]).includes(v)) {
    throw new Error(`Invalid --${name} "${v}": expected ${allowed.map((a) => `"${a}"`).join(" or ")}`);
  }
  return v as T;
}

/** Run the CLI with `args`; returns the exit code. */
export async function main(args: string[]): Promise<number> {
  const { values, positionals } = parseCli(args);
  const [command, ...rest] = positionals;
  if (values.help || !command) {
    console.log(USAGE);
    return command || values.help ? 0 : 2;
  }
  const root = resolve(values.root ?? Deno.env.get("GPT2_HOME") ?? "./.gpt2");
  switch (command) {
    case "prepare":
      return await prepareCommand(values, root);
    case "list": {
      for (const d of await listDatasets(root)) {
        console.log(
          `${d.id}\t${d.documents} docs\t${d.tokens} tokens\ttrain ${d.splits.train} valid ${d.splits.valid} test ${d.splits.test}`,
        );
      }
      return 0;
    }
    case "info": {
      const info = rest[0] ? await getDataset(root, rest[0]) : undefined;
      if (!info) throw new Error(`Dataset "${rest[0] ?? ""}" not found under "${root}"`);
      console.log(JSON.stringify(info, null, 2));
      return 0;
    }
    case "urls": {
      if (!rest[0]) throw new Error("Name a URL list file: deno task data urls FILE");
      const { urls, counts } = filterUrls((await Deno.readTextFile(rest[0])).split(/\r?\n/));
      console.error(JSON.stringify(counts));
      if (values.out) {
        const tmp = `${values.out}.tmp-${crypto.randomUUID().slice(0, 8)}`;
        await Deno.writeTextFile(tmp, urls.join("\n") + "\n");
        await Deno.rename(tmp, values.out);
      } else console.log(urls.join("\n"));
      return 0;
    }
    case "download":
      return await downloadCommand(values, rest);
    case "merge": {
      if (rest.length === 0 || !values.out) {
        throw new Error("Usage: deno task data merge PATH... --out F.jsonl");
      }
      console.error(JSON.stringify(await mergeToLooseJson(rest, values.out)));
      return 0;
    }
    default:
      console.error(USAGE);
      throw new Error(`Unknown command "${command}"`);
  }
}

/** `prepare`: a dataset from the one source named, printed as JSON when ready. */
async function prepareCommand(values: CliValues, root: string): Promise<number> {
  const urlList = values["url-list"] ?? values["urls-file"];
  const given = [values.builtin, values.path, values["texts-file"], urlList].filter((v) => v !== undefined);
  if (given.length !== 1) {
    throw new Error("Name exactly one source: --builtin, --path, --texts-file or --url-list");
  }
  let source: DatasetSource;
  if (values.builtin !== undefined) source = { builtin: values.builtin as "sotu" };
  else if (values.path !== undefined) source = { path: resolve(values.path) };
  else if (urlList !== undefined) source = { url_list: resolve(urlList) };
  else source = { texts: await readTextsFile(values["texts-file"]!) };
  const options = prepareOptions(values);
  await Deno.mkdir(root, { recursive: true });
  const bar = values["progress-json"]
    ? { update: (p: Progress) => console.error(JSON.stringify(p)), end: () => {} }
    : progressPrinter();
  const t0 = performance.now();
  let info;
  try {
    info = await prepareDataset(root, source, options, bar.update);
  } finally {
    bar.end();
  }
  const secs = (performance.now() - t0) / 1000;
  console.log(
    JSON.stringify({ id: info.id, documents: info.documents, tokens: info.tokens, splits: info.splits }),
  );
  console.error(`Dataset "${info.id}" ready in ${root}/datasets/${info.id} (${secs.toFixed(1)} s)`);
  const cut = (info as { cut?: { file: string; reason: string }[] }).cut;
  if (cut) console.error(`Partial dataset: ${cut.map((c) => `"${c.file}" ${c.reason}`).join("; ")}`);
  return 0;
}

/** The preparation options the flags give. */
function prepareOptions(values: CliValues): PrepareOptions {
  return {
    allow_any_path: true,
    ...(values.id ? { id: values.id } : {}),
    ...(values["min-tokens"] ? { min_tokens: num("min-tokens", values["min-tokens"]) } : {}),
    ...(values["dedup-threshold"]
      ? { dedup_threshold: num("dedup-threshold", values["dedup-threshold"]) }
      : {}),
    ...(values["no-dedup"] ? { dedup: false } : {}),
    ...(values.split ? { split: values.split } : {}),
    ...(values["seq-len"] ? { seq_len: num("seq-len", values["seq-len"]) } : {}),
    ...(values["max-documents"] ? { max_documents: num("max-documents", values["max-documents"]) } : {}),
    ...(values.workers ? { workers: num("workers", values.workers) } : {}),
    ...(values.force ? { force: true } : {}),
    ...(values["max-file-ms"] ? { max_file_ms: num("max-file-ms", values["max-file-ms"]) } : {}),
    ...(values["allow-partial"] ? { allow_partial: true } : {}),
    ...(values["shard-chars"] ? { shard_chars: num("shard-chars", values["shard-chars"]) } : {}),
    ...(values.format ? { format: choice("format", values.format, ["text", "chat"] as const) } : {}),
    ...(values["on-error"]
      ? { on_error: choice("on-error", values["on-error"], ["skip", "refuse"] as const) }
      : {}),
    download: { allowPrivate: Deno.env.get("GPT2_ALLOW_PRIVATE_URLS") === "1" },
  };
}

/** `download FILE --out F.jsonl`: the URLs of a list, filtered, downloaded as loose JSON lines. */
async function downloadCommand(values: CliValues, rest: string[]): Promise<number> {
  if (!rest[0] || !values.out) throw new Error("Usage: deno task data download FILE --out F.jsonl");
  const { urls, counts: urlCounts } = filterUrls((await Deno.readTextFile(rest[0])).split(/\r?\n/));
  console.error(JSON.stringify(urlCounts));
  const tmp = `${values.out}.tmp-${crypto.randomUUID().slice(0, 8)}`;
  const lines: string[] = [];
  const bar = progressPrinter();
  const { counts, failures } = await downloadUrls(
    urls,
    {
      concurrency: num("concurrency", values.concurrency),
      timeoutMs: num("timeout-ms", values["timeout-ms"]),
      allowPrivate: Deno.env.get("GPT2_ALLOW_PRIVATE_URLS") === "1",
    },
    (doc) => void lines.push(JSON.stringify(doc)),
    (p) =>
      bar.update({
        id: "",
        stage: "download",
        done: p.done,
        total: p.total,
        documents_read: p.done,
        documents: p.ok,
        tokens: 0,
      }),
  );
  bar.end();
  await Deno.writeTextFile(tmp, lines.join("\n") + (lines.length ? "\n" : ""));
  await Deno.rename(tmp, values.out);
  for (const f of failures) console.error(`Failed "${f.url}": ${f.error}`);
  console.error(JSON.stringify(counts));
  return counts.ok > 0 ? 0 : 1;
}

if (import.meta.main) {
  try {
    Deno.exit(await main(Deno.args));
  } catch (e) {
    console.error(`Error: ${(e as Error).message}`);
    Deno.exit(1);
  }
}
