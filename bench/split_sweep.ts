/**
 * Split-K of the weight gradients and the LM head's dx, chosen inside the training step (issue 38).
 *
 * Those matmuls have few output blocks (attn_proj.dw is 36 blocks of 128 × 128 for 124M), so how
 * many K slices they run decides how full the 132 SMs are, and the isolated matmul benchmark (back
 * to back dispatches that overlap each other's tails) chooses differently from the step, where each
 * waits for the one before. So this runs the whole step once per slice count, every such shape at
 * that count through a tile rule put before the measured table, and reads each matmul's time from
 * the step's timestamp queries: one column per count, the table's pick first.
 *
 *   deno run -A bench/split_sweep.ts [--models gpt2-124M,gpt2-345M] [--batch 8] [--seq 1024]
 *                                    [--splits 2,3,4,5,6,7,8,11,12] [--steps 3] [--emit rules.json]
 *                                    [--only REGEX (backward op names instead, e.g. '^attn_proj\.dx$')]
 *
 * `--emit F` writes the best count of each shape as tile rules (the pick's tile, its splitK), with
 * their rates and a note, for `deno task bench train --tile-rules-json F` to confirm and for
 * engine/kernels/matmul_tiles.json. A count whose partial sums do not fit the plan's split-K
 * scratch (matmul_part) runs without split-K in the step; such cells say "no room".
 *
 * Imports nothing from npm, so it runs on the GPU machine with `deno run -A --no-config --no-check`.
 */

import { presetConfig } from "../model/config.ts";
import { headChunkRows, MATMUL_PART_FLOATS } from "../model/plan.ts";
import { describeDevice, openDevice } from "../engine/device.ts";
import {
  chooseTile,
  MATMUL_TILE_RULES,
  matmulScratchBytes,
  type MatmulTile,
  matmulTileError,
  type TileRule,
} from "../engine/kernels/matmul.ts";
import { type BenchShape, gpt2MatmulShapes } from "./matmul_bench.ts";
import { benchTraining, type TrainBenchOptions, type TrainBenchResult } from "./train_bench.ts";

function arg(name: string, def: string): string {
  const i = Deno.args.indexOf(`--${name}`);
  return i >= 0 && i + 1 < Deno.args.length ? Deno.args[i + 1] : def;
}

/**
 * The shapes whose split count is worth choosing: transposed-A weight gradients of few blocks, and
 * lm_head.dx; with `only`, instead every backward matmul (.dx, .dw: a training step splits K only
 * in the backward pass) whose op name it matches.
 */
export function splitShapes(shapes: BenchShape[], only?: RegExp): BenchShape[] {
  return shapes.filter((s) => {
    if (only) return /\.(dx|dw)$/.test(s.op) && only.test(s.op);
    const blocks = Math.ceil(s.spec.M / 128) * Math.ceil(s.spec.N / 128);
    return s.op === "lm_head.dx" || (s.spec.transA && !s.spec.transB && blocks < 264);
  });
}

/** A rule for exactly this shape (size, layout, math, storage) running `tile`. */
export function ruleFor(s: BenchShape, tile: MatmulTile, note?: string, tflops?: number): TileRule {
  const sp = s.spec;
  return {
    M: sp.M,
    N: sp.N,
    K: sp.K,
    layout: `${sp.transA ? "T" : "N"}${sp.transB ? "T" : "N"}`,
    math: sp.math ?? "f32",
    storage: sp.dtypes?.A === "f16" || sp.dtypes?.B === "f16" ? "f16" : "f32",
    tile,
    ...(tflops !== undefined ? { tflops: Math.round(tflops * 100) / 100 } : {}),
    ...(note ? { note } : {}),
  };
}

/** A matmul's GPU time in a step and its rate: the LM head's chunks (lm_head.dx.0, .1, …) added up. */
export function matmulTime(r: TrainBenchResult, op: string): { ms: number; tflops: number } | null {
  const os = r.ops?.filter((x) => x.kind === op || new RegExp(`^${op}\\.\\d+$`).test(x.kind)) ?? [];
  if (!os.length) return null;
  const ms = os.reduce((a, o) => a + o.ms, 0);
  return { ms, tflops: os.reduce((a, o) => a + o.tflops * o.ms, 0) / ms };
}

/** A table cell: "ms (TFLOP/s)", why it did not run, or "-" when it was not measured. */
export function cellText(v: { ms: number; tflops: number } | string | undefined): string {
  return v === undefined ? "-" : typeof v === "string" ? v : `${v.ms.toFixed(2)} (${v.tflops.toFixed(1)})`;
}

if (import.meta.main) {
  const ctx = await openDevice();
  const device = describeDevice(ctx);
  console.log(device);
  const cpu = /llvmpipe|lavapipe|swiftshader/i.test(ctx.adapterInfo.description);
  const models = arg("models", cpu ? "gpt2-tiny" : "gpt2-124M,gpt2-345M").split(",");
  const B = +arg("batch", cpu ? "4" : "8"), T = +arg("seq", cpu ? "64" : "1024");
  const steps = +arg("steps", cpu ? "2" : "3");
  const splits = arg("splits", "2,3,4,5,6,7,8,11,12").split(",").map(Number);
  const onlyArg = arg("only", ""), only = onlyArg ? new RegExp(onlyArg) : undefined;
  if (splits.some((s) => !Number.isInteger(s) || s < 1)) {
    throw new Error(`--splits: positive integers, got ${splits}`);
  }
  const maxInv = ctx.limits.maxComputeInvocationsPerWorkgroup;
  const maxBytes = ctx.limits.maxComputeWorkgroupStorageSize;
  const base: TrainBenchOptions = { precision: "fp32", checkpointLayers: 0, profile: true, ops: true };
  if (!ctx.hasTimestamps) console.log("No timestamp queries on this adapter: nothing to read per matmul");
  const emitted: TileRule[] = [];
  for (const model of models) {
    const config = presetConfig(model);
    const BT = B * T;
    const shapes = splitShapes(
      gpt2MatmulShapes(model, config, BT, headChunkRows(ctx.limits, config, BT), "fp32"),
      only,
    );
    if (shapes.length === 0) throw new Error(`--only ${only}: no backward matmul of ${model} matches`);
    // The plan's split-K scratch (model/plan.ts, training): what a slice count must fit in.
    const scratch = 4 * Math.min(MATMUL_PART_FLOATS, 8 * 4 * config.n_embd ** 2);
    const pick = new Map(
      shapes.map((s) => [s.op, chooseTile(s.spec, maxInv, { maxWorkgroupBytes: maxBytes, splitK: true })]),
    );
    type Cell = { ms: number; tflops: number } | "no room" | "invalid";
    const table = new Map<string, Map<string, Cell>>(shapes.map((s) => [s.op, new Map()]));
    const columns = ["pick", ...splits.map(String)];
    for (const col of columns) {
      const rules: TileRule[] = [];
      for (const s of shapes) {
        if (col === "pick") continue;
        const p = pick.get(s.op)!; // split-K needs the second kernel generation
        const tile: MatmulTile = { ...p, ...(p.gen === 2 ? {} : { gen: 2, buffers: 2 }), splitK: +col };
        const err = matmulTileError(s.spec, tile);
        if (err) table.get(s.op)!.set(col, "invalid");
        else if (matmulScratchBytes(s.spec, tile) > scratch) table.get(s.op)!.set(col, "no room");
        else rules.push(ruleFor(s, tile));
      }
      const r = await benchTraining(ctx, model, B, T, steps, {
        ...base,
        kernels: { tileRules: [...rules, ...MATMUL_TILE_RULES] },
      });
      console.log(`${model} splits ${col}: ${r.ms_per_step.toFixed(1)} ms/step (wall clock)`);
      for (const s of shapes) {
        const t = matmulTime(r, s.op);
        if (t && !table.get(s.op)!.has(col)) table.get(s.op)!.set(col, t);
      }
    }
    console.log(`\n${model}, ${B} × ${T}: GPU ms per step of each matmul (timestamp queries), by K slices`);
    console.log(
      `  ${"op".padEnd(16)} ${"pick".padStart(12)} ${splits.map((s) => String(s).padStart(12)).join(" ")}`,
    );
    for (const s of shapes) {
      const row = table.get(s.op)!;
      const cell = (c: string) => cellText(row.get(c)).padStart(12);
      const label = `${s.op} s${pick.get(s.op)!.splitK ?? 1}`;
      console.log(`  ${label.padEnd(16)} ${cell("pick")} ${splits.map((c) => cell(String(c))).join(" ")}`);
      let best: { col: string; ms: number; tflops: number } | null = null;
      for (const [col, v] of row) {
        if (typeof v !== "string" && (!best || v.ms < best.ms)) best = { col, ...v };
      }
      if (best && best.col !== "pick") {
        const note = `measured inside the training step (bench/split_sweep.ts), ${
          new Date().toISOString().slice(0, 10)
        }, issue 38`;
        const p = pick.get(s.op)!;
        emitted.push(
          ruleFor(
            s,
            { ...p, ...(p.gen === 2 ? {} : { gen: 2, buffers: 2 }), splitK: +best.col },
            note,
            best.tflops,
          ),
        );
      }
    }
  }
  const emit = arg("emit", "");
  if (emit) {
    await Deno.writeTextFile(emit, JSON.stringify(emitted, null, 2) + "\n");
    console.log(`\n${emitted.length} rules (the best count where it beat the pick) written to ${emit}`);
  }
  ctx.device.destroy();
  Deno.exit(0);
}
