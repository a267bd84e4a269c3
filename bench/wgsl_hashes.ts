/**
 * The WGSL the engine generates, hashed: builds training models and generation plans over a fixed
 * set of configurations (fp32 and fp16, activation checkpointing, micro-batches, data and tensor
 * parallel ranks, the CPU adapters' direct kernels and the tiled ones, every generation shape) and
 * prints one SHA-256 per distinct shader module, sorted, then a digest of them all. A change that
 * should leave every kernel as it was (a move, a refactor) shows it by an unchanged digest:
 *
 *   deno run -A bench/wgsl_hashes.ts > before.txt   # on the old tree
 *   deno run -A bench/wgsl_hashes.ts > after.txt    # on the new one; `diff` them
 *
 * Needs an adapter (lavapipe will do). Every module is captured at `createShaderModule`.
 */

import { makeConfig, paramLayout } from "../model/config.ts";
import { openDevice } from "../engine/device.ts";
import { Trainer, type TrainerOptions } from "../engine/trainer.ts";
import { Generator } from "../engine/generator.ts";
import { tensorParallelConfig } from "../model/shard.ts";

const seen = new Map<string, string>();
const original = GPUDevice.prototype.createShaderModule;
GPUDevice.prototype.createShaderModule = function (this: GPUDevice, d: GPUShaderModuleDescriptor) {
  seen.set(d.code, d.label ?? "");
  return original.call(this, d);
};

async function sha(text: string): Promise<string> {
  const h = await crypto.subtle.digest("SHA-256", new TextEncoder().encode(text));
  return Array.from(new Uint8Array(h), (b) => b.toString(16).padStart(2, "0")).join("");
}

const ctx = await openDevice();
const config = makeConfig({ n_layer: 2, n_head: 4, n_embd: 64, n_positions: 64, vocab_size: 1000 });
const base: TrainerOptions = {
  config,
  batchSize: 2,
  seqLen: 32,
  schedule: { lr: 1e-3, min_lr: 1e-4, warmup_iters: 0, decay_iters: 10, style: "cosine" },
  adamw: { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, clip_grad: 1 },
  attnDropout: 0.1,
  hiddenDropout: 0.1,
  seed: 1,
};
const variants: Array<Partial<TrainerOptions>> = [
  {},
  { precision: "fp16" },
  { precision: "fp16", f16Math: false },
  { checkpointLayers: 1 },
  { microBatches: 2 },
  { dataParallel: { rank: 0, size: 2 } },
  { dataParallel: { rank: 0, size: 2 }, shardedOptimizer: true },
  { attnDropout: 0, hiddenDropout: 0, seqLen: 64 },
];
for (const cpuDirect of [true, false]) {
  for (const v of variants) {
    const tr = await Trainer.create(ctx, { ...base, ...v, kernels: { cpuDirect } });
    tr.destroy();
  }
  for (const rank of [0, 1]) {
    const tr = await Trainer.create(ctx, {
      ...base,
      config: tensorParallelConfig(config, 2),
      kernels: { cpuDirect },
      tensorParallel: { rank, size: 2, exchange: () => Promise.resolve() },
    });
    tr.destroy();
  }
}
const params = new Float32Array(paramLayout(config).totalSize);
for (const cpuUniform of [true, false]) {
  const gen = await Generator.create(ctx, config, params, {
    maxStreams: 8,
    chunk: 4,
    cpuUniform,
  });
  await gen.warm();
}
const lines: string[] = [];
for (const [code, label] of seen) lines.push(`${await sha(code)} ${label}`);
lines.sort();
console.log(lines.join("\n"));
console.log(`modules ${lines.length} digest ${await sha(lines.map((l) => l.slice(0, 64)).join("\n"))}`);
Deno.exit(0);
