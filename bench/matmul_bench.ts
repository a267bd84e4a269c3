/**
 * Matmul benchmark: every GPT-2 training matmul (forward, both backward layouts, the LM head's
 * chunk forward, dx and dw) of gpt2-124M and gpt2-345M at B·T = 8192, in fp32 and with fp16
 * storage (the dtypes and f16 math engine/graph/ gives each binding), timed by timestamp queries
 * (median and min over ≥ 20 repetitions after warmup; wall clock where the adapter has none).
 *
 *   deno task bench matmul                       chooseTile's pick for every shape
 *   deno task bench matmul --sweep [--json F]    every kernel variant × tile on every shape, in a time budget
 *   deno task bench matmul --tiny                tiny shapes (a CPU adapter runs it in under a minute)
 *   deno task bench matmul --list-shapes [--models M] [--rows 8192]   the training shapes as JSON, for
 *                                 bench/torch_matmul.py (no GPU)
 *   deno task bench matmul --from-json F --emit-tiles engine/kernels/matmul_tiles.json   (no GPU; rules of
 *                                 shapes F did not measure are kept unless --replace)
 *
 * Options: --models gpt2-124M,gpt2-345M  --precision fp32,fp16  --only REGEX (shape names)
 *          --rows 32,256,2048 (B·T of the shapes instead of 8192; forward ops of up to 2048 rows
 *          form a class per row count: a prefill's matmuls, e.g. --only '(qkv|proj|fc)$')
 *          --flush-every 2,4 (f16 math: also the pick with k-tile sums flushed every 2, 4 tiles)
 *          --kpairs (f16 math: also time the k-pair and 128-thread tiles, f16Tiles)
 *          --budget SECONDS (sweep, default 220)  --reps N (minimum timed repetitions, default 20)
 *
 * The sweep screens all candidates on the first shape of each class (layout; for TN, few or many
 * output blocks; math; storage), keeps the best four (and two split-K) of each, and times those
 * plus the current pick on every shape of the class, fp32 first (60% of the budget), then fp16.
 * Every variant's output is compared with the current pick's on the same inputs (largest
 * difference over the largest value), and a variant that disagrees is reported and never chosen.
 * The JSON (written after every shape, so a run cut short keeps what it measured) lists every
 * timing; `--emit-tiles` turns its best picks into the rule table chooseTile reads.
 *
 * Timing (bench/_gpu_bench.ts): batches of back-to-back dispatches per timestamped pass, the
 * median and min over batches of the per-dispatch time; "pick" is what engine/graph/ runs today
 * (chooseTile on the spec before dtypes are added, without the device's workgroup limit).
 *
 * Imports nothing from npm, so it runs on the GPU machine with `deno run -A --no-config --no-check`.
 */

import { makeConfig, type ModelConfig, presetConfig } from "../model/config.ts";
import { createStorage, describeDevice, type GpuContext, openDevice } from "../engine/device.ts";
import type { StorageDtype } from "../engine/kernels/common.ts";
import {
  chooseTile,
  MATMUL_TILE_RULES,
  type MatmulBinding,
  matmulFlops,
  matmulKernels,
  matmulScratchBytes,
  type MatmulSpec,
  type MatmulTile,
  matmulTileError,
  matmulWorkgroupBytes,
  splitSlices,
  tileName,
  type TileRule,
  tileThreads,
} from "../engine/kernels/matmul.ts";
import { makeOp, type Op, PipelineCache } from "../engine/ops.ts";
import { headChunkRows } from "../model/plan.ts";
import { GpuDiff, GpuTimer, type Timing } from "./_gpu_bench.ts";

/** One benchmarked matmul as engine/graph/ builds it. */
export interface BenchShape {
  /** e.g. "gpt2-345M fp32 fc.dw". */
  name: string;
  model: string;
  precision: "fp32" | "fp16";
  op: string;
  spec: MatmulSpec;
  /** Times it runs per training step (layers, or LM head chunks). */
  perStep: number;
}

type Views = Partial<Record<MatmulBinding, StorageDtype>>;
type ViewSet = Record<string, { buffer: GPUBuffer; offset: number; size: number }>;

/**
 * The training matmuls of one model at B·T rows, in the order engine/graph/ runs them, with the
 * element types and math it gives them (fp16: f16 activations, weights and most gradients).
 */
export function gpt2MatmulShapes(
  model: string,
  config: ModelConfig,
  BT: number,
  headRows: number,
  precision: "fp32" | "fp16",
): BenchShape[] {
  const C = config.n_embd, Vp = config.padded_vocab_size, L = config.n_layer;
  const half = precision === "fp16", h = (on: boolean): StorageDtype => (half && on ? "f16" : "f32");
  const chunks = Math.ceil(BT / headRows), rows = Math.min(BT, headRows);
  const out: BenchShape[] = [];
  const add = (
    op: string,
    M: number,
    N: number,
    K: number,
    transA: boolean,
    transB: boolean,
    dt: Views,
    extra: Partial<MatmulSpec> = {},
    perStep = L,
  ) => {
    const dtypes = Object.fromEntries(Object.entries(dt).filter(([, t]) => t === "f16")) as Views;
    const math = half && dtypes.A === "f16" && dtypes.B === "f16" ? "f16" : "f32";
    const spec: MatmulSpec = {
      M,
      N,
      K,
      transA,
      transB,
      bias: false,
      epilogue: "store",
      ...extra,
      ...(half ? { dtypes, math } : {}),
    };
    out.push({ name: `${model} ${precision} ${op}`, model, precision, op, spec, perStep });
  };
  const act = h(true), w = h(true);
  // forward
  add("qkv", BT, 3 * C, C, false, false, { A: act, B: w, out: act }, { bias: true });
  add("attn_proj", BT, C, C, false, false, { A: act, B: w, res: "f32", out: "f32" }, {
    bias: true,
    epilogue: "residual",
  });
  add("fc", BT, 4 * C, C, false, false, { A: act, B: w, out: act }, { bias: true });
  // fc_proj reads gelu(fch), which the fc matmul's epilogue stages (engine/graph/, training on GPU kernels).
  add("fc_proj", BT, C, 4 * C, false, false, { A: act, B: w, res: "f32", out: "f32" }, {
    bias: true,
    epilogue: "residual",
  });
  add("lm_head", rows, Vp, C, false, true, { A: act, B: w, out: "f32" }, {}, chunks);
  // backward
  add("lm_head.dx", rows, C, Vp, false, false, { A: "f32", B: w, out: "f32" }, {}, chunks);
  add("lm_head.dw", Vp, C, rows, true, false, { A: "f32", B: act, out: "f32" }, {}, chunks);
  add("fc_proj.dw", 4 * C, C, BT, true, false, { A: act, B: "f32", out: "f32" });
  add("fc_proj.dx", BT, 4 * C, C, false, true, { A: "f32", B: w, aux: act, out: act }, {
    epilogue: "gelu_grad",
  });
  add("fc.dw", C, 4 * C, BT, true, false, { A: act, B: act, out: "f32" });
  add("fc.dx", BT, C, 4 * C, false, true, { A: act, B: w, out: "f32" });
  add("attn_proj.dw", C, C, BT, true, false, { A: act, B: "f32", out: "f32" });
  add("attn_proj.dx", BT, C, C, false, true, { A: "f32", B: w, out: act });
  add("qkv.dw", C, 3 * C, BT, true, false, { A: act, B: act, out: "f32" });
  add("qkv.dx", BT, C, 3 * C, false, true, { A: act, B: w, out: "f32" });
  return out;
}

const layoutOf = (s: MatmulSpec) => `${s.transA ? "T" : "N"}${s.transB ? "T" : "N"}`;
/** Workgroups of 128×128 tiles: below about two per SM of an H200 the GPU is under-filled. */
const fewBlocks = (s: MatmulSpec) => Math.ceil(s.M / 128) * Math.ceil(s.N / 128) < 264;
/** The class whose screened candidates a shape shares: layout, few or many blocks, math, storage. */
const keyOf = (s: MatmulSpec) =>
  `${s.M <= 2048 && !s.transA ? `M${s.M} ` : ""}${layoutOf(s)}${s.transA && fewBlocks(s) ? "-small" : ""} ${
    s.math ?? "f32"
  }-math ${s.dtypes?.A === "f16" || s.dtypes?.B === "f16" ? "f16" : "f32"}-storage`;

/** Every candidate tile for a spec (unfiltered; callers drop those the spec or device refuse). */
export function candidateTiles(spec: MatmulSpec, tiny: boolean): MatmulTile[] {
  const out: MatmulTile[] = [];
  const t = (BM: number, BN: number, BK: number, TM: number, TN: number, extra: Partial<MatmulTile> = {}) =>
    out.push({ BM, BN, BK, TM, TN, ...extra });
  const kContig = !spec.transA || spec.transB; // some operand takes the transposing store
  const loadsFor = kContig ? (["mn", "k"] as const) : (["mn"] as const);
  if (tiny) {
    t(64, 64, 16, 4, 4, { gen: 2, buffers: 2, warpN: 8 });
    t(32, 32, 8, 4, 4, { gen: 2, buffers: 1, transposeLoad: "k" });
    if (spec.transA) t(32, 32, 16, 4, 4, { gen: 2, buffers: 2, splitK: 2 });
    return out;
  }
  // Split-K first for the weight gradients with few output blocks (a screen cut short by its
  // budget keeps what matters most there).
  if (spec.transA && fewBlocks(spec)) {
    for (const splitK of [2, 4, 3, 6]) {
      t(128, 128, 16, 8, 8, { gen: 2, buffers: 2, warpN: 8, splitK });
      t(128, 128, 8, 8, 8, { gen: 2, buffers: 2, warpN: 8, splitK });
      t(128, 64, 16, 8, 4, { gen: 2, buffers: 2, warpN: 8, splitK });
    }
  }
  // Forward matmuls of few rows (generation's prefill): small blocks, and split-K so that a long K
  // still fills the GPU (M = 32, N = 768, K = 3072 has 24 blocks of 32×32).
  if (!spec.transA && spec.M <= 2048 && fewBlocks(spec)) {
    for (const splitK of [4, 8, 16, 2]) {
      t(32, 64, 16, 4, 4, { gen: 2, buffers: 2, warpN: 8, splitK });
      t(32, 32, 16, 4, 4, { gen: 2, buffers: 2, warpN: 8, splitK });
      t(64, 64, 16, 4, 4, { gen: 2, buffers: 2, warpN: 8, splitK });
    }
    t(32, 32, 16, 4, 4);
    t(32, 64, 16, 4, 4, { gen: 2, buffers: 2, warpN: 8 });
    t(32, 32, 16, 4, 4, { gen: 2, buffers: 2, warpN: 8 });
  }
  // Generation 1, the tiles measured before.
  t(128, 128, 16, 8, 8);
  t(128, 128, 8, 8, 8);
  t(128, 128, 32, 8, 8);
  t(128, 64, 16, 8, 4);
  t(64, 128, 16, 4, 8);
  t(64, 64, 16, 4, 4);
  // Generation 2 on 128×128 / 8×8.
  for (const BK of [16, 8, 32]) {
    for (const buffers of BK === 32 ? [1] as const : [2, 1] as const) {
      for (const warpN of [8, 0]) {
        for (const transposeLoad of loadsFor) {
          t(128, 128, BK, 8, 8, { gen: 2, buffers, warpN, transposeLoad });
        }
      }
    }
  }
  // Generation 2 on the half-size blocks (they fill more SMs on narrow outputs).
  for (const buffers of [2, 1] as const) {
    t(128, 64, 16, 8, 4, { gen: 2, buffers, warpN: 8 });
    t(64, 128, 16, 4, 8, { gen: 2, buffers, warpN: 8 });
  }
  t(64, 64, 16, 4, 4, { gen: 2, buffers: 2, warpN: 8 });
  out.push(...f16Tiles(spec));
  return out.map((x) => (x.warpN === 0 ? { ...x, warpN: undefined } : x));
}

/**
 * Extra tiles for f16 math. The f16 register tile of 8×8 outputs holds f16 partial sums beside
 * the f32 accumulators (about 165 registers on the H200 against 123 in f32), so 256-thread
 * blocks run one per SM; the 128-thread blocks run three. kPairs packs pairs of k per workgroup
 * element (one packed multiply-add per two products). Split-K only for the weight gradients
 * with few output blocks.
 */
export function f16Tiles(spec: MatmulSpec): MatmulTile[] {
  if (spec.math !== "f16") return [];
  const kPairs = true, gen = 2 as const;
  const out: MatmulTile[] = [
    { BM: 128, BN: 128, BK: 16, TM: 8, TN: 8, gen, buffers: 2, warpN: 8, kPairs },
    { BM: 128, BN: 128, BK: 32, TM: 8, TN: 8, gen, buffers: 1, warpN: 8, transposeLoad: "k", kPairs },
    { BM: 64, BN: 128, BK: 16, TM: 8, TN: 8, gen, buffers: 2, warpN: 8 },
    { BM: 64, BN: 128, BK: 32, TM: 8, TN: 8, gen, buffers: 2, warpN: 8 },
    { BM: 128, BN: 64, BK: 16, TM: 8, TN: 8, gen, buffers: 2, warpN: 8 },
    { BM: 64, BN: 128, BK: 16, TM: 8, TN: 8, gen, buffers: 2, warpN: 8, kPairs },
    { BM: 64, BN: 128, BK: 32, TM: 8, TN: 8, gen, buffers: 2, warpN: 8, kPairs },
    { BM: 128, BN: 64, BK: 32, TM: 8, TN: 8, gen, buffers: 2, warpN: 8, kPairs },
  ];
  if (spec.transA && fewBlocks(spec)) {
    for (const splitK of [2, 4]) {
      out.push({ BM: 64, BN: 128, BK: 16, TM: 8, TN: 8, gen, buffers: 2, warpN: 8, splitK });
      out.push({ BM: 128, BN: 128, BK: 16, TM: 8, TN: 8, gen, buffers: 2, warpN: 8, splitK, kPairs });
    }
  }
  return out;
}

/** One timed variant of one shape. */
export interface VariantResult {
  tile: MatmulTile;
  name: string;
  stage: "pick" | "screen" | "full";
  median_ms: number;
  min_ms: number;
  reps: number;
  tflops_median: number;
  tflops_best: number;
  compile_ms: number;
  /** max |out - reference| / max |reference|, against the current pick on the same inputs. */
  rel_err: number | null;
  ok: boolean;
  error?: string;
}

/** Everything measured on one shape. */
export interface ShapeResult {
  name: string;
  model: string;
  precision: string;
  op: string;
  M: number;
  N: number;
  K: number;
  layout: string;
  math: string;
  storage: string;
  epilogue: string;
  per_step: number;
  flops: number;
  pick: string;
  results: VariantResult[];
  best: VariantResult | null;
  best_unsplit: VariantResult | null;
}

function arg(args: string[], name: string, def: string): string {
  const i = args.indexOf(`--${name}`);
  return i >= 0 && i + 1 < args.length ? args[i + 1] : def;
}

/** Buffers for every binding, sized for the largest shape, filled with values in [-0.5, 0.5). */
class Workspace {
  #ctx: GpuContext;
  #bufs = new Map<string, GPUBuffer>();
  constructor(ctx: GpuContext) {
    this.#ctx = ctx;
  }
  async get(name: string, dtype: StorageDtype, bytes: number): Promise<GPUBuffer> {
    const key = `${name}.${dtype}`;
    let b = this.#bufs.get(key);
    if (b && b.size >= bytes) return b;
    b?.destroy();
    b = await createStorage(this.#ctx, key, bytes);
    const n = b.size / (dtype === "f16" ? 2 : 4);
    const chunk = Math.min(n, 1 << 22);
    const fill = dtype === "f16" ? new Float16Array(chunk) : new Float32Array(chunk);
    let seed = name.length * 7919 + 1;
    for (let i = 0; i < chunk; i++) {
      seed = (Math.imul(seed, 1103515245) + 12345) >>> 0;
      fill[i] = (seed >>> 8) / 16777216 - 0.5;
    }
    for (let off = 0; off < n; off += chunk) {
      const len = Math.min(chunk, n - off);
      this.#ctx.device.queue.writeBuffer(
        b,
        off * fill.BYTES_PER_ELEMENT,
        fill.buffer,
        0,
        len * fill.BYTES_PER_ELEMENT,
      );
    }
    this.#bufs.set(key, b);
    return b;
  }
  destroy(): void {
    for (const b of this.#bufs.values()) b.destroy();
  }
}

/** Measures shapes × tiles on one device. */
class MatmulBench {
  readonly timer: GpuTimer;
  #ctx: GpuContext;
  #cache: PipelineCache;
  #ws: Workspace;
  #diff: GpuDiff;
  constructor(ctx: GpuContext) {
    this.#ctx = ctx;
    this.#cache = new PipelineCache(ctx);
    this.#ws = new Workspace(ctx);
    this.timer = new GpuTimer(ctx);
    this.#diff = new GpuDiff(ctx, this.#cache);
  }

  /** Whether the device and spec accept the tile (threads, workgroup bytes, divisibility). */
  fits(spec: MatmulSpec, tile: MatmulTile): boolean {
    const l = this.#ctx.limits;
    return matmulTileError(spec, tile) === null && tileThreads(tile) <= l.maxComputeInvocationsPerWorkgroup &&
      matmulWorkgroupBytes(spec, tile) <= l.maxComputeWorkgroupStorageSize &&
      splitSlices(spec, tile).S * spec.M * spec.N * 4 <= l.maxStorageBufferBindingSize;
  }

  async #views(spec: MatmulSpec, tile: MatmulTile): Promise<ViewSet> {
    const dt = (n: MatmulBinding): StorageDtype => spec.dtypes?.[n] ?? "f32";
    const bpe = (n: MatmulBinding) => (dt(n) === "f16" ? 2 : 4);
    const { M, N, K } = spec;
    const sizes: Record<string, [StorageDtype, number]> = {
      A: [dt("A"), M * K * bpe("A")],
      B: [dt("B"), K * N * bpe("B")],
      out: [dt("out"), M * N * bpe("out")],
      bias: ["f32", N * 4],
      res: [dt("res"), M * N * bpe("res")],
      out2: [dt("out2"), M * N * bpe("out2")],
      aux: [dt("aux"), M * N * bpe("aux")],
      part: ["f32", Math.max(16, matmulScratchBytes(spec, tile))],
      ref: [dt("out"), M * N * bpe("out")],
    };
    const views: ViewSet = {};
    for (const [n, [d, bytes]] of Object.entries(sizes)) {
      views[n] = { buffer: await this.#ws.get(n, d, bytes), offset: 0, size: Math.ceil(bytes / 16) * 16 };
    }
    return views;
  }

  /** Compiles the tile's kernels (timed) and builds their ops. */
  async ops(
    spec: MatmulSpec,
    tile: MatmulTile,
    label: string,
  ): Promise<{ ops: Op[]; compileMs: number; views: ViewSet }> {
    const views = await this.#views(spec, tile);
    const t0 = performance.now();
    const ops: Op[] = [];
    for (const k of matmulKernels(spec, tile)) {
      const pipeline = await this.#cache.get(label + k.suffix, k.code);
      ops.push(makeOp(this.#ctx, pipeline, {
        label: label + k.suffix,
        phase: "forward",
        kind: "matmul_fwd",
        views: k.bindings.map((n) => views[n]),
        grid: k.grid,
      }));
    }
    // Pipeline creation may defer the driver's compile to first use: one dispatch finishes it.
    const enc = this.#ctx.device.createCommandEncoder();
    const pass = enc.beginComputePass();
    for (const op of ops) {
      pass.setPipeline(op.pipeline);
      for (let g = 0; g < op.bindGroups.length; g++) pass.setBindGroup(g, op.bindGroups[g]);
      pass.dispatchWorkgroups(1, 1, 1);
    }
    pass.end();
    this.#ctx.device.queue.submit([enc.finish()]);
    await this.#ctx.device.queue.onSubmittedWorkDone();
    return { ops, compileMs: performance.now() - t0, views };
  }

  /**
   * Runs `ops` once on a cleared output and compares it with the reference output (or stores it
   * as the reference when `makeRef`). Returns max |out - ref| / max |ref|.
   */
  async check(spec: MatmulSpec, ops: Op[], views: ViewSet, makeRef: boolean): Promise<number> {
    const { device } = this.#ctx;
    const out = views.out, ref = views.ref;
    const enc = device.createCommandEncoder();
    enc.clearBuffer(out.buffer, 0, out.size);
    const pass = enc.beginComputePass();
    for (const op of ops) {
      pass.setPipeline(op.pipeline);
      for (let g = 0; g < op.bindGroups.length; g++) pass.setBindGroup(g, op.bindGroups[g]);
      pass.dispatchWorkgroups(op.grid[0], op.grid[1], op.grid[2]);
    }
    pass.end();
    if (makeRef) {
      enc.copyBufferToBuffer(out.buffer, 0, ref.buffer, 0, out.size);
      device.queue.submit([enc.finish()]);
      return 0;
    }
    device.queue.submit([enc.finish()]);
    return await this.#diff.rel(out, ref, (spec.M * spec.N) / 4, spec.dtypes?.out ?? "f32");
  }

  destroy(): void {
    this.timer.destroy();
    this.#ws.destroy();
    this.#diff.destroy();
  }
}

/** Largest relative difference a variant may show against the pick: f32 sums in another order, or f16 stretches. */
const tolerance = (s: MatmulSpec) => (s.math === "f16" || s.dtypes?.out === "f16" ? 2e-2 : 1e-4);

async function measure(
  bench: MatmulBench,
  shape: BenchShape,
  tile: MatmulTile,
  stage: VariantResult["stage"],
  policy: { minReps: number; targetMs: number },
  isRef: boolean,
): Promise<VariantResult> {
  const name = tileName(tile);
  const flops = matmulFlops(shape.spec);
  try {
    const { ops, compileMs, views } = await bench.ops(shape.spec, tile, `${shape.op} ${name}`);
    const err = await bench.check(shape.spec, ops, views, isRef);
    const t: Timing = await bench.timer.timeAdaptive(ops, {
      minReps: policy.minReps,
      maxReps: 400,
      targetMs: policy.targetMs,
      warmup: 2,
    });
    const ok = isRef || (Number.isFinite(err) && err <= tolerance(shape.spec));
    return {
      tile,
      name,
      stage,
      median_ms: t.median_ms,
      min_ms: t.min_ms,
      reps: t.reps,
      tflops_median: flops / (t.median_ms / 1000) / 1e12,
      tflops_best: flops / (t.min_ms / 1000) / 1e12,
      compile_ms: compileMs,
      rel_err: isRef ? null : err,
      ok,
    };
  } catch (e) {
    return {
      tile,
      name,
      stage,
      median_ms: NaN,
      min_ms: NaN,
      reps: 0,
      tflops_median: 0,
      tflops_best: 0,
      compile_ms: 0,
      rel_err: null,
      ok: false,
      error: String((e as Error).message ?? e).split("\n")[0],
    };
  }
}

function shapeRecord(s: BenchShape, pick: MatmulTile, results: VariantResult[]): ShapeResult {
  const ok = results.filter((r) => r.ok && r.reps > 0).sort((a, b) => a.median_ms - b.median_ms);
  return {
    name: s.name,
    model: s.model,
    precision: s.precision,
    op: s.op,
    M: s.spec.M,
    N: s.spec.N,
    K: s.spec.K,
    layout: layoutOf(s.spec),
    math: s.spec.math ?? "f32",
    storage: s.spec.dtypes?.A === "f16" || s.spec.dtypes?.B === "f16" ? "f16" : "f32",
    epilogue: s.spec.epilogue + (s.spec.bias ? "+bias" : "") +
      (s.spec.prologueA ? `+${s.spec.prologueA}(A)` : ""),
    per_step: s.perStep,
    flops: matmulFlops(s.spec),
    pick: tileName(pick),
    results,
    best: ok[0] ?? null,
    best_unsplit: ok.find((r) => (r.tile.splitK ?? 1) <= 1) ?? null,
  };
}

function printRow(shape: string, r: VariantResult, pickMs?: number): void {
  const f = (n: number, d = 3) => (Number.isFinite(n) ? n.toFixed(d) : "-");
  const tf = (n: number) => (n >= 1 ? n.toFixed(1) : n.toPrecision(2));
  const speed = pickMs && Number.isFinite(r.median_ms) ? `${(pickMs / r.median_ms).toFixed(2)}x` : "";
  const status = r.error ? `ERROR ${r.error}` : r.ok ? "" : `MISMATCH ${r.rel_err?.toExponential(1)}`;
  console.log(
    `${shape.padEnd(34)} ${r.name.padEnd(30)} ${f(r.median_ms).padStart(8)} ${f(r.min_ms).padStart(8)} ${
      tf(r.tflops_median).padStart(6)
    } ${tf(r.tflops_best).padStart(6)} ${String(r.reps).padStart(4)} ${f(r.compile_ms, 0).padStart(6)} ${
      speed.padStart(6)
    } ${status}`,
  );
}

/**
 * The tile table (engine/kernels/matmul_tiles.json) from a sweep's JSON: one exact-shape rule per
 * measured shape, after the rules of `keep` (the current table) for shapes the report did not
 * measure, which keep their place and notes.
 */
export function tileTable(
  report: { device: string; date: string; shapes: ShapeResult[] },
  keep: readonly TileRule[] = [],
): { about: string; device: string; rules: TileRule[] } {
  const shapeKey = (r: TileRule) => JSON.stringify([r.M, r.N, r.K, r.layout, r.math, r.storage]);
  const measured = new Set(
    report.shapes.map((s) => JSON.stringify([s.M, s.N, s.K, s.layout, s.math, s.storage])),
  );
  const rules: TileRule[] = keep.filter((r) => !measured.has(shapeKey(r)));
  const seen = new Set<string>();
  for (const s of report.shapes) {
    for (const r of [s.best, s.best_unsplit]) {
      if (!r) continue;
      const rule: TileRule = {
        M: s.M,
        N: s.N,
        K: s.K,
        layout: s.layout,
        math: s.math as "f32" | "f16",
        storage: s.storage as "f32" | "f16",
        tile: r.tile,
        tflops: Math.round(r.tflops_median * 10) / 10,
      };
      const key = JSON.stringify({ ...rule, tflops: 0 });
      if (!seen.has(key)) rules.push(rule);
      seen.add(key);
    }
  }
  return {
    about:
      "Measured matmul tile choices, consulted first by chooseTile (engine/kernels/matmul.ts). Rules are " +
      "tried in order; the first whose given fields (M, N, K, layout, math, storage) all match the spec, and " +
      "whose tile fits the device and the caller, wins. Written by `deno task bench matmul --from-json F " +
      `--emit-tiles engine/kernels/matmul_tiles.json\` from a sweep (${report.date}); a rule's note says where ` +
      "it came from when not from that sweep.",
    device: report.device,
    rules,
  };
}

async function main(args: string[]): Promise<void> {
  if (args.includes("--list-shapes")) {
    // For peers (bench/torch_matmul.py): the shapes, layouts and epilogues, one JSON line; no GPU.
    const models = arg(args, "models", "gpt2-124M,gpt2-345M").split(",");
    const BT = +arg(args, "rows", "8192");
    const limits = { maxStorageBufferBindingSize: 2 ** 31, maxBufferSize: 2 ** 40 }; // an H100's or H200's
    const list = models.flatMap((m) => {
      const config = presetConfig(m);
      return gpt2MatmulShapes(m, config, BT, headChunkRows(limits, config, BT), "fp32");
    });
    console.log(
      JSON.stringify(list.map(({ model, op, spec, perStep }) => ({ model, op, ...spec, perStep }))),
    );
    return;
  }
  const fromJson = arg(args, "from-json", "");
  if (fromJson) {
    const report = JSON.parse(await Deno.readTextFile(fromJson));
    const dest = arg(args, "emit-tiles", "");
    // Shapes the report did not measure keep their current rules (a partial sweep, e.g. fp16 only).
    const table = tileTable(report, args.includes("--replace") ? [] : MATMUL_TILE_RULES);
    const text = JSON.stringify(table, null, 2) + "\n";
    if (dest) {
      await Deno.writeTextFile(dest, text);
      console.log(`Wrote ${dest} (run deno fmt on it)`);
    } else console.log(text);
    return;
  }
  const started = performance.now();
  const elapsed = () => (performance.now() - started) / 1000;
  const ctx = await openDevice();
  const device = describeDevice(ctx);
  console.log(device);
  const cpu = /llvmpipe|lavapipe|swiftshader/i.test(ctx.adapterInfo.description);
  const tiny = args.includes("--tiny");
  const sweep = args.includes("--sweep");
  const budget = +arg(args, "budget", tiny ? "45" : "220");
  const minReps = +arg(args, "reps", tiny ? "5" : "20");
  const only = new RegExp(arg(args, "only", "."));
  /** `--flush-every 2,4`: also time the pick of every f16-math shape with those flush intervals. */
  const flushes = arg(args, "flush-every", "").split(",").filter(Boolean).map(Number);
  const kpairs = args.includes("--kpairs");
  const precisions = arg(args, "precision", ctx.hasF16 && !tiny ? "fp32,fp16" : "fp32").split(",") as Array<
    "fp32" | "fp16"
  >;
  const jsonPath = arg(args, "json", "");
  if (cpu && !tiny) console.log("CPU adapter: consider --tiny (full shapes take minutes each here)");

  // Shapes: the chosen models at B·T = 8192 (tiny: two small configs at 128 rows), plus 4096³;
  // `--rows 32,256` instead: those B·T, each its own class (a prefill's matmuls, with --only).
  const shapes: BenchShape[] = [];
  const rowsList = arg(args, "rows", "").split(",").filter(Boolean).map(Number);
  const BT = tiny ? 128 : 8192;
  const models = tiny
    ? [
      ["tiny-64", makeConfig({ n_layer: 2, n_head: 2, n_embd: 64, n_positions: 64, vocab_size: 500 })],
    ] as Array<[string, ModelConfig]>
    : arg(args, "models", "gpt2-345M,gpt2-124M").split(",").map((m) =>
      [m, presetConfig(m)] as [string, ModelConfig]
    );
  for (const precision of precisions) {
    if (precision === "fp16" && !ctx.hasF16) continue;
    for (const [name, config] of models) {
      for (const rows of rowsList.length ? rowsList : [BT]) {
        const model = rowsList.length ? `${name} M${rows}` : name;
        shapes.push(
          ...gpt2MatmulShapes(model, config, rows, headChunkRows(ctx.limits, config, rows), precision),
        );
      }
    }
  }
  if (!tiny && !rowsList.length) {
    shapes.push({
      name: "4096^3 fp32 NN",
      model: "-",
      precision: "fp32",
      op: "4096^3",
      spec: { M: 4096, N: 4096, K: 4096, transA: false, transB: false, bias: false, epilogue: "store" },
      perStep: 0,
    });
  }
  const todo = shapes.filter((s) => only.test(s.name));
  const bench = new MatmulBench(ctx);
  const maxInv = ctx.limits.maxComputeInvocationsPerWorkgroup;
  // What engine/graph/ runs today: chooseTile on the spec before dtypes and math are added.
  const pickOf = (s: BenchShape) => {
    const { dtypes: _d, math: _m, ...bare } = s.spec;
    return chooseTile(bare, maxInv);
  };
  const report = {
    device,
    date: new Date().toISOString(),
    timing: bench.timer.method,
    args,
    mode: sweep ? "sweep" : "pick",
    truncated: false,
    elapsed_s: 0,
    shapes: [] as ShapeResult[],
    screen: {} as Record<string, string[]>,
  };
  const save = async () => {
    report.elapsed_s = elapsed();
    if (jsonPath) await Deno.writeTextFile(jsonPath, JSON.stringify(report, null, 1));
  };
  console.log(
    `timing: ${bench.timer.method}; ${todo.length} shapes; ${
      sweep ? `sweep, budget ${budget} s` : "pick only"
    }`,
  );
  console.log(
    `${"shape".padEnd(34)} ${"tile".padEnd(30)} ${"med ms".padStart(8)} ${"min ms".padStart(8)} ${
      "TF/s".padStart(6)
    } ${"best".padStart(6)} ${"reps".padStart(4)} ${"cmp ms".padStart(6)} ${"vs pick".padStart(6)}`,
  );
  const full = { minReps, targetMs: tiny ? 20 : 60 };
  const screenPolicy = { minReps: Math.max(3, Math.ceil(minReps / 2)), targetMs: tiny ? 10 : 30 };

  // Clocks up before the first timing: a few hundred ms of the heaviest shape.
  if (!tiny && todo.length) {
    const heavy = todo.reduce((a, b) => (matmulFlops(a.spec) > matmulFlops(b.spec) ? a : b));
    const { ops } = await bench.ops(heavy.spec, pickOf(heavy), "warmup");
    const t = await bench.timer.time(ops, 3, 1);
    await bench.timer.time(ops, Math.min(400, Math.ceil(500 / t.median_ms)), 0);
  }

  // Per precision (fp32 first, it is the target): screen every candidate on the first shape of
  // each class, then time the pick and the class's best few on every shape.
  const order = precisions.filter((p) => todo.some((s) => s.precision === p));
  let spent = 0;
  for (const [pi, precision] of order.entries()) {
    const shapesP = todo.filter((s) => s.precision === precision);
    const share = (budget - spent) * (pi === order.length - 1 ? 1 : 0.6);
    const t0 = elapsed();
    const chosen = new Map<string, MatmulTile[]>();
    if (sweep) {
      const reps = new Map<string, BenchShape>();
      for (const s of shapesP) if (!reps.has(keyOf(s.spec)) && s.perStep > 0) reps.set(keyOf(s.spec), s);
      const perClass = (share * 0.45) / Math.max(1, reps.size);
      for (const [k, s] of reps) {
        const c0 = elapsed();
        const pick = pickOf(s);
        const results: VariantResult[] = [await measure(bench, s, pick, "pick", screenPolicy, true)];
        printRow(s.name, results[0]);
        for (const tile of candidateTiles(s.spec, tiny)) {
          if (tileName(tile) === tileName(pick) || !bench.fits(s.spec, tile)) continue;
          if (elapsed() - c0 > perClass) {
            report.truncated = true;
            console.log(`  (screen budget of ${perClass.toFixed(0)} s for ${k} spent)`);
            break;
          }
          const r = await measure(bench, s, tile, "screen", screenPolicy, false);
          printRow(s.name, r, results[0].median_ms);
          results.push(r);
        }
        const ranked = results.filter((r) => r.ok && r.stage === "screen").sort((a, b) =>
          a.median_ms - b.median_ms
        );
        const keep = ranked.filter((r) => (r.tile.splitK ?? 1) <= 1).slice(0, tiny ? 2 : 4);
        keep.push(...ranked.filter((r) => (r.tile.splitK ?? 1) > 1).slice(0, tiny ? 1 : 2));
        chosen.set(k, keep.map((r) => r.tile));
        report.screen[`${precision} ${k}`] = keep.map((r) => r.name);
        report.shapes.push(shapeRecord(s, pick, results));
        await save();
      }
    }
    for (const s of shapesP) {
      if (report.shapes.some((r) => r.name === s.name)) continue;
      if (sweep && elapsed() - t0 > share) {
        report.truncated = true;
        console.log(
          `Budget for ${precision} spent: ${s.name} and the ${precision} shapes after it are not measured`,
        );
        break;
      }
      const pick = pickOf(s);
      const results: VariantResult[] = [await measure(bench, s, pick, "pick", full, true)];
      printRow(s.name, results[0]);
      const flushVariants: MatmulTile[] = s.spec.math === "f16"
        ? flushes.filter((f) => f > 1).map((flushEvery) => ({ ...pick, flushEvery }))
        : [];
      if (kpairs) flushVariants.push(...f16Tiles(s.spec));
      for (const tile of [...flushVariants, ...(chosen.get(keyOf(s.spec)) ?? [])]) {
        if (tileName(tile) === tileName(pick) || !bench.fits(s.spec, tile)) continue;
        const r = await measure(bench, s, tile, "full", full, false);
        printRow(s.name, r, results[0].median_ms);
        results.push(r);
      }
      report.shapes.push(shapeRecord(s, pick, results));
      await save();
    }
    spent = elapsed();
  }

  // Summary: the matmul time of one training step per model and precision, pick against best.
  console.log("\nPer training step (sum over the model's matmuls, ms):  pick -> best");
  const groups = new Map<string, { pick: number; best: number }>();
  for (const r of report.shapes) {
    if (!r.per_step) continue;
    const g = groups.get(`${r.model} ${r.precision}`) ?? { pick: 0, best: 0 };
    const pick = r.results.find((x) => x.stage === "pick");
    if (!pick || !Number.isFinite(pick.median_ms)) continue;
    g.pick += pick.median_ms * r.per_step;
    g.best += (r.best?.median_ms ?? pick.median_ms) * r.per_step;
    groups.set(`${r.model} ${r.precision}`, g);
  }
  for (const [k, g] of groups) {
    console.log(`  ${k.padEnd(22)} ${g.pick.toFixed(1).padStart(8)} -> ${g.best.toFixed(1).padStart(8)}`);
  }
  const bad = report.shapes.flatMap((s) => s.results.filter((r) => !r.ok && r.stage !== "pick"));
  if (bad.length) {
    console.log(`${bad.length} variants failed or disagreed with the pick (see MISMATCH / ERROR above)`);
  }
  console.log(`elapsed ${elapsed().toFixed(0)} s${report.truncated ? " (budget reached: truncated)" : ""}`);
  await save();
  if (jsonPath) console.log(`Wrote ${jsonPath}`);
  bench.destroy();
  ctx.device.destroy();
}

if (import.meta.main) {
  await main(Deno.args);
  Deno.exit(0);
}
