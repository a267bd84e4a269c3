/**
 * The input of the graph: res[0] (B·T, C) = drop(wte[tokens] + wpe[positions]), and its backward
 * into the two tables. With tensor parallelism the lookup is vocabulary-parallel: each rank adds
 * its rows' embeddings (rank 0 also the positions), the sum is allreduced, then dropped out as
 * the fused kernel does on one GPU.
 */

import { dropoutSite } from "../../model/rng.ts";
import type { Op } from "../ops.ts";
import { embeddingBackwardWgsl, embeddingForwardWgsl, WTE_PARTITIONS } from "../kernels/embedding.ts";
import { dropoutMaskWgsl } from "../kernels/common.ts";
import {
  allreduce,
  type Backprop,
  dropSlot,
  elemGrid,
  gradView,
  type GraphBuilder,
  op,
  param,
  whole,
} from "./builder.ts";
import { type Step } from "./program.ts";

/** The embedding kernels' spec (forward dropout only where the kernel applies it). */
function embeddingSpec(g: GraphBuilder) {
  const { B, T, C, Vl, vlo } = g.dims, tp = g.tp.on;
  return {
    B,
    T,
    C,
    dropout: g.hiddenDropout > 0 && !tp ? { nSites: g.nSites } : undefined,
    accumulate: g.accumulate,
    ...(tp ? { vocab: { lo: vlo, rows: Vl }, positions: g.tp.rank === 0 } : {}),
  };
}

/** res[0] (B·T, C) from the tokens (B, T). */
export function embeddingForward(g: GraphBuilder): Step[] {
  const { BT, C } = g.dims, emb = embeddingSpec(g), dropped = g.tp.on && g.hiddenDropout > 0;
  const out = dropped ? g.partial! : g.res[0];
  const steps: Step[] = [
    op(
      g,
      "forward",
      "embedding",
      "embedding_fwd",
      embeddingForwardWgsl(emb),
      [whole(g.tokens), param(g, "wte.weight"), param(g, "wpe.weight"), whole(out)],
      elemGrid(g, (BT * C) / 4),
      { uniform: emb.dropout ? dropSlot(g, dropoutSite.embedding) : undefined },
    ),
  ];
  if (!g.tp.on) return steps;
  steps.push(allreduce("embedding", out, BT * C));
  if (dropped) {
    steps.push(
      op(
        g,
        "forward",
        "embedding",
        "embedding_drop",
        dropoutMaskWgsl((BT * C) / 4),
        [whole(g.partial!), whole(g.res[0])],
        elemGrid(g, (BT * C) / 4),
        { uniform: dropSlot(g, dropoutSite.embedding) },
      ),
    );
  }
  return steps;
}

/** The gradients of wte and wpe from t.dres, the gradient of res[0] (wte's adds to the LM head's). */
export function embeddingBackward(g: GraphBuilder, t: Backprop): Op {
  const { T, C } = g.dims, hidden = g.hiddenDropout > 0;
  return op(
    g,
    "backward",
    "embedding",
    "embedding_bwd",
    // The gradient passes the embedding dropout's mask (applied after the allreduce with TP).
    embeddingBackwardWgsl({ ...embeddingSpec(g), dropout: hidden ? { nSites: g.nSites } : undefined }),
    [whole(g.tokens), whole(t.dres), gradView(g, t, "wte.weight"), gradView(g, t, "wpe.weight")],
    elemGrid(g, ((T + WTE_PARTITIONS) * C) / 4),
    { uniform: hidden ? dropSlot(g, dropoutSite.embedding) : undefined },
  );
}
