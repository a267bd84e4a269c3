/**
 * The decode LM head over wte rounded to f16 (GeneratorOptions.lmHead "f16"): a step's logits are
 * the product of its final LayerNorm's output with the rounded wte, within the rounding's bound of
 * the fp32 head's; CPU adapters' head kernels keep reading wte. On a CPU adapter the tests ask for
 * the GPUs' head kernels (kernels.cpuHead false), so the f16 kernel is the one that runs.
 */

import assert from "node:assert/strict";
import { makeConfig, paramLayout } from "../../model/config.ts";
import { initParams } from "../../model/init.ts";
import { readFloats } from "../../engine/device.ts";
import {
  Generator,
  type GeneratorOptions,
  isCpuAdapter,
  type SamplingParams,
} from "../../engine/generator.ts";
import { assertSameFloats, noGpu, relNorm, testContext } from "../_helpers.ts";

const config = makeConfig({ n_layer: 2, n_head: 4, n_embd: 64, n_positions: 64 });
const greedy: SamplingParams = { temperature: 0, top_k: 0, top_p: 1, seed: 0 };
const prompts = [[464, 3290, 318], [1310, 13, 198, 257, 11]];

/**
 * Two streams through a prefill and one decode step: the step's final LayerNorm output and
 * logits (rows × C, rows × Vp), the tokens of 6 more steps, and whether wte's f16 copy exists.
 */
async function firstStep(params: Float32Array, opts: Partial<GeneratorOptions>) {
  const ctx = (await testContext())!, C = config.n_embd, Vp = config.padded_vocab_size;
  const gen = await Generator.create(ctx, config, params, { maxStreams: 2, chunk: 8, ...opts });
  const hs = [];
  for (const p of prompts) hs.push(await gen.admit(p, greedy));
  await gen.step(1);
  const { buffers } = await gen.forProfiling();
  const ln = (await readFloats(ctx, buffers.acts.ln)).slice(0, prompts.length * C);
  const logits = (await readFloats(ctx, buffers.acts.logits)).slice(0, prompts.length * Vp);
  const more = await gen.step(6);
  const tokens = hs.map((h) => more.get(h)!.tokens);
  const wte16 = buffers.wte16 !== null;
  gen.destroy();
  return { ln, logits, tokens, wte16 };
}

/** out[m, n] = Σ_k x[m, k] · W[n, k] in float64, W (N, K). */
function productT(x: Float32Array, W: Float32Array, M: number, N: number, K: number): Float64Array {
  const out = new Float64Array(M * N);
  for (let m = 0; m < M; m++) {
    for (let n = 0; n < N; n++) {
      let a = 0;
      for (let k = 0; k < K; k++) a += x[m * K + k] * W[n * K + k];
      out[m * N + n] = a;
    }
  }
  return out;
}

Deno.test({
  name: "Generator with lmHead f16: the decode logits are LN(x) · f16(wte)ᵀ, within the rounding of fp32's",
  ignore: noGpu,
  fn: async () => {
    const params = initParams(config, 7),
      C = config.n_embd,
      Vp = config.padded_vocab_size,
      M = prompts.length;
    const wt = paramLayout(config).byName.get("wte.weight")!;
    const wte = params.slice(wt.offset, wt.offset + wt.size),
      wte16 = Float32Array.from(Float16Array.from(wte));
    const gpuHead = { kernels: { cpuHead: false } };
    const f32 = await firstStep(params, gpuHead);
    const f16 = await firstStep(params, { ...gpuHead, lmHead: "f16" });
    assert.ok(f16.wte16 && !f32.wte16, "wte's f16 copy is made with lmHead f16 only");
    // Everything before the head is the same computation: the same prefill tokens, the same rows.
    assert.deepEqual(f16.ln, f32.ln);
    const ref16 = productT(f16.ln, wte16, M, Vp, C), ref32 = productT(f32.ln, wte, M, Vp, C);
    assert.ok(relNorm(f16.logits, ref16) < 1e-5, `f16 head: rel err ${relNorm(f16.logits, ref16)}`);
    assert.ok(relNorm(f32.logits, ref32) < 1e-5, `fp32 head: rel err ${relNorm(f32.logits, ref32)}`);
    // |Δ logit| ≤ Σ_k |x_k| · |w − f16(w)| (the rounding), plus the sums' f32 error.
    let differ = 0;
    for (let m = 0; m < M; m++) {
      for (let n = 0; n < Vp; n++) {
        let bound = 0, scale = 0;
        for (let k = 0; k < C; k++) {
          const x = Math.abs(f16.ln[m * C + k]);
          bound += x * Math.abs(wte[n * C + k] - wte16[n * C + k]);
          scale += x * Math.abs(wte[n * C + k]);
        }
        const d = Math.abs(f16.logits[m * Vp + n] - f32.logits[m * Vp + n]);
        assert.ok(d <= bound + 1e-6 * scale, `row ${m} logit ${n}: |Δ| ${d} > bound ${bound}`);
        if (d > 0) differ++;
      }
    }
    assert.ok(differ > Vp / 2, `only ${differ} of ${M * Vp} logits differ from fp32's: was f16 wte read?`);
    for (const t of f16.tokens) assert.equal(t.length, 6);
  },
});

Deno.test({
  name: "Generator with lmHead f16 keeps a CPU adapter's head kernels, over wte, unless told otherwise",
  ignore: noGpu,
  fn: async () => {
    const ctx = (await testContext())!;
    const params = initParams(config, 7);
    const plain = await firstStep(params, {});
    const f16 = await firstStep(params, { lmHead: "f16" });
    assert.equal(f16.wte16, !isCpuAdapter(ctx));
    if (isCpuAdapter(ctx)) {
      assertSameFloats(f16.logits, plain.logits, "the logits");
      assert.deepEqual(f16.tokens, plain.tokens);
    }
    await assert.rejects(
      () => Generator.create(ctx, config, params, { maxStreams: 1, chunk: 2, lmHead: "bf16" as "f16" }),
      RangeError,
    );
  },
});
