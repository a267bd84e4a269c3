/**
 * How much of the HTTP process's time a streamed token costs, without a GPU: the real app
 * (createApp, after the start-up warm-up) over a scripted Worker (tests/fakes), S concurrent
 * streaming `POST /v1/completions`, each answered with `chunks` chunks of `per` tokens (as a
 * Worker's steps post them) and read to the end; wall time from the first chunk to the last byte,
 * per token. At 64 streams an H200 generates about 17,000 tokens a second: at 20 µs a token the
 * HTTP process would be busy a third of the time just streaming them.
 *
 *   deno run -A bench/http_stream_probe.ts [--streams 64] [--chunks 4] [--per 32] [--rounds 6]
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
const S = arg("streams", 64), CHUNKS = arg("chunks", 4), PER = arg("per", 32), ROUNDS = arg("rounds", 6);
const root = await Deno.makeTempDir({ prefix: "gpt2_httpstream_" });
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
runner.start();
await new Promise((r) => setTimeout(r, 0));
const app = createApp({ runner, generation: manager, token: null });
await warmUp(app, {});
const worker = workers[0];

/** One round: ms from the first chunk posted to every stream read to its end. */
async function round(): Promise<number> {
  const before = worker.generations.length;
  const reqs = Array.from({ length: S }, (_, i) =>
    app.request("/v1/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({
        model: "tiny",
        prompt: `Hello there ${i}`,
        max_tokens: CHUNKS * PER,
        stream: true,
      }),
    }));
  while (worker.generations.length < before + S) await new Promise((r) => setTimeout(r, 0));
  const gens = worker.generations.slice(before);
  const t0 = performance.now();
  const bodies = (await Promise.all(reqs)).map((r) => r.text());
  for (let c = 0; c < CHUNKS; c++) {
    for (const g of gens) {
      const tokens = Array.from({ length: PER }, (_, k) => 464 + ((c * PER + k) % 500));
      worker.send({ type: "gen_tokens", id: g.id, tokens } satisfies FromWorker);
    }
    await new Promise((r) => setTimeout(r, 0)); // the next step's chunk comes in a later task
  }
  for (const g of gens) {
    worker.send({
      type: "gen_done",
      id: g.id,
      reason: "length",
      error: null,
      completion_tokens: CHUNKS * PER,
    });
  }
  const texts = await Promise.all(bodies);
  if (!texts.every((t) => t.endsWith("data: [DONE]\n\n"))) {
    throw new Error("a stream did not end with [DONE]");
  }
  return performance.now() - t0;
}

for (let i = 0; i < ROUNDS; i++) {
  const ms = await round();
  console.log(
    `${S} streams × ${CHUNKS * PER} tokens streamed in ${ms.toFixed(1)} ms: ` +
      `${(ms * 1000 / (S * CHUNKS * PER)).toFixed(1)} µs of the HTTP process per token`,
  );
}
await Deno.remove(root, { recursive: true });
Deno.exit(0);
