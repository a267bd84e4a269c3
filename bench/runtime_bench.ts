/**
 * `deno task bench runtime [--cycles 10] [--model gpt2-124M] [--batch 8] [--seq 1024] [--gpus 2]`:
 * start–train–SIGTERM cycles through the real server and its GPU host. One long job is
 * submitted; each cycle starts the server on the same data directory, waits until the job has
 * trained `--steps` more iterations, sends SIGTERM and records the exit status, the seconds the
 * stop took, and the iteration checkpointed. The next cycle checks the job resumed exactly there
 * (nothing lost). With `--gpus N` (N > 1) a last run starts N Workers, trains N jobs at once and
 * reports each one's tokens/s, then stops the same way.
 */

import { follow, type Server, startServer, submit } from "../tests/_server.ts";

const args = new Map<string, string>();
for (let i = 0; i < Deno.args.length; i += 2) args.set(Deno.args[i].replace(/^--/, ""), Deno.args[i + 1]);
const cycles = Number(args.get("cycles") ?? "10");
const steps = Number(args.get("steps") ?? "20");
const gpus = Number(args.get("gpus") ?? "1");
const body = (seed: number) => ({
  model: args.get("model") ?? "gpt2-124M",
  dataset: "sotu",
  train_iters: 100_000,
  batch_size: Number(args.get("batch") ?? "8"),
  seq_len: Number(args.get("seq") ?? "1024"),
  log_interval: 5,
  eval_interval: 0,
  save_interval: 0,
  keep_checkpoints: 2,
  seed,
});

/** Waits for `steps` more logged iterations of `id`, then SIGTERMs; returns what the stop did. */
async function trainThenStop(server: Server, id: string, lastEvent: number) {
  let from = -1, stoppedAt = -1, resumedAt: number | null = null, signalledAt = 0, last = lastEvent;
  const tokensPerS: number[] = [];
  await follow(`${server.url}/jobs/${id}/events`, lastEvent, (e) => {
    if (e.id > 0) last = e.id;
    const msg = String(e.data.message ?? "");
    if (msg.startsWith("Resumed from") || msg.startsWith("Started at")) resumedAt = Number(e.data.iteration);
    if (e.event === "progress" && e.data.kind === "train") {
      const it = Number(e.data.iteration);
      if (from < 0) from = it;
      tokensPerS.push(Number(e.data.tokens_per_s));
      if (!signalledAt && it - from >= steps) {
        signalledAt = performance.now();
        server.child.kill("SIGTERM");
      }
    }
    if (e.event === "checkpoint") stoppedAt = Number(e.data.iteration);
    if (e.event === "done") throw new Error(`Job ended: ${JSON.stringify(e.data)}`);
  });
  const status = await server.child.status;
  return {
    code: status.code,
    signal: status.signal,
    stop_s: Math.round((performance.now() - signalledAt) / 100) / 10,
    resumed_at: resumedAt,
    checkpoint_at: stoppedAt,
    tokens_per_s: Math.round(
      tokensPerS.slice(1).reduce((a, b) => a + b, 0) / Math.max(1, tokensPerS.length - 1),
    ),
    last,
  };
}

const home = await Deno.makeTempDir({ prefix: "gpt2_runtime_bench_" });
const rows: Record<string, unknown>[] = [];
try {
  let server = await startServer(home);
  const id = await submit(server.url, body(1));
  let lastEvent = 0, expected: number | null = 0;
  for (let c = 1; c <= cycles; c++) {
    if (c > 1) server = await startServer(home);
    const r = await trainThenStop(server, id, lastEvent);
    lastEvent = r.last;
    const lost = expected !== null && r.resumed_at !== expected;
    // The server logs how the GPU host ended when it was not a clean exit 0.
    const hostExit = server.output.join("").match(/GPU host exited with ([^\n]*)/)?.[1] ?? "0";
    rows.push({ cycle: c, ...r, last: undefined, lost, host_exit: hostExit });
    console.log(JSON.stringify(rows.at(-1)));
    if (r.code !== 0) console.log(server.output.join("").slice(-3000));
    expected = r.checkpoint_at;
  }
  const ok = rows.filter((r) => r.code === 0 && !r.lost).length;
  console.log(`\n${ok} of ${cycles} cycles exited 0 and resumed exactly where they stopped`);

  if (gpus > 1) {
    const dir = await Deno.makeTempDir({ prefix: "gpt2_runtime_bench_gpus_" });
    const s = await startServer(dir, { GPT2_GPUS: String(gpus) });
    const ids = [];
    for (let g = 0; g < gpus; g++) ids.push(await submit(s.url, body(10 + g)));
    const perJob = new Map<string, number[]>();
    await Promise.all(ids.map((j) =>
      follow(`${s.url}/jobs/${j}/events`, 0, (e) => {
        if (e.event !== "progress" || e.data.kind !== "train") return;
        const list = perJob.get(j) ?? [];
        list.push(Number(e.data.tokens_per_s));
        perJob.set(j, list);
        return list.length < 1 + Math.ceil(steps / 5);
      })
    ));
    const health = await (await fetch(`${s.url}/health`)).json();
    s.child.kill("SIGTERM");
    const status = await s.child.status;
    console.log(JSON.stringify({
      gpus,
      adapters: health.gpus.map((g: { adapter: string; pci_bus: string | null }) => [g.adapter, g.pci_bus]),
      tokens_per_s: ids.map((j) => {
        const l = perJob.get(j)!.slice(1);
        return Math.round(l.reduce((a, b) => a + b, 0) / l.length);
      }),
      exit_code: status.code,
    }));
    await Deno.remove(dir, { recursive: true });
  }
} finally {
  await Deno.remove(home, { recursive: true });
}
