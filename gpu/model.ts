/**
 * The GPT-2 graph on the GPU: plans every buffer for a given batch and sequence length, then
 * builds the forward, backward and optimizer op lists once. A training step only writes the
 * tokens and per-step scalars and records these ops into one submission.
 *
 * Forward per layer l (residual stream res[l], all (B·T, C) unless noted):
 *   ln1 = LN(res[l]); qkv = ln1·Wqkv + b (B·T, 3C); y = attention(qkv) (+lse);
 *   res2 = res[l] + drop(y·Wproj + b); ln2 = LN(res2); fch = ln2·Wfc + b, fcg = gelu(fch) (B·T, 4C);
 *   res[l+1] = res2 + drop(fcg·Wfcproj + b)
 * then lnf = LN(res[L]), logits = lnf·wteᵀ (B·T, Vp), fused cross-entropy and its gradient.
 */

import { ConfigError, type ModelConfig, type ParamLayout, paramLayout, validateSeqLen } from "./config.ts";
import { createStorage, type GpuContext } from "./device.ts";
import { dropoutSite } from "./rng.ts";
import { makeOp, type Op, type OpKind, type Phase, PipelineCache, type View } from "./ops.ts";
import {
  chooseTile,
  matmulBindings,
  matmulFlops,
  matmulGrid,
  type MatmulSpec,
  matmulWgsl,
} from "./kernels/matmul.ts";
import {
  attentionBackwardKVWgsl,
  attentionBackwardQWgsl,
  attentionDeltaWgsl,
  attentionFlops,
  attentionForwardWgsl,
  type AttentionSpec,
  chooseAttentionSplit,
  chooseAttentionTiles,
  chooseSplitAttentionTiles,
} from "./kernels/attention.ts";
import {
  colsumPartialWgsl,
  layernormBackwardWgsl,
  layernormForwardWgsl,
  layernormParamPartialWgsl,
  lnBiasPartialOffset,
  reduceRowsWgsl,
  ROW_BLOCK,
} from "./kernels/layernorm.ts";
import { embeddingBackwardWgsl, embeddingForwardWgsl, WTE_PARTITIONS } from "./kernels/embedding.ts";
import { crossEntropyWgsl, meanLossWgsl } from "./kernels/cross_entropy.ts";
import {
  adamwWgsl,
  CONTROL_BYTES,
  gradNormPartialWgsl,
  NORM_GROUPS,
  OPT_UNIFORM_BYTES,
  stepControlWgsl,
} from "./kernels/adamw.ts";
import { dropoutMaskWgsl, grid1d } from "./kernels/common.ts";

/** Slots of the small stats buffer read back for logging. */
export const STAT = { loss: 0, gradNorm: 1, evalLoss: 2 } as const;

/** Shapes of one planned model. */
export interface ModelShape {
  config: ModelConfig;
  B: number;
  T: number;
  attnDropout: number;
  hiddenDropout: number;
}

/** Activations of one transformer block, each (B·T, ·). */
export interface LayerActs {
  ln1: GPUBuffer;
  ln1s: GPUBuffer;
  qkv: GPUBuffer;
  atty: GPUBuffer;
  lse: GPUBuffer;
  res2: GPUBuffer;
  ln2: GPUBuffer;
  ln2s: GPUBuffer;
  fch: GPUBuffer;
  fcg: GPUBuffer;
}

/** The planned model: buffers and op lists. */
export interface GpuModel {
  shape: ModelShape;
  layout: ParamLayout;
  /** Flat parameters (owned by the model unless passed in). */
  params: GPUBuffer;
  /** Gradients and AdamW moments: null for an inference-only plan. */
  grads: GPUBuffer | null;
  adamM: GPUBuffer | null;
  adamV: GPUBuffer | null;
  tokens: GPUBuffer;
  /** Per-layer activations of the last forward pass. */
  layers: LayerActs[];
  /** (B·T, Vp) logits of the last forward pass (overwritten by their gradient in training). */
  logits: GPUBuffer;
  stats: GPUBuffer;
  dropUniform: GPUBuffer;
  /** Optimizer hyperparameters, schedule and loss-scaler settings (see packOptimizerUniform). */
  optUniform: GPUBuffer;
  /** GPU-side step state: optimizer step, skipped-step counters, loss scale (see CONTROL_STRUCT). */
  control: GPUBuffer;
  nSites: number;
  forward: Op[];
  /** Loss (with gradient written into the logits) and the mean into STAT.loss. */
  loss: Op[];
  /** Loss without gradient, added into STAT.evalLoss (zeroed by the caller before a run of batches). */
  evalLoss: Op[];
  backward: Op[];
  optimizer: Op[];
  /** Bytes of GPU memory allocated. */
  memoryBytes: number;
  buffers: GPUBuffer[];
}

/** Checks that every buffer of the plan fits the device; throws ConfigError naming the field. */
export function checkFits(ctx: GpuContext, shape: ModelShape): void {
  const { config: c, B, T } = shape;
  validateSeqLen(c, T);
  if (!Number.isInteger(B) || B <= 0) {
    throw new ConfigError("batch_size", `must be a positive integer, got ${B}`);
  }
  const bind = ctx.limits.maxStorageBufferBindingSize;
  const logits = B * T * c.padded_vocab_size * 4;
  if (logits > bind) {
    throw new ConfigError(
      "batch_size",
      `logits of batch_size·seq_len·padded_vocab = ${B}·${T}·${c.padded_vocab_size} floats (${logits} bytes) ` +
        `exceed the device's storage binding limit of ${bind} bytes: lower batch_size or seq_len`,
    );
  }
  const params = paramLayout(c).totalSize * 4;
  if (params > bind) {
    throw new ConfigError(
      "n_layer",
      `parameters of ${params} bytes exceed the device's binding limit of ${bind} bytes`,
    );
  }
  if (B * T * 4 * c.n_embd * 4 > bind) {
    throw new ConfigError(
      "batch_size",
      `MLP activations of ${B * T * 4 * c.n_embd * 4} bytes exceed the binding limit ${bind}`,
    );
  }
  const D = c.n_embd / c.n_head;
  const tiles = chooseAttentionTiles({ T, D }, ctx.limits.maxComputeWorkgroupStorageSize);
  if (tiles.BKV < 8) {
    throw new ConfigError("n_embd", `head size ${D} needs more workgroup memory than the device has`);
  }
}

/**
 * Allocates all buffers and builds the op lists. With `train: false` only the forward pass and the
 * loss are planned (no gradients or optimizer state); `params` shares an existing parameter buffer.
 */
export async function buildModel(
  ctx: GpuContext,
  shape: ModelShape,
  opts: { train?: boolean; params?: GPUBuffer } = {},
): Promise<GpuModel> {
  checkFits(ctx, shape);
  const { config: c, B, T } = shape;
  const C = c.n_embd, L = c.n_layer, H = c.n_head, D = C / H, Vp = c.padded_vocab_size, BT = B * T;
  const layout = paramLayout(c);
  const cache = new PipelineCache(ctx);
  const buffers: GPUBuffer[] = [];
  let memoryBytes = 0;
  const alloc = async (label: string, floats: number) => {
    const b = await createStorage(ctx, label, Math.max(1, floats) * 4);
    buffers.push(b);
    memoryBytes += b.size;
    return b;
  };
  const train = opts.train ?? true;
  const params = opts.params ?? await alloc("params", layout.totalSize);
  const tokens = await alloc("tokens", B * (T + 1));
  const stats = await alloc("stats", 64);
  const nSites = dropoutSite.count(L);
  const dropUniform = ctx.device.createBuffer({
    label: "dropout",
    size: nSites * 16,
    usage: GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST,
  });
  const optUniform = ctx.device.createBuffer({
    label: "optimizer",
    size: OPT_UNIFORM_BYTES,
    usage: GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST,
  });
  buffers.push(dropUniform, optUniform);
  const control = await alloc("control", CONTROL_BYTES / 4);

  const res: GPUBuffer[] = [];
  for (let l = 0; l <= L; l++) res.push(await alloc(`res${l}`, BT * C));
  const acts: LayerActs[] = [];
  for (let l = 0; l < L; l++) {
    acts.push({
      ln1: await alloc(`l${l}.ln1`, BT * C),
      ln1s: await alloc(`l${l}.ln1s`, BT * 2),
      qkv: await alloc(`l${l}.qkv`, BT * 3 * C),
      atty: await alloc(`l${l}.atty`, BT * C),
      lse: await alloc(`l${l}.lse`, B * H * T),
      res2: await alloc(`l${l}.res2`, BT * C),
      ln2: await alloc(`l${l}.ln2`, BT * C),
      ln2s: await alloc(`l${l}.ln2s`, BT * 2),
      fch: await alloc(`l${l}.fch`, BT * 4 * C),
      fcg: await alloc(`l${l}.fcg`, BT * 4 * C),
    });
  }
  const lnf = await alloc("lnf", BT * C), lnfs = await alloc("lnfs", BT * 2);
  const logits = await alloc("logits", BT * Vp), losses = await alloc("losses", BT);

  const P = (name: string): View => {
    const t = layout.byName.get(name);
    if (!t) throw new Error(`Unknown parameter "${name}"`);
    return { buffer: params, offset: t.offset * 4, size: t.size * 4 };
  };
  const V = (buffer: GPUBuffer): View => ({ buffer });

  const op = async (
    phase: Phase,
    kind: OpKind,
    label: string,
    code: string,
    views: View[],
    grid: [number, number, number] | [number, number] | [number],
    o: { uniform?: GPUBuffer; flops?: number } = {},
  ) => makeOp(ctx, await cache.get(label, code), { label, phase, kind, views, grid, ...o });

  const drop = (p: number, site: number) => p > 0 ? { site, nSites } : undefined;
  const matmul = async (
    phase: Phase,
    label: string,
    spec: MatmulSpec,
    views: Record<string, View>,
  ) => {
    const tile = chooseTile(spec, ctx.limits.maxComputeInvocationsPerWorkgroup);
    return await op(
      phase,
      phase === "forward" ? "matmul_fwd" : "matmul_bwd",
      label,
      matmulWgsl(spec, tile),
      matmulBindings(spec).map((n) => views[n]),
      matmulGrid(spec, tile),
      { uniform: spec.dropout ? dropUniform : undefined, flops: matmulFlops(spec) },
    );
  };
  const mm = (M: number, N: number, K: number, transA = false, transB = false) => ({
    M,
    N,
    K,
    transA,
    transB,
    bias: false,
    epilogue: "store" as const,
  });
  const rowsGrid = grid1d(BT, ctx.limits.maxComputeWorkgroupsPerDimension);
  const elemGrid = (n4: number) => grid1d(Math.ceil(n4 / 64), ctx.limits.maxComputeWorkgroupsPerDimension);
  const split = chooseAttentionSplit(D, ctx.hasSubgroups);
  const wgBytes = ctx.limits.maxComputeWorkgroupStorageSize;
  const attn: AttentionSpec = {
    B,
    T,
    H,
    D,
    split,
    ...(split > 1
      ? chooseSplitAttentionTiles({ T, D }, wgBytes, split, ctx.limits.maxComputeInvocationsPerWorkgroup)
      : chooseAttentionTiles({ T, D }, wgBytes)),
  };
  const hidden = shape.hiddenDropout, ap = shape.attnDropout;

  // ---------------------------------------------------------------- forward
  const forward: Op[] = [];
  const emb = { B, T, C, dropout: hidden > 0 ? { nSites } : undefined };
  forward.push(
    await op(
      "forward",
      "embedding",
      "embedding_fwd",
      embeddingForwardWgsl(emb),
      [V(tokens), P("wte.weight"), P("wpe.weight"), V(res[0])],
      elemGrid((BT * C) / 4),
      { uniform: hidden > 0 ? dropUniform : undefined },
    ),
  );
  const lnFwd = (x: GPUBuffer, w: string, b: string, out: GPUBuffer, st: GPUBuffer, label: string) =>
    op("forward", "layernorm", label, layernormForwardWgsl(C), [V(x), P(w), P(b), V(out), V(st)], rowsGrid);
  for (let l = 0; l < L; l++) {
    const a = acts[l], p = `h.${l}.`;
    forward.push(await lnFwd(res[l], p + "ln_1.weight", p + "ln_1.bias", a.ln1, a.ln1s, `l${l}.ln1`));
    forward.push(
      await matmul("forward", `l${l}.qkv`, { ...mm(BT, 3 * C, C), bias: true }, {
        A: V(a.ln1),
        B: P(p + "attn.c_attn.weight"),
        bias: P(p + "attn.c_attn.bias"),
        out: V(a.qkv),
      }),
    );
    const as = { ...attn, dropout: drop(ap, dropoutSite.attnProbs(l)) };
    forward.push(
      await op(
        "forward",
        "attention_fwd",
        `l${l}.attention`,
        attentionForwardWgsl(as),
        [V(a.qkv), V(a.atty), V(a.lse)],
        [Math.ceil(T / as.BQ), H, B],
        { uniform: as.dropout ? dropUniform : undefined, flops: attentionFlops(as) },
      ),
    );
    forward.push(
      await matmul("forward", `l${l}.attn_proj`, {
        ...mm(BT, C, C),
        bias: true,
        epilogue: "residual",
        dropout: drop(hidden, dropoutSite.attnProj(l)),
      }, {
        A: V(a.atty),
        B: P(p + "attn.c_proj.weight"),
        bias: P(p + "attn.c_proj.bias"),
        res: V(res[l]),
        out: V(a.res2),
      }),
    );
    forward.push(await lnFwd(a.res2, p + "ln_2.weight", p + "ln_2.bias", a.ln2, a.ln2s, `l${l}.ln2`));
    forward.push(
      await matmul("forward", `l${l}.fc`, { ...mm(BT, 4 * C, C), bias: true, epilogue: "gelu" }, {
        A: V(a.ln2),
        B: P(p + "mlp.c_fc.weight"),
        bias: P(p + "mlp.c_fc.bias"),
        out: V(a.fch),
        out2: V(a.fcg),
      }),
    );
    forward.push(
      await matmul("forward", `l${l}.fc_proj`, {
        ...mm(BT, C, 4 * C),
        bias: true,
        epilogue: "residual",
        dropout: drop(hidden, dropoutSite.mlpProj(l)),
      }, {
        A: V(a.fcg),
        B: P(p + "mlp.c_proj.weight"),
        bias: P(p + "mlp.c_proj.bias"),
        res: V(a.res2),
        out: V(res[l + 1]),
      }),
    );
  }
  forward.push(await lnFwd(res[L], "ln_f.weight", "ln_f.bias", lnf, lnfs, "lnf"));
  forward.push(
    await matmul("forward", "lm_head", mm(BT, Vp, C, false, true), {
      A: V(lnf),
      B: P("wte.weight"),
      out: V(logits),
    }),
  );

  // ---------------------------------------------------------------- loss
  const ceSpec = { rows: BT, T, V: c.vocab_size, Vp };
  const loss = [
    await op(
      "forward",
      "cross_entropy",
      "cross_entropy",
      crossEntropyWgsl({ ...ceSpec, grad: true }),
      [
        V(logits),
        V(tokens),
        V(losses),
        V(control),
      ],
      rowsGrid,
      { uniform: optUniform },
    ),
    await op("forward", "cross_entropy", "mean_loss", meanLossWgsl(BT, STAT.loss), [V(losses), V(stats)], [
      1,
    ]),
  ];
  const evalLoss = [
    await op("forward", "cross_entropy", "cross_entropy_eval", crossEntropyWgsl({ ...ceSpec, grad: false }), [
      V(logits),
      V(tokens),
      V(losses),
    ], rowsGrid),
    await op("forward", "cross_entropy", "mean_eval_loss", meanLossWgsl(BT, STAT.evalLoss, true), [
      V(losses),
      V(stats),
    ], [1]),
  ];

  // ---------------------------------------------------------------- backward
  const backward: Op[] = [];
  let optimizer: Op[] = [];
  let trainBufs: { grads: GPUBuffer; adamM: GPUBuffer; adamV: GPUBuffer } | null = null;
  if (train) {
    const grads = await alloc("grads", layout.totalSize);
    const adamM = await alloc("adam.m", layout.totalSize);
    const adamV = await alloc("adam.v", layout.totalSize);
    // Backward scratch.
    const dres = await alloc("dres", BT * C), dtmp = await alloc("dtmp", BT * C);
    const dln = await alloc("dln", BT * C), datty = await alloc("datty", BT * C);
    const d4 = await alloc("d4c", BT * 4 * C), dqkv = await alloc("dqkv", BT * 3 * C);
    const delta = await alloc("delta", B * H * T);
    const blocks = Math.ceil(BT / ROW_BLOCK);
    const part = await alloc("partials", Math.max(blocks * 4 * C, 2 * lnBiasPartialOffset(C, BT)));
    const normPart = await alloc("normPart", NORM_GROUPS);
    const G = (name: string): View => {
      const t = layout.byName.get(name)!;
      return { buffer: grads, offset: t.offset * 4, size: t.size * 4 };
    };
    const colsum = async (label: string, src: GPUBuffer, N: number, out: View) => {
      backward.push(
        await op("backward", "reduce", label + ".part", colsumPartialWgsl(N, BT), [V(src), V(part)], [
          Math.ceil(N / 4 / 64),
          blocks,
        ]),
      );
      backward.push(
        await op("backward", "reduce", label + ".sum", reduceRowsWgsl(N, blocks), [
          { buffer: part, offset: 0, size: blocks * N * 4 },
          out,
        ], [Math.ceil(N / 4 / 64)]),
      );
    };
    const lnBwd = async (
      label: string,
      dy: GPUBuffer,
      x: GPUBuffer,
      st: GPUBuffer,
      w: string,
      b: string,
      accumulate: boolean,
    ) => {
      backward.push(
        await op("backward", "layernorm", label + ".dx", layernormBackwardWgsl(C, accumulate), [
          V(dy),
          V(x),
          P(w),
          V(st),
          V(dres),
        ], rowsGrid),
      );
      backward.push(
        await op("backward", "layernorm", label + ".dw_part", layernormParamPartialWgsl(C, BT), [
          V(dy),
          V(x),
          V(st),
          V(part),
        ], [Math.ceil(C / 4 / 64), blocks]),
      );
      const half = blocks * C * 4, dbOff = lnBiasPartialOffset(C, BT) * 4;
      backward.push(
        await op("backward", "reduce", label + ".dw", reduceRowsWgsl(C, blocks), [
          { buffer: part, offset: 0, size: half },
          G(w),
        ], [Math.ceil(C / 4 / 64)]),
      );
      backward.push(
        await op("backward", "reduce", label + ".db", reduceRowsWgsl(C, blocks), [
          { buffer: part, offset: dbOff, size: half },
          G(b),
        ], [Math.ceil(C / 4 / 64)]),
      );
    };
    const maskOrSelf = async (label: string, p: number, site: number): Promise<GPUBuffer> => {
      if (p <= 0) return dres;
      backward.push(
        await op(
          "backward",
          "elementwise",
          label,
          dropoutMaskWgsl((BT * C) / 4, site, nSites),
          [V(dres), V(dtmp)],
          elemGrid((BT * C) / 4),
          {
            uniform: dropUniform,
          },
        ),
      );
      return dtmp;
    };

    // LM head: dlnf = dlogits·wte; dwte = dlogitsᵀ·lnf (stored; the embedding adds to it later).
    backward.push(
      await matmul("backward", "lm_head.dx", mm(BT, C, Vp), {
        A: V(logits),
        B: P("wte.weight"),
        out: V(dln),
      }),
    );
    backward.push(
      await matmul("backward", "lm_head.dw", mm(Vp, C, BT, true, false), {
        A: V(logits),
        B: V(lnf),
        out: G("wte.weight"),
      }),
    );
    await lnBwd("lnf.bwd", dln, res[L], lnfs, "ln_f.weight", "ln_f.bias", false);
    for (let l = L - 1; l >= 0; l--) {
      const a = acts[l], p = `h.${l}.`;
      // MLP output projection (+ residual): dres is the gradient of res[l+1].
      const dproj = await maskOrSelf(`l${l}.mlp_drop.bwd`, hidden, dropoutSite.mlpProj(l));
      backward.push(
        await matmul("backward", `l${l}.fc_proj.dw`, mm(4 * C, C, BT, true, false), {
          A: V(a.fcg),
          B: V(dproj),
          out: G(p + "mlp.c_proj.weight"),
        }),
      );
      await colsum(`l${l}.fc_proj.db`, dproj, C, G(p + "mlp.c_proj.bias"));
      backward.push(
        await matmul("backward", `l${l}.fc_proj.dx`, {
          ...mm(BT, 4 * C, C, false, true),
          epilogue: "gelu_grad",
        }, {
          A: V(dproj),
          B: P(p + "mlp.c_proj.weight"),
          aux: V(a.fch),
          out: V(d4),
        }),
      );
      backward.push(
        await matmul("backward", `l${l}.fc.dw`, mm(C, 4 * C, BT, true, false), {
          A: V(a.ln2),
          B: V(d4),
          out: G(p + "mlp.c_fc.weight"),
        }),
      );
      await colsum(`l${l}.fc.db`, d4, 4 * C, G(p + "mlp.c_fc.bias"));
      backward.push(
        await matmul("backward", `l${l}.fc.dx`, mm(BT, C, 4 * C, false, true), {
          A: V(d4),
          B: P(p + "mlp.c_fc.weight"),
          out: V(dln),
        }),
      );
      await lnBwd(`l${l}.ln2.bwd`, dln, a.res2, a.ln2s, p + "ln_2.weight", p + "ln_2.bias", true);
      // Attention output projection (+ residual): dres is now the gradient of res2.
      const dap = await maskOrSelf(`l${l}.attn_drop.bwd`, hidden, dropoutSite.attnProj(l));
      backward.push(
        await matmul("backward", `l${l}.attn_proj.dw`, mm(C, C, BT, true, false), {
          A: V(a.atty),
          B: V(dap),
          out: G(p + "attn.c_proj.weight"),
        }),
      );
      await colsum(`l${l}.attn_proj.db`, dap, C, G(p + "attn.c_proj.bias"));
      backward.push(
        await matmul("backward", `l${l}.attn_proj.dx`, mm(BT, C, C, false, true), {
          A: V(dap),
          B: P(p + "attn.c_proj.weight"),
          out: V(datty),
        }),
      );
      const as = { ...attn, dropout: drop(ap, dropoutSite.attnProbs(l)) };
      const u = { uniform: as.dropout ? dropUniform : undefined };
      backward.push(
        await op("backward", "attention_bwd", `l${l}.attention.delta`, attentionDeltaWgsl(as), [
          V(a.atty),
          V(datty),
          V(delta),
        ], grid1d(Math.ceil((BT * H) / 64), ctx.limits.maxComputeWorkgroupsPerDimension)),
      );
      const av = [V(a.qkv), V(datty), V(a.lse), V(delta), V(dqkv)];
      backward.push(
        await op("backward", "attention_bwd", `l${l}.attention.dkv`, attentionBackwardKVWgsl(as), av, [
          Math.ceil(T / as.BKV),
          H,
          B,
        ], { ...u, flops: 2 * attentionFlops(as) }),
      );
      backward.push(
        await op("backward", "attention_bwd", `l${l}.attention.dq`, attentionBackwardQWgsl(as), av, [
          Math.ceil(T / as.BQ),
          H,
          B,
        ], { ...u, flops: 1.5 * attentionFlops(as) }),
      );
      backward.push(
        await matmul("backward", `l${l}.qkv.dw`, mm(C, 3 * C, BT, true, false), {
          A: V(a.ln1),
          B: V(dqkv),
          out: G(p + "attn.c_attn.weight"),
        }),
      );
      await colsum(`l${l}.qkv.db`, dqkv, 3 * C, G(p + "attn.c_attn.bias"));
      backward.push(
        await matmul("backward", `l${l}.qkv.dx`, mm(BT, C, 3 * C, false, true), {
          A: V(dqkv),
          B: P(p + "attn.c_attn.weight"),
          out: V(dln),
        }),
      );
      await lnBwd(`l${l}.ln1.bwd`, dln, res[l], a.ln1s, p + "ln_1.weight", p + "ln_1.bias", true);
    }
    backward.push(
      await op(
        "backward",
        "embedding",
        "embedding_bwd",
        embeddingBackwardWgsl(emb),
        [
          V(tokens),
          V(dres),
          G("wte.weight"),
          G("wpe.weight"),
        ],
        elemGrid(((T + WTE_PARTITIONS) * C) / 4),
        { uniform: hidden > 0 ? dropUniform : undefined },
      ),
    );

    // ---------------------------------------------------------------- optimizer
    const n4 = layout.totalSize / 4;
    optimizer = [
      await op("optimizer", "optimizer", "grad_norm.part", gradNormPartialWgsl(n4), [V(grads), V(normPart)], [
        NORM_GROUPS,
      ]),
      await op(
        "optimizer",
        "optimizer",
        "step_control",
        stepControlWgsl(NORM_GROUPS, STAT.loss, STAT.gradNorm),
        [V(normPart), V(stats), V(control)],
        [1],
        { uniform: optUniform },
      ),
      await op(
        "optimizer",
        "optimizer",
        "adamw",
        adamwWgsl(n4, layout.decayEnd / 4),
        [V(params), V(grads), V(adamM), V(adamV), V(control)],
        grid1d(Math.ceil(n4 / 256), ctx.limits.maxComputeWorkgroupsPerDimension),
        { uniform: optUniform },
      ),
    ];
    trainBufs = { grads, adamM, adamV };
  }

  return {
    shape,
    layout,
    params,
    grads: trainBufs?.grads ?? null,
    adamM: trainBufs?.adamM ?? null,
    adamV: trainBufs?.adamV ?? null,
    tokens,
    layers: acts,
    logits,
    stats,
    dropUniform,
    optUniform,
    control,
    nSites,
    forward,
    loss,
    evalLoss,
    backward,
    optimizer,
    memoryBytes,
    buffers,
  };
}

/** Frees every buffer of the model. */
export function destroyModel(m: GpuModel): void {
  for (const b of m.buffers) b.destroy();
  m.buffers.length = 0;
}
