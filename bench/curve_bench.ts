/**
 * fp16 against fp32 loss curves: the same model, data order, seed and schedule trained twice, once
 * per precision, on State of the Union addresses (the built-in corpus), printing both curves at
 * every log step and the largest relative gap (pointwise and over 50-step means). Issue 9's
 * target: gpt2-124M's fp16 curve within 2% of fp32's over 500 iterations.
 *
 *   deno task bench curve [--model gpt2-124M] [--iters 500] [--batch 8] [--seq 512] [--log 10] [--docs 60]
 */

import { encode } from "gpt-tokenizer/encoding/r50k_base";
import { builtinDocuments } from "../data/builtin.ts";
import { Sampler } from "../data/sampler.ts";
import { EOT_TOKEN, presetConfig } from "../gpu/config.ts";
import { describeDevice, type GpuContext, openDevice } from "../gpu/device.ts";
import type { Precision } from "../gpu/plan.ts";
import { Trainer } from "../gpu/trainer.ts";

function arg(name: string, def: string): string {
  const i = Deno.args.indexOf(`--${name}`);
  return i >= 0 && i + 1 < Deno.args.length ? Deno.args[i + 1] : def;
}

/** Trains `iters` steps and returns the loss at every `log`-th step (and the last loss scale). */
async function curve(
  ctx: GpuContext,
  precision: Precision,
  tokens: Uint16Array,
  o: { model: string; iters: number; B: number; T: number; log: number },
): Promise<{ losses: number[]; lossScale: number; skipped: number; ms: number }> {
  const sampler = new Sampler(tokens, { seqLen: o.T, batchSize: o.B, seed: 1 });
  const tr = await Trainer.create(ctx, {
    config: presetConfig(o.model),
    batchSize: o.B,
    seqLen: o.T,
    schedule: {
      lr: 6e-4,
      min_lr: 6e-5,
      warmup_iters: Math.ceil(o.iters / 50),
      decay_iters: o.iters,
      style: "cosine",
    },
    adamw: { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, clip_grad: 1.0 },
    attnDropout: 0,
    hiddenDropout: 0,
    seed: 1,
    precision,
  });
  const losses: number[] = [];
  let lossScale = 1, skipped = 0;
  const t0 = performance.now();
  for (let i = 0; i < o.iters; i++) {
    tr.trainStep(sampler.nextBatch());
    if ((i + 1) % o.log === 0) {
      const s = await tr.lastStats();
      losses.push(s.loss);
      lossScale = s.lossScale;
      skipped = s.skippedSteps;
    }
  }
  const ms = (performance.now() - t0) / o.iters;
  tr.destroy();
  return { losses, lossScale, skipped, ms };
}

if (import.meta.main) {
  const o = {
    model: arg("model", "gpt2-124M"),
    iters: +arg("iters", "500"),
    B: +arg("batch", "8"),
    T: +arg("seq", "512"),
    log: +arg("log", "10"),
  };
  const ctx = await openDevice();
  console.log(describeDevice(ctx));
  const docs = (await builtinDocuments("sotu")).slice(-+arg("docs", "60"));
  const ids: number[] = [];
  for (const d of docs) ids.push(...encode(d.text), EOT_TOKEN);
  const tokens = Uint16Array.from(ids);
  console.log(
    `${o.model}, ${tokens.length} tokens of ${docs.length} addresses, batch ${o.B}×${o.T}, ${o.iters} iterations`,
  );
  const fp32 = await curve(ctx, "fp32", tokens, o);
  const fp16 = await curve(ctx, "fp16", tokens, o);
  let worst = 0, worstMean = 0;
  const win = Math.max(1, Math.round(50 / o.log));
  console.log("iteration  fp32 loss  fp16 loss  rel gap");
  for (let i = 0; i < fp32.losses.length; i++) {
    const gap = Math.abs(fp16.losses[i] - fp32.losses[i]) / fp32.losses[i];
    worst = Math.max(worst, gap);
    console.log(
      `${String((i + 1) * o.log).padStart(9)}  ${fp32.losses[i].toFixed(4).padStart(9)}  ` +
        `${fp16.losses[i].toFixed(4).padStart(9)}  ${(gap * 100).toFixed(2).padStart(6)}%`,
    );
    if ((i + 1) % win === 0) {
      const mean = (a: number[]) => a.slice(i + 1 - win, i + 1).reduce((x, y) => x + y, 0) / win;
      worstMean = Math.max(worstMean, Math.abs(mean(fp16.losses) - mean(fp32.losses)) / mean(fp32.losses));
    }
  }
  console.log(
    `largest gap: ${(worst * 100).toFixed(2)}% pointwise, ${(worstMean * 100).toFixed(2)}% over ${
      win * o.log
    }-step ` +
      `means (target 2%); fp16 loss scale ${fp16.lossScale}, ${fp16.skipped} skipped; ` +
      `ms/step fp32 ${fp32.ms.toFixed(1)}, fp16 ${fp16.ms.toFixed(1)}`,
  );
  ctx.device.destroy();
  Deno.exit(0);
}
