/**
 * Where GPU memory beyond the plan goes: allocates buffers without running kernels and compares
 * nvidia-smi's memory.used delta with the bytes asked for, beside the waste the allocator model
 * predicts (allocatorWaste in model/plan.ts: 256 MiB blocks counted whole). Variants: every buffer
 * of a model's training plan in plan order; the same buffers in the packed order the engine
 * allocates them in (allocationOrder); the same bytes in 1 GiB buffers; and N buffers of one
 * size. Needs nvidia-smi (the GPU machine).
 *
 *   deno run -A bench/alloc_probe.ts [--model gpt2-345M] [--batch 8] [--seq 1024] [--checkpoint 0]
 *                                    [--precision fp32] [--sizes 16,32,48,96,128,256,300] [--count 24]
 */

import { presetConfig } from "../model/config.ts";
import { createStorage, type GpuContext, openDevice } from "../engine/device.ts";
import { allocationOrder, allocatorWaste, planModel, type Precision } from "../model/plan.ts";

function arg(name: string, def: string): string {
  const i = Deno.args.indexOf(`--${name}`);
  return i >= 0 && i + 1 < Deno.args.length ? Deno.args[i + 1] : def;
}

async function used(): Promise<number> {
  const out = await new Deno.Command("nvidia-smi", {
    args: ["--query-gpu=memory.used", "--format=csv,noheader,nounits"],
    stdout: "piped",
  }).output();
  return Number(new TextDecoder().decode(out.stdout).trim().split("\n")[0]) * 2 ** 20;
}

/** Allocates buffers of `sizes` bytes, touches each, and returns the nvidia-smi delta. */
async function probe(ctx: GpuContext, sizes: number[]): Promise<number> {
  await ctx.device.queue.onSubmittedWorkDone();
  const before = await used();
  const bufs: GPUBuffer[] = [];
  for (const [i, s] of sizes.entries()) bufs.push(await createStorage(ctx, `probe ${i}`, s));
  const enc = ctx.device.createCommandEncoder();
  for (const b of bufs) enc.clearBuffer(b);
  ctx.device.queue.submit([enc.finish()]);
  await ctx.device.queue.onSubmittedWorkDone();
  const after = await used();
  for (const b of bufs) b.destroy();
  await ctx.device.queue.onSubmittedWorkDone();
  await new Promise((r) => setTimeout(r, 500));
  return after - before;
}

const GiB = 2 ** 30, MiB = 2 ** 20;
const ctx = await openDevice();
const config = presetConfig(arg("model", "gpt2-345M"));
const plan = planModel(ctx.limits, { config, B: +arg("batch", "8"), T: +arg("seq", "1024") }, {
  checkpointLayers: +arg("checkpoint", "0"),
  precision: arg("precision", "fp32") as Precision,
});
const storage = plan.buffers.filter((b) => b.usage === "storage");
const sizes = storage.map((b) => b.bytes);
const total = sizes.reduce((a, b) => a + b, 0);
const hist = new Map<number, number>();
for (const s of sizes) hist.set(Math.round(s / MiB), (hist.get(Math.round(s / MiB)) ?? 0) + 1);
console.log(
  `plan: ${sizes.length} buffers, ${(total / GiB).toFixed(2)} GiB; MiB x count: ` +
    [...hist].sort((a, b) => b[0] - a[0]).map(([m, n]) => `${m}x${n}`).join(" "),
);
const rows: Record<string, unknown>[] = [];
/** One variant: `list` allocated in that order, measured beside the modelled waste. */
const report = async (variant: string, list: number[]) => {
  const asked = list.reduce((a, b) => a + b, 0), modelled = allocatorWaste(list);
  const delta = await probe(ctx, list);
  rows.push({ variant, asked, delta, modelled_waste: modelled });
  console.log(
    `${variant.padEnd(28)} asked ${(asked / GiB).toFixed(3).padStart(8)} GiB  nvidia-smi ${
      (delta / GiB).toFixed(3).padStart(8)
    } GiB  ${((delta / asked - 1) * 100).toFixed(1).padStart(6)}%  modelled waste ${
      (modelled / GiB).toFixed(3).padStart(6)
    } GiB (${((modelled / asked) * 100).toFixed(1).padStart(5)}%)`,
  );
};
await report("plan buffers", sizes);
await report("plan buffers, packed order", allocationOrder(storage).order.map((b) => b.bytes));
const arena: number[] = [];
for (let left = total; left > 0; left -= GiB) arena.push(Math.min(GiB, left));
await report("same bytes in 1 GiB buffers", arena);
const count = +arg("count", "24");
for (const mib of arg("sizes", "16,32,48,64,96,128,192,256,300,512").split(",").filter(Boolean).map(Number)) {
  await report(`${count} x ${mib} MiB`, Array.from({ length: count }, () => mib * MiB));
}
console.log(JSON.stringify(rows));
