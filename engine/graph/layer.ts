/**
 * One transformer layer, forward and backward, each read top to bottom as the kernels run (the
 * shape of llm.c's gpt2_forward / gpt2_backward loop bodies). With tensor parallelism each rank
 * holds its heads and MLP columns (Megatron): the column-parallel matmuls need nothing, the
 * row-parallel projections allreduce their partial sums (matmul_steps.ts), and in backward the
 * input gradients of the column-parallel matmuls are allreduced before their LayerNorm. With
 * activation checkpointing, backward first replays the forward of the layer's group.
 */

import { dropoutSite } from "../../model/rng.ts";
import type { Op } from "../ops.ts";
import {
  attentionBackwardKVWgsl,
  attentionBackwardQWgsl,
  attentionDeltaWgsl,
  attentionFlops,
  attentionForwardWgsl,
  backwardKVSpec,
  backwardQSpec,
} from "../kernels/attention.ts";
import { attentionBackwardQScoresWgsl } from "../kernels/attention_dq.ts";
import { dropoutMaskWgsl, grid1d } from "../kernels/common.ts";
import {
  allreduce,
  type Backprop,
  drop,
  dropSlot,
  elemGrid,
  type GraphBuilder,
  op,
  whole,
} from "./builder.ts";
import { type Step } from "./program.ts";
import { geluStaging, linear, linearBackward, rowParallel } from "./matmul_steps.ts";
import { layernormBackward, layernormForward } from "./layernorm_steps.ts";

/** Layer l's forward steps: res[l] (B·T, C) in, res[l + 1] out, the activations in g.acts[l]. */
export function layerForward(g: GraphBuilder, l: number): Step[] {
  const a = g.acts[l], w = `h.${l}.`, n = `l${l}.`, { C, Cl } = g.dims, staged = geluStaging(g, a.fch);
  return [
    // ln1 = LN(res[l]); qkv = ln1·Wqkv + b (B·T, 3Cl); y = attention(qkv) (B·T, Cl) (+ lse)
    layernormForward(g, `${n}ln1`, g.res[l], w + "ln_1", a.ln1, a.ln1s),
    ...linear(g, `${n}qkv`, w + "attn.c_attn", { x: a.ln1, out: a.qkv, K: C, N: 3 * Cl }),
    attentionForward(g, l),
    // res2 = res[l] + drop(y·Wproj + b) (B·T, C): with tensor parallelism, allreduce then residual
    ...rowParallel(g, `${n}attn_proj`, w + "attn.c_proj", {
      x: a.atty,
      K: Cl,
      res: g.res[l],
      out: a.res2,
      site: dropoutSite.attnProj(l),
    }),
    // ln2 = LN(res2); fch = ln2·Wfc + b (B·T, 4Cl), and in training gelu(fch) into a scratch
    layernormForward(g, `${n}ln2`, a.res2, w + "ln_2", a.ln2, a.ln2s),
    ...linear(g, `${n}fc`, w + "mlp.c_fc", {
      x: a.ln2,
      out: a.fch,
      K: C,
      N: 4 * Cl,
      gelu: staged ?? undefined,
    }),
    // res[l + 1] = res2 + drop(gelu(fch)·Wfcproj + b), reading the staged gelu(fch), else applying
    // gelu as fch is loaded (never stored)
    ...rowParallel(g, `${n}fc_proj`, w + "mlp.c_proj", {
      x: staged ?? a.fch,
      K: 4 * Cl,
      res: a.res2,
      out: g.res[l + 1],
      site: dropoutSite.mlpProj(l),
      gelu: !staged,
    }),
  ];
}

/**
 * Layer l's backward steps: t.dres holds the gradient of res[l + 1] on entry and that of res[l] on
 * exit; the layer's weight gradients are final after them.
 */
export function layerBackward(g: GraphBuilder, t: Backprop, l: number): Step[] {
  const a = g.acts[l], w = `h.${l}.`, n = `l${l}.`, { BT, C, Cl } = g.dims;
  // Activation checkpointing: entering a group from its top, recompute its activations first.
  const s: Step[] = [...checkpointReplay(g, l)];
  // MLP output projection (+ residual): dres is the gradient of res[l+1]; d4 (B·T, 4Cl) through gelu.
  const dproj = dropoutBackward(g, t, s, `${n}mlp_drop.bwd`, dropoutSite.mlpProj(l));
  s.push(...linearBackward(g, t, `${n}fc_proj`, w + "mlp.c_proj", {
    x: a.fch,
    dy: dproj,
    dx: t.d4,
    K: 4 * Cl,
    N: C,
    gelu: true,
  }));
  // ln2's output, recomputed from res2 and its statistics (not stored).
  if (g.lnw) s.push(layernormForward(g, `${n}ln2.re`, a.res2, w + "ln_2", g.lnw, a.ln2s));
  s.push(
    ...linearBackward(g, t, `${n}fc`, w + "mlp.c_fc", { x: a.ln2, dy: t.d4, dx: t.dln, K: C, N: 4 * Cl }),
  );
  // Tensor parallelism: each rank's columns give a part of dln; sum them before the LayerNorm.
  if (g.tp.on) s.push(allreduce(`${n}fc.dx`, t.dln, BT * C));
  s.push(...layernormBackward(g, t, `${n}ln2.bwd`, t.dln, a.res2, a.ln2s, w + "ln_2", true));
  // Attention output projection (+ residual): dres is now the gradient of res2.
  const dap = dropoutBackward(g, t, s, `${n}attn_drop.bwd`, dropoutSite.attnProj(l));
  s.push(...linearBackward(g, t, `${n}attn_proj`, w + "attn.c_proj", {
    x: a.atty,
    dy: dap,
    dx: t.datty,
    K: Cl,
    N: C,
  }));
  // datty (B·T, Cl) through the attention into dqkv (B·T, 3Cl).
  s.push(...attentionBackward(g, t, l));
  // ln1's output, recomputed from res[l] and its statistics (not stored).
  if (g.lnw) s.push(layernormForward(g, `${n}ln1.re`, g.res[l], w + "ln_1", g.lnw, a.ln1s));
  s.push(
    ...linearBackward(g, t, `${n}qkv`, w + "attn.c_attn", {
      x: a.ln1,
      dy: t.dqkv,
      dx: t.dln,
      K: C,
      N: 3 * Cl,
    }),
  );
  // Tensor parallelism: each rank's heads give a part of dln, summed as above.
  if (g.tp.on) s.push(allreduce(`${n}qkv.dx`, t.dln, BT * C));
  s.push(...layernormBackward(g, t, `${n}ln1.bwd`, t.dln, g.res[l], a.ln1s, w + "ln_1", true));
  return s;
}

/**
 * Activation checkpointing: entering a group from its top (layer l), the forward of its layers
 * again from the group's input (the last group's activations are still in place). The group's
 * final output projection only rewrites the stored residual, so its steps are left out: the
 * matmul, and with tensor parallelism its exchange and residual kernel.
 */
export function checkpointReplay(g: GraphBuilder, l: number): Step[] {
  const size = g.groupSize, L = g.dims.L;
  if (size <= 0) return [];
  const group = Math.floor(l / size), lastGroup = Math.floor((L - 1) / size);
  if (group === lastGroup || (l % size !== size - 1 && l !== L - 1)) return [];
  const tail = g.tp.on ? 3 : 1;
  const steps: Step[] = [];
  for (let j = group * size; j <= l; j++) {
    steps.push(...(j === l ? g.layerSteps[j].slice(0, -tail) : g.layerSteps[j]));
  }
  return steps;
}

/** y (B·T, Cl), lse (B·T, Hl) = causal attention over qkv (B·T, 3Cl), this rank's heads. */
function attentionForward(g: GraphBuilder, l: number): Op {
  const a = g.acts[l], { B, T, Hl } = g.dims;
  const as = { ...g.attn, ...g.flashFwd, dropout: drop(g, g.attnDropout, dropoutSite.attnProbs(l)) };
  return op(
    g,
    "forward",
    "attention_fwd",
    `l${l}.attention`,
    attentionForwardWgsl(as),
    [whole(a.qkv), whole(a.atty), whole(a.lse)],
    [Math.ceil(T / as.BQ), Hl, B],
    { uniform: as.dropout ? dropSlot(g, as.dropout.site) : undefined, flops: attentionFlops(as) },
  );
}

/** dqkv (B·T, 3Cl) from datty (B·T, Cl): the rowwise delta, then dK/dV over keys and dQ over queries. */
function attentionBackward(g: GraphBuilder, t: Backprop, l: number): Op[] {
  const a = g.acts[l], { B, T, BT, Hl } = g.dims;
  const as = { ...g.attn, dropout: drop(g, g.attnDropout, dropoutSite.attnProbs(l)) };
  const u = { uniform: as.dropout ? dropSlot(g, as.dropout.site) : undefined };
  const av = [whole(a.qkv), whole(t.datty), whole(a.lse), whole(t.delta), whole(t.dqkv)];
  // With the dS scratch the dK/dV kernel also stores dS, and dQ = dS·K reads it (one product
  // instead of three, no shuffles); else the dQ kernel recomputes S, P and dP.
  const ds = g.dsScratch, kv = { ...as, writeDS: !!ds };
  const dq = ds
    ? op(
      g,
      "backward",
      "attention_bwd",
      `l${l}.attention.dq`,
      attentionBackwardQScoresWgsl(as, ds.tile),
      [
        whole(a.qkv),
        ds.view,
        whole(t.dqkv),
      ],
      [Math.ceil(T / ds.tile.BQ), Hl, B],
      { flops: 0.5 * attentionFlops(as) },
    )
    : op(g, "backward", "attention_bwd", `l${l}.attention.dq`, attentionBackwardQWgsl(as), av, [
      Math.ceil(T / backwardQSpec(as).BQ),
      Hl,
      B,
    ], { ...u, flops: 1.5 * attentionFlops(as) });
  return [
    op(g, "backward", "attention_bwd", `l${l}.attention.delta`, attentionDeltaWgsl(as), [
      whole(a.atty),
      whole(t.datty),
      whole(t.delta),
    ], grid1d(Math.ceil((BT * Hl) / 64), g.ctx.limits.maxComputeWorkgroupsPerDimension)),
    op(
      g,
      "backward",
      "attention_bwd",
      `l${l}.attention.dkv`,
      attentionBackwardKVWgsl(kv),
      ds ? [...av, ds.view] : av,
      [
        Math.ceil(T / backwardKVSpec(as).BKV),
        Hl,
        B,
      ],
      { ...u, flops: 2 * attentionFlops(as) },
    ),
    dq,
  ];
}

/**
 * The gradient of a residual branch through its dropout: t.dres masked into t.dtmp (the op pushed
 * onto `out`) when hidden dropout is on, else t.dres itself. Returns the buffer holding it.
 */
function dropoutBackward(g: GraphBuilder, t: Backprop, out: Step[], label: string, site: number): GPUBuffer {
  if (g.hiddenDropout <= 0) return t.dres;
  const { BT, C } = g.dims;
  out.push(
    op(
      g,
      "backward",
      "elementwise",
      label,
      dropoutMaskWgsl((BT * C) / 4),
      [
        whole(t.dres),
        whole(t.dtmp),
      ],
      elemGrid(g, (BT * C) / 4),
      { uniform: dropSlot(g, site) },
    ),
  );
  return t.dtmp;
}
