/**
 * The work the engine submits, op by op: builds the same training models and generation plans as
 * bench/wgsl_hashes.ts, runs one training step of each and the generator's rehearsal (every
 * prefill shape and decode bucket once), and records every command in submission order: the
 * pipeline (its WGSL's hash and entry point), each bind group's buffers (by allocation order, size,
 * offset and range), the workgroup counts, buffer copies, and every `writeBuffer` (its bytes
 * hashed). Labels are kept apart, so a rename shows alone. Prints the command count and two
 * digests (commands without labels, and labels); `--out F` writes one line per command, for
 * `diff`. A reshaping that leaves the engine's work as it was shows it by an unchanged first digest:
 *
 *   deno run -A bench/op_dump.ts --out before.txt   # on the old tree (copy this file there)
 *   deno run -A bench/op_dump.ts --out after.txt    # on the new one
 *
 * Needs an adapter (lavapipe will do). Imports nothing from npm.
 */

import { makeConfig, paramLayout } from "../model/config.ts";
import { openDevice } from "../engine/device.ts";
import { Trainer, type TrainerOptions } from "../engine/trainer.ts";
import { Generator } from "../engine/generator.ts";
import { tensorParallelConfig } from "../model/shard.ts";

const lines: string[] = [];
const labels: string[] = [];
const ids = new WeakMap<object, string>();
let nextBuffer = 0;

/** A short stable hash of text or bytes (FNV-1a, 64 bits as two 32-bit halves). */
function fnv(data: string | Uint8Array): string {
  const bytes = typeof data === "string" ? new TextEncoder().encode(data) : data;
  let a = 0x811c9dc5, b = 0x01000193 ^ 0x5bd1e995;
  for (const x of bytes) {
    a = Math.imul(a ^ x, 0x01000193) >>> 0;
    b = Math.imul(b ^ x ^ (a >>> 7), 0x5bd1e995) >>> 0;
  }
  return a.toString(16).padStart(8, "0") + b.toString(16).padStart(8, "0");
}

function record(line: string, label = ""): void {
  lines.push(line);
  labels.push(label);
}

const dev = GPUDevice.prototype;
const createShaderModule = dev.createShaderModule;
dev.createShaderModule = function (this: GPUDevice, d: GPUShaderModuleDescriptor) {
  const m = createShaderModule.call(this, d);
  ids.set(m, fnv(d.code));
  return m;
};
const createComputePipeline = dev.createComputePipeline;
dev.createComputePipeline = function (this: GPUDevice, d: GPUComputePipelineDescriptor) {
  const p = createComputePipeline.call(this, d);
  ids.set(p, `${ids.get(d.compute.module)}:${d.compute.entryPoint ?? ""}`);
  return p;
};
const createComputePipelineAsync = dev.createComputePipelineAsync;
dev.createComputePipelineAsync = async function (this: GPUDevice, d: GPUComputePipelineDescriptor) {
  const p = await createComputePipelineAsync.call(this, d);
  ids.set(p, `${ids.get(d.compute.module)}:${d.compute.entryPoint ?? ""}`);
  return p;
};
const createBuffer = dev.createBuffer;
dev.createBuffer = function (this: GPUDevice, d: GPUBufferDescriptor) {
  const b = createBuffer.call(this, d);
  ids.set(b, `b${nextBuffer++}/${d.size}/${d.usage}`);
  return b;
};
const createBindGroup = dev.createBindGroup;
dev.createBindGroup = function (this: GPUDevice, d: GPUBindGroupDescriptor) {
  const g = createBindGroup.call(this, d);
  const entries = [...d.entries].map((e) => {
    const r = e.resource as GPUBufferBinding;
    return `${e.binding}=${ids.get(r.buffer) ?? "?"}@${r.offset ?? 0}+${r.size ?? "all"}`;
  });
  ids.set(g, entries.join(","));
  return g;
};
const pass = GPUComputePassEncoder.prototype;
const setPipeline = pass.setPipeline;
pass.setPipeline = function (this: GPUComputePassEncoder, p: GPUComputePipeline) {
  record(`pipeline ${ids.get(p)}`, p.label);
  return setPipeline.call(this, p);
};
const setBindGroup = pass.setBindGroup as (this: GPUComputePassEncoder, ...a: unknown[]) => undefined;
(pass as unknown as { setBindGroup: unknown }).setBindGroup = function (
  this: GPUComputePassEncoder,
  i: number,
  g: GPUBindGroup | null,
  ...rest: unknown[]
) {
  record(`bind ${i} ${g ? ids.get(g) : "null"}${rest.length ? ` dyn ${JSON.stringify(rest[0])}` : ""}`);
  return setBindGroup.call(this, i, g, ...rest);
};
const dispatch = pass.dispatchWorkgroups;
pass.dispatchWorkgroups = function (this: GPUComputePassEncoder, x: number, y?: number, z?: number) {
  record(`dispatch ${x} ${y ?? 1} ${z ?? 1}`);
  return dispatch.call(this, x, y, z);
};
const dispatchIndirect = pass.dispatchWorkgroupsIndirect;
pass.dispatchWorkgroupsIndirect = function (this: GPUComputePassEncoder, b: GPUBuffer, offset: number) {
  record(`dispatch indirect ${ids.get(b)}@${offset}`);
  return dispatchIndirect.call(this, b, offset);
};
const enc = GPUCommandEncoder.prototype;
const copy = enc.copyBufferToBuffer as (this: GPUCommandEncoder, ...a: unknown[]) => undefined;
(enc as unknown as { copyBufferToBuffer: unknown }).copyBufferToBuffer = function (
  this: GPUCommandEncoder,
  ...a: unknown[]
) {
  const [src, so, dst, d, size] = a as [GPUBuffer, number, GPUBuffer, number, number];
  record(`copy ${ids.get(src)}@${so} -> ${ids.get(dst)}@${d} ${size}`);
  return copy.call(this, ...a);
};
const queue = GPUQueue.prototype;
const writeBuffer = queue.writeBuffer as (this: GPUQueue, ...a: unknown[]) => undefined;
(queue as unknown as { writeBuffer: unknown }).writeBuffer = function (this: GPUQueue, ...a: unknown[]) {
  const [b, offset, data, dataOffset = 0, size] = a as [GPUBuffer, number, BufferSource, number, number?];
  const view = ArrayBuffer.isView(data)
    ? new Uint8Array(data.buffer, data.byteOffset, data.byteLength)
    : new Uint8Array(data as ArrayBuffer);
  const per = ArrayBuffer.isView(data) && "BYTES_PER_ELEMENT" in data
    ? (data as unknown as { BYTES_PER_ELEMENT: number }).BYTES_PER_ELEMENT
    : 1;
  const bytes = view.subarray(dataOffset * per, size === undefined ? undefined : (dataOffset + size) * per);
  record(`write ${ids.get(b)}@${offset} ${bytes.length} ${fnv(bytes)}`);
  return writeBuffer.call(this, ...a);
};

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
  { checkpointLayers: 1 },
  { microBatches: 2 },
  { attnDropout: 0, hiddenDropout: 0, seqLen: 64 },
];
const batch = (o: Partial<TrainerOptions>) => {
  const B = o.batchSize ?? base.batchSize, T = o.seqLen ?? base.seqLen, n = o.microBatches ?? 1;
  const one = (k: number) => Uint16Array.from({ length: B * (T + 1) }, (_, i) => (i * 31 + k * 7) % 1000);
  return n === 1 ? one(0) : Array.from({ length: n }, (_, k) => one(k));
};
for (const cpuDirect of [true, false]) {
  for (const v of variants) {
    record(`# trainer ${JSON.stringify({ ...v, cpuDirect })}`);
    const tr = await Trainer.create(ctx, { ...base, ...v, kernels: { cpuDirect } });
    tr.trainStep(batch(v));
    await tr.lastStats();
    tr.destroy();
  }
  record(`# trainer tensor parallel rank 0 of 2 ${JSON.stringify({ cpuDirect })}`);
  const tp = await Trainer.create(ctx, {
    ...base,
    config: tensorParallelConfig(config, 2),
    kernels: { cpuDirect },
    tensorParallel: { rank: 0, size: 2, exchange: () => Promise.resolve() },
  });
  tp.destroy();
}
const layout = paramLayout(config);
const params = Float32Array.from({ length: layout.totalSize }, (_, i) => Math.sin(i) * 0.02);
for (const cpuUniform of [true, false]) {
  record(`# generator ${JSON.stringify({ cpuUniform })}`);
  const gen = await Generator.create(ctx, config, params, { maxStreams: 8, chunk: 4, cpuUniform });
  await gen.warm({ rehearse: true });
}
const out = Deno.args.indexOf("--out");
if (out >= 0) {
  await Deno.writeTextFile(
    Deno.args[out + 1],
    lines.map((l, i) => `${l}${labels[i] ? `  # ${labels[i]}` : ""}`).join("\n") + "\n",
  );
}
const digest = async (xs: string[]) =>
  Array.from(
    new Uint8Array(await crypto.subtle.digest("SHA-256", new TextEncoder().encode(xs.join("\n")))),
    (b) => b.toString(16).padStart(2, "0"),
  ).join("");
console.log(
  `commands ${lines.length}, dispatches ${lines.filter((l) => l.startsWith("dispatch")).length}; ` +
    `digest ${await digest(lines)}; labels ${await digest(labels)}`,
);
Deno.exit(0);
