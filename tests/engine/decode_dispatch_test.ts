/**
 * The kernels of one decode step, counted (issue 38's fusion, bench/RESULTS.md "Decode: the reduces
 * fused into the kernels that read them"): with the GPUs' kernels a layer is 7 dispatches — the
 * qkv reduce happens in the attention kernel and the fc reduce in the fcproj gemv — and the step
 * adds the embedding, the final LayerNorm, the LM head and the sampler (88 for gpt2-124M). A CPU
 * adapter's uniform-buffer kernels keep the fc reduce. With `kernels.residualRows`, steps of that
 * many rows or fewer leave the proj and fcproj reduces to the gemv after them: 5 a layer, the last
 * layer's fcproj reduce kept (65 for gpt2-124M), and the same tokens and logprobs bit for bit.
 */

import assert from "node:assert/strict";
import { makeConfig } from "../../model/config.ts";
import { initParams } from "../../model/init.ts";
import { Generator, type GeneratorOptions, isCpuAdapter } from "../../engine/generator.ts";
import { noGpu, testContext } from "../_helpers.ts";
import type { StreamOutput } from "../../engine/generate/gen_types.ts";

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
    "a decode step runs 7 kernels a layer and 4 more with the GPUs' kernels (the qkv and fc reduces fused), the residual reduces kept",
  ignore: noGpu,
  fn: async () => {
    for (const streams of [1, 3]) {
      const labels = await stepLabels(streams, {
        cpuUniform: false,
        kernels: { cpuHead: false, residualRows: 0 },
      });
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
    // GPUs: a one-row step also leaves its residual reduces to the next gemv by default (residualRows 1).
    assert.equal(layer.length, isCpuAdapter(ctx) ? 8 : 5, layer.join(" "));
  },
});

Deno.test({
  name:
    "with kernels.residualRows a decode step of that many rows runs 5 kernels a layer (the proj and fcproj reduces in the next gemv), more rows 7; by default one row",
  ignore: noGpu,
  fn: async () => {
    const L = config.n_layer;
    const byDefault = async (streams: number) =>
      (await stepLabels(streams, { cpuUniform: false, kernels: { cpuHead: false } })).length;
    assert.deepEqual([await byDefault(1), await byDefault(2)], [5 * L + 1 + 4, 7 * L + 4]);
    for (const [streams, fused] of [[1, true], [2, true], [3, false]] as const) {
      const labels = await stepLabels(streams, {
        cpuUniform: false,
        kernels: { cpuHead: false, residualRows: 2 },
      });
      const what = `${streams} streams: ${labels.join(" ")}`;
      assert.equal(labels.length, fused ? 5 * L + 1 + 4 : 7 * L + 4, what);
      if (!fused) continue;
      const layer = (l: number) =>
        labels.filter((x) => x.startsWith(`dec.l${l}.`)).map((x) => x.split(".").slice(2).join("."));
      assert.deepEqual(layer(1), ["qkv.gemv", "attn", "proj.gemv", "fc.gemv", "fcproj.gemv"], what);
      assert.deepEqual(layer(L - 1), [
        "qkv.gemv",
        "attn",
        "proj.gemv",
        "fc.gemv",
        "fcproj.gemv",
        "fcproj.sum",
      ], what);
    }
  },
});

Deno.test({
  name:
    "decoding with the residual reduces in the next gemv gives the same tokens and logprobs bit for bit, 1 and 2 streams",
  ignore: noGpu,
  fn: async () => {
    const ctx = (await testContext())!;
    // Every parameter moved off its initial value, so the biases (0 at init) take part.
    const params = initParams(config, 3).map((v, i) => v + 0.02 * Math.sin(i * 12.9898));
    const run = async (residualRows: number) => {
      const gen = await Generator.create(ctx, config, params, {
        maxStreams: 2,
        chunk: 6,
        cpuUniform: false,
        kernels: { cpuHead: false, residualRows },
      });
      try {
        const outs: StreamOutput[][] = [];
        for (const streams of [1, 2]) {
          const hs = [];
          for (let i = 0; i < streams; i++) {
            hs.push(
              await gen.admit([5 + i, 17, 42, 9], {
                temperature: 1.3,
                // The second stream through the sampler's compacted, ranked paths.
                top_k: i === 1 ? 40 : 0,
                top_p: i === 1 ? 0.9 : 1,
                seed: 11 + i,
                logprobs: 2,
              }),
            );
          }
          const first = await gen.step(0);
          const next = await gen.step(5);
          outs.push(hs.flatMap((h) => [first.get(h)!, next.get(h)!]));
          for (const h of hs) gen.release(h);
        }
        return outs;
      } finally {
        gen.destroy();
      }
    };
    const plain = await run(0), fused = await run(2);
    assert.equal(plain[0][1].tokens.length, 5);
    assert.deepEqual(fused, plain);
  },
});
