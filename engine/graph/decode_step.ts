/**
 * The GPT-2 graph of generation beside the training graph: one decode step for S streams (embed
 * each stream's last token, L layers, final LayerNorm, LM head, sampling on the GPU), and the tail
 * a prefill appends to the training graph's forward pass (layer.ts, planned without gradients):
 * each layer's KV write into the cache, a gathered LM head over each prompt's last row, sampling.
 *
 * A decode layer reads as layerForward does (qkv, attention, projection, MLP), but over a handful
 * of rows its kernels differ: skinny gemv with a reduce pass, the LayerNorm normalised in the
 * gemv's prologue, and attention over the cache that first reduces the qkv gemv's partial sums
 * and writes the row's K and V into the cache (kernels/decode.ts, kernels/gemv.ts). Sharing layerForward's steps would change those
 * kernels, so a decode layer is written here, once, for every batch bucket; the prefill shares
 * layerForward with training.
 */

import type { ModelConfig } from "../../model/config.ts";
import type { GpuContext } from "../device.ts";
import type { Op, OpKind, View } from "../ops.ts";
import { chooseTile, matmulBindings, matmulGrid, type MatmulSpec, matmulWgsl } from "../kernels/matmul.ts";
import { layernormForwardWgsl } from "../kernels/layernorm.ts";
import {
  attentionDecodeWgsl,
  type DecodeSpec,
  embedDecodeWgsl,
  kvWriteWgsl,
  SEL_WORDS,
} from "../kernels/decode.ts";
import { sampleWgsl } from "../kernels/sample.ts";
import {
  GEMV_T_MAX_ROWS,
  GEMV_TRANSPOSED_COLUMNS,
  GEMV_TRANSPOSED_ROWS,
  type GemvEpilogue,
  gemvGroupRows,
  gemvKSplit,
  gemvPartialWgsl,
  gemvReduceBindings,
  gemvReduceWgsl,
  gemvRowGroups,
  type GemvSpec,
  gemvTColumns,
  gemvTLanes,
  gemvTransposedWgsl,
  type GemvTSpec,
  gemvTuning,
  gemvTWgsl,
  gemvUboLayerWgsl,
  type GemvUboSpec,
  gemvUboWgsl,
  gemvWorkgroupBytes,
} from "../kernels/gemv.ts";
import { grid1d, UNIFORM_BINDING_BYTES } from "../kernels/common.ts";

/**
 * The decode activations: one row per stream (x, x2, y: (S, C); fch, fcg: (S, 4C)). qkv stays in
 * `part` as the gemv's partial sums: the decode attention reduces it.
 */
export interface DecodeActs {
  x: GPUBuffer;
  x2: GPUBuffer;
  /** The final LayerNorm's output (S, C) and its statistics (S, 2). */
  ln: GPUBuffer;
  stats: GPUBuffer;
  y: GPUBuffer;
  fch: GPUBuffer;
  fcg: GPUBuffer;
  /** (max(S, prefill prompts), Vp). */
  logits: GPUBuffer;
  /** The gemv's partial sums over K splits. */
  part: GPUBuffer;
  /** The fc gemv's partial sums, which the fcproj gemv reduces (decodeMlp). */
  fcPart: GPUBuffer;
  /**
   * Where residualFused: the qkv gemv's partial sums, which the decode attention reduces (part
   * then holds the proj and fcproj partial sums that the next gemv reduces). Otherwise unused.
   */
  qkvPart: GPUBuffer;
}

/** CPU adapters: wte in uniform blocks of BC columns (gemvUboWgsl), NB bound per dispatch. */
export interface UboHead {
  blocks: GPUBuffer;
  base: GPUBuffer;
  align: number;
  BC: number;
  NB: number;
  count: number;
}

/**
 * CPU adapters: the layers' weights in uniform slices (gemvUboLayerWgsl) by weight name: the
 * slices' and the LayerNorm's ranges in `buffer`, and rows per slice.
 */
export interface UboLayers {
  buffer: GPUBuffer;
  byWeight: Map<string, { R: number; slices: View[]; ln: View | null }>;
}

/** The KV cache: per layer, keys and values of every slot ((slots, n_positions, C) each). */
export interface KvCache {
  kc: GPUBuffer[];
  vc: GPUBuffer[];
}

/** What the generation graph is built over (engine/generate/gen_buffers.ts provides it). */
export interface DecodeGraph {
  readonly ctx: GpuContext;
  readonly config: ModelConfig;
  readonly opts: {
    chunk: number;
    directSampler: boolean;
    kernels: { residualRows?: number; writtenSampler?: boolean };
  };
  /** A CPU adapter: kernels without barriers, serial reductions. */
  readonly cpu: boolean;
  /** The LM head runs CPU adapters' kernels (wteT, ubo, per-thread gemvT). */
  readonly cpuHead: boolean;
  readonly acts: DecodeActs;
  /** Each row's state, sampling parameters, chunk tokens and logprobs; the prefill's selection. */
  readonly state: GPUBuffer;
  readonly sampling: GPUBuffer;
  readonly out: GPUBuffer;
  readonly lp: GPUBuffer;
  readonly sel: GPUBuffer;
  readonly wteT: GPUBuffer | null;
  /** wte in f16 for the decode LM head (packF16), or null: it reads wte. */
  readonly wte16: GPUBuffer | null;
  readonly ubo: UboHead | null;
  readonly uboW: UboLayers | null;
  op(
    kind: OpKind,
    label: string,
    code: string,
    views: View[],
    grid: [number, number, number] | [number, number] | [number],
  ): Promise<Op>;
  /** A parameter tensor by name. */
  P(name: string): View;
}

const V = (buffer: GPUBuffer): View => ({ buffer });

/** One decode step for S rows: embed, the layers, final LayerNorm, LM head, sample. */
export async function decodeStep(g: DecodeGraph, kv: KvCache, S: number): Promise<Op[]> {
  const c = g.config, a = g.acts, C = c.n_embd;
  const spec: DecodeSpec = { S, H: c.n_head, D: C / c.n_head, Tmax: c.n_positions };
  const ops: Op[] = [];
  ops.push(
    await g.op("embedding", "dec.embed", embedDecodeWgsl(spec), [
      V(g.state),
      g.P("wte.weight"),
      g.P("wpe.weight"),
      V(a.x),
    ], [Math.ceil((S * C) / 4 / 64)]),
  );
  for (let l = 0; l < c.n_layer; l++) ops.push(...await decodeLayer(g, kv, l, S));
  ops.push(
    await g.op("layernorm", "dec.lnf", layernormForwardWgsl(C), [
      V(a.x),
      g.P("ln_f.weight"),
      g.P("ln_f.bias"),
      V(a.ln),
      V(a.stats),
    ], [S]),
  );
  if (g.ubo && S * C * 4 <= UNIFORM_BINDING_BYTES) {
    ops.push(...await lmHeadUbo(g, "dec.lm_head", S, a.ln));
  } else ops.push(await lmHead(g, "dec.lm_head", S, a.ln, false));
  ops.push(await sampleStep(g, "dec.sample", S, "stream"));
  return ops;
}

/**
 * Whether a decode step of S rows leaves its two residual reduces (x2 = x + y·Wproj + b, and x =
 * x2 + fcg·Wfcproj + b) to the gemv that normalises their output next (gemv lnOf: the fc gemv, and
 * the next layer's qkv gemv), two kernels a layer fewer: at most `kernels.residualRows` rows
 * (GeneratorOptions; each workgroup of those gemvs sums its rows' partial sums once, work that
 * grows with the rows: on an H200, 4 rows ran 12% slower this way), GPU kernels (not the
 * uniform-slice weights), and the rows fitting in workgroup memory.
 */
export function residualFused(g: DecodeGraph, S: number): boolean {
  if (S > (g.opts.kernels.residualRows ?? 0) || g.uboW) return false;
  const C = g.config.n_embd, tune = gemvTuning(S);
  const worst: GemvSpec = {
    M: S,
    N: 4 * C,
    K: C,
    bias: true,
    epilogue: "gelu",
    KS: 1,
    ln: true,
    lnOf: { KS: 1 },
    staged: !g.cpu && tune.staged,
    groupRows: tune.groupRows,
  };
  return gemvWorkgroupBytes(worst) <= g.ctx.limits.maxComputeWorkgroupStorageSize;
}

/**
 * Layer l of a decode step: x (S, C) in, x out (through x2), the K and V rows into the cache.
 * Where residualFused, layer l > 0 finds x as the previous layer's fcproj partial sums in
 * acts.part (its qkv gemv reduces them and writes x), and the last layer alone reduces its fcproj
 * into x for the final LayerNorm.
 */
export async function decodeLayer(g: DecodeGraph, kv: KvCache, l: number, S: number): Promise<Op[]> {
  const c = g.config, a = g.acts, C = c.n_embd, H = c.n_head;
  const spec: DecodeSpec = { S, H, D: C / H, Tmax: c.n_positions };
  const p = `h.${l}.`, base = { transA: false, transB: false, bias: true } as const;
  const fused = residualFused(g, S);
  // The previous layer's fcproj reduce, done here when fused: x = x2 + (Σ + b), then LN1.
  const inFromParts = fused && l > 0
    ? { KS: gemvKSplit(C, 4 * C, S), res: V(a.x2), bias: g.P(`h.${l - 1}.mlp.c_proj.bias`), out: V(a.x) }
    : undefined;
  // qkv = LN1(x)·Wqkv + b (S, 3C), the LayerNorm in the gemv's prologue: its K-split partial sums
  const qkvPart = fused ? a.qkvPart : a.part;
  const qkv = await decodeLinear(
    g,
    `dec.l${l}.qkv`,
    { ...base, M: S, N: 3 * C, K: C, epilogue: "store" },
    p + "attn.c_attn.weight",
    { A: V(inFromParts ? a.part : a.x), bias: g.P(p + "attn.c_attn.bias") },
    { ln: [p + "ln_1.weight", p + "ln_1.bias"], partialOnly: true, part: qkvPart, lnOf: inFromParts },
  );
  // x2 = x + y·Wproj + b (fused: left as partial sums in acts.part for the fc gemv to reduce)
  const proj = await decodeLinear(
    g,
    `dec.l${l}.proj`,
    { ...base, M: S, N: C, K: C, epilogue: "residual" },
    p + "attn.c_proj.weight",
    { A: V(a.y), bias: g.P(p + "attn.c_proj.bias"), res: V(a.x), out: V(a.x2) },
    { partialOnly: fused },
  );
  return [
    ...qkv.ops,
    // y = attention of each row's query over its stream's cache (S, C); it sums qkv's partials,
    // adds the bias and appends the row's key and value to the cache first
    await g.op("attention_fwd", `dec.l${l}.attn`, attentionDecodeWgsl(spec, { KS: qkv.spec.KS }), [
      V(g.state),
      V(qkvPart),
      g.P(p + "attn.c_attn.bias"),
      V(kv.kc[l]),
      V(kv.vc[l]),
      V(a.y),
    ], [S, H]),
    ...proj.ops,
    ...await decodeMlp(g, l, S, fused ? proj.spec.KS : 0),
  ];
}

/**
 * The MLP of layer l: x = x2 + gelu(LN2(x2)·Wfc + b)·Wfcproj + b. On GPUs the fc gemv's partial
 * sums go to acts.fcPart and the fcproj gemv reduces them, adds the bias and applies GELU as it
 * stages its input (no fc reduce kernel); where fcproj reads its input as uniforms (CPU adapters'
 * gemvUboLayerWgsl) the fc reduce stores fcg first. `projKS` > 0 (residualFused): x2 is still the
 * proj gemv's partial sums in acts.part, which the fc gemv reduces (writing x2), and the fcproj
 * reduce is left to the next layer's qkv gemv (but in the last layer).
 */
async function decodeMlp(g: DecodeGraph, l: number, S: number, projKS: number): Promise<Op[]> {
  const a = g.acts, C = g.config.n_embd, p = `h.${l}.`;
  const base = { transA: false, transB: false, bias: true } as const;
  const fcSpec: MatmulSpec = { ...base, M: S, N: 4 * C, K: C, epilogue: "gelu" };
  const projSpec: MatmulSpec = { ...base, M: S, N: C, K: 4 * C, epilogue: "residual" };
  const fused = !uboOf(g, p + "mlp.c_proj.weight", projSpec);
  const inFromParts = projKS > 0
    ? { KS: projKS, res: V(a.x), bias: g.P(p + "attn.c_proj.bias"), out: V(a.x2) }
    : undefined;
  // fch = LN2(x2)·Wfc + b (S, 4C), fcg = gelu(fch)
  const fc = await decodeLinear(
    g,
    `dec.l${l}.fc`,
    fcSpec,
    p + "mlp.c_fc.weight",
    { A: V(inFromParts ? a.part : a.x2), bias: g.P(p + "mlp.c_fc.bias"), out: V(a.fch), out2: V(a.fcg) },
    {
      ln: [p + "ln_2.weight", p + "ln_2.bias"],
      lnOf: inFromParts,
      ...(fused ? { partialOnly: true, part: a.fcPart } : {}),
    },
  );
  // x = x2 + fcg·Wfcproj + b
  const proj = await decodeLinear(
    g,
    `dec.l${l}.fcproj`,
    projSpec,
    p + "mlp.c_proj.weight",
    { A: V(fused ? a.fcPart : a.fcg), bias: g.P(p + "mlp.c_proj.bias"), res: V(a.x2), out: V(a.x) },
    {
      ...(fused ? { geluOf: { KS: fc.spec.KS, bias: g.P(p + "mlp.c_fc.bias") } } : {}),
      partialOnly: projKS > 0 && l < g.config.n_layer - 1,
    },
  );
  return [...fc.ops, ...proj.ops];
}

/** The uniform-slice weights of `weight` where its gemv reads them (CPU adapters), else undefined. */
function uboOf(g: DecodeGraph, weight: string, s: MatmulSpec) {
  const u = g.uboW?.byWeight.get(weight);
  return u !== undefined && s.M * s.K * 4 <= UNIFORM_BINDING_BYTES ? u : undefined;
}

/**
 * One linear layer of weight `weight`: on GPUs the skinny gemv (row groups of 8 beyond 8 rows),
 * on CPU adapters the uniform-slice gemv where its weight was copied (gemvUboLayerWgsl); then the
 * reduce kernel. `fuse.ln` names the LayerNorm before it (views.A is then its raw input,
 * normalised in the prologue); `fuse.partialOnly` leaves the partial sums in acts.part for the
 * next kernel to reduce (the decode attention does qkv's). Returns the ops and the gemv's spec.
 */
async function decodeLinear(
  g: DecodeGraph,
  label: string,
  s: MatmulSpec,
  weight: string,
  views: Record<string, View>,
  fuse: {
    ln?: [string, string];
    partialOnly?: boolean;
    /** Where the partial sums go (default acts.part). */
    part?: GPUBuffer;
    /** views.A is the previous gemv's partial sums, reduced with this bias and GELU as staged. */
    geluOf?: { KS: number; bias: View };
    /**
     * With ln: views.A is the previous gemv's partial sums; the rows normalised are res + (Σ +
     * bias), written to `out` too (gemv lnOf).
     */
    lnOf?: { KS: number; res: View; bias: View; out: View };
  } = {},
): Promise<{ ops: Op[]; spec: GemvSpec }> {
  const a = g.acts;
  const u = uboOf(g, weight, s);
  const ubo = u !== undefined;
  if (ubo && (fuse.geluOf || fuse.lnOf)) {
    throw new RangeError(`${label}: a uniform-slice gemv cannot reduce its input`);
  }
  const tune = gemvTuning(s.M);
  const spec: GemvSpec = {
    M: s.M,
    N: s.N,
    K: s.K,
    bias: s.bias,
    epilogue: s.epilogue as GemvEpilogue,
    KS: ubo ? 1 : gemvKSplit(s.N, s.K, s.M, tune),
    ln: !!fuse.ln,
    geluOf: fuse.geluOf ? { KS: fuse.geluOf.KS } : undefined,
    lnOf: fuse.lnOf ? { KS: fuse.lnOf.KS } : undefined,
    // A reduced input is always staged (each value summed once per workgroup).
    staged: !!fuse.geluOf || (!g.cpu && tune.staged),
    ...(ubo ? {} : { unroll: tune.unroll, groupRows: tune.groupRows }),
  };
  const part = V(fuse.part ?? a.part);
  const all: Record<string, View> = { ...views, B: g.P(weight), part };
  const partial = ubo
    ? await g.op(
      "matmul_fwd",
      label + ".gemv",
      gemvUboLayerWgsl({ M: s.M, N: s.N, K: s.K, R: u.R, ln: !!fuse.ln }),
      [
        { buffer: views.A.buffer, offset: 0, size: s.M * s.K * 4 },
        part,
        ...(fuse.ln && u.ln ? [u.ln] : []),
        ...u.slices,
      ],
      [Math.ceil(s.N / 4 / 64)],
    )
    : await g.op(
      "matmul_fwd",
      label + ".gemv",
      gemvPartialWgsl(spec),
      [
        all.A,
        all.B,
        all.part,
        ...(fuse.ln ? [g.P(fuse.ln[0]), g.P(fuse.ln[1])] : []),
        ...(fuse.geluOf ? [fuse.geluOf.bias] : []),
        ...(fuse.lnOf ? [fuse.lnOf.res, fuse.lnOf.bias, fuse.lnOf.out] : []),
      ],
      [Math.ceil(s.N / 128), spec.KS, gemvRowGroups(s.M, gemvGroupRows(spec))],
    );
  if (fuse.partialOnly) return { ops: [partial], spec };
  const sum = await g.op(
    "matmul_fwd",
    label + ".sum",
    gemvReduceWgsl(spec),
    gemvReduceBindings(spec).map((n) => all[n]),
    [Math.ceil((s.M * s.N) / 4 / 64)],
  );
  return { ops: [partial, sum], spec };
}

/**
 * A prefill's tail over the forward pass of B prompts of bucketed length Tb (`qkv[l]` each
 * layer's qkv, `lnf` the final LayerNorm's output): each layer's KV write into the cache (`kv`,
 * one op per layer, run while that layer's activations are in place), then the LM head gathered
 * over each prompt's last row and the sampling of its first token (`rest`).
 */
export async function prefillTail(
  g: DecodeGraph,
  cache: KvCache,
  B: number,
  Tb: number,
  qkv: GPUBuffer[],
  lnf: GPUBuffer,
): Promise<{ kv: Op[]; rest: Op[] }> {
  const c = g.config, kv: Op[] = [], ops: Op[] = [];
  const spec: DecodeSpec = { S: B, H: c.n_head, D: c.n_embd / c.n_head, Tmax: c.n_positions };
  const kvGrid = grid1d(
    Math.ceil((B * Tb * c.n_embd) / 4 / 64),
    g.ctx.limits.maxComputeWorkgroupsPerDimension,
  );
  for (let l = 0; l < c.n_layer; l++) {
    kv.push(
      await g.op("attention_fwd", `prefill.l${l}.kv`, kvWriteWgsl(spec, { prefill: { B, Tb } }), [
        { buffer: g.sel },
        { buffer: qkv[l] },
        { buffer: cache.kc[l] },
        { buffer: cache.vc[l] },
      ], kvGrid),
    );
  }
  ops.push(await lmHead(g, "prefill.lm_head", B, lnf, true));
  ops.push(await sampleStep(g, "prefill.sample", B, "prefill"));
  return { kv, rest: ops };
}

/**
 * Samples each row's next token from the logits into its state, the chunk's tokens and logprobs:
 * `rows` "stream" for S decode rows, "prefill" for B prompts gathered through sel.
 */
async function sampleStep(g: DecodeGraph, label: string, S: number, rows: "stream" | "prefill"): Promise<Op> {
  const c = g.config;
  const sample = sampleWgsl({
    V: c.vocab_size,
    Vp: c.padded_vocab_size,
    streams: S,
    chunk: g.opts.chunk,
    rows,
    maxPos: c.n_positions - 1,
    serialReductions: g.cpu,
    subgroups: !g.cpu && g.ctx.subgroupMinSize > 0,
    direct: g.cpu && g.opts.directSampler,
    writtenRest: g.opts.kernels.writtenSampler ?? false,
  });
  return await g.op("elementwise", label, sample, [
    V(g.acts.logits),
    V(g.state),
    V(g.sampling),
    V(g.out),
    V(g.lp),
    ...(rows === "prefill" ? [V(g.sel)] : []),
  ], [S]);
}

/**
 * The LM head over `M` rows of `x` (gathered through sel for a prefill) into the logits. A decode
 * step of up to GEMV_T_MAX_ROWS rows reads wte's f16 copy where there is one; a prefill's head
 * runs once per prompt batch and reads wte.
 */
async function lmHead(g: DecodeGraph, label: string, M: number, x: GPUBuffer, gather: boolean): Promise<Op> {
  const c = g.config, Vp = c.padded_vocab_size, C = c.n_embd, logits = g.acts.logits;
  if (g.wteT && M <= GEMV_TRANSPOSED_ROWS) {
    const s = { M, N: Vp, K: C, gather: gather ? { selStride: SEL_WORDS } : undefined };
    return await g.op(
      "matmul_fwd",
      label,
      gemvTransposedWgsl(s),
      [V(x), V(g.wteT), V(logits), ...(gather ? [V(g.sel)] : [])],
      [Math.ceil(Vp / GEMV_TRANSPOSED_COLUMNS / 64)],
    );
  }
  if (M <= GEMV_T_MAX_ROWS || g.cpuHead) {
    const w16 = gather ? null : g.wte16;
    const s: GemvTSpec = {
      M,
      N: Vp,
      K: C,
      gather: gather ? { selStride: SEL_WORDS } : undefined,
      perThread: g.cpuHead,
      weights: w16 ? "f16" : "f32",
      // Lane sums by subgroup shuffles where a subgroup holds a row's lanes (the same sums).
      shuffle: !g.cpuHead && g.ctx.hasSubgroups && g.ctx.subgroupMinSize >= gemvTLanes(C),
    };
    return await g.op(
      "matmul_fwd",
      label,
      gemvTWgsl(s),
      [V(x), w16 ? V(w16) : g.P("wte.weight"), V(logits), ...(gather ? [V(g.sel)] : [])],
      [Math.ceil(Vp / gemvTColumns(s))],
    );
  }
  const s: MatmulSpec = { M, N: Vp, K: C, transA: false, transB: true, bias: false, epilogue: "store" };
  const tile = chooseTile(s, g.ctx.limits.maxComputeInvocationsPerWorkgroup);
  const views: Record<string, View> = { A: V(x), B: g.P("wte.weight"), out: V(logits) };
  return await g.op(
    "matmul_fwd",
    label,
    matmulWgsl(s, tile),
    matmulBindings(s).map((n) => views[n]),
    matmulGrid(s, tile),
  );
}

/** The decode LM head through uniform blocks of wte (CPU adapters, see gemvUboWgsl): one op per NB blocks. */
async function lmHeadUbo(g: DecodeGraph, label: string, M: number, x: GPUBuffer): Promise<Op[]> {
  const u = g.ubo!, C = g.config.n_embd, blockBytes = C * u.BC * 4;
  const s: GemvUboSpec = { M, N: g.config.padded_vocab_size, K: C, BC: u.BC, NB: u.NB };
  const code = gemvUboWgsl(s), ops: Op[] = [];
  for (let d = 0; d * u.NB < u.count; d++) {
    const blocks = [...Array(u.NB).keys()].map((b) => ({
      buffer: u.blocks,
      offset: Math.min(d * u.NB + b, u.count - 1) * blockBytes,
      size: blockBytes,
    }));
    ops.push(
      await g.op("matmul_fwd", label, code, [
        { buffer: x, offset: 0, size: M * C * 4 },
        { buffer: u.base, offset: d * u.align, size: 16 },
        { buffer: g.acts.logits },
        ...blocks,
      ], [u.NB]),
    );
  }
  return ops;
}
