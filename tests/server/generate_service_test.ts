/**
 * The Worker-side generation service on the real GPU (a tiny random model from a Hugging Face
 * directory): a request that finds every stream slot taken waits in order and is admitted at the
 * step after a cancel frees one; requests sent together to an idle batcher are prefilled together;
 * and training's turn resolves once generation has had its share, or at once when generation is
 * idle. Skipped without an adapter. The options' environment variables and their errors.
 */

import { generationOptionsFromEnv } from "../../worker/worker_settings.ts";
import assert from "node:assert/strict";
import { makeConfig } from "../../model/config.ts";
import { initParams } from "../../model/init.ts";
import { exportTensors, hfConfig } from "../../checkpoint/checkpoint.ts";
import { GenerationService, type GenerationServiceOptions } from "../../worker/serving.ts";
import type { FromWorker, WorkerGeneration } from "../../protocol.ts";
import { resolveModelSource } from "../../checkpoint/model_source.ts";
import { writeSafetensors } from "../../checkpoint/safetensors.ts";
import { noGpu, testContext } from "../_helpers.ts";
import { until } from "../_wait.ts";

const config = makeConfig({ n_layer: 1, n_head: 4, n_embd: 64, n_positions: 64 });

/** A tiny random model as a Hugging Face directory under a fresh home (remove `root` after). */
async function randomModel() {
  const root = await Deno.makeTempDir({ prefix: "gpt2_gensvc_" });
  const dir = `${root}/models/rand`;
  await Deno.mkdir(dir, { recursive: true });
  await writeSafetensors(`${dir}/model.safetensors`, exportTensors(config, initParams(config, 5)));
  await Deno.writeTextFile(
    `${dir}/config.json`,
    JSON.stringify(hfConfig(config, { attention_dropout: 0, hidden_dropout: 0 })),
  );
  return { root, model: await resolveModelSource(root, "rand") };
}

/** A service on the test adapter with `opts`, and the messages it posts. */
function service(opts: Partial<GenerationServiceOptions>) {
  const msgs: FromWorker[] = [];
  const svc = new GenerationService(async () => (await testContext())!, (m) => msgs.push(m), opts);
  return { svc, msgs };
}

/** A request for `model` on a fixed 3-token prompt; `over` changes any field. */
function request(
  model: WorkerGeneration["model"],
  id: string,
  over: Partial<WorkerGeneration>,
): WorkerGeneration {
  return {
    id,
    model,
    prompt: [464, 3290, 318],
    max_tokens: 6,
    temperature: 1,
    top_k: 0,
    top_p: 1,
    seed: 1,
    stop_at_eos: false,
    ...over,
  };
}

Deno.test({
  name: "GenerationService queues past its slots and admits at the step after a cancel frees one",
  ignore: noGpu,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: async () => {
    const { root, model } = await randomModel();
    const { svc, msgs } = service({ maxStreams: 1, chunk: 4, firstChunk: 2 });
    const req = (id: string, max_tokens: number) => request(model, id, { max_tokens });
    const of = (id: string, type: FromWorker["type"]) =>
      msgs.filter((m) => m.type === type && "id" in m && m.id === id);
    try {
      await svc.generate(req("a", 50));
      await svc.generate(req("b", 3));
      await until(() => of("a", "gen_tokens").length >= 2, "a's first tokens", 60_000);
      assert.equal(of("b", "gen_started").length, 0, "b waits: the only slot is a's");
      assert.ok(svc.busy);
      svc.cancel("a");
      await until(() => of("b", "gen_done").length === 1, "b to finish", 60_000);
      const a = of("a", "gen_done")[0] as Extract<FromWorker, { type: "gen_done" }>;
      const b = of("b", "gen_done")[0] as Extract<FromWorker, { type: "gen_done" }>;
      assert.equal(a.reason, "cancelled");
      assert.ok(a.completion_tokens < 50);
      assert.deepEqual([b.reason, b.completion_tokens], ["length", 3]);
      const started = msgs.findIndex((m) => m.type === "gen_started" && m.id === "b");
      assert.ok(started > msgs.indexOf(a), "b started after a's slot was freed");
      await until(() => !svc.busy, "the engine to go idle");
      // Training's turn returns at once when nothing is generating.
      const t0 = performance.now();
      await svc.turn(10_000);
      assert.ok(performance.now() - t0 < 100);
    } finally {
      await svc.destroy();
      await Deno.remove(root, { recursive: true });
    }
  },
});

Deno.test({
  name: "GenerationService: requests sent together to an idle batcher are prefilled in one step",
  ignore: noGpu,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: async () => {
    const { root, model } = await randomModel();
    // Running ahead as on GPUs.
    const { svc, msgs } = service({
      maxStreams: 4,
      chunk: 4,
      firstChunk: 2,
      admitWindowMs: 50,
      runAhead: true,
    });
    const req = (id: string) => request(model, id, { temperature: 0 });
    try {
      await svc.generate(req("warm")); // loads the model
      await until(() => msgs.some((m) => m.type === "gen_done"), "the warm-up", 60_000);
      await until(() => !svc.busy, "the engine to go idle");
      const loadMs = (m: FromWorker) => m.type === "gen_started" ? m.load_ms : null;
      assert.ok(
        msgs.map(loadMs).some((ms) => ms !== null && ms > 0),
        "the request that loaded the model reports it",
      );
      msgs.length = 0;
      await svc.generate(req("a"));
      await svc.generate(req("b"));
      await until(() => msgs.filter((m) => m.type === "gen_done").length === 2, "both", 60_000);
      const firstTokens = msgs.findIndex((m) => m.type === "gen_tokens");
      const started = msgs.filter((m, i) => m.type === "gen_started" && i < firstTokens);
      assert.equal(started.length, 2, "both admitted before the first token came");
      assert.deepEqual(started.map(loadMs), [0, 0], "a loaded model's requests waited for no load");
      for (const id of ["a", "b"]) {
        const done = msgs.find((m) => m.type === "gen_done" && m.id === id) as Extract<
          FromWorker,
          { type: "gen_done" }
        >;
        assert.deepEqual([done.reason, done.completion_tokens], ["length", 6]);
      }
    } finally {
      await svc.destroy();
      await Deno.remove(root, { recursive: true });
    }
  },
});

Deno.test({
  name:
    "GenerationService: training's turn waits for a model loading for a waiting request, so the load's GPU rounds never queue behind training steps",
  ignore: noGpu,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: async () => {
    const { root, model } = await randomModel();
    // Warming at load, as on GPUs: the load runs GPU rounds of its own.
    const { svc, msgs } = service({
      maxStreams: 4,
      chunk: 4,
      firstChunk: 2,
      prefillTokens: 64,
      warmAtLoad: true,
    });
    try {
      const t0 = performance.now();
      await svc.generate(request(model, "first", { max_tokens: 2 }));
      // A training step that took 1 ms hands over: its share alone would be under a millisecond.
      await svc.turn(1);
      const turnMs = performance.now() - t0;
      const started = msgs.find((m) => m.type === "gen_started") as
        | Extract<FromWorker, { type: "gen_started" }>
        | undefined;
      assert.ok(started, `training went on after ${turnMs.toFixed(0)} ms while the model was still loading`);
      assert.ok(
        started.load_ms > 0 && started.load_ms <= turnMs + 1,
        `load ${started.load_ms} ms, turn ${turnMs} ms`,
      );
      await until(() => msgs.some((m) => m.type === "gen_done"), "the request", 60_000);
      // Loaded and idle: the turn is immediate again.
      await until(() => !svc.busy, "the engine to go idle");
      const t1 = performance.now();
      await svc.turn(1);
      assert.ok(performance.now() - t1 < 100);
    } finally {
      await svc.destroy();
      await Deno.remove(root, { recursive: true });
    }
  },
});

Deno.test({
  name:
    "GenerationService beside training: the first request is served before the full warm-up, which runs once the engine is idle, training held meanwhile",
  ignore: noGpu,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: async () => {
    const { root, model } = await randomModel();
    const { svc, msgs } = service({
      maxStreams: 2,
      chunk: 4,
      firstChunk: 2,
      prefillTokens: 32,
      warmAtLoad: true,
    });
    const ctx = (await testContext())!;
    const device = ctx.device, create = device.createComputePipeline;
    let created = 0;
    device.createComputePipeline = (d: GPUComputePipelineDescriptor) => {
      created++;
      return create.call(device, d);
    };
    const done = () => msgs.filter((m) => m.type === "gen_done").length;
    try {
      svc.trainingStep(); // a job trains on this GPU
      await svc.generate(request(model, "first", { max_tokens: 2 }));
      await until(() => done() === 1, "the first request", 120_000);
      const atFirst = created;
      assert.ok(svc.busy, "the deferred warm-up runs once the first request is done");
      // Training's turn waits for it, as for a load.
      const t0 = performance.now();
      await svc.turn(1);
      assert.ok(!svc.busy, `training went on after ${(performance.now() - t0).toFixed(0)} ms, mid warm-up`);
      const atWarm = created;
      assert.ok(
        atWarm > atFirst,
        `the warm-up compiled nothing after the first request (${atFirst} pipelines)`,
      );
      // Everything is built now: no concurrency or prompt length compiles anything.
      let n = 0;
      for (const streams of [1, 2]) {
        for (const len of [1, 40]) {
          const before = done();
          for (let i = 0; i < streams; i++) {
            await svc.generate(
              request(model, `r${n++}`, { prompt: Array.from({ length: len }, (_, j) => j + i) }),
            );
          }
          await until(() => done() === before + streams, `${streams} streams of ${len} tokens`, 120_000);
        }
      }
      assert.equal(created - atWarm, 0, "pipelines created after the deferred warm-up");
      const errors = msgs.filter((m) => m.type === "gen_done" && m.reason !== "length");
      assert.deepEqual(errors, []);
    } finally {
      device.createComputePipeline = create;
      await svc.destroy();
      await Deno.remove(root, { recursive: true });
    }
  },
});

Deno.test({
  name:
    "GenerationService warming at load: no pipeline is created for any concurrency or prompt length after the first request",
  ignore: noGpu,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: async () => {
    const { root, model } = await randomModel();
    const { svc, msgs } = service({
      maxStreams: 8,
      chunk: 4,
      firstChunk: 2,
      prefillTokens: 128,
      warmAtLoad: true,
    });
    const ctx = (await testContext())!;
    const device = ctx.device, create = device.createComputePipeline;
    const createAsync = device.createComputePipelineAsync;
    let created = 0;
    device.createComputePipeline = (d: GPUComputePipelineDescriptor) => {
      created++;
      return create.call(device, d);
    };
    device.createComputePipelineAsync = (d: GPUComputePipelineDescriptor) => {
      created++;
      return createAsync.call(device, d);
    };
    const done = () => msgs.filter((m) => m.type === "gen_done").length;
    try {
      await svc.generate(request(model, "load", { max_tokens: 1 }));
      await until(() => done() === 1, "the load", 120_000);
      const atLoad = created;
      assert.ok(atLoad > 0, "the load compiled the kernels");
      // Every concurrency up to the slots, with prompts of every length bucket, sent together.
      let n = 1;
      for (const streams of [1, 2, 3, 5, 8]) {
        for (const len of [1, 33, config.n_positions - 1]) {
          const before = done();
          for (let i = 0; i < streams; i++) {
            await svc.generate(
              request(model, `r${n++}`, { prompt: Array.from({ length: len }, (_, j) => (j * 7 + i) % 500) }),
            );
          }
          await until(() => done() === before + streams, `${streams} streams of ${len} tokens`, 120_000);
        }
      }
      const errors = msgs.filter((m) => m.type === "gen_done" && m.reason !== "length");
      assert.deepEqual(errors, [], "every request ran to its length");
      assert.equal(created - atLoad, 0, "pipelines created after the load");
    } finally {
      device.createComputePipeline = create;
      device.createComputePipelineAsync = createAsync;
      await svc.destroy();
      await Deno.remove(root, { recursive: true });
    }
  },
});

Deno.test({
  name:
    "GenerationService: an idle batcher waits admitQuietMs on the posted count for the rest of a burst, and a lone request only that long",
  ignore: noGpu,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: async () => {
    const { root, model } = await randomModel();
    // The GPU host's side, scripted: `sent` counts posts to the Worker, `taken` what generate() took in.
    let sent = 0, taken = 0;
    const waits: number[] = [];
    let next: WorkerGeneration | null = null;
    const { svc, msgs } = service({
      maxStreams: 4,
      chunk: 4,
      firstChunk: 2,
      admitWindowMs: 1000,
      admitQuietMs: 0.5,
      runAhead: true,
      inbox: () => sent - taken,
      // The next request of the burst is "posted" while the engine waits for it, and delivered
      // at the following turn of the event loop, as a message from the GPU host would be.
      awaitPosted: (ms) => {
        waits.push(ms);
        if (next === null) return false;
        const r = next;
        next = null;
        sent++;
        setTimeout(() => {
          taken++;
          svc.generate(r);
        }, 0);
        return true;
      },
    });
    const req = (id: string) => request(model, id, { temperature: 0 });
    const deliver = (r: WorkerGeneration) => {
      sent++;
      taken++;
      return svc.generate(r);
    };
    try {
      await deliver(req("warm")); // loads the model
      await until(() => msgs.some((m) => m.type === "gen_done"), "the warm-up", 60_000);
      await until(() => !svc.busy, "the engine to go idle");
      msgs.length = 0;
      waits.length = 0;
      next = req("b");
      await deliver(req("a"));
      await until(() => msgs.filter((m) => m.type === "gen_done").length === 2, "both", 60_000);
      const firstTokens = msgs.findIndex((m) => m.type === "gen_tokens");
      const started = msgs.flatMap((m, i) => m.type === "gen_started" && i < firstTokens ? [m.id] : []);
      assert.deepEqual(
        started.sort(),
        ["a", "b"],
        "the request posted during the quiet wait was prefilled with a",
      );
      assert.deepEqual(waits, [0.5, 0.5], "one wait that saw b posted, one that saw nothing more");
      // A lone request: one quiet wait of 0.5 ms, then its step.
      await until(() => !svc.busy, "the engine to go idle");
      msgs.length = 0;
      waits.length = 0;
      await deliver(req("c"));
      await until(() => msgs.some((m) => m.type === "gen_done"), "the lone request", 60_000);
      assert.deepEqual(waits, [0.5]);
    } finally {
      await svc.destroy();
      await Deno.remove(root, { recursive: true });
    }
  },
});

Deno.test("generationOptionsFromEnv reads the run-ahead and warm-at-load switches and the admission window, naming bad values", () => {
  const env = (o: Record<string, string>) => ({ get: (k: string) => o[k] });
  const d = generationOptionsFromEnv(env({}));
  assert.equal(d.runAhead, undefined, "unset: GPUs run ahead, CPU adapters do not");
  assert.equal(d.admitWindowMs, 4);
  const o = generationOptionsFromEnv(env({ GPT2_GEN_RUN_AHEAD: "0", GPT2_GEN_ADMIT_WINDOW_MS: "0.5" }));
  assert.equal(o.runAhead, false);
  assert.equal(o.admitWindowMs, 0.5);
  assert.equal(d.admitQuietMs, 1);
  assert.equal(generationOptionsFromEnv(env({ GPT2_GEN_ADMIT_QUIET_MS: "0" })).admitQuietMs, 0);
  assert.equal(
    d.warmAtLoad,
    undefined,
    "unset: GPUs compile every kernel at load, CPU adapters on first use",
  );
  assert.equal(generationOptionsFromEnv(env({ GPT2_GEN_WARM_AT_LOAD: "0" })).warmAtLoad, false);
  assert.equal(generationOptionsFromEnv(env({ GPT2_GEN_WARM_AT_LOAD: "1" })).warmAtLoad, true);
  assert.throws(
    () => generationOptionsFromEnv(env({ GPT2_GEN_WARM_AT_LOAD: "all" })),
    /GPT2_GEN_WARM_AT_LOAD "all" must be 0 or 1/,
  );
  assert.throws(
    () => generationOptionsFromEnv(env({ GPT2_GEN_RUN_AHEAD: "yes" })),
    /GPT2_GEN_RUN_AHEAD "yes" must be 0 or 1/,
  );
  assert.throws(
    () => generationOptionsFromEnv(env({ GPT2_GEN_ADMIT_WINDOW_MS: "-1" })),
    /GPT2_GEN_ADMIT_WINDOW_MS/,
  );
});

Deno.test("GenerationService answers a rehearsal (the server's warm-up) from its prompt through the same port, with no model, engine or device, stamped like a generation", async () => {
  const msgs: FromWorker[] = [];
  let opened = 0;
  const svc = new GenerationService(() => {
    opened++;
    return Promise.reject(new Error("no device for a rehearsal"));
  }, (m) => msgs.push(m));
  const model = {
    id: "warm-up.rehearsal",
    kind: "safetensors" as const,
    path: "",
    version: "rehearsal",
    config,
  };
  const prompt = [464, 3290, 318, 257, 1332, 286, 262, 4382, 11, 290];
  await svc.generate(
    request(model, "r1", { prompt, max_tokens: 12, rehearsal: true, sent_at: 1, relayed_at: 2 }),
  );
  await svc.generate(request(model, "r2", { prompt, max_tokens: 3, rehearsal: true }));
  await until(() => msgs.filter((m) => m.type === "gen_done").length === 2, "both rehearsals done");
  assert.equal(opened, 0, "the device was never opened");
  assert.equal(svc.busy, false, "no engine holds anything");
  const of = (id: string) => msgs.filter((m) => "id" in m && m.id === id);
  const [started, tokens, done] = of("r1");
  assert.equal(started.type, "gen_started");
  if (started.type !== "gen_started") return;
  assert.equal(started.stamps?.sent_at, 1);
  assert.equal(started.stamps?.relayed_at, 2);
  assert.ok(started.stamps!.received_at! <= started.stamps!.admitted_at!, "received, then admitted");
  assert.deepEqual(tokens, {
    type: "gen_tokens",
    id: "r1",
    tokens: prompt.slice(0, 8),
    first_at: (tokens as { first_at: number }).first_at,
  });
  assert.deepEqual(done, { type: "gen_done", id: "r1", reason: "length", error: null, completion_tokens: 8 });
  // At most max_tokens.
  assert.deepEqual(of("r2").map((m) => m.type), ["gen_started", "gen_tokens", "gen_done"]);
  assert.deepEqual((of("r2")[1] as { tokens: number[] }).tokens, prompt.slice(0, 3));
});
