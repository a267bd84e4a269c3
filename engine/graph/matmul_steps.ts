/**
 * The graph's matmuls: how one matmul becomes kernels on this device (tiled, split-K, the CPU
 * adapters' direct and uniform-buffer kernels), and the linear layers built from them, forward
 * (column-parallel, and row-parallel with its residual and tensor-parallel exchange) and backward
 * (weight, bias and input gradients), so a block names a layer once instead of three matmuls.
 */

import type { Op, Phase, View } from "../ops.ts";
import {
  chooseTile,
  matmulFlops,
  matmulKernels,
  matmulScratchBytes,
  type MatmulSpec,
} from "../kernels/matmul.ts";
import { uboMatmulPlan } from "../kernels/matmul_ubo.ts";
import { matmulDirectError, matmulDirectKernel } from "../kernels/matmul_direct.ts";
import { colsumPartialWgsl, reduceRowsWgsl } from "../kernels/layernorm.ts";
import { geluWgsl, UNIFORM_BINDING_BYTES } from "../kernels/common.ts";
import { biasDropResidualWgsl } from "../parallel/tensor_parallel_kernels.ts";
import {
  allreduce,
  type Backprop,
  buf,
  colsumUnroll,
  CPU_MATMUL_MIN_MACS,
  dimsUniform,
  drop,
  dropSlot,
  dtypeOf,
  elemGrid,
  gradView,
  type GraphBuilder,
  op,
  param,
  weight,
  whole,
} from "./builder.ts";
import { type Step } from "./program.ts";

/** A plain (M, K)·(K, N) matmul spec, stored, without bias. */
export function mm(M: number, N: number, K: number, transA = false, transB = false) {
  return { M, N, K, transA, transB, bias: false, epilogue: "store" as const };
}

/** A matmul's kernels: one, or with split-K one per slice of K and a reduction applying the epilogue. */
export function matmul(
  g: GraphBuilder,
  phase: Phase,
  label: string,
  spec: MatmulSpec,
  views: Record<string, View>,
): Op[] {
  const { ctx } = g;
  // Each binding's element type is its buffer's, as planned.
  const dtypes = Object.fromEntries(Object.entries(views).map(([n, v]) => [n, dtypeOf(g, v.buffer)]));
  const math = g.f16Math && dtypes.A === "f16" && dtypes.B === "f16" ? "f16" : "f32";
  const uniformDims = g.uniformDims === "all" || (g.uniformDims === "weight-gradients" && spec.transA);
  const full: MatmulSpec = { ...spec, dtypes, math, ...(uniformDims ? { uniformDims } : {}) };
  const ubo = g.cpuUniform ? cpuMatmul(g, phase, label, full, views) : null;
  if (ubo) return ubo;
  const kind = phase === "forward" ? "matmul_fwd" : "matmul_bwd";
  if (g.cpuDirect && matmulDirectError(full) === null) {
    const kernel = matmulDirectKernel(full);
    const o = {
      uniform: kernel.uniform ? dropSlot(g, full.dropout!.site) : undefined,
      flops: matmulFlops(spec),
    };
    return [op(g, phase, kind, label, kernel.code, kernel.bindings.map((n) => views[n]), kernel.grid, o)];
  }
  const limits = { maxWorkgroupBytes: ctx.limits.maxComputeWorkgroupStorageSize, rules: g.tileRules };
  // Split-K in backward, and in the forward of a plan without training (a checkpointed recompute
  // in training drops a layer's last forward op, which split-K makes two), only where its partial
  // sums fit the planned scratch (planned for training and for hiddenOnly plans).
  let tile = chooseTile(full, ctx.limits.maxComputeInvocationsPerWorkgroup, {
    ...limits,
    splitK: (phase === "backward" || !g.train) && !!g.matmulPart,
  });
  if (matmulScratchBytes(full, tile) > (g.matmulPart?.size ?? 0)) {
    tile = chooseTile(full, ctx.limits.maxComputeInvocationsPerWorkgroup, { ...limits, splitK: false });
  }
  return matmulKernels(full, tile).map((kernel) =>
    op(
      g,
      phase,
      kind,
      label + kernel.suffix,
      kernel.code,
      kernel.bindings.map((n) => n === "part" ? { buffer: g.matmulPart! } : views[n]),
      kernel.grid,
      {
        uniform: kernel.uniform
          ? dropSlot(g, full.dropout!.site)
          : kernel.dims
          ? dimsUniform(g, kernel.dims)
          : undefined,
        flops: kernel.suffix === ".sum" ? 0 : matmulFlops(spec),
      },
    )
  );
}

/**
 * CPU adapters: the uniform-buffer matmul (kernels/matmul_ubo.ts) for matmuls of at least
 * CPU_MATMUL_MIN_MACS multiply-adds whose uniform operand's buffer allows it; null otherwise.
 */
function cpuMatmul(
  g: GraphBuilder,
  phase: Phase,
  label: string,
  spec: MatmulSpec,
  views: Record<string, View>,
): Op[] | null {
  if (spec.M * spec.N * spec.K < CPU_MATMUL_MIN_MACS) return null;
  const lim = g.ctx.device.limits;
  const plan = uboMatmulPlan(spec, {
    maxUniformBytes: Math.min(lim.maxUniformBufferBindingSize, UNIFORM_BINDING_BYTES),
    uniformAlign: lim.minUniformBufferOffsetAlignment,
    storageAlign: lim.minStorageBufferOffsetAlignment,
  });
  if (typeof plan === "string") return null;
  if (!(views[plan[0].operand].buffer.usage & GPUBufferUsage.UNIFORM)) return null;
  return plan.map((d, i) =>
    op(
      g,
      phase,
      phase === "forward" ? "matmul_fwd" : "matmul_bwd",
      plan.length > 1 ? `${label}.u${i}` : label,
      d.code,
      d.bindings.map((n) => {
        const v = views[n], r = d.ranges[n];
        return r ? { buffer: v.buffer, offset: (v.offset ?? 0) + r.offset, size: r.size } : v;
      }),
      d.grid,
      {
        uniform: d.uniform ? dropSlot(g, spec.dropout!.site) : undefined,
        flops: i === 0 ? matmulFlops(spec) : 0,
      },
    )
  );
}

/** What a linear layer's forward reads and writes. */
export interface LinearIO {
  /** (B·T, K) the layer's input. */
  x: GPUBuffer;
  /** (B·T, N) its output (row-parallel: (B·T, C)). */
  out: GPUBuffer;
  K: number;
  N: number;
  /** (B·T, N) also written with gelu(out) (the MLP's activation, for its projection to read). */
  gelu?: GPUBuffer;
}

/**
 * A linear layer `out = x·W + b` with the weight and bias of parameter prefix `name`
 * (column-parallel with tensor parallelism: N is this rank's columns).
 */
export function linear(g: GraphBuilder, label: string, name: string, { x, out, K, N, gelu }: LinearIO): Op[] {
  return matmul(g, "forward", label, {
    ...mm(g.dims.BT, N, K),
    bias: true,
    ...(gelu ? { epilogue: "gelu" as const } : {}),
  }, {
    A: whole(x),
    B: weight(g, name + ".weight"),
    bias: param(g, name + ".bias"),
    out: whole(out),
    ...(gelu ? { out2: whole(gelu) } : {}),
  });
}

/**
 * Where a training forward stores gelu(fch) for the MLP projection to read: the backward's d4
 * scratch, free until the layer's backward writes it. The tiled projection runs well below its
 * twins' rate when it applies GELU to every tiled load of fch (each element is loaded C/BN
 * times; the weight gradient's twin case measured 19.3 against 36.0 TFLOP/s on an H200,
 * bench/RESULTS.md issue 38), so the fc matmul's epilogue writes it once. Null (GELU applied as
 * fch is loaded) without a backward, on the CPU adapters' kernels (one pipeline fewer to
 * compile), or where the scratch's element type is not fch's.
 */
export function geluStaging(g: GraphBuilder, fch: GPUBuffer): GPUBuffer | null {
  if (!g.train || g.cpuDirect || g.cpuUniform) return null;
  const d4 = buf(g, "d4c");
  return dtypeOf(g, d4) === dtypeOf(g, fch) ? d4 : null;
}

/** What a row-parallel output projection reads and writes besides its input. */
export interface ProjectionIO {
  /** (B·T, K) the projection's input: this rank's heads or MLP columns. */
  x: GPUBuffer;
  K: number;
  /** (B·T, C) the residual stream it adds to, and (B·T, C) the sum. */
  res: GPUBuffer;
  out: GPUBuffer;
  /** The dropout site of the branch (see model/rng.ts). */
  site: number;
  /** Apply GELU to x as it is loaded (the MLP's activation, never stored). */
  gelu?: boolean;
}

/**
 * A row-parallel output projection plus residual, `out = res + drop(x·W + b)`, the weight and
 * bias of parameter prefix `name`: fused into the matmul on one GPU; with tensor parallelism the
 * partial sums are allreduced first (a Sync step), then bias, dropout and residual.
 */
export function rowParallel(g: GraphBuilder, label: string, name: string, io: ProjectionIO): Step[] {
  const { BT, C } = g.dims, { x, K, res, out } = io, w = name + ".weight", b = name + ".bias";
  const d = drop(g, g.hiddenDropout, io.site), gelu = io.gelu ? { prologueA: "gelu" as const } : {};
  if (!g.tp.on) {
    return matmul(g, "forward", label, {
      ...mm(BT, C, K),
      bias: true,
      epilogue: "residual",
      dropout: d,
      ...gelu,
    }, { A: whole(x), B: weight(g, w), bias: param(g, b), res: whole(res), out: whole(out) });
  }
  const partial = g.partial!;
  return [
    ...matmul(g, "forward", label, { ...mm(BT, C, K), ...gelu }, {
      A: whole(x),
      B: weight(g, w),
      out: whole(partial),
    }),
    allreduce(label, partial, BT * C),
    op(
      g,
      "forward",
      "elementwise",
      `${label}.residual`,
      biasDropResidualWgsl(BT, C, d),
      [whole(partial), param(g, b), whole(res), whole(out)],
      elemGrid(g, (BT * C) / 4),
      { uniform: d ? dropSlot(g, d.site) : undefined },
    ),
  ];
}

/** What a linear layer's backward reads and writes. */
export interface LinearGrads {
  /** (B·T, K) the layer's input, as the forward read it. */
  x: GPUBuffer;
  /** (B·T, N) the gradient of its output. */
  dy: GPUBuffer;
  /** (B·T, K) the gradient of its input, written. */
  dx: GPUBuffer;
  K: number;
  N: number;
  /** The forward applied GELU to x as it was loaded: dx is the gradient through it. */
  gelu?: boolean;
}

/**
 * The backward of a linear layer of parameter prefix `name`: dW = xᵀ·dy, db = Σ rows of dy and
 * dx = dy·Wᵀ (through GELU where the forward applied it), in that order.
 */
export function linearBackward(
  g: GraphBuilder,
  t: Backprop,
  label: string,
  name: string,
  { x, dy, dx, K, N, gelu }: LinearGrads,
): Op[] {
  const BT = g.dims.BT, w = name + ".weight";
  // The tiled weight gradient runs at about half its rate when it applies GELU to A on every load
  // (each element of x is loaded N/BN times; measured on an H200, bench/RESULTS.md issue 38), so
  // gelu(x) is written once into dx, which the dx matmul overwrites after. The CPU adapters'
  // kernels keep the prologue (one pipeline fewer to compile).
  const stage = gelu && !g.cpuDirect && !g.cpuUniform && dtypeOf(g, dx) === dtypeOf(g, x);
  return [
    ...(stage
      ? [op(g, "backward", "elementwise", `${label}.gelu`, geluWgsl((BT * K) / 4, dtypeOf(g, x)), [
        whole(x),
        whole(dx),
      ], elemGrid(g, (BT * K) / 4))]
      : []),
    ...matmul(g, "backward", `${label}.dw`, {
      ...mm(K, N, BT, true, false),
      epilogue: t.dwEpilogue,
      ...(gelu && !stage ? { prologueA: "gelu" as const } : {}),
    }, { A: whole(stage ? dx : x), B: whole(dy), out: gradView(g, t, w) }),
    ...colsum(g, t, `${label}.db`, dy, N, gradView(g, t, name + ".bias")),
    ...matmul(
      g,
      "backward",
      `${label}.dx`,
      gelu ? { ...mm(BT, K, N, false, true), epilogue: "gelu_grad" } : mm(BT, K, N, false, true),
      gelu
        ? { A: whole(dy), B: weight(g, w), aux: whole(x), out: whole(dx) }
        : { A: whole(dy), B: weight(g, w), out: whole(dx) },
    ),
  ];
}

/** `out` (+)= the column sums of the (B·T, N) `src`: partial sums per row block, then their sum. */
export function colsum(
  g: GraphBuilder,
  t: Backprop,
  label: string,
  src: GPUBuffer,
  N: number,
  out: View,
): Op[] {
  const { blocks, part } = t;
  return [
    op(
      g,
      "backward",
      "reduce",
      label + ".part",
      colsumPartialWgsl(N, g.dims.BT, dtypeOf(g, src), colsumUnroll(g)),
      [
        whole(src),
        whole(part),
      ],
      [Math.ceil(N / 4 / 64), blocks],
    ),
    op(g, "backward", "reduce", label + ".sum", reduceRowsWgsl(N, blocks, g.accumulate, colsumUnroll(g)), [
      { buffer: part, offset: 0, size: blocks * N * 4 },
      out,
    ], [Math.ceil(N / 4 / 64)]),
  ];
}
