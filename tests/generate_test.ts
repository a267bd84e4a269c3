/**
 * Generation on the GPU: greedy decoding with the KV cache equals the CPU reference's greedy
 * continuation token for token (two streams batched together), seeded sampling is reproducible,
 * top-k 1 is greedy, and padded vocabulary ids are never produced.
 */

import assert from "node:assert/strict";
import { makeConfig } from "../gpu/config.ts";
import { Generator } from "../gpu/generator.ts";
import { referenceGreedy } from "../gpu/reference.ts";
import { Trainer } from "../gpu/trainer.ts";
import { noGpu, testContext } from "./_helpers.ts";

const config = makeConfig({ n_layer: 2, n_head: 4, n_embd: 64, n_positions: 64 });

let trained: Promise<Float32Array> | null = null;
/** A briefly trained tiny model (trained once, shared by the tests), so logits are not near-ties. */
function trainedParams(): Promise<Float32Array> {
  trained ??= train();
  return trained;
}

async function train(): Promise<Float32Array> {
  const ctx = (await testContext())!;
  const B = 2, T = 32;
  const tr = await Trainer.create(ctx, {
    config,
    batchSize: B,
    seqLen: T,
    schedule: { lr: 1e-2, min_lr: 1e-3, warmup_iters: 2, decay_iters: 30, style: "cosine" },
    adamw: { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0, clip_grad: 1 },
    attnDropout: 0,
    hiddenDropout: 0,
    seed: 3,
  });
  const tokens = new Uint16Array(B * (T + 1)).map((_, i) =>
    [464, 3290, 318, 257, 1310, 13, 198][i % 7] + (i % 5)
  );
  for (let i = 0; i < 30; i++) tr.trainStep(tokens);
  const { params } = await tr.exportState();
  tr.destroy();
  return params;
}

const greedy = { temperature: 0, top_k: 0, top_p: 1, seed: 0 };

Deno.test({
  name: "Generator greedy decoding equals the CPU reference token for token, streams batched together",
  ignore: noGpu,
  fn: async () => {
    const params = await trainedParams();
    const p0 = [464, 3290, 318, 257], p1 = [1310, 13, 198, 464, 3291, 320, 259];
    const p64 = Float64Array.from(params);
    const want0 = referenceGreedy(config, p64, p0, 16), want1 = referenceGreedy(config, p64, p1, 16);
    // 2 streams decode through the fused skinny gemv; 9 through the tiled matmul and separate kernels.
    for (const streams of [2, 9]) {
      const gen = await Generator.create((await testContext())!, config, params, { streams, chunk: 8 });
      await gen.prefill(0, p0, greedy);
      await gen.prefill(streams - 1, p1, greedy);
      const first = await gen.decode(7);
      const second = await gen.decode(8);
      assert.deepEqual([...first[0], ...second[0]], want0, `${streams} streams, stream 0`);
      assert.deepEqual(
        [...first[streams - 1], ...second[streams - 1]],
        want1,
        `${streams} streams, last stream`,
      );
      gen.destroy();
    }
  },
});

Deno.test({
  name: "Generator seeded sampling is reproducible, top_k 1 is greedy, ids stay in the real vocabulary",
  ignore: noGpu,
  fn: async () => {
    const params = await trainedParams();
    const gen = await Generator.create((await testContext())!, config, params, { streams: 1, chunk: 10 });
    const prompt = [464, 3290, 318];
    const run = async (s: { temperature: number; top_k: number; top_p: number; seed: number }) => {
      await gen.prefill(0, prompt, s);
      return [...(await gen.decode(9))[0]];
    };
    const a = await run({ temperature: 1.5, top_k: 0, top_p: 1, seed: 42 });
    const b = await run({ temperature: 1.5, top_k: 0, top_p: 1, seed: 42 });
    const c = await run({ temperature: 1.5, top_k: 0, top_p: 1, seed: 43 });
    assert.deepEqual(a, b, "same seed, same tokens");
    assert.notDeepEqual(a, c, "another seed, other tokens");
    assert.ok([...a, ...c].every((t) => t < config.vocab_size), "no padded ids");
    const k1 = await run({ temperature: 1.0, top_k: 1, top_p: 1, seed: 9 });
    const g = await run(greedy);
    assert.deepEqual(k1, g, "top_k 1 equals greedy");
    const nucleus = await run({ temperature: 1.0, top_k: 0, top_p: 1e-6, seed: 5 });
    assert.deepEqual(nucleus, g, "a tiny top_p keeps only the most likely token");
    gen.destroy();
  },
});
