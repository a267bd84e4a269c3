/**
 * The Worker-side generation service on the real GPU (a tiny random model from a Hugging Face
 * directory): a request that finds every stream slot taken waits in order and is admitted at the
 * step after a cancel frees one; and training's turn resolves once generation has had its share,
 * or at once when generation is idle. Skipped without an adapter.
 */

import assert from "node:assert/strict";
import { makeConfig } from "../gpu/config.ts";
import { initParams } from "../gpu/init.ts";
import { exportTensors, hfConfig } from "../jobs/checkpoint.ts";
import { GenerationService } from "../jobs/generation_service.ts";
import type { FromWorker, WorkerGeneration } from "../jobs/messages.ts";
import { resolveModelSource } from "../jobs/model_source.ts";
import { writeSafetensors } from "../jobs/safetensors.ts";
import { noGpu, testContext } from "./_helpers.ts";
import { until } from "./_wait.ts";

const config = makeConfig({ n_layer: 1, n_head: 4, n_embd: 64, n_positions: 64 });

Deno.test({
  name: "GenerationService queues past its slots and admits at the step after a cancel frees one",
  ignore: noGpu,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: async () => {
    const root = await Deno.makeTempDir({ prefix: "gpt2_gensvc_" });
    const dir = `${root}/models/rand`;
    await Deno.mkdir(dir, { recursive: true });
    await writeSafetensors(`${dir}/model.safetensors`, exportTensors(config, initParams(config, 5)));
    await Deno.writeTextFile(
      `${dir}/config.json`,
      JSON.stringify(hfConfig(config, { attention_dropout: 0, hidden_dropout: 0 })),
    );
    const model = await resolveModelSource(root, "rand");
    const msgs: FromWorker[] = [];
    const svc = new GenerationService(async () => (await testContext())!, (m) => msgs.push(m), {
      maxStreams: 1,
      chunk: 4,
      firstChunk: 2,
    });
    const req = (id: string, max_tokens: number): WorkerGeneration => ({
      id,
      model,
      prompt: [464, 3290, 318],
      max_tokens,
      temperature: 1,
      top_k: 0,
      top_p: 1,
      seed: 1,
      stop_at_eos: false,
    });
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
