/**
 * The serving path rehearsed at load (GenerationServiceOptions.rehearseAtLoad), on the test
 * adapter with a tiny random model: the engine's own step runs bursts of synthetic requests
 * after the warm-up, while the real requests that arrive meanwhile wait aside in order (a cancel
 * still finds them). Nothing of the rehearsal is posted, the real requests get exactly their own
 * messages and the same greedy tokens as on a service that does not rehearse, the generator ends
 * with every slot free, and a later burst is served alike. Skipped without an adapter.
 */

import assert from "node:assert/strict";
import { makeConfig } from "../model/config.ts";
import { initParams } from "../model/init.ts";
import { exportTensors, hfConfig } from "../checkpoint/checkpoint.ts";
import { GenerationService, type GenerationServiceOptions } from "../worker/serving.ts";
import { Generator, type SamplingParams } from "../engine/generator.ts";
import type { FromWorker, WorkerGeneration } from "../protocol.ts";
import { resolveModelSource } from "../checkpoint/model_source.ts";
import { writeSafetensors } from "../checkpoint/safetensors.ts";
import { noGpu, testContext } from "./_helpers.ts";
import { until } from "./_wait.ts";

const config = makeConfig({ n_layer: 1, n_head: 4, n_embd: 64, n_positions: 64 });
const STREAMS = 8;

/** A tiny random model as a Hugging Face directory under a fresh home (remove `root` after). */
async function randomModel() {
  const root = await Deno.makeTempDir({ prefix: "gpt2_rehearsal_" });
  const dir = `${root}/models/rand`;
  await Deno.mkdir(dir, { recursive: true });
  await writeSafetensors(`${dir}/model.safetensors`, exportTensors(config, initParams(config, 7)));
  await Deno.writeTextFile(
    `${dir}/config.json`,
    JSON.stringify(hfConfig(config, { attention_dropout: 0, hidden_dropout: 0 })),
  );
  return { root, model: await resolveModelSource(root, "rand") };
}

/** A greedy request on prompt `prompt`. */
function request(
  model: WorkerGeneration["model"],
  id: string,
  prompt: number[],
  max_tokens = 6,
): WorkerGeneration {
  return { id, model, prompt, max_tokens, temperature: 0, top_k: 0, top_p: 1, seed: 1, stop_at_eos: false };
}

type Msg<T extends FromWorker["type"]> = Extract<FromWorker, { type: T }>;

/** Per request id: its gen_started count, its tokens in order, its gen_done messages. */
function byRequest(msgs: FromWorker[]) {
  const out = new Map<string, { started: number; tokens: number[]; done: Msg<"gen_done">[] }>();
  for (const m of msgs) {
    if (m.type !== "gen_started" && m.type !== "gen_tokens" && m.type !== "gen_done") continue;
    let r = out.get(m.id);
    if (!r) out.set(m.id, r = { started: 0, tokens: [], done: [] });
    if (m.type === "gen_started") r.started++;
    else if (m.type === "gen_tokens") r.tokens.push(...m.tokens);
    else r.done.push(m);
  }
  return out;
}

/** Whether an admission is the rehearsal's (its synthetic requests sample with top-k 40 at 0.8). */
const isRehearsal = (s: SamplingParams) => s.top_k === 40 && Math.abs(s.temperature - 0.8) < 1e-6;

/**
 * Runs the scenario on a fresh service with `opts`: request "a" loads the model; once the
 * rehearsal admits its first stream (or at once, when there is none) "b" and "c" arrive, "c" is
 * cancelled and training hands over a turn; then, once all is idle, a burst of STREAMS requests.
 * Returns the messages, the rehearsal's admissions (and what was odd about them), when "c"
 * arrived, whether the turn ended by "a"'s step (or its limit), the generator, and the errors logged.
 */
async function scenario(model: WorkerGeneration["model"], opts: Partial<GenerationServiceOptions>) {
  const msgs: FromWorker[] = [];
  const svc = new GenerationService(async () => (await testContext())!, (m) => msgs.push(m), {
    maxStreams: STREAMS,
    chunk: 4,
    firstChunk: 2,
    prefillTokens: 128,
    runAhead: true,
    ...opts,
  });
  const admit = Generator.prototype.admit, error = console.error;
  const errors: string[] = [], odd: string[] = [];
  let rehearsed = 0, gen: Generator | null = null, during: (() => void) | null = null;
  let cArrivedAt = -1, turnEnded: boolean | null = null;
  const arrive = () => {
    cArrivedAt = msgs.length;
    // Training hands over a turn of a fraction of a ms: only a step of a real request may end it,
    // or the turn's limit (its share plus a second) while the model still loads.
    const t0 = performance.now();
    svc.turn(1).then(() =>
      turnEnded = msgs.some((m) => m.type === "gen_started" && m.id === "a") || performance.now() - t0 >= 1000
    );
    // Requests and a cancel while the engine rehearses: added synchronously (the engine exists).
    svc.generate(request(model, "b", [50, 51, 52, 53, 54]));
    svc.generate(request(model, "c", [60, 61]));
    svc.cancel("c");
  };
  Generator.prototype.admit = function (
    this: Generator,
    prompt: ArrayLike<number>,
    sampling: SamplingParams,
    maxTokens?: number,
  ) {
    gen = this;
    if (isRehearsal(sampling)) {
      rehearsed++;
      // Recorded, not thrown: the engine would take a throw for a failed admission.
      if (!(maxTokens !== undefined && maxTokens >= 2 && maxTokens <= 4)) odd.push(`max_tokens ${maxTokens}`);
      if (!(prompt.length >= 8 && prompt.length <= 40)) odd.push(`a prompt of ${prompt.length} tokens`);
      const f = during;
      during = null;
      f?.();
    }
    return admit.call(this, prompt, sampling, maxTokens);
  };
  console.error = (...a: unknown[]) => errors.push(a.map(String).join(" "));
  try {
    const rehearse = opts.rehearseAtLoad ?? opts.warmAtLoad ?? false;
    if (rehearse) during = arrive;
    await svc.generate(request(model, "a", [464, 3290, 318]));
    if (!rehearse) arrive();
    const ended = (ids: string[]) => () => {
      const r = byRequest(msgs);
      return ids.every((id) => (r.get(id)?.done.length ?? 0) > 0);
    };
    await until(ended(["a", "b", "c"]), "a, b and c to end", 60_000);
    await until(() => !svc.busy, "the engine to go idle", 10_000);
    const burst = Array.from({ length: STREAMS }, (_, i) => `burst${i}`);
    for (const [i, id] of burst.entries()) {
      const prompt = Array.from({ length: 3 + 5 * i }, (_, j) => (100 + 37 * i + 11 * j) % config.vocab_size);
      await svc.generate(request(model, id, prompt, 3 + (i % 4)));
    }
    await until(ended(burst), "the burst to end", 60_000);
    await until(() => !svc.busy, "the engine to go idle", 10_000);
    return { msgs, rehearsed, odd, cArrivedAt, turnEnded, gen: gen as Generator | null, errors, burst };
  } finally {
    Generator.prototype.admit = admit;
    console.error = error;
    await svc.destroy();
  }
}

Deno.test({
  name:
    "Rehearsing the serving path at load posts nothing of its own, keeps the requests that arrive meanwhile in order and cancellable, and leaves their tokens unchanged",
  ignore: noGpu,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: async () => {
    const { root, model } = await randomModel();
    try {
      const on = await scenario(model, { warmAtLoad: true, rehearseAtLoad: true });
      const off = await scenario(model, { warmAtLoad: true, rehearseAtLoad: false });

      // The rehearsal ran twice over bursts of 1, 4 and 8 streams (16 > maxStreams), only when on.
      assert.equal(on.rehearsed, 2 * (1 + 4 + STREAMS));
      assert.equal(off.rehearsed, 0);
      assert.deepEqual(on.odd, [], "synthetic requests of 8-40 prompt tokens and 2-4 new ones");
      assert.deepEqual(on.errors, [], "nothing logged: the rehearsal did not fail");
      assert.ok(on.cArrivedAt >= 0, "b and c arrived while the engine rehearsed");

      const real = ["a", "b", "c", ...on.burst].sort();
      for (const run of [on, off]) {
        const r = byRequest(run.msgs);
        // Only the real requests' messages, and exactly theirs.
        assert.deepEqual([...r.keys()].sort(), real, "ids posted");
        for (const id of real.filter((id) => id !== "c")) {
          const { started, tokens, done } = r.get(id)!;
          const want = id === "a" || id === "b" ? 6 : 3 + (Number(id.slice(5)) % 4);
          assert.equal(started, 1, `${id}: one gen_started`);
          assert.equal(done.length, 1, `${id}: one gen_done`);
          assert.deepEqual([done[0].reason, done[0].completion_tokens], ["length", want], id);
          assert.equal(tokens.length, want, `${id}: its tokens`);
        }
        // c was cancelled while it waited (during the rehearsal when on): no start, no tokens.
        const c = r.get("c")!;
        assert.deepEqual([c.started, c.tokens.length, c.done.length], [0, 0, 1]);
        assert.deepEqual([c.done[0].reason, c.done[0].completion_tokens], ["cancelled", 0]);
        // a, then b, admitted in their order, after c's cancel.
        const at = (type: FromWorker["type"], id: string) =>
          run.msgs.findIndex((m) => m.type === type && "id" in m && m.id === id);
        assert.ok(at("gen_done", "c") < at("gen_started", "a"), "c cancelled before a started");
        assert.ok(at("gen_started", "a") < at("gen_started", "b"), "a admitted before b");
        assert.equal(
          run.turnEnded,
          true,
          "training's turn ended by a's step or its limit, not by the rehearsal's",
        );
        // The generator ended with every slot free.
        assert.ok(run.gen, "the generator was seen");
        assert.deepEqual([run.gen.streams, run.gen.free], [0, STREAMS]);
      }
      // With the rehearsal, c's cancel was posted while the engine was still loading: its gen_done
      // came before any message of a, which waited for the load.
      const first = on.msgs.findIndex((m) => m.type.startsWith("gen_") && "id" in m && m.id === "a");
      const cDone = on.msgs.findIndex((m) => m.type === "gen_done" && m.id === "c");
      assert.ok(on.cArrivedAt <= cDone && cDone < first);

      // The same greedy tokens with and without the rehearsal, for every request.
      const a = byRequest(on.msgs), b = byRequest(off.msgs);
      for (const id of real) assert.deepEqual(a.get(id)!.tokens, b.get(id)!.tokens, `${id}'s tokens`);
    } finally {
      await Deno.remove(root, { recursive: true });
    }
  },
});
