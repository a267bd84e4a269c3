/**
 * The decode gemv's tuning, timed as a decode step runs it (issue 38): one layer's four linear
 * layers (qkv with its LayerNorm, proj + reduce, fc with its LayerNorm, fcproj reducing fc's
 * partials with GELU + reduce) back to back in one pass, for each tuning of gemvTuning's fields:
 * workgroups aimed at (the K-split), weight loads in flight, rows per workgroup and staging. The
 * qkv partials get a plain reduce here (the decode attention sums them as it reads q, k, v).
 * Today's tuning is marked; the fastest per row count is printed last, to copy into gemvTuning.
 *
 *   deno run -A bench/gemv_sweep.ts [--model gpt2-124M] [--rows 1,16] [--targets 132,264,528,1056]
 *     [--unrolls 4,8] [--group-rows 8,16] [--reps 200]
 */

import { presetConfig } from "../model/config.ts";
import { describeDevice, openDevice } from "../engine/device.ts";
import { makeOp, type Op, PipelineCache } from "../engine/ops.ts";
import {
  chooseKSplit,
  gemvGroupRows,
  gemvPartialWgsl,
  gemvReduceBindings,
  gemvReduceWgsl,
  gemvRowGroups,
  type GemvSpec,
  type GemvTuning,
  gemvTuning,
} from "../engine/kernels/gemv.ts";
import { GpuTimer } from "./_gpu_bench.ts";

function arg(name: string, def: string): string {
  const i = Deno.args.indexOf(`--${name}`);
  return i >= 0 && i + 1 < Deno.args.length ? Deno.args[i + 1] : def;
}
const nums = (s: string) => s.split(",").map(Number);

const ctx = await openDevice();
console.log(describeDevice(ctx));
const config = presetConfig(arg("model", "gpt2-124M"));
const C = config.n_embd, REPS = +arg("reps", "200");
const cache = new PipelineCache(ctx);
const timer = new GpuTimer(ctx);
const usage = GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST;
const made: GPUBuffer[] = [];
const buf = (floats: number) => {
  const b = ctx.device.createBuffer({ size: Math.max(16, floats * 4), usage });
  made.push(b);
  return b;
};

/** The partial (+ reduce) ops of one linear layer; returns them and the spec. */
async function linear(
  label: string,
  M: number,
  N: number,
  K: number,
  t: GemvTuning,
  o: { ln?: boolean; geluOf?: { KS: number }; reduce: "store" | "residual" | null; x?: GPUBuffer },
): Promise<{ ops: Op[]; spec: GemvSpec; part: GPUBuffer }> {
  const spec: GemvSpec = {
    M,
    N,
    K,
    bias: true,
    epilogue: o.reduce ?? "store",
    KS: chooseKSplit(N, K, t.target, M, t.groupRows),
    ln: !!o.ln,
    geluOf: o.geluOf,
    staged: !!o.geluOf || t.staged,
    unroll: t.unroll,
    groupRows: t.groupRows,
  };
  const part = buf(spec.KS * M * N);
  const views = [
    { buffer: o.x ?? buf(M * K) },
    { buffer: buf(K * N) },
    { buffer: part },
    ...(o.ln ? [{ buffer: buf(K) }, { buffer: buf(K) }] : []),
    ...(o.geluOf ? [{ buffer: buf(K) }] : []),
  ];
  const ops: Op[] = [
    makeOp(ctx, await cache.get(label, gemvPartialWgsl(spec)), {
      label,
      phase: "forward",
      kind: "matmul_fwd",
      views,
      grid: [Math.ceil(N / 128), spec.KS, gemvRowGroups(M, gemvGroupRows(spec))],
    }),
  ];
  if (o.reduce) {
    const all: Record<string, GPUBuffer> = {
      part,
      out: buf(M * N),
      bias: buf(N),
      res: buf(M * N),
      out2: buf(M * N),
    };
    ops.push(
      makeOp(ctx, await cache.get(label + ".sum", gemvReduceWgsl(spec)), {
        label: label + ".sum",
        phase: "forward",
        kind: "matmul_fwd",
        views: gemvReduceBindings(spec).map((n) => ({ buffer: all[n] })),
        grid: [Math.ceil((M * N) / 4 / 64)],
      }),
    );
  }
  return { ops, spec, part };
}

async function layer(M: number, t: GemvTuning): Promise<{ name: string; ops: Op[] }[]> {
  const qkv = await linear("qkv", M, 3 * C, C, t, { ln: true, reduce: "store" });
  const proj = await linear("proj", M, C, C, t, { reduce: "residual" });
  const fc = await linear("fc", M, 4 * C, C, t, { ln: true, reduce: null });
  const fcproj = await linear("fcproj", M, C, 4 * C, t, {
    geluOf: { KS: fc.spec.KS },
    reduce: "residual",
    x: fc.part,
  });
  return [
    { name: "qkv", ops: qkv.ops },
    { name: "proj", ops: proj.ops },
    { name: "fc", ops: fc.ops },
    { name: "fcproj", ops: fcproj.ops },
  ];
}

const key = (t: GemvTuning) => `target ${t.target} unroll ${t.unroll} rows ${t.groupRows} staged ${t.staged}`;
const best: Record<number, { t: GemvTuning; us: number }> = {};
for (const M of nums(arg("rows", "1,16"))) {
  const today = gemvTuning(M);
  const tunings: GemvTuning[] = [];
  for (const target of nums(arg("targets", "132,264,528,1056"))) {
    for (const unroll of nums(arg("unrolls", "4,8"))) {
      for (const groupRows of nums(arg("group-rows", "8,16")).filter((g) => g === 8 || g < M * 2)) {
        for (const staged of M >= 8 ? [true] : [false, true]) {
          if (!staged && unroll !== today.unroll) continue; // the plain loop has no unroll
          tunings.push({ target, unroll, groupRows, staged });
        }
      }
    }
  }
  if (!tunings.some((t) => key(t) === key(today))) tunings.unshift(today);
  console.log(`\n${M} rows (today: ${key(today)})`);
  for (const t of tunings) {
    let parts: { name: string; ops: Op[] }[];
    try {
      parts = await layer(M, t);
    } catch (e) {
      console.log(`${key(t).padEnd(44)} does not build: ${(e as Error).message.split("\n")[0]}`);
      continue;
    }
    const whole = (await timer.time(parts.flatMap((p) => p.ops), REPS)).median_ms * 1000;
    const each: string[] = [];
    for (const p of parts) {
      each.push(`${p.name} ${((await timer.time(p.ops, REPS)).median_ms * 1000).toFixed(1)}`);
    }
    const mark = key(t) === key(today) ? "  <- today" : "";
    console.log(`${key(t).padEnd(44)} layer ${whole.toFixed(1)} us  (${each.join(", ")})${mark}`);
    if (!best[M] || whole < best[M].us) best[M] = { t, us: whole };
    for (const b of made.splice(0)) b.destroy();
  }
}
console.log("\nfastest per row count:");
for (const [M, b] of Object.entries(best)) {
  console.log(`${M} rows: ${key(b.t)}, ${b.us.toFixed(1)} us a layer`);
}
console.log(JSON.stringify(best));
