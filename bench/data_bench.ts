/**
 * Benchmark of the data pipeline end to end: prepares a synthetic corpus (State of the Union
 * sentences recombined into new documents, with 2% planted near-duplicates) from `.jsonl` files on
 * disk, through clean, dedup, tokenize and split.
 *
 * Reports throughput (input MB/s, and MB per CPU-second, which is steadier on a shared machine)
 * and the process's peak RSS (VmHWM, workers included). The corpus is written by this process;
 * preparation runs in a fresh child so its peak RSS is the pipeline's alone, and running several
 * sizes shows how memory depends on input size. Usage:
 *   deno run -A bench/data_bench.ts [--sizes 25,100] [--heap-mb 128] [--cpu-prof DIR] [--workers N]
 *   deno run -A bench/data_bench.ts --short 8000000 [--dir /var/tmp] [--workers N]
 *   deno run -A bench/data_bench.ts --index 8000000
 * `--short N` prepares N short distinct documents instead (8 words each, as the 3-million test
 * in tests/data/data_scale_test.ts, with min_tokens 4): the whole pipeline's peak memory at a document
 * count like OpenWebText's (issue 27). `--dir` is where the temporary corpus and root go.
 * `--index N` measures the dedup index alone (issue 27): N distinct random signatures added to an
 * LshIndex kept in a temporary folder, in a fresh child; it prints the index's bytes, bytes per
 * document, the child's peak RSS and the CPU time per document.
 * `--heap-mb N` runs the child with V8's old space capped at N MB and its young generation at
 * 2 MB per isolate (by default V8 grows the young generation of each of the three isolates with
 * the allocation rate). Environment: DATA_BENCH_TRACE=1 prints memory every second,
 * DATA_BENCH_GC=1 prints the main heap after a full GC, DATA_BENCH_NO_DEDUP=1 turns dedup off.
 */
import process from "node:process";
import { join } from "node:path";
import { builtinDocuments, LshIndex, prepareDataset } from "../data/mod.ts";

/** splitmix32 PRNG. */
function rng(seed: number): () => number {
  let s = seed >>> 0;
  return () => {
    s = (s + 0x9e3779b9) >>> 0;
    let z = Math.imul(s ^ (s >>> 16), 0x85ebca6b);
    z = Math.imul(z ^ (z >>> 13), 0xc2b2ae35);
    return ((z ^ (z >>> 16)) >>> 0) / 4294967296;
  };
}

/** Write about `mb` MB of synthetic documents as .jsonl files under `dir`; returns bytes written. */
export async function writeCorpus(
  dir: string,
  mb: number,
  seed = 7,
): Promise<{ bytes: number; documents: number }> {
  const speeches = await builtinDocuments("sotu");
  const sentences = speeches.flatMap((s) => s.text.split(/(?<=[.!?])\s+/)).filter((s) => s.length > 20);
  const rand = rng(seed);
  const target = mb * 1e6;
  const enc = new TextEncoder();
  let bytes = 0, documents = 0, fileNo = 0;
  let recent: string[] = [];
  await Deno.mkdir(dir, { recursive: true });
  while (bytes < target) {
    using f = await Deno.open(join(dir, `part-${String(fileNo++).padStart(3, "0")}.jsonl`), {
      write: true,
      create: true,
    });
    let fileBytes = 0;
    const lines: string[] = [];
    while (fileBytes < 25e6 && bytes + fileBytes < target) {
      let text: string;
      if (recent.length > 0 && rand() < 0.02) {
        // A near-duplicate: an earlier document with one sentence changed.
        const words = recent[Math.floor(rand() * recent.length)].split(" ");
        words[Math.floor(rand() * words.length)] = "indeed";
        text = words.join(" ");
      } else {
        const paragraphs: string[] = [];
        const np = 4 + Math.floor(rand() * 10);
        for (let p = 0; p < np; p++) {
          const ns = 3 + Math.floor(rand() * 5);
          const sent: string[] = [];
          for (let i = 0; i < ns; i++) sent.push(sentences[Math.floor(rand() * sentences.length)]);
          paragraphs.push(sent.join(" "));
        }
        text = paragraphs.join("\n\n");
        recent.push(text);
        if (recent.length > 64) recent = recent.slice(32);
      }
      const line = JSON.stringify({ text, url: `synthetic:${documents}` }) + "\n";
      lines.push(line);
      fileBytes += line.length;
      documents++;
    }
    const data = enc.encode(lines.join(""));
    for (let off = 0; off < data.length;) off += await f.write(data.subarray(off));
    bytes += data.length;
  }
  return { bytes, documents };
}

/**
 * Write `n` short distinct documents (8 words from 4,096 made-up words each, as
 * tests/data/data_scale_test.ts) as one `.jsonl` file under `dir`; returns bytes written.
 */
export async function writeShortCorpus(
  dir: string,
  n: number,
): Promise<{ bytes: number; documents: number }> {
  const syllables = "ka lo mi ne ru sa to vi ze po da fu gi he jo ku".split(" ");
  const vocab = Array.from(
    { length: 4096 },
    (_, i) => syllables[i & 15] + syllables[(i >> 4) & 15] + syllables[(i >> 8) & 15],
  );
  const rand = rng(35), enc = new TextEncoder();
  await Deno.mkdir(dir, { recursive: true });
  using f = await Deno.open(join(dir, "short.jsonl"), { write: true, create: true });
  let lines: string[] = [], bytes = 0;
  for (let d = 0; d < n; d++) {
    const w: string[] = [];
    for (let i = 0; i < 8; i++) w.push(vocab[Math.floor(rand() * 4096)]);
    lines.push(`{"text":"${w.join(" ")}"}\n`);
    if (lines.length === 65536 || d === n - 1) {
      const data = enc.encode(lines.join(""));
      for (let off = 0; off < data.length;) off += await f.write(data.subarray(off));
      bytes += data.length;
      lines = [];
    }
  }
  return { bytes, documents: n };
}

/** Peak resident set size of this process in bytes (Linux VmHWM), or NaN elsewhere. */
function peakRss(): number {
  try {
    const m = /VmHWM:\s+(\d+) kB/.exec(Deno.readTextFileSync("/proc/self/status"));
    return m ? Number(m[1]) * 1024 : NaN;
  } catch {
    return NaN;
  }
}

/** Prepare the corpus under `root` in this (fresh) process and print one JSON line of figures. */
async function runPrepare(root: string, inputBytes: number, inputDocuments: number): Promise<void> {
  const trace = Deno.env.get("DATA_BENCH_TRACE")
    ? setInterval(() => {
      const m = Deno.memoryUsage();
      const st = Deno.readTextFileSync("/proc/self/status").split("\n").filter((l) =>
        /^(RssAnon|RssFile|RssShmem|Threads)/.test(l)
      ).map((l) => l.replace(/\s+/g, " ")).join(", ");
      console.error(st);
      console.error(
        `rss ${(m.rss / 2 ** 20).toFixed(0)} MB, main heap ${(m.heapUsed / 2 ** 20).toFixed(0)}/${
          (m.heapTotal / 2 ** 20).toFixed(0)
        } MB, external ${(m.external / 2 ** 20).toFixed(0)} MB`,
      );
    }, 1000)
    : undefined;
  // Per-thread CPU (Linux): the largest utime + stime seen per thread, sampled every 100 ms.
  const threadCpu = new Map<string, { name: string; ticks: number }>();
  const sampleThreads = () => {
    try {
      for (const e of Deno.readDirSync("/proc/self/task")) {
        const stat = Deno.readTextFileSync(`/proc/self/task/${e.name}/stat`);
        const close = stat.lastIndexOf(")");
        const fields = stat.slice(close + 2).split(" ");
        const name = stat.slice(stat.indexOf("(") + 1, close);
        const ticks = Number(fields[11]) + Number(fields[12]);
        const old = threadCpu.get(e.name);
        if (!old || ticks > old.ticks) threadCpu.set(e.name, { name, ticks });
      }
    } catch {
      // Not Linux.
    }
  };
  const threads = Deno.env.get("DATA_BENCH_THREADS") ? setInterval(sampleThreads, 100) : undefined;
  const cpu0 = process.cpuUsage();
  const t0 = performance.now();
  const workers = Deno.env.get("DATA_BENCH_WORKERS");
  const info = await prepareDataset(root, { path: "corpus" }, {
    id: "bench",
    dedup: !Deno.env.get("DATA_BENCH_NO_DEDUP"),
    ...(Deno.env.get("DATA_BENCH_MIN_TOKENS")
      ? { min_tokens: Number(Deno.env.get("DATA_BENCH_MIN_TOKENS")) }
      : {}),
    ...(workers ? { workers: Number(workers) } : {}),
  });
  const seconds = (performance.now() - t0) / 1000;
  const cpu = process.cpuUsage(cpu0);
  clearInterval(trace);
  if (threads !== undefined) {
    clearInterval(threads);
    sampleThreads();
    const byName = new Map<string, number>();
    for (const { name, ticks } of threadCpu.values()) {
      byName.set(name, (byName.get(name) ?? 0) + ticks / 100);
    }
    console.error(`thread CPU seconds: ${JSON.stringify(Object.fromEntries(byName))}`);
  }
  if (Deno.env.get("DATA_BENCH_GC")) {
    (globalThis as unknown as { gc: () => void }).gc();
    console.error(`main heap after gc: ${(Deno.memoryUsage().heapUsed / 2 ** 20).toFixed(1)} MB`);
  }
  const cpuSeconds = (cpu.user + cpu.system) / 1e6;
  const stats = info.stats as Record<string, number>;
  console.log(JSON.stringify({
    input_mb: +(inputBytes / 1e6).toFixed(1),
    input_documents: inputDocuments,
    seconds: +seconds.toFixed(2),
    mb_per_s: +(inputBytes / 1e6 / seconds).toFixed(1),
    cpu_seconds: +cpuSeconds.toFixed(2),
    mb_per_cpu_s: +(inputBytes / 1e6 / cpuSeconds).toFixed(1),
    documents: info.documents,
    near_duplicates: stats.near_duplicates,
    tokens: info.tokens,
    peak_rss_mb: +(peakRss() / 2 ** 20).toFixed(0),
    cores: navigator.hardwareConcurrency,
    workers: workers ? Number(workers) : navigator.hardwareConcurrency,
  }));
}

/** Add `n` distinct random signatures to an LshIndex (in this fresh process) and print its figures. */
function runIndex(n: number): void {
  const dir = Deno.makeTempDirSync({ prefix: "gpt2-lsh-bench-" });
  try {
    const index = new LshIndex(128, 0.8, { dir });
    const sig = new Uint32Array(128), rand = rng(27);
    const cpu0 = process.cpuUsage(), t0 = performance.now();
    let dups = 0;
    for (let d = 0; d < n; d++) {
      for (let i = 0; i < 128; i++) sig[i] = (rand() * 2 ** 32) >>> 0;
      if (index.addUnlessDuplicate(sig)) dups++;
    }
    index.flush();
    const seconds = (performance.now() - t0) / 1000, cpu = process.cpuUsage(cpu0);
    const m = Deno.memoryUsage();
    console.log(JSON.stringify({
      documents: n,
      kept: index.size,
      false_duplicates: dups,
      index_mib: +(index.memoryBytes / 2 ** 20).toFixed(0),
      bytes_per_document: +(index.memoryBytes / n).toFixed(1),
      stated_bytes_per_document: index.bytesPerDocument,
      peak_rss_mib: +(peakRss() / 2 ** 20).toFixed(0),
      heap_used_mib: +(m.heapUsed / 2 ** 20).toFixed(1),
      seconds: +seconds.toFixed(1),
      cpu_us_per_document: +((cpu.user + cpu.system) / n).toFixed(2),
    }));
    index.close();
  } finally {
    Deno.removeSync(dir, { recursive: true });
  }
}

if (import.meta.main) {
  const args = Deno.args;
  const flag = (name: string) => {
    const i = args.indexOf(name);
    return i >= 0 ? args[i + 1] : undefined;
  };
  const child = flag("--prepare");
  if (child) await runPrepare(child, Number(flag("--bytes")), Number(flag("--documents")));
  else if (flag("--index-child")) runIndex(Number(flag("--index-child")));
  else if (flag("--index")) {
    const out = await new Deno.Command(Deno.execPath(), {
      args: ["run", "-A", new URL(import.meta.url).pathname, "--index-child", flag("--index")!],
      stdout: "piped",
      stderr: "inherit",
    }).output();
    if (!out.success) throw new Error(`Index benchmark failed (exit ${out.code})`);
    console.log(new TextDecoder().decode(out.stdout).trim());
  } else {
    const short = flag("--short");
    const sizes = short
      ? [Number(short)]
      : (flag("--sizes") ?? flag("--mb") ?? "25,100").split(",").map(Number);
    for (const mb of sizes) {
      const root = await Deno.makeTempDir({ prefix: "gpt2-data-bench-", dir: flag("--dir") });
      try {
        const corpus = short
          ? await writeShortCorpus(join(root, "corpus"), Number(short))
          : await writeCorpus(join(root, "corpus"), mb);
        const out = await new Deno.Command(Deno.execPath(), {
          args: [
            "run",
            "-A",
            ...(flag("--cpu-prof") ? ["--cpu-prof", `--cpu-prof-dir=${flag("--cpu-prof")}`] : []),
            ...(Deno.env.get("DATA_BENCH_GC") ? ["--v8-flags=--expose-gc"] : []),
            ...(flag("--heap-mb")
              ? [`--v8-flags=--max-old-space-size=${flag("--heap-mb")},--max-semi-space-size=2`]
              : []),
            new URL(import.meta.url).pathname,
            "--prepare",
            root,
            "--bytes",
            String(corpus.bytes),
            "--documents",
            String(corpus.documents),
          ],
          stdout: "piped",
          stderr: "inherit",
          env: {
            ...(flag("--workers") ? { DATA_BENCH_WORKERS: flag("--workers")! } : {}),
            ...(short ? { DATA_BENCH_MIN_TOKENS: "4" } : {}),
          },
        }).output();
        if (!out.success) {
          throw new Error(
            `Benchmark of ${short ? `${short} documents` : `${mb} MB`} failed (exit ${out.code})`,
          );
        }
        console.log(new TextDecoder().decode(out.stdout).trim());
      } finally {
        await Deno.remove(root, { recursive: true });
      }
    }
  }
}
