/**
 * Where a cold start's time goes on a CPU adapter: builds the demo's trainer (or `--model`,
 * `--batch`, `--seq`), timing each pipeline's creation, then runs one step with one submission per
 * op, twice, so an op's first dispatch minus its second is what the driver compiled lazily
 * (llvmpipe through OpenGL compiles at first dispatch). Run with MESA_SHADER_CACHE_DISABLE=true for
 * a fresh machine's figures. Prints the slowest ops of each kind. `--tiled` keeps the GPUs' tiled
 * kernels on a CPU adapter (what it compiled before the direct ones existed).
 */
import { openDevice } from "../engine/device.ts";
import { presetConfig } from "../model/config.ts";
import { Trainer } from "../engine/trainer.ts";
import { DEFAULT_ADAMW } from "../model/schedule.ts";
import type { CompileProgress, Op } from "../engine/ops.ts";

const arg = (name: string, dflt: string) => {
  const i = Deno.args.indexOf(`--${name}`);
  return i >= 0 ? Deno.args[i + 1] : dflt;
};
const model = arg("model", "gpt2-tiny");
const B = Number(arg("batch", "4")), T = Number(arg("seq", "32"));
const ctx = await openDevice();
console.log(`adapter: ${ctx.adapterInfo.description} / ${ctx.adapterInfo.device}`);
const created: { label: string; ms: number; lines: number }[] = [];
const dev = ctx.device;
const orig = dev.createComputePipeline.bind(dev);
dev.createComputePipeline = (d: GPUComputePipelineDescriptor) => {
  const t0 = performance.now();
  const p = orig(d);
  created.push({ label: d.label ?? "?", ms: performance.now() - t0, lines: 0 });
  return p;
};
const compiled: CompileProgress[] = [];
const t0 = performance.now();
const trainer = await Trainer.create(ctx, {
  config: presetConfig(model),
  batchSize: B,
  seqLen: T,
  schedule: { lr: 1e-3, min_lr: 1e-4, warmup_iters: 1, decay_iters: 10, style: "cosine" },
  adamw: DEFAULT_ADAMW,
  attnDropout: 0,
  hiddenDropout: 0,
  seed: 1,
  kernels: { cpuDirect: !Deno.args.includes("--tiled") },
  onCompile: (p) => {
    if (Deno.args.includes("--verbose")) {
      console.log(`  ${p.done}/${p.total} ${p.label} ${p.ms.toFixed(0)} ms`);
    }
    compiled.push(p);
  },
});
const build = performance.now() - t0;
const createSum = created.reduce((s, c) => s + c.ms, 0);
console.log(
  `build ${build.toFixed(0)} ms, ${created.length} pipelines created in ${
    createSum.toFixed(0)
  } ms; ${compiled.length} reported, ${compiled.reduce((s, c) => s + c.ms, 0).toFixed(0)} ms`,
);
for (const c of [...compiled].sort((a, b) => b.ms - a.ms).slice(0, 12)) {
  console.log(`compile ${c.ms.toFixed(0).padStart(6)} ms ${c.label}`);
}
const m = trainer.model;
const ops = [...m.forward, ...m.loss, ...m.backward, ...m.optimizer].filter((o) => "pipeline" in o) as Op[];
console.log(`${ops.length} ops`);
async function runOnce(): Promise<number[]> {
  const times: number[] = [];
  for (const op of ops) {
    const t = performance.now();
    const enc = dev.createCommandEncoder();
    const pass = enc.beginComputePass();
    pass.setPipeline(op.pipeline);
    op.bindGroups.forEach((g, i) => pass.setBindGroup(i, g));
    pass.dispatchWorkgroups(...op.grid);
    pass.end();
    dev.queue.submit([enc.finish()]);
    await dev.queue.onSubmittedWorkDone();
    times.push(performance.now() - t);
  }
  return times;
}
const t1 = performance.now();
const first = await runOnce();
const firstTotal = performance.now() - t1;
const second = await runOnce();
console.log(
  `first pass ${firstTotal.toFixed(0)} ms, second ${second.reduce((a, b) => a + b, 0).toFixed(0)} ms`,
);
const rows = ops.map((o, i) => ({ label: o.label, kind: o.kind, first: first[i], second: second[i] }));
const seen = new Map<GPUComputePipeline, number>();
rows.sort((a, b) => (b.first - b.second) - (a.first - a.second));
for (const r of rows.slice(0, Number(arg("top", "40")))) {
  console.log(`${(r.first - r.second).toFixed(0).padStart(7)} ms  ${r.kind.padEnd(14)} ${r.label}`);
}
const createdTop = [...created].sort((a, b) => b.ms - a.ms).slice(0, 10);
for (const c of createdTop) console.log(`create ${c.ms.toFixed(0).padStart(6)} ms ${c.label}`);
void seen;
Deno.exit(0);
