/**
 * Activation checkpointing recomputes each group of layers in backward from the group's input;
 * dropout masks are counter-based, so in fp32 the losses, every gradient and the parameters after
 * a few steps are bit-identical to the run that stores every activation — here with dropout on,
 * three layers and groups of 1 and 2 (an uneven last group), and the plan is smaller.
 */

import assert from "node:assert/strict";
import { makeConfig } from "../../model/config.ts";
import { Trainer } from "../../engine/trainer.ts";
import { noGpu, testContext } from "../_helpers.ts";

const config = makeConfig({ n_layer: 3, n_head: 2, n_embd: 32, n_positions: 32, vocab_size: 256 });
const B = 2, T = 32;

function batch(seed: number): Uint16Array {
  const out = new Uint16Array(B * (T + 1));
  let s = seed;
  for (let i = 0; i < out.length; i++) {
    s = (Math.imul(s, 1103515245) + 12345) >>> 0;
    out[i] = (s >>> 16) % config.vocab_size;
  }
  return out;
}

async function trainer(checkpointLayers: number): Promise<Trainer> {
  const ctx = (await testContext())!;
  return await Trainer.create(ctx, {
    config,
    batchSize: B,
    seqLen: T,
    schedule: { lr: 1e-2, min_lr: 1e-3, warmup_iters: 1, decay_iters: 10, style: "cosine" },
    adamw: { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, clip_grad: 1 },
    attnDropout: 0.1,
    hiddenDropout: 0.1,
    seed: 9,
    checkpointLayers,
  });
}

const same = (a: Float32Array, b: Float32Array) =>
  a.length === b.length && a.every((x, i) => Object.is(x, b[i]));

for (const k of [1, 2]) {
  Deno.test({
    name: `Trainer with checkpoint_num_layers ${k} is bit-identical to storing every activation (fp32)`,
    ignore: noGpu,
    fn: async () => {
      const full = await trainer(0), ckpt = await trainer(k);
      assert.ok(
        ckpt.memoryBytes < full.memoryBytes,
        `checkpointed plan ${ckpt.memoryBytes} B < ${full.memoryBytes} B`,
      );
      for (let i = 0; i < 3; i++) {
        full.trainStep(batch(50 + i));
        ckpt.trainStep(batch(50 + i));
        const [a, b] = [await full.lastStats(), await ckpt.lastStats()];
        assert.ok(Object.is(a.loss, b.loss), `step ${i}: loss ${a.loss} vs ${b.loss}`);
        assert.ok(Object.is(a.gradNorm, b.gradNorm), `step ${i}: norm ${a.gradNorm} vs ${b.gradNorm}`);
      }
      assert.ok(same(await full.gradients(), await ckpt.gradients()), "every gradient identical");
      assert.ok(
        same((await full.exportState()).params, (await ckpt.exportState()).params),
        "parameters identical",
      );
      full.destroy();
      ckpt.destroy();
    },
  });
}
