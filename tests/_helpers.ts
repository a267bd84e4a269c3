/**
 * Test helpers: one shared GPU device for the GPU tests (skipped when no adapter exists), upload
 * helpers, and an error measure for comparing GPU results with the CPU reference.
 */

import { createStorage, type GpuContext, openDevice } from "../engine/device.ts";

let ctxPromise: Promise<GpuContext | null> | null = null;

/** The test device, or null when no WebGPU adapter is available (tests then skip). */
export function testContext(): Promise<GpuContext | null> {
  ctxPromise ??= openDevice().catch(() => null);
  return ctxPromise;
}

/** Whether a GPU adapter exists (evaluated once at module load for `ignore`). */
export const noGpu = (await testContext()) === null;

/** Uploads floats into a new storage buffer (with `extraUsage`, e.g. UNIFORM, besides). */
export async function upload(
  ctx: GpuContext,
  label: string,
  data: Float32Array | Uint32Array,
  extraUsage = 0,
): Promise<GPUBuffer> {
  const buf = await createStorage(ctx, label, data.byteLength, extraUsage);
  ctx.device.queue.writeBuffer(buf, 0, data.buffer as ArrayBuffer, data.byteOffset, data.byteLength);
  return buf;
}

/** Largest |a - b| / (|b| + atol) over all elements, and where it happened. */
export function maxRelErr(
  a: ArrayLike<number>,
  b: ArrayLike<number>,
  atol = 1e-6,
): { err: number; at: number } {
  if (a.length !== b.length) throw new Error(`Length mismatch: ${a.length} vs ${b.length}`);
  let err = 0, at = -1;
  for (let i = 0; i < a.length; i++) {
    const e = Math.abs(a[i] - b[i]) / (Math.abs(b[i]) + atol);
    if (!(e <= err)) {
      err = e;
      at = i;
    }
  }
  return { err, at };
}

/** ‖a − b‖ / ‖b‖. */
export function relNorm(a: ArrayLike<number>, b: ArrayLike<number>): number {
  let num = 0, den = 0;
  for (let i = 0; i < a.length; i++) {
    num += (a[i] - b[i]) ** 2;
    den += b[i] ** 2;
  }
  return Math.sqrt(num / Math.max(den, 1e-30));
}

/**
 * Asserts two float arrays hold the same values bit for bit (NaN equal to NaN), naming the first
 * index that differs and how many do. node:assert's deepEqual builds a diff of the whole arrays
 * when they differ, which takes minutes for a model's gradients: a failing test would look hung.
 */
export function assertSameFloats(a: Float32Array, b: Float32Array, what: string): void {
  if (a.length !== b.length) throw new Error(`${what}: ${a.length} values against ${b.length}`);
  const ua = new Uint32Array(a.buffer, a.byteOffset, a.length),
    ub = new Uint32Array(b.buffer, b.byteOffset, b.length);
  let first = -1, count = 0;
  for (let i = 0; i < ua.length; i++) {
    if (ua[i] !== ub[i] && !(Number.isNaN(a[i]) && Number.isNaN(b[i]))) {
      if (first < 0) first = i;
      count++;
    }
  }
  if (first >= 0) {
    throw new Error(
      `${what}: ${count} of ${a.length} values differ, the first at ${first} (${a[first]} against ${
        b[first]
      })`,
    );
  }
}

/** Deterministic pseudo-random floats in [-1, 1). */
export function randomFloats(n: number, seed: number): Float32Array {
  const out = new Float32Array(n);
  let s = seed >>> 0 || 1;
  for (let i = 0; i < n; i++) {
    s ^= s << 13;
    s ^= s >>> 17;
    s ^= s << 5;
    out[i] = ((s >>> 0) / 4294967296) * 2 - 1;
  }
  return out;
}
