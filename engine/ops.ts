/**
 * Build once, dispatch many: compiled pipelines are cached by their WGSL, and an `Op` is a
 * pipeline with its bind groups and grid, created once when a model is planned. Encoding a step
 * only records dispatches. With timestamp queries each op gets its own pass and timing.
 */

import { createPipeline, type GpuContext, GpuError } from "./device.ts";

/** A range of a buffer bound to a kernel. Offset and size in bytes. */
export interface View {
  buffer: GPUBuffer;
  offset?: number;
  size?: number;
}

/** Phases of a training step, for the timing breakdown. */
export type Phase = "forward" | "backward" | "optimizer";

/** Kernel families, for the per-kernel table of the benchmark. */
export type OpKind =
  | "matmul_fwd"
  | "matmul_bwd"
  | "attention_fwd"
  | "attention_bwd"
  | "layernorm"
  | "cross_entropy"
  | "embedding"
  | "reduce"
  | "elementwise"
  | "optimizer";

/** One recorded dispatch. */
export interface Op {
  label: string;
  phase: Phase;
  kind: OpKind;
  pipeline: GPUComputePipeline;
  bindGroups: GPUBindGroup[];
  grid: [number, number, number];
  flops: number;
}

/** One pipeline compiled while a model or generator is built, of `total` distinct ones it needs. */
export interface CompileProgress {
  /** Pipelines compiled so far, 1-based. */
  done: number;
  /** Distinct pipelines this build compiles (known before the first is compiled). */
  total: number;
  /** The first kernel label that uses it. */
  label: string;
  /** Milliseconds it took: creation, plus on CPU adapters its first dispatch (where Mesa compiles). */
  ms: number;
}

/** Receives each {@link CompileProgress} as it happens. */
export type CompileListener = (p: CompileProgress) => void;

/** What {@link makeOp} takes besides the pipeline. */
export interface OpOptions {
  label: string;
  phase: Phase;
  kind: OpKind;
  views: View[];
  /** The uniform at group 1: a whole buffer, or a range of one (a dropout site's slot). */
  uniform?: GPUBuffer | View;
  grid: [number, number, number] | [number, number] | [number];
  flops?: number;
}

/** Compiles each distinct WGSL source once per device. */
export class PipelineCache {
  #ctx: GpuContext;
  #cache = new Map<string, Promise<GPUComputePipeline>>();
  constructor(ctx: GpuContext) {
    this.#ctx = ctx;
  }
  /** The pipeline for `code`, compiled on first use. */
  get(name: string, code: string): Promise<GPUComputePipeline> {
    let p = this.#cache.get(code);
    if (!p) {
      p = createPipeline(this.#ctx, name, code);
      this.#cache.set(code, p);
    }
    return p;
  }
  /** Whether `code` was compiled (or is being compiled) already. */
  has(code: string): boolean {
    return this.#cache.has(code);
  }
  get size(): number {
    return this.#cache.size;
  }
  /** A batch of ops compiled together through this cache (see {@link OpBatch}). */
  batch(): OpBatch {
    return new OpBatch(this.#ctx, this);
  }
}

/**
 * Ops of one build whose pipelines are compiled together at its end: `defer` lists an op at once
 * and `compile` completes them all, knowing how many pipelines it needs before compiling the
 * first, so it can report progress against a total. A batch that is never compiled leaves
 * nothing behind.
 */
export class OpBatch {
  #ctx: GpuContext;
  #cache: PipelineCache;
  #ops: { op: Op; code: string; o: OpOptions }[] = [];
  constructor(ctx: GpuContext, cache: PipelineCache) {
    this.#ctx = ctx;
    this.#cache = cache;
  }

  /**
   * An op whose pipeline and bind groups are filled in by {@link compile}: the returned object is
   * the one completed, so it can be listed at once. Its grid and bindings are checked now.
   */
  defer(code: string, o: OpOptions): Op {
    const grid = checkGrid(this.#ctx, o);
    checkBindings(this.#ctx, o);
    const op: Op = {
      label: o.label,
      phase: o.phase,
      kind: o.kind,
      pipeline: undefined as unknown as GPUComputePipeline,
      bindGroups: [],
      grid,
      flops: o.flops ?? 0,
    };
    this.#ops.push({ op, code, o });
    return op;
  }

  /**
   * Compiles the pipelines of the deferred ops in the order the ops were deferred and completes
   * them. `onProgress` hears of each distinct pipeline the cache did not hold, with their total.
   * With `warm`, each new pipeline is also dispatched once, one workgroup, and waited for: Mesa's
   * llvmpipe compiles a shader at its first dispatch, not at pipeline creation, so this moves that
   * cost here where it is reported. `true` dispatches on the bindings of its first op (the caller
   * makes sure that changes nothing it keeps; see buildModel); "scratch" on zeroed buffers of the
   * same sizes and usages, made for the dispatch and destroyed after.
   */
  async compile(onProgress?: CompileListener, warm: boolean | "scratch" = false): Promise<void> {
    const list = this.#ops.splice(0);
    const fresh = new Set(list.map((d) => d.code).filter((c) => !this.#cache.has(c)));
    const total = fresh.size;
    let done = 0;
    for (const d of list) {
      const t0 = performance.now();
      Object.assign(d.op, makeOp(this.#ctx, await this.#cache.get(d.o.label, d.code), d.o));
      if (!fresh.delete(d.code)) continue;
      if (warm === "scratch") await warmDispatch(this.#ctx, scratchOp(this.#ctx, d.op.pipeline, d.o), true);
      else if (warm) await warmDispatch(this.#ctx, d.op);
      onProgress?.({ done: ++done, total, label: d.o.label, ms: performance.now() - t0 });
    }
  }
}

/**
 * Dispatches one workgroup of `op` and waits for it (see OpBatch.compile); with `destroy`, frees
 * the buffers it binds after.
 */
async function warmDispatch(
  ctx: GpuContext,
  op: Op & { buffers?: GPUBuffer[] },
  destroy = false,
): Promise<void> {
  const enc = ctx.device.createCommandEncoder();
  const pass = enc.beginComputePass();
  recordOps(pass, [{ ...op, grid: [1, 1, 1] }]);
  pass.end();
  ctx.device.queue.submit([enc.finish()]);
  await ctx.device.queue.onSubmittedWorkDone();
  if (destroy) { for (const b of op.buffers ?? []) b.destroy(); }
}

/** `o` on zeroed buffers of the same binding sizes and usages (a warm-up dispatch that touches nothing kept). */
function scratchOp(
  ctx: GpuContext,
  pipeline: GPUComputePipeline,
  o: OpOptions,
): Op & { buffers: GPUBuffer[] } {
  const buffers: GPUBuffer[] = [];
  const mirror = (b: GPUBuffer, bytes: number) => {
    const m = ctx.device.createBuffer({
      label: `${o.label}.warm`,
      size: Math.max(16, Math.ceil(bytes / 16) * 16),
      usage: b.usage & ~(GPUBufferUsage.MAP_READ | GPUBufferUsage.MAP_WRITE),
    });
    buffers.push(m);
    return m;
  };
  const views = o.views.map((v) => ({ buffer: mirror(v.buffer, v.size ?? v.buffer.size - (v.offset ?? 0)) }));
  const u = o.uniform && uniformView(o.uniform);
  const uniform = u ? mirror(u.buffer, u.size ?? u.buffer.size - (u.offset ?? 0)) : undefined;
  return { ...makeOp(ctx, pipeline, { ...o, views, uniform }), buffers };
}

function checkGrid(ctx: GpuContext, o: Pick<OpOptions, "label" | "grid">): [number, number, number] {
  const maxWg = ctx.limits.maxComputeWorkgroupsPerDimension;
  const grid: [number, number, number] = [o.grid[0], o.grid[1] ?? 1, o.grid[2] ?? 1];
  if (grid.some((g) => g > maxWg || g < 1)) {
    throw new GpuError(
      `Kernel "${o.label}"`,
      `grid ${grid.join("x")} exceeds the device's ${maxWg} workgroups per dimension`,
    );
  }
  return grid;
}

function checkBindings(ctx: GpuContext, o: Pick<OpOptions, "label" | "views">): GPUBindGroupEntry[] {
  return o.views.map((v, i) => {
    const size = v.size ?? v.buffer.size - (v.offset ?? 0);
    if (size > ctx.limits.maxStorageBufferBindingSize) {
      throw new GpuError(
        `Kernel "${o.label}"`,
        `binding ${i} of ${size} bytes exceeds maxStorageBufferBindingSize ${ctx.limits.maxStorageBufferBindingSize}`,
      );
    }
    return { binding: i, resource: { buffer: v.buffer, offset: v.offset ?? 0, size } };
  });
}

/** Creates the op: bind group 0 from `views` in binding order, group 1 the optional uniform. */
export function makeOp(ctx: GpuContext, pipeline: GPUComputePipeline, o: OpOptions): Op {
  const { device } = ctx;
  const grid = checkGrid(ctx, o);
  const entries = checkBindings(ctx, o);
  const bindGroups = [
    device.createBindGroup({ label: o.label, layout: pipeline.getBindGroupLayout(0), entries }),
  ];
  if (o.uniform) {
    const { buffer, offset, size } = uniformView(o.uniform);
    bindGroups.push(device.createBindGroup({
      label: o.label + ".uniform",
      layout: pipeline.getBindGroupLayout(1),
      entries: [{
        binding: 0,
        resource: size === undefined ? { buffer } : { buffer, offset: offset ?? 0, size },
      }],
    }));
  }
  return { label: o.label, phase: o.phase, kind: o.kind, pipeline, bindGroups, grid, flops: o.flops ?? 0 };
}

/** An op's uniform as a view (a bare buffer binds whole). */
function uniformView(u: GPUBuffer | View): View {
  return "buffer" in u ? u : { buffer: u };
}

/** Records the dispatches of `ops` into an open compute pass. */
export function recordOps(pass: GPUComputePassEncoder, ops: Op[]): void {
  for (const op of ops) {
    pass.setPipeline(op.pipeline);
    for (let g = 0; g < op.bindGroups.length; g++) pass.setBindGroup(g, op.bindGroups[g]);
    pass.dispatchWorkgroups(op.grid[0], op.grid[1], op.grid[2]);
  }
}

/** Records ops into one compute pass (or one pass per op with timestamps at `querySet`). */
export function encodeOps(enc: GPUCommandEncoder, ops: Op[], querySet?: GPUQuerySet, queryBase = 0): void {
  if (!querySet) {
    const pass = enc.beginComputePass();
    recordOps(pass, ops);
    pass.end();
    return;
  }
  ops.forEach((op, i) => {
    const pass = enc.beginComputePass({
      timestampWrites: {
        querySet,
        beginningOfPassWriteIndex: queryBase + 2 * i,
        endOfPassWriteIndex: queryBase + 2 * i + 1,
      },
    });
    recordOps(pass, [op]);
    pass.end();
  });
}
