/**
 * The kernels of one decode step, counted (issue 38's fusion, bench/RESULTS.md "Decode: the reduces
 * fused into the kernels that read them"): with the GPUs' kernels a layer is 7 dispatches — the
 * qkv reduce happens in the attention kernel and the fc reduce in the fcproj gemv — and the step
 * adds the embedding, the final LayerNorm, the LM head and the sampler (88 for gpt2-124M). A CPU
 * adapter's uniform-buffer kernels keep the fc reduce.
 */

import assert from "node:assert/strict";
import { makeConfig } from "../../model/config.ts";
import { initParams } from "../../model/init.ts";
import { Generator, type GeneratorOptions, isCpuAdapter } from "../../engine/generator.ts";
import { noGpu, testContext } from "../_helpers.ts";

const config = makeConfig({ n_layer: 3, n_head: 4, n_embd: 64, n_positions: 64 });

/** The labels of a decode step's kernels at `streams` streams. */
async function stepLabels(streams: number, opts: Partial<GeneratorOptions>): Promise<string[]> {
  const ctx = (await testContext())!;
  const gen = await Generator.create(ctx, config, initParams(config, 1), {
    maxStreams: 4,
    chunk: 2,
    ...opts,
  });
  try {
    for (let i = 0; i < streams; i++) {
      await gen.admit([1 + i, 2, 3], { temperature: 0, top_k: 0, top_p: 1, seed: i });
    }
    await gen.step(1);
    return (await (await gen.forProfiling()).decode()).map((o) => o.label);
  } finally {
    gen.destroy();
  }
}

Deno.test({
  name:
    "a decode step runs 7 kernels a layer and 4 more with the GPUs' kernels (the qkv and fc reduces fused)",
  ignore: noGpu,
  fn: async () => {
    for (const streams of [1, 3]) {
      const labels = await stepLabels(streams, { cpuUniform: false, kernels: { cpuHead: false } });
      assert.equal(labels.length, 7 * config.n_layer + 4, `${streams} streams: ${labels.join(" ")}`);
      const layer = labels.filter((l) => l.startsWith("dec.l1.")).map((l) => l.slice("dec.l1.".length));
      assert.deepEqual(layer, [
        "qkv.gemv",
        "attn",
        "proj.gemv",
        "proj.sum",
        "fc.gemv",
        "fcproj.gemv",
        "fcproj.sum",
      ]);
      assert.deepEqual(labels.filter((l) => !/^dec\.l\d/.test(l)), [
        "dec.embed",
        "dec.lnf",
        "dec.lm_head",
        "dec.sample",
      ]);
    }
  },
});

Deno.test({
  name:
    "by default a CPU adapter's decode keeps the fc reduce for its uniform-buffer fcproj (8 kernels a layer)",
  ignore: noGpu,
  fn: async () => {
    const ctx = (await testContext())!;
    const layer = (await stepLabels(1, {})).filter((l) => l.startsWith("dec.l0."));
    assert.equal(layer.includes("dec.l0.fc.sum"), isCpuAdapter(ctx), layer.join(" "));
    assert.equal(layer.length, isCpuAdapter(ctx) ? 8 : 7, layer.join(" "));
  },
});
