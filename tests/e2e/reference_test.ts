/**
 * Checks the CPU reference of GPT-2 training (tests/reference/cpu_gpt2.ts) on its own terms: analytic gradients
 * against central finite differences for every tensor (dropout off and on), spec properties of the
 * forward pass (causality, padded vocabulary, the untrained loss), hand-computed AdamW steps, and the
 * parameter counts. The GPU engine is checked against this reference, so it has to be right first.
 */

import assert from "node:assert/strict";
import {
  makeConfig,
  type ModelConfig,
  parameterCount,
  paramLayout,
  presetConfig,
} from "../../model/config.ts";
import {
  initParams,
  normalZiggurat,
  paramViews,
  referenceAdamWStep,
  referenceForward,
  referenceLossAndGrads,
  type ReferenceOptions,
} from "../reference/cpu_gpt2.ts";
import { Rng } from "../../model/rng.ts";
import { type AdamWConfig, DEFAULT_ADAMW } from "../../model/schedule.ts";

const TINY = makeConfig({
  n_layer: 2,
  n_head: 2,
  n_embd: 16,
  n_positions: 16,
  vocab_size: 61,
  padded_vocab_size: 64,
});
const B = 2, T = 8;

/** Random parameters of a healthy scale (larger than GPT-2's init, so every path carries gradient). */
function randomParams(config: ModelConfig, seed: number): Float64Array {
  const layout = paramLayout(config);
  const p = new Float64Array(layout.totalSize);
  const rng = new Rng(seed);
  for (const t of layout.tensors) {
    const isLnWeight = /ln_\w+\.weight$/.test(t.name);
    const std = t.shape.length === 2 ? 0.3 : 0.1;
    for (let i = 0; i < t.size; i++) p[t.offset + i] = (isLnWeight ? 1 : 0) + std * rng.normal();
  }
  return p;
}

function randomTokens(n: number, vocab: number, seed: number): Int32Array {
  const rng = new Rng(seed);
  return Int32Array.from({ length: n }, () => rng.nextU32() % vocab);
}

/** Central difference of the loss along one parameter. */
function numericGrad(params: Float64Array, index: number, loss: () => number, eps = 1e-5): number {
  const saved = params[index];
  params[index] = saved + eps;
  const lp = loss();
  params[index] = saved - eps;
  const lm = loss();
  params[index] = saved;
  return (lp - lm) / (2 * eps);
}

function checkGradients(opts: Partial<ReferenceOptions>): void {
  const layout = paramLayout(TINY);
  const params = randomParams(TINY, 7);
  const tokens = randomTokens(B * (T + 1), TINY.vocab_size, 11);
  // token 0 never appears as an input, so wte row 0 is reached through the LM head only
  for (let i = 0; i < tokens.length; i++) if (tokens[i] === 0) tokens[i] = 1;
  tokens[3] = 0; // ...but is a target
  const { grads } = referenceLossAndGrads(TINY, params, tokens, B, T, opts);
  const loss = () => referenceForward(TINY, params, tokens, B, T, opts).loss;
  const rng = new Rng(123);
  const C = TINY.n_embd;
  let worst = 0, checked = 0;
  for (const t of layout.tensors) {
    const picks = new Set<number>();
    for (let k = 0; k < 5; k++) picks.add(rng.nextU32() % t.size);
    if (t.name === "wte.weight") {
      picks.add(tokens[0] * C + 3); // a row read by the embedding (and the LM head)
      picks.add(0 * C + 5); // a row read by the LM head only
    }
    if (t.name === "wpe.weight") picks.add((T - 1) * C + 2);
    for (const i of picks) {
      const analytic = grads[t.offset + i], numeric = numericGrad(params, t.offset + i, loss);
      const rel = Math.abs(analytic - numeric) / Math.max(Math.abs(analytic), Math.abs(numeric), 1e-12);
      if (Math.abs(analytic) > 1e-6 || Math.abs(numeric) > 1e-6) {
        assert.ok(rel < 1e-5, `${t.name}[${i}]: analytic ${analytic} numeric ${numeric} rel ${rel}`);
        worst = Math.max(worst, rel);
      } else {
        assert.ok(
          Math.abs(analytic - numeric) < 1e-10,
          `${t.name}[${i}]: analytic ${analytic} numeric ${numeric}`,
        );
      }
      checked++;
    }
  }
  // padded wte rows: excluded from the softmax, so the gradient is exactly 0 both ways
  const wte = layout.byName.get("wte.weight")!;
  for (let v = TINY.vocab_size; v < TINY.padded_vocab_size; v++) {
    for (let c = 0; c < C; c++) {
      const i = wte.offset + v * C + c;
      assert.equal(grads[i], 0, `padded wte row ${v}`);
    }
    assert.equal(numericGrad(params, wte.offset + v * C, loss), 0);
  }
  // wpe rows past T are never read
  const wpe = layout.byName.get("wpe.weight")!;
  for (let i = T * C; i < wpe.size; i++) assert.equal(grads[wpe.offset + i], 0);
  // alignment padding between tensors has zero gradient
  const inTensor = new Uint8Array(layout.totalSize);
  for (const t of layout.tensors) inTensor.fill(1, t.offset, t.offset + t.size);
  for (let i = 0; i < layout.totalSize; i++) if (!inTensor[i]) assert.equal(grads[i], 0);
  assert.ok(checked >= 3 * layout.tensors.length && worst < 1e-5, `checked ${checked}, worst ${worst}`);
  console.log(`checked ${checked} entries, worst relative error ${worst.toExponential(2)}`);
}

Deno.test("referenceLossAndGrads() matches finite differences on every tensor", () => {
  checkGradients({});
});

Deno.test("referenceLossAndGrads() matches finite differences on every tensor with dropout on", () => {
  checkGradients({ seed: 42, step: 3, attnDropout: 0.3, hiddenDropout: 0.2 });
});

Deno.test("referenceForward() dropout depends on seed and step and is deterministic", () => {
  const params = randomParams(TINY, 1);
  const tokens = randomTokens(B * (T + 1), TINY.vocab_size, 2);
  const run = (o: Partial<ReferenceOptions>) => referenceForward(TINY, params, tokens, B, T, o).loss;
  const on = { seed: 5, step: 0, attnDropout: 0.1, hiddenDropout: 0.1 };
  assert.equal(run(on), run(on));
  assert.notEqual(run(on), run({}));
  assert.notEqual(run(on), run({ ...on, step: 1 }));
  assert.notEqual(run(on), run({ ...on, seed: 6 }));
  assert.equal(run({ seed: 5, step: 0 }), run({ seed: 9, step: 4 }));
});

Deno.test("referenceForward() is causal and computes logits over the padded vocabulary", () => {
  const params = randomParams(TINY, 3);
  const tokens = randomTokens(B * (T + 1), TINY.vocab_size, 4);
  const a = referenceForward(TINY, params, tokens, B, T);
  const changed = tokens.slice();
  changed[5] = (changed[5] + 1) % TINY.vocab_size; // input position 5 of row 0
  const b = referenceForward(TINY, params, changed, B, T);
  const Vp = TINY.padded_vocab_size;
  for (let t = 0; t < T; t++) {
    const same = a.logits.subarray(t * Vp, (t + 1) * Vp).every((x, v) => x === b.logits[t * Vp + v]);
    assert.equal(same, t < 5, `position ${t}`);
  }
  // padded columns hold real dot products with the (non-zero) padded rows, but the loss ignores them
  assert.notEqual(a.logits[Vp - 1], 0);
  const P = paramViews(TINY, params);
  P.wte.fill(100, TINY.vocab_size * TINY.n_embd);
  assert.equal(referenceForward(TINY, params, tokens, B, T).loss, a.loss);
});

Deno.test("referenceForward() loss of an untrained GPT-2-vocabulary model is near ln(50257)", () => {
  const config = makeConfig({ n_layer: 2, n_head: 4, n_embd: 64, n_positions: 64 });
  assert.equal(config.padded_vocab_size, 50304);
  const params = Float64Array.from(initParams(config, 1));
  const tokens = randomTokens(2 * 17, config.vocab_size, 5);
  const { loss, logits } = referenceForward(config, params, tokens, 2, 16);
  assert.equal(logits.length, 2 * 16 * 50304);
  assert.ok(Math.abs(loss - Math.log(50257)) < 0.1, `loss ${loss}`);
});

Deno.test("initParams() follows the GPT-2 initialisation and is deterministic", () => {
  const config = makeConfig({ n_layer: 4, n_head: 4, n_embd: 64, n_positions: 64 });
  const layout = paramLayout(config);
  const p = initParams(config, 9);
  assert.deepEqual(p, initParams(config, 9));
  assert.notDeepEqual(p.subarray(0, 64), initParams(config, 10).subarray(0, 64));
  const std = (a: Float32Array) => Math.sqrt(a.reduce((s, x) => s + x * x, 0) / a.length);
  const view = (name: string) => {
    const t = layout.byName.get(name)!;
    return p.subarray(t.offset, t.offset + t.size);
  };
  const wte = view("wte.weight");
  assert.ok(Math.abs(std(wte.subarray(0, config.vocab_size * 64)) - 0.02) < 0.0005);
  assert.ok(wte.subarray(config.vocab_size * 64).every((x) => x === 0));
  assert.ok(Math.abs(std(view("h.1.mlp.c_fc.weight")) - 0.02) < 0.001);
  assert.ok(Math.abs(std(view("h.2.attn.c_proj.weight")) - 0.02 / Math.sqrt(8)) < 0.0005);
  assert.ok(Math.abs(std(view("h.3.mlp.c_proj.weight")) - 0.02 / Math.sqrt(8)) < 0.0005);
  assert.ok(view("h.0.ln_1.weight").every((x) => x === 1));
  assert.ok(view("ln_f.weight").every((x) => x === 1));
  assert.ok(view("h.0.attn.c_attn.bias").every((x) => x === 0));
  assert.ok(view("ln_f.bias").every((x) => x === 0));
  // and the ziggurat draws are standard normal
  const rng = new Rng(3);
  let s1 = 0, s2 = 0, tail = 0;
  const n = 200_000;
  for (let i = 0; i < n; i++) {
    const x = normalZiggurat(rng);
    s1 += x;
    s2 += x * x;
    if (Math.abs(x) > 2) tail++;
  }
  assert.ok(Math.abs(s1 / n) < 0.01 && Math.abs(s2 / n - 1) < 0.01 && Math.abs(tail / n - 0.0455) < 0.002);
});

/** A buffer for TINY with one chosen value in wte (decayed) and one in ln_f.bias (not decayed). */
function oneHot(values: [number, number]): Float64Array {
  const layout = paramLayout(TINY);
  const a = new Float64Array(layout.totalSize);
  a[layout.byName.get("wte.weight")!.offset] = values[0];
  a[layout.byName.get("ln_f.bias")!.offset] = values[1];
  return a;
}

Deno.test("referenceAdamWStep() matches a hand-computed step", () => {
  const layout = paramLayout(TINY);
  const iw = layout.byName.get("wte.weight")!.offset, ib = layout.byName.get("ln_f.bias")!.offset;
  const adamw: AdamWConfig = { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, clip_grad: 0 };
  const params = oneHot([0.3, 0.3]), m = oneHot([0, 0]), v = oneHot([0, 0]);
  const lr = 0.1;
  // step 0 (t = 1): m = 0.1 g, v = 0.05 g², mhat = g, vhat = g²
  const { gradNorm } = referenceAdamWStep(TINY, params, oneHot([0.5, -2]), m, v, 0, lr, adamw);
  assert.ok(Math.abs(gradNorm - Math.sqrt(0.25 + 4)) < 1e-15);
  const w1 = 0.3 - lr * (0.5 / (0.5 + 1e-8) + 0.1 * 0.3);
  const b1 = 0.3 - lr * (-2 / (2 + 1e-8)); // no weight decay on biases
  assert.ok(Math.abs(params[iw] - w1) < 1e-15 && Math.abs(params[ib] - b1) < 1e-15);
  assert.ok(Math.abs(m[iw] - 0.05) < 1e-15 && Math.abs(v[iw] - 0.0125) < 1e-15);
  // step 1 (t = 2) with g = 0.2 on the weight: bias correction 1 - 0.9², 1 - 0.95²
  referenceAdamWStep(TINY, params, oneHot([0.2, 0]), m, v, 1, lr, adamw);
  const m2 = 0.9 * 0.05 + 0.1 * 0.2, v2 = 0.95 * 0.0125 + 0.05 * 0.04;
  const w2 = w1 - lr * ((m2 / 0.19) / (Math.sqrt(v2 / 0.0975) + 1e-8) + 0.1 * w1);
  assert.ok(Math.abs(params[iw] - w2) < 1e-15, `${params[iw]} vs ${w2}`);
  // zero gradient everywhere else: only weight decay moves decayed parameters, nothing else changes
  assert.equal(params.reduce((n, x) => n + (x !== 0 ? 1 : 0), 0), 2);
});

Deno.test("referenceAdamWStep() clipping scales the gradient before the moments", () => {
  const layout = paramLayout(TINY);
  const iw = layout.byName.get("wte.weight")!.offset, ib = layout.byName.get("ln_f.bias")!.offset;
  const adamw = { ...DEFAULT_ADAMW, clip_grad: 1 };
  const grads = oneHot([3, 4]); // norm 5
  const m = oneHot([0, 0]), v = oneHot([0, 0]);
  const { gradNorm } = referenceAdamWStep(TINY, oneHot([0, 0]), grads, m, v, 0, 1e-3, adamw);
  assert.equal(gradNorm, 5);
  const coef = 1 / (5 + 1e-6);
  assert.ok(Math.abs(grads[iw] - 3 * coef) < 1e-15 && Math.abs(grads[ib] - 4 * coef) < 1e-15);
  assert.ok(Math.abs(m[iw] - 0.1 * 3 * coef) < 1e-15);
  assert.ok(Math.abs(v[ib] - 0.05 * (4 * coef) ** 2) < 1e-15);
  // under the threshold nothing is scaled
  const small = oneHot([0.3, 0.4]);
  referenceAdamWStep(TINY, oneHot([0, 0]), small, oneHot([0, 0]), oneHot([0, 0]), 0, 1e-3, adamw);
  assert.equal(small[iw], 0.3);
});

Deno.test("parameterCount() of the GPT-2 presets matches the layout", () => {
  const c345 = presetConfig("gpt2-345M"), c124 = presetConfig("gpt2-124M");
  assert.equal(parameterCount(c345), 354871296);
  assert.equal(parameterCount(c124), 124475904);
  assert.equal(paramLayout(c345).numParams, 354871296);
  assert.equal(paramLayout(c124).numParams, 124475904);
});

Deno.test("referenceForward() rejects bad token windows", () => {
  const params = randomParams(TINY, 1);
  assert.throws(() => referenceForward(TINY, params, new Int32Array(5), B, T), /Expected 18 tokens/);
  assert.throws(() => referenceForward(TINY, params, new Int32Array(B * (T + 1)).fill(61), B, T), /outside/);
  assert.throws(() => referenceForward(TINY, params, new Int32Array(17 * 2), 1, 33), /exceeds n_positions/);
});
