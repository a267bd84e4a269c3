/**
 * The WebGPU engine against the float64 CPU reference on a tiny GPT-2 (2 layers, 4 heads, 64 dims,
 * seq 32, the real 50257-token vocabulary padded to 50304): logits, loss, every parameter's
 * gradient with and without dropout, and a 10-step AdamW loss trajectory.
 */

import assert from "node:assert/strict";
import { makeConfig, paramLayout } from "../../model/config.ts";
import { referenceAdamWStep, referenceForward, referenceLossAndGrads } from "../reference/cpu_gpt2.ts";
import { initParams } from "../../model/init.ts";
import { learningRate, type LrSchedule } from "../../model/schedule.ts";
import { Trainer, type TrainerOptions } from "../../engine/trainer.ts";
import { buildModel, destroyModel } from "../../engine/graph/mod.ts";
import { opsOf } from "../../engine/graph/program.ts";
import { assertSameFloats, noGpu, relNorm, testContext } from "../_helpers.ts";

const config = makeConfig({ n_layer: 2, n_head: 4, n_embd: 64, n_positions: 32 });
const B = 2, T = 32;
const schedule: LrSchedule = { lr: 3e-3, min_lr: 3e-4, warmup_iters: 3, decay_iters: 10, style: "cosine" };
const adamw = { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, clip_grad: 1.0 };

function batch(seed: number): Uint16Array {
  const out = new Uint16Array(B * (T + 1));
  let s = seed;
  for (let i = 0; i < out.length; i++) {
    s = (Math.imul(s, 1103515245) + 12345) >>> 0;
    // Mostly small ids so tokens repeat (exercising the wte scatter-add), some anywhere in the vocabulary.
    out[i] = i % 7 === 0 ? (s >>> 8) % config.vocab_size : (s >>> 16) % 300;
  }
  return out;
}

async function trainer(
  dropout: number,
  seed = 7,
  kernels?: TrainerOptions["kernels"],
  attentionScores?: boolean,
): Promise<Trainer> {
  const ctx = (await testContext())!;
  const opts: TrainerOptions = {
    kernels,
    attentionScores,
    config,
    batchSize: B,
    seqLen: T,
    schedule,
    adamw,
    attnDropout: dropout,
    hiddenDropout: dropout,
    seed,
  };
  return await Trainer.create(ctx, opts);
}

Deno.test({
  name: "Trainer.logits() and the loss match the CPU reference",
  ignore: noGpu,
  fn: async () => {
    const tr = await trainer(0);
    const tokens = batch(1);
    const params = Float64Array.from(initParams(config, 7));
    const ref = referenceForward(config, params, tokens, B, T);
    const logits = await tr.logits(tokens);
    const err = relNorm(logits.subarray(0, ref.logits.length), ref.logits);
    assert.ok(err < 1e-5, `logits relative error ${err} (tolerance 1e-5)`);
    const loss = await tr.evalLoss(tokens);
    assert.ok(Math.abs(loss - ref.loss) < 1e-4 * ref.loss, `loss ${loss} vs reference ${ref.loss}`);
    // Several batches in one call: the mean of their losses, read back once.
    const other = batch(5), lossOther = await tr.evalLoss(other);
    const both = await tr.evalLoss([tokens, other]);
    assert.ok(Math.abs(both - (loss + lossOther) / 2) < 1e-6 * both, `two-batch loss ${both}`);
    tr.destroy();
  },
});

// The GPUs' kernels too (tiled matmuls, GELU staged for the MLP's weight gradient, the split
// attention backward on its own tilings), which a CPU adapter otherwise replaces.
const gpuKernels = { cpuDirect: false, cpuMatmul: false } as const;
for (const [dropout, kernels, scores] of [[0], [0.1], [0.1, gpuKernels], [0.1, gpuKernels, true]] as const) {
  Deno.test({
    name: `Trainer.trainStep() gradients of every tensor match the CPU reference (dropout ${dropout}${
      kernels ? ", the GPUs' kernels" : ""
    }${scores ? ", dQ from stored dS" : ""})`,
    ignore: noGpu,
    fn: async () => {
      const tr = await trainer(dropout, 7, kernels, scores);
      const tokens = batch(2);
      const params = Float64Array.from(initParams(config, 7));
      const ref = referenceLossAndGrads(config, params, tokens, B, T, {
        seed: 7,
        step: 0,
        attnDropout: dropout,
        hiddenDropout: dropout,
      });
      tr.trainStep(tokens);
      const { loss } = await tr.lastStats();
      assert.ok(Math.abs(loss - ref.loss) < 1e-4 * ref.loss, `loss ${loss} vs reference ${ref.loss}`);
      const grads = await tr.gradients();
      const worst: string[] = [];
      for (const t of paramLayout(config).tensors) {
        const g = grads.subarray(t.offset, t.offset + t.size);
        const r = ref.grads.subarray(t.offset, t.offset + t.size);
        const err = relNorm(g, r);
        // Tolerance 1e-4 relative to the tensor's gradient norm (float32 against float64).
        if (!(err < 1e-4)) worst.push(`${t.name}: ${err.toExponential(2)}`);
      }
      assert.deepEqual(worst, [], `tensors whose gradient differs: ${worst.join(", ")}`);
      // Padded vocabulary rows never receive gradient.
      const wte = paramLayout(config).byName.get("wte.weight")!;
      const padded = grads.subarray(wte.offset + config.vocab_size * config.n_embd, wte.offset + wte.size);
      assert.ok(padded.every((x) => x === 0), "padded wte rows have zero gradient");
      tr.destroy();
    },
  });
}

Deno.test({
  name:
    "Trainer.trainStep() with the attention fills and the LayerNorm rows written out, 16 loads in flight in the column sums, and the dK/dV sums reduce-scattered, gives the same loss and gradients bit for bit (the GPUs' kernels, stored dS, dropout)",
  ignore: noGpu,
  fn: async () => {
    const tokens = batch(2);
    const run = async (kernels: TrainerOptions["kernels"]) => {
      const tr = await trainer(0.1, 7, kernels, true);
      tr.trainStep(tokens);
      const out = { loss: (await tr.lastStats()).loss, grads: await tr.gradients() };
      tr.destroy();
      return out;
    };
    // The loops as they were (each choice named: GPUs now default to the written-out kernels).
    const loops = await run({
      ...gpuKernels,
      attentionFills: false,
      layernormWritten: false,
      columnSumUnroll: 8,
      attentionScatter: false,
    });
    const written = await run({
      ...gpuKernels,
      attentionFills: true,
      layernormWritten: true,
      columnSumUnroll: 16,
      attentionScatter: true,
    });
    assert.equal(written.loss, loops.loss);
    assert.ok(written.grads.some((g) => g !== 0));
    assertSameFloats(written.grads, loops.grads, "the gradients");
  },
});

Deno.test({
  name:
    "Trainer.trainStep() with the matmuls' sizes in a uniform compiles fewer pipelines and gives the same loss and gradients bit for bit (the GPUs' kernels, dropout)",
  ignore: noGpu,
  fn: async () => {
    const tokens = batch(2);
    const run = async (uniformDims: "all" | "none") => {
      const tr = await trainer(0.1, 7, { ...gpuKernels, uniformDims }, true);
      const pipelines = new Set([...tr.model.forward, ...tr.model.loss, ...tr.model.backward].map((o) =>
        o.pipeline
      ))
        .size;
      tr.trainStep(tokens);
      const out = { loss: (await tr.lastStats()).loss, grads: await tr.gradients(), pipelines };
      tr.destroy();
      return out;
    };
    const literal = await run("none"), uniform = await run("all");
    assert.equal(uniform.loss, literal.loss);
    assert.ok(uniform.grads.some((g) => g !== 0));
    assertSameFloats(uniform.grads, literal.grads, "the gradients");
    // Shapes that share a tile, layout and epilogue share a pipeline (e.g. the weight gradients).
    assert.ok(
      uniform.pipelines < literal.pipelines,
      `${uniform.pipelines} pipelines with the sizes in a uniform, ${literal.pipelines} without`,
    );
  },
});

Deno.test({
  name: "attentionScores: the dQ kernel does one product over the stored dS instead of three",
  ignore: noGpu,
  fn: async () => {
    const ctx = (await testContext())!;
    if (!ctx.hasSubgroups) return;
    const shape = { config, B, T, attnDropout: 0.1, hiddenDropout: 0.1 };
    for (const [attentionScores, share] of [[false, 0.75], [true, 0.25]] as const) {
      const m = await buildModel(ctx, shape, { kernels: gpuKernels, attentionScores });
      const flops = (label: string) => opsOf(m.program.backward).find((o) => o.label === label)!.flops;
      assert.equal(
        flops("l1.attention.dq") / flops("l1.attention.dkv"),
        share,
        `attentionScores ${attentionScores}`,
      );
      destroyModel(m);
    }
  },
});

Deno.test({
  name: "Trainer 10-step AdamW loss trajectory matches the CPU reference",
  ignore: noGpu,
  fn: async () => {
    const tr = await trainer(0);
    const params = Float64Array.from(initParams(config, 7));
    const m = new Float64Array(params.length), v = new Float64Array(params.length);
    for (let step = 0; step < 10; step++) {
      const tokens = batch(100 + (step % 3));
      const ref = referenceLossAndGrads(config, params, tokens, B, T, { seed: 7, step });
      const refNorm = referenceAdamWStep(
        config,
        params,
        ref.grads,
        m,
        v,
        step,
        learningRate(schedule, step),
        adamw,
      );
      tr.trainStep(tokens);
      const s = await tr.lastStats();
      assert.ok(
        Math.abs(s.loss - ref.loss) < 2e-4 * ref.loss,
        `step ${step}: loss ${s.loss} vs reference ${ref.loss}`,
      );
      assert.ok(
        Math.abs(s.gradNorm - refNorm.gradNorm) < 1e-3 * refNorm.gradNorm,
        `step ${step}: grad norm ${s.gradNorm} vs ${refNorm.gradNorm}`,
      );
    }
    const state = await tr.exportState();
    const err = relNorm(state.params, params);
    assert.ok(err < 1e-4, `parameters after 10 steps: relative error ${err}`);
    tr.destroy();
  },
});
