/**
 * fp16 against fp32 loss curves: the same model, data order, seed and schedule trained twice, once
 * per precision, on State of the Union addresses (the built-in corpus), printing both curves at
 * every log step and the largest relative gap (pointwise and over 50-step means). Issue 9's
 * target: gpt2-124M's fp16 curve within 2% of fp32's over 500 iterations.
 *
 * fp16's dynamic loss scaling starts high, so its first steps overflow and are skipped (no
 * update, the LR schedule does not advance): at iteration i it has applied i − skipped updates.
 * So the curves are also compared aligned by applied updates (fp16's loss after u updates against
 * fp32's after u), and by iteration after fp16's last skipped step. The loss at an iteration is
 * of that iteration's batch, and both runs draw the same batch at the same iteration, so aligned
 * pairs are of different batches: their 50-update means are the meaningful figure. The loss and
 * the skipped count are read back after every step (one readback per step, so ms/step includes
 * it).
 *
 *   deno task bench curve [--model gpt2-124M] [--iters 500] [--batch 8] [--seq 512] [--log 10] [--docs 60]
 */

import { encode } from "gpt-tokenizer/encoding/r50k_base";
import { builtinDocuments } from "../data/builtin.ts";
import { Sampler } from "../data/sampler.ts";
import { EOT_TOKEN, presetConfig } from "../model/config.ts";
import { describeDevice, type GpuContext, openDevice } from "../engine/device.ts";
import type { Precision } from "../model/plan.ts";
import { Trainer } from "../engine/trainer.ts";

function arg(name: string, def: string): string {
  const i = Deno.args.indexOf(`--${name}`);
  return i >= 0 && i + 1 < Deno.args.length ? Deno.args[i + 1] : def;
}

/** One precision's run: the loss at every iteration and whether that iteration's update was applied. */
interface Curve {
  /** Loss of iteration i's batch (before its update), every iteration. */
  losses: number[];
  /** Whether iteration i's update was applied (false: skipped, non-finite gradients). */
  applied: boolean[];
  lossScale: number;
  skipped: number;
  ms: number;
}

/** Trains `iters` steps, reading the loss and skipped count back after every one. */
async function curve(
  ctx: GpuContext,
  precision: Precision,
  tokens: Uint16Array,
  o: { model: string; iters: number; B: number; T: number; log: number },
): Promise<Curve> {
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
  const losses: number[] = [], applied: boolean[] = [];
  let lossScale = 1, skipped = 0;
  const t0 = performance.now();
  for (let i = 0; i < o.iters; i++) {
    tr.trainStep(sampler.nextBatch());
    const s = await tr.lastStats();
    losses.push(s.loss);
    applied.push(s.skippedSteps === skipped);
    lossScale = s.lossScale;
    skipped = s.skippedSteps;
  }
  const ms = (performance.now() - t0) / o.iters;
  tr.destroy();
  return { losses, applied, lossScale, skipped, ms };
}

/** The losses by applied update: entry u is the loss of the iteration that applied update u + 1 (u updates before it). */
function byUpdate(c: Curve): number[] {
  return c.losses.filter((_, i) => c.applied[i]);
}

/**
 * The largest relative gap of `test` from `ref` (same indexing): pointwise at `points`, and
 * between means of windows of `win` entries starting at `from` (whole windows only; NaN when
 * there is none).
 */
function gaps(
  ref: number[],
  test: number[],
  points: number[],
  win: number,
  from = 0,
): { pointwise: number; mean: number } {
  const rel = (a: number, b: number) => Math.abs(a - b) / b;
  const n = Math.min(ref.length, test.length);
  let pointwise = 0, mean = from + win <= n ? 0 : NaN;
  for (const i of points) if (i >= from && i < n) pointwise = Math.max(pointwise, rel(test[i], ref[i]));
  const avg = (a: number[], s: number) => a.slice(s, s + win).reduce((x, y) => x + y, 0) / win;
  for (let s = from; s + win <= n; s += win) mean = Math.max(mean, rel(avg(test, s), avg(ref, s)));
  return { pointwise, mean };
}

const pct = (x: number) => Number.isNaN(x) ? "n/a" : `${(x * 100).toFixed(2)}%`;

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
  const u32 = byUpdate(fp32), u16 = byUpdate(fp16);
  // Log steps: iterations log, 2·log, … (index n − 1); by update the same counts.
  const logPoints = Array.from({ length: Math.floor(o.iters / o.log) }, (_, k) => (k + 1) * o.log - 1);
  const win = Math.max(1, Math.round(50 / o.log));
  const span = win * o.log;
  // By iteration, as before: pointwise at log steps, means of the log-step losses over `span` steps.
  const at = (a: number[]) => logPoints.map((i) => a[i]);
  const byIter = gaps(at(fp32.losses), at(fp16.losses), logPoints.map((_, k) => k), win);
  // Means of every iteration's loss, by iteration and by applied update.
  const byIterAll = gaps(fp32.losses, fp16.losses, logPoints, span);
  const aligned = gaps(u32, u16, logPoints, span);
  // By iteration after fp16's last skipped step.
  const lastSkip = fp16.applied.lastIndexOf(false);
  const after = gaps(fp32.losses, fp16.losses, logPoints, span, lastSkip + 1);
  // Left: by iteration. Right: fp16's updates applied before that iteration's loss, and fp16's
  // loss after as many updates as fp32 has had (fp32's loss on the left), with its gap.
  console.log(
    "iteration  fp32 loss  fp16 loss  rel gap  │  fp16 updates  fp16 loss at fp32's updates  rel gap",
  );
  for (const i of logPoints) {
    const gap = Math.abs(fp16.losses[i] - fp32.losses[i]) / fp32.losses[i];
    const updates = fp16.applied.slice(0, i).filter(Boolean).length;
    const u = fp32.applied.slice(0, i).filter(Boolean).length;
    const a = u < u16.length ? u16[u] : null;
    const right = a === null
      ? `${"—".padStart(27)}  ${"".padStart(7)}`
      : `${a.toFixed(4).padStart(27)}  ${pct(Math.abs(a - u32[u]) / u32[u]).padStart(7)}`;
    console.log(
      `${String(i + 1).padStart(9)}  ${fp32.losses[i].toFixed(4).padStart(9)}  ` +
        `${fp16.losses[i].toFixed(4).padStart(9)}  ${pct(gap).padStart(7)}  │  ${
          String(updates).padStart(12)
        }  ${right}`,
    );
  }
  console.log(
    `by iteration: largest gap ${pct(byIter.pointwise)} pointwise, ${
      pct(byIter.mean)
    } over ${span}-step means ` +
      `of the log steps (${pct(byIterAll.mean)} over means of every step)`,
  );
  console.log(
    `by applied update: largest gap ${pct(aligned.pointwise)} pointwise, ${
      pct(aligned.mean)
    } over ${span}-update ` +
      `means (${Math.min(u32.length, u16.length)} updates compared; aligned pairs are of different batches)`,
  );
  console.log(
    lastSkip < 0
      ? "after the last skipped step: fp16 skipped none"
      : `after the last skipped step (iteration ${lastSkip + 1}): largest gap ${
        pct(after.pointwise)
      } pointwise, ` +
        `${pct(after.mean)} over ${span}-step means`,
  );
  console.log(
    `largest gap (target 2%): by iteration ${pct(byIter.pointwise)} pointwise, ${pct(byIter.mean)} over ` +
      `${span}-step means; by applied update ${pct(aligned.pointwise)} pointwise, ${
        pct(aligned.mean)
      } over ` +
      `${span}-update means; after iteration ${lastSkip + 1} ${pct(after.pointwise)} pointwise, ` +
      `${
        pct(after.mean)
      } over ${span}-step means; fp16 loss scale ${fp16.lossScale}, ${fp16.skipped} skipped ` +
      `(fp32 ${fp32.skipped}); ms/step fp32 ${fp32.ms.toFixed(1)}, fp16 ${
        fp16.ms.toFixed(1)
      } (readback every step)`,
  );
  ctx.device.destroy();
  Deno.exit(0);
}
