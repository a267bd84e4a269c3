/**
 * WebGPU device setup: picks the high-performance adapter, requests the limits and optional
 * features the engine uses, and wraps pipeline creation in error scopes so that a bad kernel
 * fails loudly with its name instead of computing silent garbage.
 */

/** An open GPU device and what it can do. */
export interface GpuContext {
  device: GPUDevice;
  adapterInfo: { vendor: string; architecture: string; device: string; description: string };
  /** Optional features that were granted. */
  features: Set<string>;
  limits: {
    maxStorageBufferBindingSize: number;
    maxBufferSize: number;
    maxComputeWorkgroupStorageSize: number;
    maxComputeInvocationsPerWorkgroup: number;
    maxComputeWorkgroupsPerDimension: number;
    maxStorageBuffersPerShaderStage: number;
  };
  hasF16: boolean;
  hasTimestamps: boolean;
  hasSubgroups: boolean;
  /** The smallest subgroup the adapter may run (adapter.info.subgroupMinSize); 0 without subgroups. */
  subgroupMinSize: number;
  /** Set once the device is lost; later submissions fail with this reason. */
  lostReason: string | null;
  /** The first validation error no error scope caught; the next readback raises it. */
  uncaptured: string | null;
}

/** Raised when no adapter exists (e.g. no Vulkan driver); distinct from device failures. */
export class NoAdapterError extends Error {
  constructor(detail: string) {
    super(`No WebGPU adapter found: ${detail}`);
    this.name = "NoAdapterError";
  }
}

/** Whether `ctx` is a software adapter running on the CPU. */
export function isCpuAdapter(ctx: GpuContext): boolean {
  const a = ctx.adapterInfo;
  return /llvmpipe|lavapipe|swiftshader|software/i.test(`${a.description} ${a.device} ${a.vendor}`);
}

/** A WebGPU validation or out-of-memory error raised for a named kernel or buffer. */
export class GpuError extends Error {
  constructor(what: string, message: string) {
    super(`${what}: ${message}`);
    this.name = "GpuError";
  }
}

const OPTIONAL_FEATURES = ["shader-f16", "subgroups", "timestamp-query"];
const WANTED_LIMITS = [
  "maxStorageBufferBindingSize",
  "maxBufferSize",
  "maxComputeWorkgroupStorageSize",
  "maxComputeInvocationsPerWorkgroup",
  "maxComputeWorkgroupSizeX",
  "maxComputeWorkgroupSizeY",
  "maxComputeWorkgroupsPerDimension",
  "maxStorageBuffersPerShaderStage",
  "maxUniformBuffersPerShaderStage",
] as const;

/** Opens the high-performance adapter with its maximum limits and the optional features it offers. */
export async function openDevice(opts: { features?: string[] } = {}): Promise<GpuContext> {
  if (!("gpu" in navigator) || !navigator.gpu) throw new NoAdapterError("navigator.gpu is not available");
  const adapter = await navigator.gpu.requestAdapter({ powerPreference: "high-performance" });
  if (!adapter) {
    throw new NoAdapterError("requestAdapter returned null (is a Vulkan or GL driver installed?)");
  }
  const wanted = opts.features ?? OPTIONAL_FEATURES;
  const requiredFeatures: GPUFeatureName[] = [];
  for (const f of wanted) {
    // "subgroups" is requestable on some backends without being listed: try it separately.
    if (adapter.features.has(f as GPUFeatureName) || f === "subgroups") {
      requiredFeatures.push(f as GPUFeatureName);
    }
  }
  const requiredLimits: Record<string, number> = {};
  for (const name of WANTED_LIMITS) requiredLimits[name] = adapter.limits[name];
  let device: GPUDevice;
  try {
    device = await adapter.requestDevice({ requiredFeatures, requiredLimits });
  } catch {
    device = await adapter.requestDevice({
      requiredFeatures: requiredFeatures.filter((f) => f !== "subgroups"),
      requiredLimits,
    });
  }
  for (const name of WANTED_LIMITS) {
    if (device.limits[name] < requiredLimits[name]) {
      throw new GpuError(
        "requestDevice",
        `limit ${name} is ${device.limits[name]}, asked for ${requiredLimits[name]}`,
      );
    }
  }
  const info = adapter.info;
  const ctx: GpuContext = {
    device,
    adapterInfo: {
      vendor: info.vendor,
      architecture: info.architecture,
      device: info.device,
      description: info.description,
    },
    features: new Set([...device.features]),
    limits: {
      maxStorageBufferBindingSize: device.limits.maxStorageBufferBindingSize,
      maxBufferSize: device.limits.maxBufferSize,
      maxComputeWorkgroupStorageSize: device.limits.maxComputeWorkgroupStorageSize,
      maxComputeInvocationsPerWorkgroup: device.limits.maxComputeInvocationsPerWorkgroup,
      maxComputeWorkgroupsPerDimension: device.limits.maxComputeWorkgroupsPerDimension,
      maxStorageBuffersPerShaderStage: device.limits.maxStorageBuffersPerShaderStage,
    },
    hasF16: device.features.has("shader-f16"),
    hasTimestamps: device.features.has("timestamp-query"),
    hasSubgroups: device.features.has("subgroups"),
    subgroupMinSize: device.features.has("subgroups")
      ? (info as GPUAdapterInfo & { subgroupMinSize?: number }).subgroupMinSize ?? 0
      : 0,
    lostReason: null,
    uncaptured: null,
  };
  device.lost.then((l) => {
    ctx.lostReason = `${l.reason}: ${l.message}`;
  });
  device.addEventListener("uncapturederror", (e) => {
    ctx.uncaptured ??= (e as GPUUncapturedErrorEvent).error.message;
  });
  return ctx;
}

/** One line describing the adapter, features and key limits. */
export function describeDevice(ctx: GpuContext): string {
  const gib = (n: number) => (n / 2 ** 30).toFixed(2) + " GiB";
  return `${ctx.adapterInfo.description || ctx.adapterInfo.vendor} [${[...ctx.features].join(", ")}] ` +
    `storage binding ${gib(ctx.limits.maxStorageBufferBindingSize)}, buffer ${
      gib(ctx.limits.maxBufferSize)
    }, ` +
    `workgroup storage ${ctx.limits.maxComputeWorkgroupStorageSize} B, ` +
    `${ctx.limits.maxComputeInvocationsPerWorkgroup} invocations`;
}

/** Compiles a compute pipeline, raising "Shader compilation failed" with the kernel's name and the GPU's message. */
export async function createPipeline(
  ctx: GpuContext,
  name: string,
  code: string,
): Promise<GPUComputePipeline> {
  const { device } = ctx;
  device.pushErrorScope("validation");
  const module = device.createShaderModule({ label: name, code });
  const pipeline = device.createComputePipeline({ label: name, layout: "auto", compute: { module } });
  const err = await device.popErrorScope();
  if (err) {
    const info = await module.getCompilationInfo();
    const msgs = info.messages.map((m) => `${m.lineNum}:${m.linePos} ${m.message}`).join("\n");
    throw new GpuError(`Shader compilation failed for kernel "${name}"`, `${err.message}\n${msgs}`);
  }
  return pipeline;
}

/** Creates a storage buffer inside an out-of-memory scope, naming it on failure. */
export async function createStorage(
  ctx: GpuContext,
  label: string,
  bytes: number,
  extraUsage = 0,
): Promise<GPUBuffer> {
  if (bytes > ctx.limits.maxBufferSize) {
    throw new GpuError(
      `Buffer "${label}"`,
      `${bytes} bytes exceeds the device's maxBufferSize ${ctx.limits.maxBufferSize}`,
    );
  }
  ctx.device.pushErrorScope("out-of-memory");
  ctx.device.pushErrorScope("validation");
  const buf = ctx.device.createBuffer({
    label,
    size: Math.max(16, Math.ceil(bytes / 16) * 16),
    usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST | extraUsage,
  });
  const v = await ctx.device.popErrorScope();
  const o = await ctx.device.popErrorScope();
  if (v || o) throw new GpuError(`Cannot allocate buffer "${label}" (${bytes} bytes)`, (v ?? o)!.message);
  return buf;
}

/** A byte range of a buffer to read back. */
export interface ReadRange {
  buffer: GPUBuffer;
  offset?: number;
  bytes?: number;
}

/**
 * A staging buffer (MAP_READ, or `usage` instead) for `ranges` end to end, their byte offsets in
 * it, and `copy`, which records the copies filling it (into an encoder submitted once the data is
 * final).
 */
export function stagingFor(
  ctx: GpuContext,
  ranges: ReadRange[],
  usage: GPUBufferUsageFlags = GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST,
): { buffer: GPUBuffer; offsets: number[]; bytes: number[]; copy: (enc: GPUCommandEncoder) => void } {
  const sized = ranges.map((r) => {
    const offset = r.offset ?? 0;
    return { buffer: r.buffer, offset, bytes: r.bytes ?? r.buffer.size - offset };
  });
  const offsets: number[] = [];
  let total = 0;
  for (const r of sized) {
    offsets.push(total);
    total += r.bytes;
  }
  const buffer = ctx.device.createBuffer({
    size: Math.ceil(total / 4) * 4,
    usage,
  });
  const copy = (enc: GPUCommandEncoder) =>
    sized.forEach((r, i) => enc.copyBufferToBuffer(r.buffer, r.offset, buffer, offsets[i], r.bytes));
  return { buffer, offsets, bytes: sized.map((r) => r.bytes), copy };
}

/**
 * Reads several buffer ranges through one staging buffer and one mapAsync (each mapAsync blocks
 * ~10 ms on real GPUs, so callers batch what they need). Returns one ArrayBuffer per range.
 */
export async function readBuffers(ctx: GpuContext, ranges: ReadRange[]): Promise<ArrayBuffer[]> {
  const staged = stagingFor(ctx, ranges);
  const enc = ctx.device.createCommandEncoder();
  staged.copy(enc);
  ctx.device.queue.submit([enc.finish()]);
  await staged.buffer.mapAsync(GPUMapMode.READ);
  const all = staged.buffer.getMappedRange().slice(0);
  staged.buffer.unmap();
  staged.buffer.destroy();
  checkDevice(ctx);
  return staged.offsets.map((at, i) => all.slice(at, at + staged.bytes[i]));
}

/** Reads `bytes` bytes from `src` at `offset` (a staging copy plus mapAsync: blocks ~10 ms on real GPUs). */
export async function readBuffer(
  ctx: GpuContext,
  src: GPUBuffer,
  offset = 0,
  bytes = src.size - offset,
): Promise<ArrayBuffer> {
  return (await readBuffers(ctx, [{ buffer: src, offset, bytes }]))[0];
}

/** Throws if the device was lost or raised a validation error that no scope caught. */
export function checkDevice(ctx: GpuContext): void {
  if (ctx.lostReason) throw new GpuError("Device lost", ctx.lostReason);
  if (ctx.uncaptured) throw new GpuError("GPU validation error", ctx.uncaptured);
}

/** Reads a float32 buffer (or a range of it, in floats). */
export async function readFloats(
  ctx: GpuContext,
  src: GPUBuffer,
  offset = 0,
  count?: number,
): Promise<Float32Array> {
  const n = count ?? src.size / 4 - offset;
  return new Float32Array(await readBuffer(ctx, src, offset * 4, n * 4));
}
