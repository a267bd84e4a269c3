/**
 * SFT's loss mask: on the float64 CPU reference the masked loss is the mean over the assistant's
 * targets only (and its gradient the derivative of that, by finite differences), and the WebGPU
 * engine's masked loss, evaluation loss and every gradient tensor match the reference.
 */
import assert from "node:assert/strict";
import { makeConfig, paramLayout } from "../../model/config.ts";
import { initParams } from "../../model/init.ts";
import { crossentropy_forward, referenceForward, referenceLossAndGrads } from "../reference/cpu_gpt2.ts";
import { Trainer } from "../../engine/trainer.ts";
import { noGpu, relNorm, testContext } from "../_helpers.ts";

const config = makeConfig({ n_layer: 2, n_head: 4, n_embd: 64, n_positions: 32 });
const B = 2, T = 32;

function batch(seed: number): Uint16Array {
  const out = new Uint16Array(B * (T + 1));
  let s = seed;
  for (let i = 0; i < out.length; i++) {
    s = (Math.imul(s, 1103515245) + 12345) >>> 0;
    out[i] = (s >>> 16) % 500;
  }
  return out;
}

/** Assistant-like spans: targets 5..12 of row 0 and 20..30 of row 1. */
function mask(): Uint8Array {
  const m = new Uint8Array(B * T);
  for (let t = 5; t < 13; t++) m[t] = 1;
  for (let t = 20; t < 31; t++) m[T + t] = 1;
  return m;
}

Deno.test("referenceForward() with a loss mask is the mean loss over the masked targets only", () => {
  const params = Float64Array.from(initParams(config, 3));
  const tokens = batch(1), m = mask();
  const plain = referenceForward(config, params, tokens, B, T);
  const masked = referenceForward(config, params, tokens, B, T, { lossMask: m });
  const targets = new Int32Array(B * T);
  for (let b = 0; b < B; b++) for (let t = 0; t < T; t++) targets[b * T + t] = tokens[b * (T + 1) + t + 1];
  const losses = new Float64Array(B * T);
  crossentropy_forward(losses, plain.logits, targets, B, T, config.vocab_size, config.padded_vocab_size);
  let sum = 0, n = 0;
  for (let i = 0; i < B * T; i++) if (m[i]) (sum += losses[i], n++);
  assert.ok(Math.abs(masked.loss - sum / n) < 1e-12, `masked ${masked.loss} vs ${sum / n}`);
  assert.ok(Math.abs(masked.loss - plain.loss) > 1e-6, "the mask changes the loss");
  // The gradient is the masked loss's: central differences on a few parameters.
  const { grads } = referenceLossAndGrads(config, params, tokens, B, T, { lossMask: m });
  const layout = paramLayout(config);
  const wte = layout.byName.get("wte.weight")!, fc = layout.byName.get("h.1.mlp.c_fc.weight")!;
  for (const i of [wte.offset + tokens[7] * config.n_embd + 3, fc.offset + 100, fc.offset + 2049]) {
    const h = 1e-5, p = params[i];
    params[i] = p + h;
    const up = referenceForward(config, params, tokens, B, T, { lossMask: m }).loss;
    params[i] = p - h;
    const down = referenceForward(config, params, tokens, B, T, { lossMask: m }).loss;
    params[i] = p;
    const fd = (up - down) / (2 * h);
    assert.ok(Math.abs(fd - grads[i]) < 1e-6 + 1e-4 * Math.abs(fd), `param ${i}: grad ${grads[i]} vs ${fd}`);
  }
});

Deno.test({
  name: "Trainer with lossMask: loss, evaluation loss and every gradient match the masked CPU reference",
  ignore: noGpu,
  fn: async () => {
    const ctx = (await testContext())!;
    const tr = await Trainer.create(ctx, {
      config,
      batchSize: B,
      seqLen: T,
      schedule: { lr: 1e-3, min_lr: 1e-4, warmup_iters: 0, decay_iters: 10, style: "cosine" },
      adamw: { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, clip_grad: 1.0 },
      attnDropout: 0,
      hiddenDropout: 0,
      seed: 7,
      lossMask: true,
    });
    try {
      const tokens = batch(2), m = mask();
      const params = Float64Array.from(initParams(config, 7));
      const ref = referenceLossAndGrads(config, params, tokens, B, T, { seed: 7, step: 0, lossMask: m });
      const evalLoss = await tr.evalLoss({ tokens, mask: m });
      assert.ok(Math.abs(evalLoss - ref.loss) < 1e-4 * ref.loss, `eval loss ${evalLoss} vs ${ref.loss}`);
      // A plain batch counts every target.
      const all = referenceForward(config, params, tokens, B, T).loss;
      const plain = await tr.evalLoss(tokens);
      assert.ok(Math.abs(plain - all) < 1e-4 * all, `unmasked loss ${plain} vs ${all}`);
      tr.trainStep({ tokens, mask: m });
      const { loss } = await tr.lastStats();
      assert.ok(Math.abs(loss - ref.loss) < 1e-4 * ref.loss, `loss ${loss} vs reference ${ref.loss}`);
      const grads = await tr.gradients();
      const worst: string[] = [];
      for (const t of paramLayout(config).tensors) {
        const err = relNorm(
          grads.subarray(t.offset, t.offset + t.size),
          ref.grads.subarray(t.offset, t.offset + t.size),
        );
        if (!(err < 1e-4)) worst.push(`${t.name}: ${err.toExponential(2)}`);
      }
      assert.deepEqual(worst, [], `tensors whose gradient differs: ${worst.join(", ")}`);
    } finally {
      tr.destroy();
    }
  },
});

Deno.test({
  name:
    "Trainer with lossMask and 2 micro-batches: the loss and gradients are the mean of their masked means",
  ignore: noGpu,
  fn: async () => {
    const ctx = (await testContext())!;
    const tr = await Trainer.create(ctx, {
      config,
      batchSize: B,
      seqLen: T,
      schedule: { lr: 1e-3, min_lr: 1e-4, warmup_iters: 0, decay_iters: 10, style: "cosine" },
      adamw: { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, clip_grad: 1.0 },
      attnDropout: 0,
      hiddenDropout: 0,
      seed: 7,
      lossMask: true,
      microBatches: 2,
    });
    try {
      const params = Float64Array.from(initParams(config, 7));
      const m1 = mask(), m2 = new Uint8Array(B * T);
      m2[3] = m2[T + 30] = 1; // few targets: each micro-batch's mean has its own denominator
      const [t1, t2] = [batch(3), batch(4)];
      const r1 = referenceLossAndGrads(config, params, t1, B, T, { seed: 7, step: 0, lossMask: m1 });
      const r2 = referenceLossAndGrads(config, params, t2, B, T, { seed: 7, step: 0, lossMask: m2 });
      tr.trainStep([{ tokens: t1, mask: m1 }, { tokens: t2, mask: m2 }]);
      const { loss } = await tr.lastStats();
      const want = (r1.loss + r2.loss) / 2;
      assert.ok(Math.abs(loss - want) < 1e-4 * want, `loss ${loss} vs ${want}`);
      const grads = await tr.gradients();
      const ref = r1.grads.map((g, i) => (g + r2.grads[i]) / 2);
      const err = relNorm(grads, ref);
      assert.ok(err < 1e-4, `gradients: relative error ${err}`);
    } finally {
      tr.destroy();
    }
  },
});
