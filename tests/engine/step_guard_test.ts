/**
 * The non-finite step guard and the dynamic loss scaler, on the GPU with a tiny model (small
 * vocabulary, so lavapipe is quick): a step whose gradient is made NaN on the GPU leaves weights
 * and moments unchanged, is counted, and does not advance the optimizer step or learning rate;
 * the loss scale follows Megatron's state machine (skip, backoff, hysteresis, growth).
 */

import assert from "node:assert/strict";
import { makeConfig } from "../../model/config.ts";
import { learningRate, type LrSchedule } from "../../model/schedule.ts";
import { type StepStats, Trainer, type TrainerOptions } from "../../engine/trainer.ts";
import type { LossScalerConfig } from "../../engine/kernels/adamw.ts";
import { noGpu, testContext } from "../_helpers.ts";

const config = makeConfig({ n_layer: 1, n_head: 2, n_embd: 32, n_positions: 16, vocab_size: 256 });
const B = 2, T = 16;
const schedule: LrSchedule = { lr: 1e-2, min_lr: 1e-3, warmup_iters: 2, decay_iters: 12, style: "cosine" };
const adamw = { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, clip_grad: 1.0 };

function batch(seed: number): Uint16Array {
  const out = new Uint16Array(B * (T + 1));
  let s = seed;
  for (let i = 0; i < out.length; i++) {
    s = (Math.imul(s, 1103515245) + 12345) >>> 0;
    out[i] = (s >>> 16) % config.vocab_size;
  }
  return out;
}

async function trainer(extra: Partial<TrainerOptions> = {}): Promise<Trainer> {
  const ctx = (await testContext())!;
  return await Trainer.create(ctx, {
    config,
    batchSize: B,
    seqLen: T,
    schedule,
    adamw,
    attnDropout: 0,
    hiddenDropout: 0,
    seed: 3,
    ...extra,
  });
}

Deno.test({
  name: "Trainer skips a step with a NaN gradient: weights unchanged, counted, schedule not advanced",
  ignore: noGpu,
  fn: async () => {
    const tr = await trainer({ debugNonFiniteAt: [1, 2] });
    tr.trainStep(batch(10));
    const s0 = await tr.lastStats();
    assert.deepEqual([s0.skippedSteps, s0.consecutiveSkipped, s0.optimizerStep], [0, 0, 1]);
    const before = await tr.exportState();

    tr.trainStep(batch(11));
    const s1 = await tr.lastStats();
    assert.ok(Number.isFinite(s1.loss), `the loss itself stays finite, got ${s1.loss}`);
    assert.ok(!Number.isFinite(s1.gradNorm), `the gradient norm is not finite, got ${s1.gradNorm}`);
    assert.deepEqual([s1.skippedSteps, s1.consecutiveSkipped, s1.optimizerStep], [1, 1, 1]);
    tr.trainStep(batch(12));
    const s2 = await tr.lastStats();
    assert.deepEqual([s2.skippedSteps, s2.consecutiveSkipped, s2.optimizerStep], [2, 2, 1]);
    const after = await tr.exportState();
    assert.equal(after.step, 3, "iterations advance on skipped steps");
    for (const k of ["params", "m", "v"] as const) {
      assert.ok(after[k].every((x, i) => Object.is(x, before[k][i])), `${k} unchanged by skipped steps`);
    }
    assert.equal(s2.lr, Math.fround(learningRate(schedule, 1)), "the next step's learning rate is step 1's");

    tr.trainStep(batch(13));
    const s3 = await tr.lastStats();
    assert.ok(Number.isFinite(s3.loss) && Number.isFinite(s3.gradNorm), "training continues finite");
    assert.deepEqual([s3.skippedSteps, s3.consecutiveSkipped, s3.optimizerStep], [2, 0, 2]);
    const final = await tr.exportState();
    assert.ok(final.params.every(Number.isFinite), "parameters stay finite");
    assert.ok(final.params.some((x, i) => x !== before.params[i]), "the clean step updates parameters");
    tr.destroy();
  },
});

Deno.test({
  name: "Trainer with skipped steps ends bit-identical to a run that never saw those batches",
  ignore: noGpu,
  fn: async () => {
    const skipping = await trainer({ debugNonFiniteAt: [1] });
    const clean = await trainer();
    for (const [i, b] of [10, 11, 12, 13].entries()) {
      skipping.trainStep(batch(b));
      if (i !== 1) clean.trainStep(batch(b));
    }
    const a = await skipping.exportState(), c = await clean.exportState();
    assert.equal(a.control?.optimizerStep, 3);
    assert.equal(c.control?.optimizerStep, 3);
    for (const k of ["params", "m", "v"] as const) {
      assert.ok(a[k].every((x, i) => Object.is(x, c[k][i])), `${k} identical`);
    }
    skipping.destroy();
    clean.destroy();
  },
});

/** Megatron's DynamicGradScaler.update(), the specification the GPU kernel follows. */
function scalerModel(cfg: LossScalerConfig, overflows: boolean[]): number[] {
  let scale = cfg.initialScale, growth = 0, hyst = cfg.hysteresis;
  return overflows.map((found) => {
    if (found) {
      growth = 0;
      hyst -= 1;
      if (hyst <= 0) scale = Math.max(scale * cfg.backoffFactor, cfg.minScale);
    } else {
      growth += 1;
      if (growth === cfg.growthInterval) {
        growth = 0;
        hyst = cfg.hysteresis;
        scale *= cfg.growthFactor;
      }
    }
    return scale;
  });
}

Deno.test({
  name: "Loss scaler follows Megatron's state machine with injected overflows",
  ignore: noGpu,
  fn: async () => {
    const lossScaler: LossScalerConfig = {
      initialScale: 2 ** 8,
      growthInterval: 3,
      growthFactor: 2,
      backoffFactor: 0.5,
      hysteresis: 2,
      minScale: 64,
    };
    // Growth after 3 clean steps; one overflow spends hysteresis; two back off; floors at minScale.
    const pattern = [0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0].map((x) => x === 1);
    const expected = scalerModel(lossScaler, pattern);
    assert.deepEqual(expected, [256, 256, 512, 512, 512, 256, 128, 64, 64, 64, 64, 64, 128, 128]);
    const at = pattern.flatMap((f, i) => f ? [i] : []);
    const tr = await trainer({ lossScaler, debugNonFiniteAt: at });
    const seen: StepStats[] = [];
    for (let i = 0; i < pattern.length; i++) {
      tr.trainStep(batch(20 + i));
      seen.push(await tr.lastStats());
    }
    assert.deepEqual(seen.map((s) => s.lossScale), expected);
    assert.deepEqual(seen.map((s) => s.skippedSteps), pattern.map((_, i) => at.filter((j) => j <= i).length));
    // Only overflows at the floor (64) count toward the failure limit: those at 512, 256 and 128
    // are the scaler backing off, hysteresis or not.
    assert.deepEqual(seen.map((s) => s.consecutiveSkipped), [0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0]);
    assert.equal(seen.at(-1)!.optimizerStep, pattern.filter((f) => !f).length);
    // The scale cancels out of the reported norm: clean steps report the unscaled gradient norm.
    const plain = await trainer();
    plain.trainStep(batch(20));
    const ref = await plain.lastStats();
    const rel = Math.abs(seen[0].gradNorm - ref.gradNorm) / ref.gradNorm;
    assert.ok(rel < 1e-5, `scaled run's norm ${seen[0].gradNorm} vs ${ref.gradNorm}`);
    tr.destroy();
    plain.destroy();
  },
});

Deno.test({
  name: "Overflows count toward the failure limit only where the scaler cannot back off",
  ignore: noGpu,
  fn: async () => {
    const at = [1, 2, 3];
    const counts = async (lossScaler?: LossScalerConfig) => {
      const tr = await trainer({ lossScaler, debugNonFiniteAt: at });
      const seen: number[] = [];
      for (let i = 0; i < 5; i++) {
        tr.trainStep(batch(40 + i));
        seen.push((await tr.lastStats()).consecutiveSkipped);
      }
      tr.destroy();
      return seen;
    };
    const dynamic = {
      initialScale: 8,
      growthInterval: 100,
      growthFactor: 2,
      backoffFactor: 0.5,
      hysteresis: 1,
    };
    // fp32 (no scaler) and a static scale (backoff 1) count every overflow.
    assert.deepEqual(await counts(), [0, 1, 2, 3, 0]);
    assert.deepEqual(await counts({ ...dynamic, backoffFactor: 1, growthFactor: 1, minScale: 1 }), [
      0,
      1,
      2,
      3,
      0,
    ]);
    // Dynamic from 8 to a floor of 4: the overflow at 8 backs off, those at 4 count.
    assert.deepEqual(await counts({ ...dynamic, minScale: 4 }), [0, 0, 1, 2, 0]);
  },
});
