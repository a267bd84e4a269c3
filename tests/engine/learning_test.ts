/**
 * The engine learns: gpt2-tiny trained on real English (State of the Union addresses from the
 * built-in corpus) on whatever adapter is present drives the loss far below the uniform
 * baseline ln(50257) ≈ 10.8.
 */

import assert from "node:assert/strict";
import { encode } from "gpt-tokenizer/encoding/r50k_base";
import { builtinDocuments } from "../../data/builtin.ts";
import { Sampler } from "../../data/sampler.ts";
import { EOT_TOKEN, presetConfig } from "../../model/config.ts";
import { Trainer } from "../../engine/trainer.ts";
import { noGpu, testContext } from "../_helpers.ts";

const STEPS = 100;
/** Mean loss of the last 20 steps must fall under this (uniform over the vocabulary: ln 50257 ≈ 10.8). */
const TARGET = 6.7;

Deno.test({
  name: `Trainer learns English: gpt2-tiny loss falls under ${TARGET} within ${STEPS} steps`,
  ignore: noGpu,
  fn: async () => {
    const docs = (await builtinDocuments("sotu")).slice(-1);
    const ids: number[] = [];
    for (const d of docs) ids.push(...encode(d.text), EOT_TOKEN);
    const tokens = Uint16Array.from(ids);
    const B = 4, T = 32;
    const sampler = new Sampler(tokens, { seqLen: T, batchSize: B, seed: 1 });
    const tr = await Trainer.create((await testContext())!, {
      config: presetConfig("gpt2-tiny"),
      batchSize: B,
      seqLen: T,
      schedule: { lr: 1e-2, min_lr: 1e-3, warmup_iters: 10, decay_iters: STEPS, style: "cosine" },
      adamw: { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.01, clip_grad: 1.0 },
      attnDropout: 0,
      hiddenDropout: 0,
      seed: 1,
    });
    const first = await tr.evalLoss(sampler.nextBatch());
    const recent: number[] = [];
    for (let i = 0; i < STEPS; i++) {
      tr.trainStep(sampler.nextBatch());
      if (i >= STEPS - 20) recent.push((await tr.lastStats()).loss);
      else if (i % 50 === 0) console.log(`step ${i}: loss ${(await tr.lastStats()).loss.toFixed(3)}`);
    }
    const last = recent.reduce((a, b) => a + b, 0) / recent.length;
    console.log(
      `tokens ${tokens.length}, initial loss ${first.toFixed(3)}, mean of last 20 steps ${last.toFixed(3)}`,
    );
    assert.ok(first > 10, `untrained loss ${first} should be near ln(50257)`);
    assert.ok(last < TARGET, `loss after ${STEPS} steps is ${last}, expected under ${TARGET}`);
    tr.destroy();
  },
});
