/**
 * The output of the graph: lnf = LN(res[L]), logits = lnf·wteᵀ (B·T, Vp), the fused cross-entropy
 * and, in training, its gradient pushed back through the head. The head runs over chunks of rows
 * so the logits take one chunk of memory: with several chunks each chunk's logits are computed,
 * turned into their gradient and pushed back before the next. With tensor parallelism each rank
 * holds Vl columns of the logits and the loss combines the ranks' row statistics (a `vocab_ce`
 * exchange) instead of gathering them.
 */

import type { Op, View } from "../ops.ts";
import { crossEntropyWgsl, meanLossWgsl } from "../kernels/cross_entropy.ts";
import { grid1d, ZERO_WORDS_PER_GROUP, zeroWordsWgsl } from "../kernels/common.ts";
import { ceFromStatsWgsl, ceLocalStatsWgsl } from "../parallel/tensor_parallel_kernels.ts";
import {
  allreduce,
  type Backprop,
  buf,
  type Chunk,
  gradView,
  type GraphBuilder,
  op,
  rowsView,
  weight,
  whole,
} from "./builder.ts";
import { STAT, type Step } from "./program.ts";
import { CE_ROWS_SLOT_BYTES } from "../../model/plan.ts";
import { matmul, mm } from "./matmul_steps.ts";
import { layernormBackward, layernormForward } from "./layernorm_steps.ts";

/**
 * The forward's end: the final LayerNorm, and the LM head when it runs in one chunk (unless
 * `withHead` is false: a plan that stops at the hidden states).
 */
export function headForward(g: GraphBuilder, withHead = true): Step[] {
  const L = g.dims.L;
  return [
    layernormForward(g, "lnf", g.res[L], "ln_f", g.lnf, g.lnfs),
    ...(withHead && g.nChunks === 1 ? lmHead(g, g.chunks[0]) : []),
  ];
}

/** The loss of a plan without training: the first chunk's, its gradient written into the logits as in training. */
export function inferenceLoss(g: GraphBuilder): Step[] {
  return [...crossEntropy(g, g.chunks[0], true), meanLoss(g)];
}

/** The loss without gradient, added into STAT.evalLoss (zeroed by the caller before a run of batches). */
export function evalLoss(g: GraphBuilder): Step[] {
  const steps: Step[] = [];
  for (const chunk of g.chunks) {
    if (g.nChunks > 1) steps.push(...lmHead(g, chunk));
    steps.push(...crossEntropy(g, chunk, false));
  }
  steps.push(
    op(g, "forward", "cross_entropy", "mean_eval_loss", meanLossWgsl(g.dims.BT, STAT.evalLoss, true), [
      whole(g.losses),
      whole(g.stats),
    ], [1]),
  );
  return steps;
}

/**
 * The training loss and the head's backward: `loss` computes the loss with its gradient in place
 * of the logits (and, with several chunks, each chunk's head forward and backward around it);
 * `backward` opens the backward pass (the one-chunk head's backward) and ends with the final
 * LayerNorm's, leaving the gradient of res[L] in t.dres.
 */
export function headBackward(g: GraphBuilder, t: Backprop): { loss: Step[]; backward: Step[] } {
  const { BT, C, L } = g.dims;
  const loss: Step[] = [], backward: Step[] = [];
  if (g.nChunks === 1) {
    loss.push(...crossEntropy(g, g.chunks[0], true), meanLoss(g));
    backward.push(...lmHeadBackward(g, t, g.chunks[0]));
  } else {
    for (const chunk of g.chunks) {
      loss.push(...lmHead(g, chunk), ...crossEntropy(g, chunk, true), ...lmHeadBackward(g, t, chunk));
    }
    loss.push(meanLoss(g));
  }
  // Tensor parallelism: each rank's vocabulary columns give a part of dlnf (and each column- or
  // head-parallel matmul of a layer a part of its input's gradient): sum them before the LayerNorm.
  if (g.tp.on) backward.push(allreduce("lm_head.dx", t.dln, BT * C));
  backward.push(...layernormBackward(g, t, "lnf.bwd", t.dln, g.res[L], g.lnfs, "ln_f", false));
  return { loss, backward };
}

/** A chunk's logits (n, Vl) = lnf rows (n, C) · wteᵀ: this rank's Vl columns (all Vp on one GPU). */
function lmHead(g: GraphBuilder, chunk: Chunk): Op[] {
  const { C, Vl } = g.dims, { i, r0, n } = chunk;
  return matmul(g, "forward", g.nChunks > 1 ? `lm_head.${i}` : "lm_head", mm(n, Vl, C, false, true), {
    A: rowsView(g, g.lnf, r0, n, C),
    B: weight(g, "wte.weight"),
    out: rowsView(g, g.logits, 0, n, Vl),
  });
}

/**
 * The LM head's backward for a chunk: dlnf rows = dlogits·wte; dwte = dlogitsᵀ·lnf (the embedding
 * adds to it later). With one chunk the product is stored. With several, every chunk accumulates,
 * after the first clears the gradient: one pipeline for all chunks, where a storing first chunk
 * would compile a second copy of the largest matmul kernel of the step (about 0.5 s on a fresh
 * H100, against a clear of the gradient's bytes each step). Gradients that accumulate over
 * micro-batches are cleared by the trainer instead.
 */
function lmHeadBackward(g: GraphBuilder, t: Backprop, chunk: Chunk): Op[] {
  const { C, Vl } = g.dims, { i, r0, n } = chunk, sfx = g.nChunks > 1 ? `.${i}` : "";
  const dwte = gradView(g, t, "wte.weight");
  const store = g.nChunks === 1 && !g.accumulate;
  const clear = i === 0 && g.nChunks > 1 && !g.accumulate;
  return [
    ...matmul(g, "backward", `lm_head.dx${sfx}`, mm(n, C, Vl), {
      A: rowsView(g, g.logits, 0, n, Vl),
      B: weight(g, "wte.weight"),
      out: rowsView(g, t.dln, r0, n, C),
    }),
    ...(clear ? [zeroView(g, "lm_head.dw.clear", dwte)] : []),
    ...matmul(g, "backward", `lm_head.dw${sfx}`, {
      ...mm(Vl, C, n, true, false),
      epilogue: store ? "store" : "accumulate",
    }, {
      A: rowsView(g, g.logits, 0, n, Vl),
      B: rowsView(g, g.lnf, r0, n, C),
      out: dwte,
    }),
  ];
}

/** An op that sets every byte of `v` to zero (see zeroWordsWgsl). */
function zeroView(g: GraphBuilder, label: string, v: View): Op {
  const words = (v.size ?? v.buffer.size - (v.offset ?? 0)) / 4;
  if (!Number.isInteger(words)) {
    throw new RangeError(`${label}: ${words * 4} bytes is not a whole number of words`);
  }
  const grid = grid1d(Math.ceil(words / ZERO_WORDS_PER_GROUP), g.ctx.limits.maxComputeWorkgroupsPerDimension);
  return op(g, "backward", "elementwise", label, zeroWordsWgsl(words), [v], grid);
}

/** The loss of a chunk's rows into g.losses (and its gradient in place of the logits with `grad`). */
function crossEntropy(g: GraphBuilder, chunk: Chunk, grad: boolean): Step[] {
  const { BT, T, Vp, Vl, vlo } = g.dims, { i, r0, n } = chunk, V = g.shape.config.vocab_size;
  const sfx = `${grad ? "" : "_eval"}${g.nChunks > 1 ? `.${i}` : ""}`;
  const grid = grid1d(n, g.ctx.limits.maxComputeWorkgroupsPerDimension);
  const gradOpts = grad ? { uniform: g.optUniform } : {};
  const totalRows = BT * g.microBatches * g.dataParallel;
  const out = [whole(g.tokens), whole(g.losses)];
  // SFT's loss mask: per-row weights after the token ids (see kernels/cross_entropy.ts).
  const weights = g.opts.lossMask ? g.dims.B * (T + 1) : undefined;
  if (weights !== undefined && g.tp.on) {
    throw new RangeError("A loss mask (SFT) is not supported with tensor parallelism: use tensor_parallel 1");
  }
  if (!g.tp.on) {
    // Several chunks: each binds its first row's slot of ceRows (writeChunkRows), one pipeline for all.
    const rows = g.nChunks > 1 ? buf(g, "ceRows") : null;
    return [
      op(
        g,
        "forward",
        "cross_entropy",
        `cross_entropy${sfx}`,
        crossEntropyWgsl({ rows: n, rowBase: rows ? "uniform" : r0, totalRows, T, V, Vp, grad, weights }),
        [
          rowsView(g, g.logits, 0, n, Vp),
          ...out,
          ...(grad ? [whole(g.control)] : []),
          ...(rows ? [{ buffer: rows, offset: i * CE_ROWS_SLOT_BYTES, size: 16 }] : []),
        ],
        grid,
        gradOpts,
      ),
    ];
  }
  const ceStats = buf(g, "ceStats");
  const vs = { rows: n, rowBase: r0, totalRows, T, V, Vl, lo: vlo };
  const lv = rowsView(g, g.logits, 0, n, Vl);
  return [
    op(g, "forward", "cross_entropy", `cross_entropy_stats${sfx}`, ceLocalStatsWgsl(vs), [
      lv,
      whole(g.tokens),
      whole(ceStats),
    ], grid),
    { sync: "vocab_ce", label: `cross_entropy${sfx}`, stats: ceStats, rows: n },
    op(
      g,
      "forward",
      "cross_entropy",
      `cross_entropy${sfx}`,
      ceFromStatsWgsl(vs, grad),
      [lv, ...out, whole(ceStats), ...(grad ? [whole(g.control)] : [])],
      grid,
      gradOpts,
    ),
  ];
}

/**
 * Writes each LM-head chunk's first row into its slot of the plan's ceRows uniform, if it has one:
 * constants, written once the build's kernels are compiled (a CPU adapter's warm-up clears every
 * buffer after).
 */
export function writeChunkRows(g: GraphBuilder): void {
  const rows = g.byLabel.get("ceRows");
  if (!rows) return;
  const u = new Uint32Array((g.nChunks * CE_ROWS_SLOT_BYTES) / 4);
  for (const c of g.chunks) u[(c.i * CE_ROWS_SLOT_BYTES) / 4] = c.r0;
  g.ctx.device.queue.writeBuffer(rows, 0, u);
}

/** The mean of the rows' losses into STAT.loss (added over micro-batches). */
function meanLoss(g: GraphBuilder): Op {
  return op(
    g,
    "forward",
    "cross_entropy",
    "mean_loss",
    meanLossWgsl(g.dims.BT * g.microBatches, STAT.loss, g.accumulate),
    [whole(g.losses), whole(g.stats)],
    [1],
  );
}
