/**
 * Tests of data preparation at scale (issue 27): bounded memory (3 million short distinct
 * documents under a 1 GiB V8 heap), nothing cut silently (a file slowed past the per-file limit
 * fails the preparation, or publishes a dataset marked partial when allowed; a slow consumer never
 * cuts a file), and resumption (a preparation killed with SIGKILL and started again publishes the
 * same bytes as an uninterrupted run).
 *
 * The big runs go through the CLI in a subprocess, as a user would run them, so that a heap limit
 * and a SIGKILL apply to the preparation alone.
 */
import assert from "node:assert/strict";
import { join } from "node:path";
import {
  emptyMergeCounts,
  type FileIssue,
  prepareDataset,
  readDocuments,
  type ReadPosition,
} from "../../data/mod.ts";
import { makeDocs, nearDuplicate, rng, withRoot } from "../data_fixtures.ts";

const SMALL = { min_tokens: 16, seq_len: 8, split: "8,1,1", workers: 1 };
const CLI = new URL("../../data/cli.ts", import.meta.url).pathname;

/** Names in a folder, sorted. */
async function names(dir: string): Promise<string[]> {
  return (await Array.fromAsync(Deno.readDir(dir))).map((e) => e.name).sort();
}

Deno.test("a JSON-lines file slowed past the per-file limit fails the preparation naming file and line, or is published as partial", async () => {
  await withRoot(async (root) => {
    await Deno.mkdir(join(root, "src"));
    // 100 ordinary lines, then 40 lines made slow to parse by 2 MB of padding each: at least 20 ms in
    // all on any machine, against a limit of 5 (at 100 ms a fast machine parsed them all in time).
    const docs = makeDocs(140, 60, 31), pad = "x".repeat(1 << 21);
    const lines = docs.map((text, i) => JSON.stringify(i < 100 ? { text } : { text, pad }));
    await Deno.writeTextFile(join(root, "src", "big.jsonl"), lines.join("\n") + "\n");
    const opts = { ...SMALL, max_file_ms: 5 };
    let message = "";
    await prepareDataset(root, { path: "src" }, opts).catch((e) => (message = (e as Error).message));
    const m = message.match(/source file "big\.jsonl" was cut at line (\d+) \(timed out: parsing took/);
    assert.ok(m, `error: ${message}`);
    assert.match(message, /nothing was published/);
    // Nothing published, and no temporary or work folder left behind.
    assert.deepEqual(await names(join(root, "datasets")), []);

    const info = await prepareDataset(root, { path: "src" }, { ...opts, allow_partial: true });
    const { partial, cut } = info as { partial?: boolean; cut?: FileIssue[] };
    assert.equal(partial, true);
    assert.equal(cut?.length, 1);
    assert.equal(cut![0].file, "big.jsonl");
    const line = (cut![0].cut as { line: number }).line;
    assert.ok(line > 1 && line <= 140, `cut at ${line}`);
    assert.equal(info.documents, line - 1);
    assert.deepEqual(await names(join(root, "datasets")), [info.id]);
  });
});

Deno.test("the per-file limit counts parsing only: a slow consumer of a big file does not cut it", async () => {
  await withRoot(async (root) => {
    const docs = makeDocs(40, 50, 32);
    await Deno.writeTextFile(join(root, "f.jsonl"), docs.map((text) => JSON.stringify({ text })).join("\n"));
    const issues: FileIssue[] = [];
    const counts = emptyMergeCounts();
    const got: string[] = [];
    const t0 = performance.now();
    for await (
      const doc of readDocuments(join(root, "f.jsonl"), counts, {
        maxFileMs: 100,
        onIssue: (i) => void issues.push(i),
      })
    ) {
      got.push(doc.text);
      await new Promise((r) => setTimeout(r, 10)); // a tokenizer that takes 10 ms per document
    }
    assert.ok(performance.now() - t0 > 300, "the consumer took longer than the limit");
    assert.deepEqual(got, docs);
    assert.deepEqual(issues, []);
    assert.equal(counts.timed_out, 0);
  });
});

Deno.test("readDocuments resumes from a saved position: the rest of the stream is the same", async () => {
  await withRoot(async (root) => {
    await Deno.mkdir(join(root, "src", "b"), { recursive: true });
    const docs = makeDocs(30, 40, 33);
    await Deno.writeTextFile(
      join(root, "src", "a.jsonl"),
      docs.slice(0, 10).map((t) => JSON.stringify(t)).join("\n"),
    );
    await Deno.writeTextFile(join(root, "src", "b", "c.txt"), docs[10]);
    await Deno.writeTextFile(join(root, "src", "b", "d.json"), JSON.stringify(docs.slice(11, 20)));
    await Deno.writeTextFile(
      join(root, "src", "e.jsonl"),
      docs.slice(20).map((t) => JSON.stringify({ text: t })).join("\r\n") + "\n",
    );
    const all: { text: string; at: ReadPosition }[] = [];
    const position = { file: "", offset: 0, line: 0, item: 0 };
    for await (const d of readDocuments(join(root, "src"), emptyMergeCounts(), { position })) {
      all.push({ text: d.text, at: { ...position } });
    }
    assert.equal(all.length, 30);
    for (const k of [0, 4, 9, 10, 12, 19, 25, 29]) {
      const rest = await Array.fromAsync(
        readDocuments(join(root, "src"), emptyMergeCounts(), { resumeFrom: all[k].at }),
      );
      assert.deepEqual(rest.map((d) => d.text), all.slice(k + 1).map((d) => d.text), `after document ${k}`);
    }
  });
});

/** Run the data CLI; `onLine` sees each stderr line (progress JSON) and may kill the child. */
async function runCli(
  args: string[],
  onLine?: (line: string, child: Deno.ChildProcess) => void,
  env: Record<string, string> = {},
): Promise<{ code: number; signal: string | null; stdout: string; stderr: string[] }> {
  const child = new Deno.Command(Deno.execPath(), {
    args: ["run", "-A", CLI, ...args],
    stdout: "piped",
    stderr: "piped",
    env,
  }).spawn();
  const stderr: string[] = [];
  const readErr = (async () => {
    let buf = "";
    for await (const chunk of child.stderr.pipeThrough(new TextDecoderStream())) {
      buf += chunk;
      let nl;
      while ((nl = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, nl);
        buf = buf.slice(nl + 1);
        stderr.push(line);
        onLine?.(line, child);
      }
    }
  })();
  const stdout = new Response(child.stdout).text();
  const status = await child.status;
  await readErr;
  return { code: status.code, signal: status.signal, stdout: await stdout, stderr };
}

Deno.test("a preparation killed with SIGKILL resumes from its last shard and publishes the same bytes", async () => {
  await withRoot(async (dir) => {
    // About 4 MB in 3 files, with near-duplicates of earlier documents planted throughout, so that
    // dedup decisions after the kill depend on documents kept before it.
    const src = join(dir, "corpus");
    await Deno.mkdir(src);
    const rand = rng(34);
    const docs = makeDocs(4500, 150, 34);
    const texts = docs.map((d, i) =>
      i > 50 && rand() < 0.1 ? nearDuplicate(docs[Math.floor(rand() * i)], 100) : d
    );
    for (let f = 0; f < 3; f++) {
      const part = texts.slice(f * 1500, (f + 1) * 1500).map((text) => JSON.stringify({ text }));
      await Deno.writeTextFile(join(src, `part-${f}.jsonl`), part.join("\n") + "\n");
    }
    const args = (root: string) => [
      "prepare",
      "--path",
      src,
      "--root",
      root,
      "--min-tokens",
      "16",
      "--seq-len",
      "8",
      "--split",
      "8,1,1",
      "--workers",
      "1",
      "--shard-chars",
      "100000",
      "--progress-json",
    ];
    // Killed once a few shards are committed.
    const killed = join(dir, "killed");
    let killedAt = 0;
    const first = await runCli(args(killed), (line, child) => {
      if (!line.startsWith("{") || killedAt) return;
      const p = JSON.parse(line);
      if ((p.shards ?? 0) >= 5) {
        killedAt = p.shards;
        child.kill("SIGKILL");
      }
    });
    assert.equal(first.signal, "SIGKILL", first.stderr.slice(-5).join("\n"));
    const left = await names(join(killed, "datasets"));
    assert.equal(left.length, 1, `left: ${left}`);
    assert.match(left[0], /^\.work-/);
    // Started again: it resumes (some bytes done already) and finishes.
    const second = await runCli(args(killed));
    assert.equal(second.code, 0, second.stderr.slice(-5).join("\n"));
    const events = second.stderr.filter((l) => l.startsWith("{")).map((l) => JSON.parse(l));
    const resumed = events.find((p) => p.resumed_bytes !== undefined);
    assert.ok(resumed && resumed.resumed_bytes > 0 && resumed.shards >= killedAt, JSON.stringify(events[0]));
    // Progress events carry bytes, documents, stage, rate and ETA.
    const all = [...first.stderr, ...second.stderr].filter((l) => l.startsWith("{")).map((l) =>
      JSON.parse(l)
    );
    const timed = all.find((p) => p.stage === "tokenize" && p.rate > 0 && p.eta_s !== undefined);
    assert.ok(timed && timed.total > 0 && timed.done > 0 && timed.documents_read > 0, JSON.stringify(events));
    // An uninterrupted run for comparison.
    const whole = join(dir, "whole");
    const third = await runCli(args(whole));
    assert.equal(third.code, 0, third.stderr.slice(-5).join("\n"));
    const id = JSON.parse(third.stdout).id;
    assert.equal(JSON.parse(second.stdout).id, id);
    assert.deepEqual(await names(join(killed, "datasets")), [id]);
    for (const f of ["train.bin", "valid.bin", "test.bin", "documents.idx"]) {
      const a = await Deno.readFile(join(killed, "datasets", id, f));
      const b = await Deno.readFile(join(whole, "datasets", id, f));
      assert.ok(a.length > 0 && a.length === b.length && a.every((x, i) => x === b[i]), `${f} differs`);
    }
    const manifest = async (root: string) => {
      const m = JSON.parse(await Deno.readTextFile(join(root, "datasets", id, "manifest.json")));
      delete m.created_at, delete m.seconds, delete m.stats.worker_ms;
      return m;
    };
    const [a, b] = [await manifest(killed), await manifest(whole)];
    assert.ok(a.stats.near_duplicates > 100, `near-duplicates ${a.stats.near_duplicates}`);
    assert.deepEqual(a, b);
  });
});

Deno.test("3 million short distinct documents prepare under a 1 GiB V8 heap", async () => {
  await withRoot(async (dir) => {
    // 8 words from 4,096 made-up words each: about 200 MB of distinct documents, written streamed.
    const n = 3_000_000, path = join(dir, "short.jsonl");
    const syllables = "ka lo mi ne ru sa to vi ze po da fu gi he jo ku".split(" ");
    const vocab = Array.from(
      { length: 4096 },
      (_, i) => syllables[i & 15] + syllables[(i >> 4) & 15] + syllables[(i >> 8) & 15],
    );
    const rand = rng(35);
    {
      using f = await Deno.open(path, { write: true, create: true });
      const enc = new TextEncoder();
      let lines: string[] = [];
      for (let d = 0; d < n; d++) {
        const w: string[] = [];
        for (let i = 0; i < 8; i++) w.push(vocab[Math.floor(rand() * 4096)]);
        lines.push(`{"text":"${w.join(" ")}"}\n`);
        if (lines.length === 65536 || d === n - 1) {
          const bytes = enc.encode(lines.join(""));
          for (let off = 0; off < bytes.length;) off += await f.write(bytes.subarray(off));
          lines = [];
        }
      }
    }
    const root = join(dir, "root");
    const run = await runCli(
      [
        "prepare",
        "--path",
        path,
        "--root",
        root,
        "--min-tokens",
        "4",
        "--seq-len",
        "16",
        "--split",
        "98,1,1",
      ],
      undefined,
      { DENO_V8_FLAGS: "--max-old-space-size=1024" },
    );
    assert.equal(run.code, 0, run.stderr.slice(-5).join("\n"));
    const { id, documents } = JSON.parse(run.stdout);
    assert.equal(documents, n);
    const m = JSON.parse(await Deno.readTextFile(join(root, "datasets", id, "manifest.json")));
    assert.equal(m.stats.documents_read, n);
    assert.equal(m.stats.near_duplicates, 0);
  });
});

Deno.test("a preparation removes its id's work folders left with other options, and no one else's", async () => {
  await withRoot(async (root) => {
    const datasets = join(root, "datasets");
    for (const name of [".work-stale-0123456789", ".work-stale-x-0123456789"]) {
      await Deno.mkdir(join(datasets, name, "out"), { recursive: true });
      await Deno.writeTextFile(join(datasets, name, "journal.json"), "{}");
    }
    const info = await prepareDataset(root, { texts: makeDocs(6, 100, 37) }, { ...SMALL, id: "stale" });
    assert.deepEqual(await names(datasets), [".work-stale-x-0123456789", info.id]);
  });
});
