/**
 * The update after backward, over the flat parameter, gradient and moment arrays segment by
 * segment (engine/flat.ts; nothing binds more than the device allows): the gradient norm's
 * partial sums, the step control (clipping, loss scale, skipped steps), AdamW, and with fp16 the
 * refresh of the f16 weight copy. Also the parameters' checksum read back after a step.
 */

import { normRanges } from "../../model/plan.ts";
import type { Op, View } from "../ops.ts";
import {
  adamwWgsl,
  castF16Wgsl,
  gradNormPartialWgsl,
  NORM_GROUPS,
  stepControlWgsl,
} from "../kernels/adamw.ts";
import { checksumPartialWgsl } from "../kernels/checksum.ts";
import { grid1d } from "../kernels/common.ts";
import { type Backprop, buf, type GraphBuilder, op, whole } from "./builder.ts";
import { STAT, type Step } from "./program.ts";

/** fp16: the f16 weight copy refreshed from the master weights (after every update); else none. */
export function castWeights(g: GraphBuilder): Op[] {
  const { params, params16, plan: { segments } } = g;
  if (!params16) return [];
  return segments.map((seg, i) =>
    op(
      g,
      "optimizer",
      "optimizer",
      `cast_f16${segments.length > 1 ? `.${i}` : ""}`,
      castF16Wgsl(seg.size / 4),
      [whole(params.segments[i].buffer), whole(params16.segments[i].buffer)],
      grid1d(Math.ceil(seg.size / 4 / 256), g.ctx.limits.maxComputeWorkgroupsPerDimension),
    )
  );
}

/**
 * The optimizer step: per segment the norm's partial sums (into its own NORM_GROUPS slots of
 * t.normPart), the step control, then AdamW per segment and `cast` (castWeights). Without the
 * moments (distributed optimizer) the update is the caller's: no steps.
 */
export function optimizerSteps(g: GraphBuilder, t: Backprop, cast: Op[]): Step[] {
  if (!t.fullState) return [];
  const { params, layout, plan: { segments } } = g, { grads, adamM, adamV, normPart } = t;
  const normOps: Op[] = [], adamOps: Op[] = [];
  for (const [i, seg] of segments.entries()) {
    const n4 = seg.size / 4, sf = segments.length > 1 ? `.${i}` : "";
    const decayEnd4 = Math.min(Math.max(layout.decayEnd - seg.start, 0), seg.size) / 4;
    const gv = grads.segments[i].buffer;
    normOps.push(
      op(g, "optimizer", "optimizer", `grad_norm.part${sf}`, gradNormPartialWgsl(n4), [
        whole(gv),
        { buffer: normPart, offset: i * NORM_GROUPS * 4, size: NORM_GROUPS * 4 },
      ], [NORM_GROUPS]),
    );
    adamOps.push(
      op(
        g,
        "optimizer",
        "optimizer",
        `adamw${sf}`,
        adamwWgsl(n4, decayEnd4),
        [
          whole(params.segments[i].buffer),
          whole(gv),
          whole(adamM!.segments[i].buffer),
          whole(adamV!.segments[i].buffer),
          whole(g.control),
        ],
        grid1d(Math.ceil(n4 / 256), g.ctx.limits.maxComputeWorkgroupsPerDimension),
        { uniform: g.optUniform },
      ),
    );
  }
  // With tensor parallelism the per-segment partials above are built but left out of the program.
  const norm = g.tp.on
    ? tensorParallelNorm(g, t)
    : { steps: normOps, total: whole(normPart), parts: NORM_GROUPS * segments.length };
  return [
    ...norm.steps,
    op(
      g,
      "optimizer",
      "optimizer",
      "step_control",
      stepControlWgsl(norm.parts, STAT.loss, STAT.gradNorm),
      [norm.total, whole(g.stats), whole(g.control)],
      [1],
      { uniform: g.optUniform },
    ),
    ...adamOps,
    ...cast,
  ];
}

/**
 * Tensor parallelism: each rank adds the squares of its shards' gradients (rank 0 also the
 * replicated tensors', which are equal everywhere); the host sums the ranks' parts into one.
 */
function tensorParallelNorm(g: GraphBuilder, t: Backprop): { steps: Step[]; total: View; parts: number } {
  const tpParts = buf(g, "tpNormParts"), total = buf(g, "normTotal");
  const ranges = normRanges(g.shape.config, g.layout, g.plan.segments, g.tp.size, g.tp.rank);
  const steps: Step[] = ranges.map((r, i) =>
    op(g, "optimizer", "optimizer", `grad_norm.range${i}`, gradNormPartialWgsl(r.size / 4), [
      { buffer: t.grads.segments[r.segment].buffer, offset: r.offset * 4, size: r.size * 4 },
      { buffer: tpParts, offset: i * NORM_GROUPS * 4, size: NORM_GROUPS * 4 },
    ], [NORM_GROUPS])
  );
  steps.push({ sync: "norm", label: "grad_norm", parts: tpParts, count: ranges.length * NORM_GROUPS, total });
  return { steps, total: whole(total), parts: 1 };
}

/**
 * Checksum partials of the parameters (NORM_GROUPS u32 per segment) into t.normPart, reusing the
 * norm's scratch (run after the optimizer, read back).
 */
export function checksumSteps(g: GraphBuilder, t: Backprop): Op[] {
  const { params, plan: { segments } } = g;
  return segments.map((seg, i) =>
    op(
      g,
      "optimizer",
      "optimizer",
      `checksum${segments.length > 1 ? `.${i}` : ""}`,
      checksumPartialWgsl(seg.size / 4, seg.start),
      [whole(params.segments[i].buffer), {
        buffer: t.normPart,
        offset: i * NORM_GROUPS * 4,
        size: NORM_GROUPS * 4,
      }],
      [NORM_GROUPS],
    )
  );
}
