/**
 * How long the HTTP process takes to hand a burst of generation requests to the GPU host, on a
 * fresh app and once warm, without a GPU: the real app (createApp) over a scripted Worker
 * (tests/fakes), S concurrent in-memory `POST /v1/completions`, timed until the Worker has all of
 * them. `--warm-up` runs the server's start-up warm-up (warmUp) first, as main.ts does.
 *
 *   deno run -A bench/http_cold_probe.ts [--warm-up] [--streams 16,16,64,64]
 */
import { GenerationManager } from "../server/generate/mod.ts";
import { JobRunner, JobStore } from "../server/jobs/mod.ts";
import type { FromWorker } from "../protocol.ts";
import { ScriptedWorker } from "../tests/fakes/fake_worker.ts";
import { createApp } from "../server/routes/mod.ts";
import { warmUp } from "../server/rehearsal.ts";

const arg = (name: string, dflt: string) => {
  const i = Deno.args.indexOf(`--${name}`);
  return i >= 0 ? Deno.args[i + 1] : dflt;
};
const root = await Deno.makeTempDir({ prefix: "gpt2_httpcold_" });
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
const worker = workers[0];
const prompt = "The quick brown fox jumps over the lazy dog, and then a few more words follow it";

/** S requests sent together: ms until the Worker has every one; then each is answered and read. */
async function round(S: number): Promise<number> {
  const before = worker.generations.length, t0 = performance.now();
  const reqs = Array.from({ length: S }, (_, i) =>
    app.request("/v1/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ model: "tiny", prompt: prompt + i, max_tokens: 8, stream: true, top_k: 40 }),
    }));
  while (worker.generations.length < before + S) await new Promise((r) => setTimeout(r, 0));
  const ms = performance.now() - t0;
  for (const g of worker.generations.slice(before)) {
    const msg: FromWorker = {
      type: "gen_done",
      id: g.id,
      reason: "length",
      error: null,
      completion_tokens: 0,
    };
    worker.send(msg);
  }
  for (const r of await Promise.all(reqs)) await r.text();
  return ms;
}

await round(1); // as the benchmark's model-loading request
if (Deno.args.includes("--warm-up")) console.log(`warm-up: ${(await warmUp(app, {})).toFixed(1)} ms`);
for (const S of arg("streams", "16,16,64,64").split(",").map(Number)) {
  console.log(`${S} requests: all at the GPU host after ${(await round(S)).toFixed(1)} ms`);
}
await Deno.remove(root, { recursive: true });
Deno.exit(0);
