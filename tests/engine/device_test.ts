/**
 * Device setup and failure reporting: requested limits are granted, a bad kernel fails with its
 * name, and a validation error outside any error scope surfaces at the next readback.
 */

import assert from "node:assert/strict";
import {
  createPipeline,
  createStorage,
  describeDevice,
  GpuError,
  openDevice,
  readFloats,
} from "../../engine/device.ts";
import { noGpu } from "../_helpers.ts";

Deno.test({
  name: "openDevice() grants the adapter's limits and reports them",
  ignore: noGpu,
  fn: async () => {
    const ctx = await openDevice();
    const adapter = (await navigator.gpu.requestAdapter({ powerPreference: "high-performance" }))!;
    assert.equal(ctx.limits.maxStorageBufferBindingSize, adapter.limits.maxStorageBufferBindingSize);
    assert.equal(ctx.limits.maxComputeWorkgroupStorageSize, adapter.limits.maxComputeWorkgroupStorageSize);
    assert.match(describeDevice(ctx), /storage binding .* GiB, buffer .* GiB, workgroup storage \d+ B/);
    ctx.device.destroy();
  },
});

Deno.test({
  name: "createPipeline() names the kernel whose shader fails to compile",
  ignore: noGpu,
  fn: async () => {
    const ctx = await openDevice();
    await assert.rejects(
      () => createPipeline(ctx, "broken_kernel", "@compute @workgroup_size(1) fn main() { let x = y; }"),
      (e: unknown) =>
        e instanceof GpuError && /Shader compilation failed for kernel "broken_kernel"/.test(e.message),
    );
    ctx.device.destroy();
  },
});

Deno.test({
  name: "readFloats() raises a validation error that no error scope caught",
  ignore: noGpu,
  fn: async () => {
    const ctx = await openDevice();
    const buf = await createStorage(ctx, "small", 64);
    const enc = ctx.device.createCommandEncoder();
    enc.copyBufferToBuffer(buf, 0, buf, 0, 4096); // out of range: a validation error
    ctx.device.queue.submit([enc.finish()]);
    await assert.rejects(
      () => readFloats(ctx, buf),
      (e: unknown) => e instanceof GpuError && /validation/i.test(e.message),
    );
    ctx.device.destroy();
  },
});
