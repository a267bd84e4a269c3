/**
 * Matmul tiles chosen inside the training step (issue 38), as split_sweep.ts chooses split-K counts:
 * the isolated matmul benchmark times back-to-back dispatches that overlap each other's tails, and
 * its picks differ from what runs fastest in the step, where each matmul waits for the one before.
 * This runs the whole step once per candidate tile ("column"), every matmul shape of the model
 * given that tile through a rule put before the measured table (keeping the shape's split-K count
 * where the table splits it), and reads each matmul's GPU time from the step's timestamp queries:
 * one column per candidate, the table's pick first.
 *
 *   deno run -A bench/tile_sweep.ts [--models gpt2-345M] [--batch 8] [--seq 1024] [--steps 3]
 *                                   [--only REGEX (op names, e.g. '^(fc|qkv|lm_head\.dx)$')]
 *                                   [--candidates 0,1,2 (indexes into the list below; default all)]
 *                                   [--emit rules.json] [--min-gain 0.01]
 *
 * `--emit F` writes, for each shape whose best candidate beat the pick by at least --min-gain (1%)
 * of its time, that tile as a rule (with its rate and a note), for `deno task bench train
 * --tile-rules-json F` to confirm in a fresh process and for engine/kernels/matmul_tiles.json. A
 * candidate the shape or the device refuses (tile error, workgroup memory, threads, split-K
 * scratch) runs the pick in that column; its cell says why.
 *
 * Imports nothing from npm, so it runs on the GPU machine with `deno run -A --no-config --no-check`.
 */

import { presetConfig } from "../model/config.ts";
import { headChunkRows, MATMUL_PART_FLOATS } from "../model/plan.ts";
import { describeDevice, isCpuAdapter, openDevice } from "../engine/device.ts";
import {
  chooseTile,
  MATMUL_TILE_RULES,
  matmulScratchBytes,
  type MatmulSpec,
  type MatmulTile,
  matmulTileError,
  matmulWorkgroupBytes,
  tileName,
  type TileRule,
  tileThreads,
} from "../engine/kernels/matmul.ts";
import { type BenchShape, gpt2MatmulShapes } from "./matmul_bench.ts";
import { cellText, matmulTime, ruleFor } from "./split_sweep.ts";
import { benchTraining, type TrainBenchOptions } from "./train_bench.ts";

function arg(name: string, def: string): string {
  const i = Deno.args.indexOf(`--${name}`);
  return i >= 0 && i + 1 < Deno.args.length ? Deno.args[i + 1] : def;
}

/**
 * The candidate tiles, tried on every shape: the second kernel generation on 128 × 128 blocks of
 * 8 × 8 per thread with each depth, buffering, warp shape and transposing load, the half-size
 * blocks, the first generation's 128 × 128 at depths 8, 16 and 32, blocks 96 wide or tall, and
 * threads 12 columns wide.
 */
export function sweepTiles(): MatmulTile[] {
  const g2 = { gen: 2 } as const;
  return [
    { BM: 128, BN: 128, BK: 8, TM: 8, TN: 8, ...g2, buffers: 2, warpN: 8, transposeLoad: "mn" },
    { BM: 128, BN: 128, BK: 16, TM: 8, TN: 8, ...g2, buffers: 2, warpN: 8, transposeLoad: "mn" },
    { BM: 128, BN: 128, BK: 16, TM: 8, TN: 8, ...g2, buffers: 2, warpN: 8, transposeLoad: "k" },
    { BM: 128, BN: 128, BK: 16, TM: 8, TN: 8, ...g2, buffers: 1, warpN: 8 },
    { BM: 128, BN: 128, BK: 32, TM: 8, TN: 8, ...g2, buffers: 1, warpN: 8 },
    { BM: 128, BN: 128, BK: 8, TM: 8, TN: 8, ...g2, buffers: 2 },
    { BM: 128, BN: 128, BK: 8, TM: 8, TN: 8, ...g2, buffers: 2, warpN: 4 },
    { BM: 128, BN: 128, BK: 8, TM: 8, TN: 8, ...g2, buffers: 2, warpN: 16 },
    { BM: 128, BN: 64, BK: 16, TM: 8, TN: 4, ...g2, buffers: 2, warpN: 8 },
    { BM: 64, BN: 128, BK: 16, TM: 4, TN: 8, ...g2, buffers: 2, warpN: 8 },
    { BM: 128, BN: 128, BK: 8, TM: 8, TN: 8, ...g2, buffers: 2, warpN: 8, transposeLoad: "k" },
    // The first generation, which the isolated sweep picked for several forward shapes.
    { BM: 128, BN: 128, BK: 16, TM: 8, TN: 8 },
    { BM: 128, BN: 128, BK: 8, TM: 8, TN: 8 },
    { BM: 128, BN: 128, BK: 32, TM: 8, TN: 8 },
    // Blocks 96 wide or tall at depth 24 (192 threads), for N = 768: 124M's attn_proj and its dx
    // run 384 blocks of 128 × 128, about 1.45 waves of an H100's or H200's 132 SMs at 2 blocks
    // each; 128 × 96 makes 512 blocks (1.94 waves), 64 × 96 1024 blocks at 4 an SM.
    { BM: 128, BN: 96, BK: 24, TM: 8, TN: 8 },
    { BM: 128, BN: 96, BK: 24, TM: 8, TN: 8, ...g2, buffers: 2, warpN: 4 },
    { BM: 128, BN: 96, BK: 24, TM: 8, TN: 8, ...g2, buffers: 2, warpN: 4, transposeLoad: "k" },
    { BM: 96, BN: 128, BK: 24, TM: 8, TN: 8, ...g2, buffers: 2, warpN: 8 },
    { BM: 64, BN: 96, BK: 24, TM: 8, TN: 4, ...g2, buffers: 2, warpN: 8 },
    // Threads 12 columns wide for the same shapes: 128 × 96 blocks of 128 threads (512 blocks, one
    // wave at 4 an SM, if a thread fits in 128 registers), 128 × 192 of 256 threads (256 blocks, one
    // wave at 2 an SM), and 4 × 12 threads on 128 × 96 (256 threads, two waves at 2 an SM).
    { BM: 128, BN: 96, BK: 16, TM: 8, TN: 12 },
    { BM: 128, BN: 96, BK: 16, TM: 8, TN: 12, ...g2, buffers: 2, warpN: 8 },
    { BM: 128, BN: 96, BK: 16, TM: 8, TN: 12, ...g2, buffers: 1, warpN: 8 },
    { BM: 128, BN: 192, BK: 16, TM: 8, TN: 12 },
    { BM: 128, BN: 192, BK: 16, TM: 8, TN: 12, ...g2, buffers: 2, warpN: 8 },
    { BM: 128, BN: 96, BK: 32, TM: 4, TN: 12 },
    // 128 × 192 in the second generation for the input gradient's transposed B (the first
    // generation's ran attn_proj at 38.2 TFLOP/s on the H200 but its dx at 36.0).
    { BM: 128, BN: 192, BK: 16, TM: 8, TN: 12, ...g2, buffers: 1, warpN: 8, transposeLoad: "k" },
    { BM: 128, BN: 192, BK: 16, TM: 8, TN: 12, ...g2, buffers: 1 },
    { BM: 128, BN: 192, BK: 16, TM: 8, TN: 12, ...g2, buffers: 2, transposeLoad: "k" },
    // 12 rows or columns a thread for the other shapes whose sides divide by 192 (N = 2304, 3072 and
    // 50304; the weight gradients' M = 768, 2304, 3072, 50304), at the weight gradients' depth too.
    { BM: 192, BN: 128, BK: 16, TM: 12, TN: 8 },
    { BM: 192, BN: 128, BK: 32, TM: 12, TN: 8, ...g2, buffers: 1, warpN: 8 },
    { BM: 128, BN: 192, BK: 32, TM: 8, TN: 12, ...g2, buffers: 1, warpN: 8 },
  ];
}

/** Why `tile` cannot run `spec` in the step on this device, or null. */
export function sweepRefusal(
  spec: MatmulSpec,
  tile: MatmulTile,
  lim: { maxInvocations: number; maxWorkgroupBytes: number; scratchBytes: number },
): string | null {
  if (matmulTileError(spec, tile)) return "invalid";
  if (tileThreads(tile) > lim.maxInvocations || matmulWorkgroupBytes(spec, tile) > lim.maxWorkgroupBytes) {
    return "too big";
  }
  if ((tile.splitK ?? 1) > 1 && matmulScratchBytes(spec, tile) > lim.scratchBytes) return "no room";
  return null;
}

/** `tile` with the pick's split-K count, when the pick splits K (split-K needs the second generation). */
export function withPickSplit(tile: MatmulTile, pick: MatmulTile): MatmulTile {
  const k = pick.splitK ?? 1;
  if (k <= 1) return tile;
  return { ...tile, ...(tile.gen === 2 ? {} : { gen: 2, buffers: 2 }), splitK: k };
}

if (import.meta.main) {
  const ctx = await openDevice();
  console.log(describeDevice(ctx));
  const cpu = isCpuAdapter(ctx);
  // Named in each emitted rule's note: the table may come to hold rules measured on other GPUs.
  const gpu = ctx.adapterInfo.description || ctx.adapterInfo.vendor || "this adapter";
  const models = arg("models", cpu ? "gpt2-tiny" : "gpt2-345M").split(",");
  const B = +arg("batch", cpu ? "4" : "8"), T = +arg("seq", cpu ? "64" : "1024");
  const steps = +arg("steps", cpu ? "1" : "3");
  const only = new RegExp(arg("only", "."));
  const minGain = +arg("min-gain", "0.01");
  const all = sweepTiles();
  const picked = arg("candidates", "");
  const indexes = picked ? picked.split(",").map(Number) : all.map((_, i) => i);
  if (indexes.some((i) => !Number.isInteger(i) || i < 0 || i >= all.length)) {
    throw new Error(`--candidates: indexes 0 to ${all.length - 1}, got ${picked}`);
  }
  if (!ctx.hasTimestamps) console.log("No timestamp queries on this adapter: nothing to read per matmul");
  const maxInvocations = ctx.limits.maxComputeInvocationsPerWorkgroup;
  const maxWorkgroupBytes = ctx.limits.maxComputeWorkgroupStorageSize;
  const base: TrainBenchOptions = { precision: "fp32", checkpointLayers: 0, profile: true, ops: true };
  const emitted: TileRule[] = [];
  for (const model of models) {
    const config = presetConfig(model);
    const BT = B * T;
    const shapes: BenchShape[] = gpt2MatmulShapes(
      model,
      config,
      BT,
      headChunkRows(ctx.limits, config, BT),
      "fp32",
    )
      .filter((s) => only.test(s.op));
    // The plan's split-K scratch (model/plan.ts, training).
    const scratchBytes = 4 * Math.min(MATMUL_PART_FLOATS, 8 * 4 * config.n_embd ** 2);
    const lim = { maxInvocations, maxWorkgroupBytes, scratchBytes };
    const pick = new Map(
      shapes.map((s) => [s.op, chooseTile(s.spec, maxInvocations, { maxWorkgroupBytes, splitK: true })]),
    );
    type Cell = { ms: number; tflops: number } | string;
    const table = new Map<string, Map<string, Cell>>(shapes.map((s) => [s.op, new Map()]));
    const tileOf = (s: BenchShape, col: string) =>
      col === "pick" ? pick.get(s.op)! : withPickSplit(all[+col], pick.get(s.op)!);
    const columns = ["pick", ...indexes.map(String)];
    for (const col of columns) {
      const rules: TileRule[] = [];
      for (const s of shapes) {
        if (col === "pick") continue;
        const why = sweepRefusal(s.spec, tileOf(s, col), lim);
        if (why) table.get(s.op)!.set(col, why);
        else rules.push(ruleFor(s, tileOf(s, col)));
      }
      const r = await benchTraining(ctx, model, B, T, steps, {
        ...base,
        kernels: { tileRules: [...rules, ...MATMUL_TILE_RULES] },
      });
      const name = col === "pick" ? "pick" : `${col} ${tileName(all[+col])}`;
      console.log(`${model} tile ${name}: ${r.ms_per_step.toFixed(1)} ms/step (wall clock)`);
      for (const s of shapes) {
        const t = matmulTime(r, s.op);
        if (t && !table.get(s.op)!.has(col)) table.get(s.op)!.set(col, t);
      }
    }
    console.log(`\n${model}, ${B} × ${T}: GPU ms per step of each matmul (timestamp queries), by tile`);
    indexes.forEach((i) => console.log(`  ${String(i).padStart(2)}: ${tileName(all[i])}`));
    console.log(`  ${"op".padEnd(14)} ${columns.map((c) => c.padStart(13)).join(" ")}`);
    for (const s of shapes) {
      const row = table.get(s.op)!;
      const cell = (c: string) => cellText(row.get(c)).padStart(13);
      console.log(`  ${s.op.padEnd(14)} ${columns.map(cell).join(" ")}`);
      const p = row.get("pick");
      let best: { col: string; ms: number; tflops: number } | null = null;
      for (const [col, v] of row) {
        if (col !== "pick" && typeof v !== "string" && (!best || v.ms < best.ms)) best = { col, ...v };
      }
      if (best && typeof p === "object" && best.ms < p.ms * (1 - minGain)) {
        const note = `measured inside the training step (bench/tile_sweep.ts) on ${gpu}, ${
          new Date().toISOString().slice(0, 10)
        }, issue 38: ${best.ms.toFixed(2)} ms against the pick's ${p.ms.toFixed(2)}`;
        emitted.push(ruleFor(s, tileOf(s, best.col), note, best.tflops));
      }
    }
  }
  const emit = arg("emit", "");
  if (emit) {
    await Deno.writeTextFile(emit, JSON.stringify(emitted, null, 2) + "\n");
    console.log(`\n${emitted.length} rules (the best tile where it beat the pick) written to ${emit}`);
  }
  ctx.device.destroy();
  Deno.exit(0);
}
