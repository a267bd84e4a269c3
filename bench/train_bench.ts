/**
 * Training-step benchmark: tokens/s and ms/step of GPT-2 presets on the adapter it finds, then a
 * per-kernel table from timestamp queries (time, share, achieved TFLOP/s), and optionally the
 * PyTorch peer (bench/torch_gpt2.py) run in the same process tree for a side-by-side ratio.
 *
 *   deno task bench [--models gpt2-124M,gpt2-345M] [--batch 8] [--seq 1024] [--steps 10] [--torch]
 *                   [--precision fp32|fp16] [--checkpoint N] [--no-profile] [--no-f16-math]
 *                   [--tile-rules all|split-k|none] [--no-flash] [--shared-attn-tiles]
 *                   [--attn-scores | --no-attn-scores] (dQ as a matmul over the dS the dK/dV kernel
 *                   stores; default: where the split kernels run)
 *                   [--attn-unroll 1|2|4] (the split attention backward's loops, rows per trip)
 *                   [--attn-fills] (the attention backward's tile fills written out, AttentionSpec.writtenFills)
 *                   [--attn-scatter] (the dK/dV kernel's sums reduce-scattered, AttentionSpec.scatterSums)
 *                   [--ln-written] (the LayerNorm kernels' row trips written out, kernels.layernormWritten)
 *                   [--uniform-dims all|none|weight-gradients] (which matmuls read their sizes from a
 *                   uniform, kernels.uniformDims)
 *                   [--colsum-unroll 8|16|32] (loads in flight of the bias and LayerNorm column sums)
 *                   [--head-chunk-rows N] (rows of one LM head chunk, a multiple of 64; default: 512 MiB of logits)
 *                   [--ops] (the matmuls by shape) [--tile-rules-json F] (rules before the measured ones)
 *                   [--objectives plain,sft] (each model under each objective, in turns, --rounds 2 times)
 *                   [--variants "default;--attn-fills;--colsum-unroll 32" [--rounds 2]] (each variant's
 *                   flags before the others, all in this process, every round each variant once in an
 *                   order turned by one each round; then each variant's median ms/step and profiled kernel
 *                   families against the first variant's: bench/variants.ts)
 *
 * Memory: beside each run it prints the plan's estimate per category (model/memory_estimate.ts, the same
 * plan the engine allocates), the bytes allocated, and the GPU memory measured by nvidia-smi
 * (memory.used after the timed steps minus before the model was built) where nvidia-smi exists.
 * `--checkpoint N` recomputes activations in groups of N layers. `--objectives plain,sft` compares a
 * plain step with SFT's masked loss (a trainer created with `lossMask`, batches carrying a mask that
 * selects about half of the targets in runs, like assistant turns) at the same shape.
 *
 * Imports nothing from npm, so it runs on the GPU machine with `deno run -A --no-config --no-check`.
 */

import { presetConfig } from "../model/config.ts";
import { describeDevice, type GpuContext, openDevice } from "../engine/device.ts";
import { type Estimate, estimateTraining } from "../model/memory_estimate.ts";
import type { Precision } from "../model/plan.ts";
import { type OpTiming, Trainer, type TrainerOptions } from "../engine/trainer.ts";
import { MATMUL_TILE_RULES, type TileRule } from "../engine/kernels/matmul.ts";
import { planVariants, roundOrder, type Sample, summarize, summaryLines } from "./variants.ts";

/** How one benchmark run trains. */
export interface TrainBenchOptions {
  precision: Precision;
  /** Layers per recomputed group, 0 for none. */
  checkpointLayers: number;
  /** Time each kernel in one extra profiled step. */
  profile: boolean;
  /** With profile: also the matmuls by shape. */
  ops?: boolean;
  /** fp16: f16 arithmetic in the matmuls whose inputs are f16 (false: f32 arithmetic on f16 data). */
  f16Math?: boolean;
  /** SFT: the loss over masked targets only (Trainer's lossMask), batches with a mask. */
  sft?: boolean;
  /** Kernel choices (see BuildOptions.kernels). */
  kernels?: TrainerOptions["kernels"];
  /** The attention backward's dQ as a matmul over stored dS (PlanOptions.attentionScores). */
  attentionScores?: boolean;
  /** Rows of one LM head chunk (ChunkOptions.headChunkRows); default the plan's. */
  headChunkRows?: number;
}

/** One model's measured figures. */
export interface TrainBenchResult {
  model: string;
  batch: number;
  seq: number;
  ms_per_step: number;
  tokens_per_s: number;
  loss: number;
  precision: Precision;
  checkpoint_layers: number;
  objective: "plain" | "sft";
  /** Loss scale after the timed steps, and steps skipped on overflow (fp16 starts at 2^32 and backs off). */
  loss_scale: number;
  skipped_steps: number;
  kernels: Array<{ kind: string; ms: number; share: number; tflops: number }>;
  /** The matmuls by shape (op labels without their layer), with `--ops`. */
  ops?: Array<{ kind: string; ms: number; share: number; tflops: number }>;
  phases: Record<string, number>;
  /** The plan's estimate (bytes per category) for this run. */
  estimate: Estimate["bytes_per_gpu"];
  /** Bytes of the buffers the trainer allocated. */
  allocated_bytes: number;
  /** GPU memory used after the timed steps minus before (nvidia-smi), or null where unavailable. */
  measured_bytes: number | null;
  torch?: { tokens_per_s: number; ms_per_step: number } | { error: string };
  /** With --variants: the variant's name (its flags, or "default"). */
  variant?: string;
}

function arg(args: readonly string[], name: string, def: string): string {
  const i = args.indexOf(`--${name}`);
  return i >= 0 && i + 1 < args.length ? args[i + 1] : def;
}

/** Times `steps` training steps (after warmup) and one profiled step. */
export async function benchTraining(
  ctx: GpuContext,
  model: string,
  B: number,
  T: number,
  steps: number,
  o: TrainBenchOptions = { precision: "fp32", checkpointLayers: 0, profile: true },
): Promise<TrainBenchResult> {
  const config = presetConfig(model);
  const estimate = estimateTraining({
    config,
    batchSize: B,
    seqLen: T,
    precision: o.precision,
    checkpointLayers: o.checkpointLayers,
    limits: ctx.limits,
  }).bytes_per_gpu;
  const usedBefore = await gpuMemoryUsed();
  const t0 = performance.now();
  const tr = await Trainer.create(ctx, {
    config,
    batchSize: B,
    seqLen: T,
    schedule: { lr: 1e-4, min_lr: 1e-5, warmup_iters: 0, decay_iters: 1000, style: "cosine" },
    adamw: { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.01, clip_grad: 1.0 },
    attnDropout: 0,
    hiddenDropout: 0,
    seed: 1,
    profile: ctx.hasTimestamps && o.profile,
    checkpointLayers: o.checkpointLayers,
    precision: o.precision,
    f16Math: o.f16Math,
    kernels: o.kernels,
    attentionScores: o.attentionScores,
    ...(o.headChunkRows ? { chunks: { headChunkRows: o.headChunkRows } } : {}),
    lossMask: o.sft,
  });
  console.error(
    `${model}: planned in ${((performance.now() - t0) / 1000).toFixed(1)} s, ` +
      `${(tr.memoryBytes / 2 ** 30).toFixed(2)} GiB on the GPU`,
  );
  const tokens = new Uint16Array(B * (T + 1));
  let s = 12345;
  for (let i = 0; i < tokens.length; i++) {
    s = (Math.imul(s, 1103515245) + 12345) >>> 0;
    tokens[i] = (s >>> 8) % config.vocab_size;
  }
  const batch = o.sft ? { tokens, mask: assistantMask(B * T) } : tokens;
  for (let i = 0; i < 2; i++) tr.trainStep(batch);
  await tr.lastStats();
  const start = performance.now();
  for (let i = 0; i < steps; i++) tr.trainStep(batch);
  const { loss, lossScale, skippedSteps } = await tr.lastStats();
  const ms = (performance.now() - start) / steps;
  const usedAfter = await gpuMemoryUsed();
  const result: TrainBenchResult = {
    model,
    batch: B,
    seq: T,
    ms_per_step: ms,
    tokens_per_s: (B * T) / (ms / 1000),
    loss,
    precision: o.precision,
    checkpoint_layers: o.checkpointLayers,
    objective: o.sft ? "sft" : "plain",
    loss_scale: lossScale,
    skipped_steps: skippedSteps,
    kernels: [],
    phases: {},
    estimate,
    allocated_bytes: tr.memoryBytes,
    measured_bytes: usedBefore !== null && usedAfter !== null ? usedAfter - usedBefore : null,
  };
  if (ctx.hasTimestamps && o.profile) {
    tr.trainStep(batch, true);
    const prof = (await tr.profile())!;
    result.kernels = aggregate(prof);
    if (o.ops) {
      result.ops = aggregate(
        prof.filter((p) => p.kind.startsWith("matmul")).map((p) => ({
          ...p,
          kind: p.label.replace(/^l\d+\./, "").replace(/(\.(part|sum|[a-z]\d+))+$/, ""),
        })),
      );
    }
    for (const p of prof) result.phases[p.phase] = (result.phases[p.phase] ?? 0) + p.ms;
  }
  tr.destroy();
  return result;
}

/** A loss mask of n targets: runs of 16-256 unmasked (user) then masked-in (assistant) targets, about half each. */
function assistantMask(n: number): Uint8Array {
  const mask = new Uint8Array(n);
  let s = 777, on = 0;
  for (let i = 0; i < n;) {
    s = (Math.imul(s, 1103515245) + 12345) >>> 0;
    const run = 16 + ((s >>> 8) % 241);
    mask.fill(on, i, Math.min(n, i + run));
    i += run;
    on ^= 1;
  }
  return mask;
}

/** GPU memory in use (bytes, nvidia-smi's memory.used of the GPU this process sees first), or null. */
async function gpuMemoryUsed(): Promise<number | null> {
  try {
    const out = await new Deno.Command("nvidia-smi", {
      args: ["--query-gpu=memory.used", "--format=csv,noheader,nounits"],
      stdout: "piped",
      stderr: "null",
    }).output();
    if (!out.success) return null;
    const mib = Number(new TextDecoder().decode(out.stdout).trim().split("\n")[0]);
    return Number.isFinite(mib) ? mib * 2 ** 20 : null;
  } catch {
    return null;
  }
}

function aggregate(prof: OpTiming[]) {
  const total = prof.reduce((a, p) => a + p.ms, 0);
  const by = new Map<string, { ms: number; flops: number }>();
  for (const p of prof) {
    const e = by.get(p.kind) ?? { ms: 0, flops: 0 };
    e.ms += p.ms;
    e.flops += p.flops;
    by.set(p.kind, e);
  }
  return [...by.entries()]
    .map(([kind, e]) => ({ kind, ms: e.ms, share: e.ms / total, tflops: e.flops / (e.ms / 1000) / 1e12 }))
    .sort((a, b) => b.ms - a.ms);
}

async function runTorch(model: string, B: number, T: number, steps: number) {
  try {
    const out = await new Deno.Command("python3", {
      args: [
        "bench/torch_gpt2.py",
        "--model",
        model,
        "--batch",
        `${B}`,
        "--seq",
        `${T}`,
        "--steps",
        `${steps}`,
      ],
      stderr: "inherit",
    }).output();
    const line = new TextDecoder().decode(out.stdout).trim().split("\n").pop() ?? "";
    if (!out.success) return { error: `python3 exited with ${out.code}` };
    const j = JSON.parse(line);
    return { tokens_per_s: j.tokens_per_s as number, ms_per_step: j.ms_per_step as number };
  } catch (e) {
    return { error: String(e) };
  }
}

/** Prints a result as a table. */
export function printResult(r: TrainBenchResult): void {
  const f = (n: number, d = 1) => n.toFixed(d);
  const gib = (n: number) => (n / 2 ** 30).toFixed(2);
  console.log(
    `\n${r.model}  batch ${r.batch} seq ${r.seq} ${r.precision}${r.objective === "sft" ? " sft" : ""}` +
      `${r.checkpoint_layers ? ` checkpoint ${r.checkpoint_layers}` : ""}: ${f(r.ms_per_step)} ms/step, ${
        f(r.tokens_per_s, 0)
      } tokens/s, loss ${f(r.loss, 3)}` +
      (r.precision === "fp16" ? `, loss scale ${r.loss_scale}, ${r.skipped_steps} steps skipped` : ""),
  );
  const e = r.estimate;
  console.log(
    `  memory GiB: estimate ${gib(e.total)} (weights ${gib(e.weights)}, gradients ${gib(e.gradients)}, ` +
      `optimizer ${gib(e.optimizer)}, activations ${gib(e.activations)}, logits ${gib(e.logits)}, ` +
      `workspace ${gib(e.workspace)}); allocated ${gib(r.allocated_bytes)}; measured (nvidia-smi) ${
        r.measured_bytes === null ? "n/a" : gib(r.measured_bytes)
      }`,
  );
  if (r.torch) {
    if ("error" in r.torch) console.log(`  PyTorch fp32 eager: ${r.torch.error}`);
    else {
      console.log(
        `  PyTorch fp32 eager: ${f(r.torch.tokens_per_s, 0)} tokens/s -> ratio ${
          f(r.tokens_per_s / r.torch.tokens_per_s, 3)
        }x`,
      );
    }
  }
  if (r.kernels.length) {
    console.log(
      `  phases (GPU ms, profiled step): ${
        Object.entries(r.phases).map(([k, v]) => `${k} ${f(v)}`).join(", ")
      }`,
    );
    console.log("  kernel           ms      share   TFLOP/s");
    for (
      const k of [
        ...r.kernels,
        ...(r.ops ? [{ kind: "(matmuls)", ms: 0, share: 0, tflops: 0 }] : []),
        ...r.ops ?? [],
      ]
    ) {
      console.log(
        `  ${k.kind.padEnd(15)} ${f(k.ms).padStart(7)}  ${(f(k.share * 100) + "%").padStart(6)}  ${
          k.tflops > 0 ? f(k.tflops, 2).padStart(7) : "      -"
        }`,
      );
    }
  }
}

/** The options of one run from the command's flags (a variant's flags come first and win). */
export function trainOptions(args: readonly string[]): TrainBenchOptions {
  const a = [...args];
  const precision = arg(a, "precision", "fp32") as Precision;
  if (precision !== "fp32" && precision !== "fp16") throw new Error(`Unknown --precision "${precision}"`);
  return {
    precision,
    checkpointLayers: +arg(a, "checkpoint", "0"),
    profile: !a.includes("--no-profile"),
    ops: a.includes("--ops"),
    f16Math: !a.includes("--no-f16-math"),
    kernels: {
      tileRules: a.includes("--tile-rules-json")
        ? [
          ...JSON.parse(Deno.readTextFileSync(arg(a, "tile-rules-json", ""))) as TileRule[],
          ...MATMUL_TILE_RULES,
        ]
        : arg(a, "tile-rules", "all") as "all" | "split-k" | "none",
      flashAttention: !a.includes("--no-flash"),
      attentionBackwardTiles: !a.includes("--shared-attn-tiles"),
      ...(a.includes("--attn-unroll") ? { attentionUnroll: +arg(a, "attn-unroll", "1") as 1 | 2 | 4 } : {}),
      ...(a.includes("--attn-fills") ? { attentionFills: true } : {}),
      ...(a.includes("--attn-scatter") ? { attentionScatter: true } : {}),
      ...(a.includes("--ln-written") ? { layernormWritten: true } : {}),
      ...(a.includes("--uniform-dims")
        ? { uniformDims: arg(a, "uniform-dims", "all") as "weight-gradients" | "all" | "none" }
        : {}),
      ...(a.includes("--colsum-unroll")
        ? { columnSumUnroll: +arg(a, "colsum-unroll", "8") as 8 | 16 | 32 }
        : {}),
    },
    attentionScores: a.includes("--no-attn-scores") ? false : a.includes("--attn-scores") ? true : undefined,
    headChunkRows: a.includes("--head-chunk-rows") ? +arg(a, "head-chunk-rows", "0") : undefined,
  };
}

if (import.meta.main) {
  const args = Deno.args;
  const ctx = await openDevice();
  console.log(describeDevice(ctx));
  const cpu = /llvmpipe|lavapipe|swiftshader/i.test(ctx.adapterInfo.description);
  const models = arg(args, "models", cpu ? "gpt2-tiny" : "gpt2-124M,gpt2-345M").split(",");
  const B = +arg(args, "batch", cpu ? "4" : "8"), T = +arg(args, "seq", cpu ? "64" : "1024");
  const steps = +arg(args, "steps", cpu ? "3" : "10");
  const plan = planVariants(args, trainOptions), variants = plan.variants;
  if (cpu) console.log("CPU adapter: benchmarking gpt2-tiny only (pass --models to override)");
  const objectives = arg(args, "objectives", "plain").split(",");
  for (const o of objectives) if (o !== "plain" && o !== "sft") throw new Error(`Unknown objective "${o}"`);
  if (objectives.length > 1 && variants.length > 1) {
    throw new Error("--objectives and --variants: one at a time");
  }
  const rounds = objectives.length > 1 ? +arg(args, "rounds", "2") : plan.rounds;
  const results: TrainBenchResult[] = [];
  const samples: Sample[] = [];
  for (const model of models) {
    for (let round = 0; round < rounds; round++) {
      for (const v of roundOrder(variants, round)) {
        for (const objective of objectives) {
          const r = await benchTraining(ctx, model, B, T, steps, { ...v.options, sft: objective === "sft" });
          if (args.includes("--torch") && round === 0 && v === variants[0] && objective === objectives[0]) {
            r.torch = await runTorch(model, B, T, steps);
          }
          if (variants.length > 1) {
            r.variant = v.name;
            console.log(`\nvariant ${v.name}, round ${round + 1} of ${rounds}:`);
            samples.push({ variant: v.name, key: model, value: r.ms_per_step });
            for (const k of r.kernels) {
              samples.push({ variant: v.name, key: `${model} ${k.kind}`, value: k.ms });
            }
          }
          printResult(r);
          results.push(r);
        }
      }
    }
    if (objectives.length > 1) {
      const best = (o: string) =>
        Math.max(...results.filter((r) => r.model === model && r.objective === o).map((r) => r.tokens_per_s));
      const line = objectives.map((o) => `${o} ${best(o).toFixed(0)}`).join(", ");
      console.log(
        `${model}: best tokens/s over ${rounds} rounds: ${line}` +
          (objectives.includes("sft") && objectives.includes("plain")
            ? ` (sft / plain ${(best("sft") / best("plain")).toFixed(3)})`
            : ""),
      );
    }
  }
  if (variants.length > 1) {
    // ms per step first (the keys that are model names), then each kernel family's profiled ms.
    const rows = summarize(samples, variants.map((v) => v.name), false);
    const whole = rows.filter((r) => models.includes(r.key)),
      parts = rows.filter((r) => !models.includes(r.key));
    console.log("");
    for (
      const line of summaryLines([...whole, ...parts], "ms per step; kernel families: profiled GPU ms", false)
    ) {
      console.log(line);
    }
    // The peer ran once per model, in this call: each variant's median step against it.
    for (const r of results) {
      if (!r.torch || "error" in r.torch) continue;
      for (const w of whole.filter((w) => w.key === r.model)) {
        console.log(
          `${r.model} [${w.variant}]: ${((B * T) / (w.median / 1000)).toFixed(0)} tokens/s (median step), ` +
            `PyTorch fp32 eager ${r.torch.tokens_per_s.toFixed(0)}: ${
              (r.torch.ms_per_step / w.median).toFixed(3)
            }× (same call)`,
        );
      }
    }
  }
  const out = arg(args, "json", "");
  if (out) await Deno.writeTextFile(out, JSON.stringify({ device: describeDevice(ctx), results }, null, 2));
  ctx.device.destroy();
  Deno.exit(0);
}
