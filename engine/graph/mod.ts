/**
 * The GPT-2 graph on the GPU: plans every buffer for a given batch and sequence length, then
 * builds the forward, backward and optimizer op lists once. A training step only writes the
 * tokens and per-step scalars and records these ops into one submission.
 *
 * `buildModel` composes the blocks in the order their kernels run, as llm.c's gpt2_forward and
 * gpt2_backward do: embedding (embedding_block.ts), L layers (layer.ts), final LayerNorm, LM head
 * and loss (head.ts); backward the same in reverse; then the optimizer (optimizer.ts). The blocks
 * share one builder (builder.ts), which holds the plan's buffers and defers each op into one batch
 * compiled at the end.
 *
 * Nothing binds more than the device allows: the flat parameter, gradient and moment arrays are
 * split into segments (engine/flat.ts) that the optimizer walks one by one, and the LM head with its
 * cross-entropy runs over chunks of rows, each chunk's logits computed, turned into their gradient
 * and pushed back through the head before the next (so the logits take one chunk of memory).
 */

import { type GpuContext, isCpuAdapter } from "../device.ts";
import type { Op, OpBatch } from "../ops.ts";
import { type Backprop, createBackprop, createBuilder, type GraphBuilder } from "./builder.ts";
import { type GpuModel, type GraphOptions, type ModelShape, opsOf, type Step } from "./program.ts";
import { embeddingBackward, embeddingForward } from "./embedding_block.ts";
import { layerBackward, layerForward } from "./layer.ts";
import { evalLoss, headBackward, headForward, inferenceLoss, writeChunkRows } from "./head.ts";
import { castWeights, checksumSteps, optimizerSteps } from "./optimizer.ts";

export { checkFits, CPU_MATMUL_MIN_MACS, createBufferPool } from "./builder.ts";
export {
  type BufferPool,
  type BuildOptions,
  type GpuModel,
  type GraphOptions,
  isSync,
  type LayerActs,
  type ModelShape,
  STAT,
  type Step,
  type Sync,
} from "./program.ts";

/**
 * Allocates all buffers and builds the op lists. With `train: false` only the forward pass and the
 * loss are planned (no gradients or optimizer state); `params` shares an existing parameter buffer.
 */
export async function buildModel(
  ctx: GpuContext,
  shape: ModelShape,
  opts: GraphOptions = {},
): Promise<GpuModel> {
  const g = await createBuilder(ctx, shape, opts);
  const L = g.dims.L;
  const forward = embeddingForward(g);
  for (let l = 0; l < L; l++) {
    g.layerSteps.push(layerForward(g, l));
    forward.push(...g.layerSteps[l]);
  }
  const hidden = opts.hiddenOnly === true;
  forward.push(...headForward(g, !hidden));
  let loss = g.train || hidden ? [] : inferenceLoss(g);
  const evalSteps = hidden ? [] : evalLoss(g);
  const cast = castWeights(g);
  const backward: Step[] = [], backwardMarks: { layer: number; at: number }[] = [];
  let optimizer: Step[] = [], checksum: Op[] = [], t: Backprop | null = null;
  let checksumBatch: OpBatch | null = null, checksumReady: Promise<void> | null = null;
  if (g.train) {
    t = createBackprop(g);
    const head = headBackward(g, t);
    loss = head.loss;
    backward.push(...head.backward);
    for (let l = L - 1; l >= 0; l--) {
      backward.push(...layerBackward(g, t, l));
      backwardMarks.push({ layer: l, at: opsOf(backward).length });
    }
    backward.push(embeddingBackward(g, t));
    optimizer = optimizerSteps(g, t, cast);
    // The checksum goes into a batch of its own, compiled on first use (compileChecksum).
    const main = g.batch;
    g.batch = checksumBatch = g.cache.batch();
    checksum = checksumSteps(g, t);
    g.batch = main;
  }
  await compile(g);
  writeChunkRows(g);
  return {
    shape,
    layout: g.layout,
    params: g.params,
    grads: t?.grads ?? null,
    adamM: t?.adamM ?? null,
    adamV: t?.adamV ?? null,
    headRows: g.plan.headRows,
    tokens: g.tokens,
    layers: g.acts,
    lnf: g.lnf,
    logits: g.logits,
    stats: g.stats,
    dropUniform: g.dropUniform,
    optUniform: g.optUniform,
    control: g.control,
    nSites: g.nSites,
    forward: opsOf(forward),
    loss: opsOf(loss),
    evalLoss: opsOf(evalSteps),
    backward: opsOf(backward),
    backwardMarks,
    optimizer: opsOf(optimizer),
    program: { forward, loss, evalLoss: evalSteps, backward, optimizer },
    tensorParallel: { rank: g.tp.rank, size: g.tp.size },
    castWeights: cast,
    checksum,
    compileChecksum: () => checksumReady ??= checksumBatch?.compile() ?? Promise.resolve(),
    checksumParts: t?.normPart ?? null,
    memoryBytes: g.memoryBytes,
    microBatches: g.microBatches,
    dataParallel: g.dataParallel,
    buffers: g.buffers,
    uniforms: [...g.dimsUniforms.values()],
    plan: g.plan,
  };
}

/**
 * Compiles every kernel of the build, against a known total (the buffers are freed if one fails).
 * On a CPU adapter each is also dispatched once, since Mesa compiles at the first dispatch: on
 * buffers that hold nothing yet (a shared parameter buffer only feeds a forward pass, which never
 * writes it), cleared again after.
 */
async function compile(g: GraphBuilder): Promise<void> {
  const { ctx, opts, train, buffers } = g;
  const warm = isCpuAdapter(ctx) && (!opts.params || !train);
  try {
    await g.batch.compile(opts.onCompile, warm);
  } catch (e) {
    for (const b of [...buffers, ...g.dimsUniforms.values()]) b.destroy();
    throw e;
  }
  if (warm) {
    const enc = ctx.device.createCommandEncoder();
    for (const b of buffers) enc.clearBuffer(b);
    ctx.device.queue.submit([enc.finish()]);
  }
}

/** Frees every buffer of the model. */
export function destroyModel(m: GpuModel): void {
  for (const b of [...m.buffers, ...m.uniforms]) b.destroy();
  m.buffers.length = 0;
  m.uniforms.length = 0;
}
