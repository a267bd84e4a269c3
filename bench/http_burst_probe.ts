/**
 * A fresh server's first burst against the next ones, without a GPU: the real app (createApp) on
 * Deno.serve over a scripted Worker (tests/fakes; it answers each generation with one token a
 * millisecond after it arrives, and the warm-up's rehearsals with the real Worker's code), in a
 * subprocess of its own that runs the start-up warm-up (warmUp, as main.ts does) and one request
 * (the benchmark's model load) before it prints its port. This process, the client, first runs
 * its own code against a stub server (so that the first round measures a cold server, not a cold
 * client), then sends `--rounds` bursts of S concurrent streaming `POST /v1/completions`, 600 ms
 * apart, and prints per burst the p50 of the time to the answer's headers and to its end (the one
 * token and [DONE]). `--servers` fresh servers one after another.
 *
 *   deno run -A bench/http_burst_probe.ts [--streams 64] [--rounds 4] [--servers 3]
 *                                         [--burst 64] [--socket-rounds 6] [--no-worker] [--prof DIR]
 *
 * `--burst` and `--socket-rounds` set the warm-up's socket rounds; `--no-worker` runs the warm-up
 * before the Worker starts, so that its rehearsals are answered in the HTTP process (as they all
 * were before they went through a ready Worker).
 */
import { GenerationManager } from "../server/generate/mod.ts";
import { JobRunner, JobStore } from "../server/jobs/mod.ts";
import type { FromWorker } from "../protocol.ts";
import { ScriptedWorker } from "../tests/fakes/fake_worker.ts";
import { createApp } from "../server/routes/mod.ts";
import { warmUp } from "../server/rehearsal.ts";

const arg = (name: string, dflt: number) => {
  const i = Deno.args.indexOf(`--${name}`);
  return i >= 0 ? Number(Deno.args[i + 1]) : dflt;
};
const S = arg("streams", 64), ROUNDS = arg("rounds", 4), SERVERS = arg("servers", 3);
const BURST = arg("burst", 64), SOCKET_ROUNDS = arg("socket-rounds", 6);
const NO_WORKER = Deno.args.includes("--no-worker");
/** `--prof DIR`: each server writes a V8 CPU profile of its whole life (warm-up included) into DIR. */
const PROF = (() => {
  const i = Deno.args.indexOf("--prof");
  return i >= 0 ? Deno.args[i + 1] : null;
})();

/** The server side: prints its port once warmed up and past its first request. */
async function serve(): Promise<void> {
  const root = await Deno.makeTempDir({ prefix: "gpt2_httpburst_" });
  await Deno.mkdir(`${root}/models/tiny`, { recursive: true });
  await Deno.writeTextFile(
    `${root}/models/tiny/config.json`,
    JSON.stringify({ n_layer: 2, n_head: 4, n_embd: 64, n_positions: 1024, vocab_size: 50257 }),
  );
  await Deno.writeFile(`${root}/models/tiny/model.safetensors`, new Uint8Array(8));
  const store = new JobStore(":memory:");
  const workers: ScriptedWorker[] = [];
  const runner = new JobRunner(store, {
    root,
    gpus: 1,
    spawn: () => {
      const w = new ScriptedWorker();
      workers.push(w);
      return w;
    },
    datasetExists: () => Promise.resolve(true),
  });
  const manager = new GenerationManager(runner.pool, root, {});
  const app = createApp({ runner, generation: manager, token: null });
  const srv = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen: () => {} }, app.fetch);
  const warm = () =>
    warmUp(app, {
      port: srv.addr.port,
      burst: BURST,
      socketRounds: SOCKET_ROUNDS,
      ready: () => manager.whenReady(10_000),
    });
  // With --no-worker the warm-up runs before the Worker starts: no GPU is ready for it.
  if (NO_WORKER) await warm();
  runner.start();
  await new Promise((r) => setTimeout(r, 0));
  const worker = workers[0];
  // Answers each generation (not the rehearsals, which the fake's real Worker code answers) a
  // millisecond after it arrives, as a GPU's step would some time later.
  let answered = 0;
  const post = worker.postMessage.bind(worker);
  worker.postMessage = (msg) => {
    post(msg);
    if (msg.type !== "generate" || msg.request.rehearsal) return;
    setTimeout(() => {
      for (; answered < worker.generations.length; answered++) {
        const id = worker.generations[answered].id;
        worker.send({ type: "gen_tokens", id, tokens: [464] } satisfies FromWorker);
        worker.send({ type: "gen_done", id, reason: "length", error: null, completion_tokens: 1 });
      }
    }, 1);
  };
  if (!NO_WORKER) await warm();
  // The benchmark's first request (it loads the model there).
  const res = await fetch(`http://127.0.0.1:${srv.addr.port}/v1/completions`, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ model: "tiny", prompt: "Load", max_tokens: 1, stream: true }),
  });
  await res.text();
  const { worker: through, here } = manager.rehearsed;
  console.log(JSON.stringify({ port: srv.addr.port, through, here }));
  Deno.addSignalListener("SIGTERM", () => Deno.exit(0));
}

const median = (a: number[]) => [...a].sort((x, y) => x - y)[a.length >> 1];

/** S concurrent streams to `base`: p50 ms to the headers and to the end. */
async function burst(base: string): Promise<{ headers: number; end: number }> {
  const rs = await Promise.all(Array.from({ length: S }, async (_, i) => {
    const t0 = performance.now();
    const res = await fetch(`${base}/v1/completions`, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({
        model: "tiny",
        prompt: `A prompt of some length, stream ${i}`,
        max_tokens: 1,
        stream: true,
      }),
    });
    const headers = performance.now() - t0;
    await res.text();
    return { headers, end: performance.now() - t0 };
  }));
  return { headers: median(rs.map((r) => r.headers)), end: median(rs.map((r) => r.end)) };
}

async function client(): Promise<void> {
  const stub = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen: () => {} }, async (req) => {
    await req.text();
    return new Response("data: x\n\ndata: [DONE]\n\n", { headers: { "content-type": "text/event-stream" } });
  });
  for (let i = 0; i < 3; i++) await burst(`http://127.0.0.1:${stub.addr.port}`);
  await stub.shutdown();
  for (let s = 0; s < SERVERS; s++) {
    const child = new Deno.Command(Deno.execPath(), {
      args: [
        "run",
        "-A",
        ...(PROF ? ["--cpu-prof", `--cpu-prof-dir=${PROF}`, "--cpu-prof-interval=100"] : []),
        new URL(import.meta.url).pathname,
        "--serve",
        ...Deno.args,
      ],
      stdout: "piped",
      stderr: "inherit",
    }).spawn();
    const reader = child.stdout.pipeThrough(new TextDecoderStream()).getReader();
    let line = "";
    while (!line.includes("\n")) {
      const { value, done } = await reader.read();
      if (done) throw new Error("the server exited before its port");
      line += value;
    }
    const { port, through, here } = JSON.parse(line);
    const rounds: string[] = [];
    for (let r = 0; r < ROUNDS; r++) {
      await new Promise((res) => setTimeout(res, 600));
      const b = await burst(`http://127.0.0.1:${port}`);
      rounds.push(`${b.headers.toFixed(1)} / ${b.end.toFixed(1)}`);
    }
    console.log(
      `server ${s + 1} (warm-up: ${through} rehearsals through the Worker, ${here} in the HTTP process), ` +
        `${S} streams, p50 ms to headers / end, burst by burst: ${rounds.join(", ")}`,
    );
    child.kill("SIGTERM");
    await child.status;
    reader.releaseLock();
  }
}

if (Deno.args.includes("--serve")) await serve();
else await client();
