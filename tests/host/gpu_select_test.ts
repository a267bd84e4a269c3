/**
 * GPU pinning without GPUs: the device-select variables for each mode, the PCI tag format, the
 * placement probe's reading of nvidia-smi memory, and the refusal when two Workers share a GPU.
 */

import { readHostSettings } from "../../host/host_settings.ts";
import assert from "node:assert/strict";
import {
  checkPlacement,
  deviceSelectEnv,
  grownGpu,
  parseSelectMode,
  type PciGpu,
  pciTag,
} from "../../host/gpu_select.ts";

const two: PciGpu[] = [{ index: 0, bus: "0000:19:00.0" }, { index: 1, bus: "0000:3B:00.0" }];
const four: PciGpu[] = [...two, { index: 2, bus: "0000:4c:00.0" }, { index: 3, bus: "0000:5d:00.0" }];

Deno.test("pciTag() writes Mesa's DRI_PRIME tag in lower case", () => {
  assert.equal(pciTag("0000:3B:00.0"), "pci-0000_3b_00_0");
  assert.equal(pciTag("00000000:19:00.1"), "pci-0000_19_00_1");
  assert.throws(() => pciTag("19:00"), { message: 'Invalid PCI bus id "19:00"' });
});

Deno.test("deviceSelectEnv() disables the layer for one GPU and inverts the tag for two in auto mode", () => {
  assert.deepEqual(deviceSelectEnv([two[0]], 0, "auto"), { NODEVICE_SELECT: "1" });
  assert.deepEqual(deviceSelectEnv(two, 0, "off"), { NODEVICE_SELECT: "1" });
  // Mesa 22.3 selects the GPU it was not told: name the other one.
  assert.deepEqual(deviceSelectEnv(two, 0, "auto"), {
    DRI_PRIME: "pci-0000_3b_00_0",
    MESA_VK_DEVICE_SELECT_FORCE_DEFAULT_DEVICE: "1",
  });
  assert.equal(deviceSelectEnv(two, 1, "auto").DRI_PRIME, "pci-0000_19_00_0");
  assert.equal(deviceSelectEnv(two, 1, "direct").DRI_PRIME, "pci-0000_3b_00_0");
  assert.equal(deviceSelectEnv(four, 2, "auto").DRI_PRIME, "pci-0000_4c_00_0");
  assert.throws(() => deviceSelectEnv(four, 2, "inverted"), /two GPUs only; found 4/);
  assert.throws(() => deviceSelectEnv(two, 2, "direct"), { message: "No GPU 2: found 2" });
});

Deno.test("parseSelectMode() accepts the four modes and names a bad value", () => {
  assert.equal(parseSelectMode(undefined), "auto");
  assert.equal(parseSelectMode("inverted"), "inverted");
  assert.throws(() => parseSelectMode("gpu0"), { message: /Invalid GPT2_GPU_SELECT "gpu0"/ });
});

Deno.test("grownGpu() finds the one GPU whose memory grew by the probe, else null", () => {
  assert.equal(grownGpu([500, 500], [500, 1530], 768), 1);
  assert.equal(grownGpu([500, 500], [520, 510], 768), null);
  assert.equal(grownGpu([500, 500], [1500, 1530], 768), null, "both grew: cannot tell");
});

Deno.test("checkPlacement() refuses two Workers on one GPU when each could have its own", () => {
  checkPlacement([0, 1], 2);
  checkPlacement([0, null], 2);
  checkPlacement([0, 0, 0], 1);
  assert.throws(() => checkPlacement([1, 1], 2), {
    message: /^Workers 0 and 1 both landed on GPU 1 although 2 GPUs exist/,
  });
  // More Workers than GPUs: sharing is intended.
  checkPlacement([0, 1, 0], 2);
});

Deno.test("readHostSettings() reads GPT2_GPU_SELECT and GPT2_SHUTDOWN_S, naming a bad value", () => {
  const env = (o: Record<string, string>) => ({ get: (k: string) => o[k] });
  assert.deepEqual(readHostSettings(env({})), { select: "auto", shutdownMs: 30_000 });
  assert.deepEqual(readHostSettings(env({ GPT2_GPU_SELECT: "off", GPT2_SHUTDOWN_S: "5" })), {
    select: "off",
    shutdownMs: 5000,
  });
  assert.throws(() => readHostSettings(env({ GPT2_SHUTDOWN_S: "-1" })), /Invalid GPT2_SHUTDOWN_S "-1"/);
  assert.throws(() => readHostSettings(env({ GPT2_GPU_SELECT: "sideways" })), /GPT2_GPU_SELECT/);
});
