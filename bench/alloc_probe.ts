/**
 * Where GPU memory beyond the plan goes: allocates buffers without running kernels and compares
 * nvidia-smi's memory.used delta with the bytes asked for. Variants: every buffer of a model's
 * training plan as the engine allocates it; the same bytes in 1 GiB buffers; and N buffers of
 * one size. Needs nvidia-smi (the GPU machine).
 *
 *   deno run -A bench/alloc_probe.ts [--model gpt2-345M] [--batch 8] [--seq 1024] [--checkpoint 0]
 *                                    [--precision fp32] [--sizes 16,32,48,96,128,256,300] [--count 24]
 */

import { presetConfig } from "../gpu/config.ts";
import { createStorage, type GpuContext, openDevice } from "../gpu/device.ts";
import { planModel, type Precision } from "../gpu/plan.ts";

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
const sizes = plan.buffers.filter((b) => b.usage === "storage").map((b) => b.bytes);
const total = sizes.reduce((a, b) => a + b, 0);
const hist = new Map<number, number>();
for (const s of sizes) hist.set(Math.round(s / MiB), (hist.get(Math.round(s / MiB)) ?? 0) + 1);
console.log(
  `plan: ${sizes.length} buffers, ${(total / GiB).toFixed(2)} GiB; MiB x count: ` +
    [...hist].sort((a, b) => b[0] - a[0]).map(([m, n]) => `${m}x${n}`).join(" "),
);
const rows: Record<string, unknown>[] = [];
const report = (variant: string, asked: number, delta: number) => {
  rows.push({ variant, asked, delta });
  console.log(
    `${variant.padEnd(28)} asked ${(asked / GiB).toFixed(3).padStart(8)} GiB  nvidia-smi ${
      (delta / GiB).toFixed(3).padStart(8)
    } GiB  ${((delta / asked - 1) * 100).toFixed(1).padStart(6)}%`,
  );
};
report("plan buffers", total, await probe(ctx, sizes));
const arena: number[] = [];
for (let left = total; left > 0; left -= GiB) arena.push(Math.min(GiB, left));
report("same bytes in 1 GiB buffers", total, await probe(ctx, arena));
const count = +arg("count", "24");
for (const mib of arg("sizes", "16,32,48,64,96,128,192,256,300,512").split(",").filter(Boolean).map(Number)) {
  const list = Array.from({ length: count }, () => mib * MiB);
  report(`${count} x ${mib} MiB`, count * mib * MiB, await probe(ctx, list));
}
console.log(JSON.stringify(rows));
