/**
 * The graph's LayerNorms, forward and backward, by parameter prefix (`h.3.ln_1`, `ln_f`): the
 * forward writes the normalised rows and their statistics, which the backward (and a checkpointed
 * recompute) reads back; the backward adds the input's gradient into the residual's.
 */

import type { Op } from "../ops.ts";
import {
  layernormBackwardWgsl,
  layernormForwardWgsl,
  layernormParamPartialWgsl,
  lnBiasPartialOffset,
  reduceRowsWgsl,
} from "../kernels/layernorm.ts";
import {
  type Backprop,
  colsumUnroll,
  dtypeOf,
  gradView,
  type GraphBuilder,
  layernormWritten,
  op,
  param,
  rowsGrid,
  whole,
} from "./builder.ts";

/** out (B·T, C) = LN(x) with the weight and bias of `name`; st (B·T) its row statistics. */
export function layernormForward(
  g: GraphBuilder,
  label: string,
  x: GPUBuffer,
  name: string,
  out: GPUBuffer,
  st: GPUBuffer,
): Op {
  const written = layernormWritten(g);
  return op(g, "forward", "layernorm", label, layernormForwardWgsl(g.dims.C, dtypeOf(g, out), written), [
    whole(x),
    param(g, name + ".weight"),
    param(g, name + ".bias"),
    whole(out),
    whole(st),
  ], rowsGrid(g));
}

/**
 * The backward of `out = LN(x)` given dy (B·T, C) and the forward's statistics st: dx into
 * t.dres (added to it with `accumulate`, the residual's gradient so far), then the weight and
 * bias gradients as column sums over row blocks.
 */
export function layernormBackward(
  g: GraphBuilder,
  t: Backprop,
  label: string,
  dy: GPUBuffer,
  x: GPUBuffer,
  st: GPUBuffer,
  name: string,
  accumulate: boolean,
): Op[] {
  const { C, BT } = g.dims, { blocks, part } = t;
  const partBytes = blocks * C * 4, dbOffset = lnBiasPartialOffset(C, BT) * 4;
  return [
    op(
      g,
      "backward",
      "layernorm",
      label + ".dx",
      layernormBackwardWgsl(C, accumulate, layernormWritten(g)),
      [
        whole(dy),
        whole(x),
        param(g, name + ".weight"),
        whole(st),
        whole(t.dres),
      ],
      rowsGrid(g),
    ),
    op(
      g,
      "backward",
      "layernorm",
      label + ".dw_part",
      layernormParamPartialWgsl(C, BT, colsumUnroll(g) / 2),
      [
        whole(dy),
        whole(x),
        whole(st),
        whole(part),
      ],
      [Math.ceil(C / 4 / 64), blocks],
    ),
    op(g, "backward", "reduce", label + ".dw", reduceRowsWgsl(C, blocks, g.accumulate, colsumUnroll(g)), [
      { buffer: part, offset: 0, size: partBytes },
      gradView(g, t, name + ".weight"),
    ], [Math.ceil(C / 4 / 64)]),
    op(g, "backward", "reduce", label + ".db", reduceRowsWgsl(C, blocks, g.accumulate, colsumUnroll(g)), [
      { buffer: part, offset: dbOffset, size: partBytes },
      gradView(g, t, name + ".bias"),
    ], [Math.ceil(C / 4 / 64)]),
  ];
}
