/**
 * Which physical GPU each Worker gets. WebGPU has no way to name a GPU (CUDA_VISIBLE_DEVICES and
 * powerPreference change nothing), so the GPU host pins Worker i before its first
 * `requestAdapter` with Mesa's Vulkan device-select layer (Debian package `mesa-vulkan-drivers`,
 * `VK_LAYER_MESA_device_select`): the layer reads DRI_PRIME and
 * MESA_VK_DEVICE_SELECT_FORCE_DEFAULT_DEVICE from the process environment when the Worker creates
 * its Vulkan instance, so the host sets them for one Worker at a time.
 *
 * Mesa 22.3's layer (Debian 12) matches DRI_PRIME's PCI tag inverted: on a two-GPU machine,
 * naming GPU A selects GPU B. `GPT2_GPU_SELECT` picks the mode: `auto` (inverted with two GPUs,
 * direct otherwise), `direct`, `inverted`, or `off` (no pinning). Since a wrong guess would put
 * two Workers on one GPU silently, the host also measures where each Worker landed (a probe
 * buffer's growth in `nvidia-smi`'s per-GPU memory) and refuses to start when two share a GPU.
 */

/** A GPU on the PCI bus, in the driver's (CUDA's) order. */
export interface PciGpu {
  index: number;
  /** PCI bus id as nvidia-smi and sysfs print it, e.g. "0000:19:00.0". */
  bus: string;
}

/** How DRI_PRIME's tag is chosen (see the file header). */
export type SelectMode = "auto" | "direct" | "inverted" | "off";

/** Parses GPT2_GPU_SELECT. */
export function parseSelectMode(value: string | undefined): SelectMode {
  const v = (value ?? "auto").trim() || "auto";
  if (v === "auto" || v === "direct" || v === "inverted" || v === "off") return v;
  throw new Error(`Invalid GPT2_GPU_SELECT "${value}": expected "auto", "direct", "inverted" or "off"`);
}

/** Mesa's tag for a PCI bus id: "0000:19:00.0" -> "pci-0000_19_00_0". */
export function pciTag(bus: string): string {
  const m = /^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$/.exec(bus.trim());
  if (!m) throw new Error(`Invalid PCI bus id "${bus}"`);
  return `pci-${m[1].slice(-4)}_${m[2]}_${m[3]}_${m[4]}`.toLowerCase();
}

/** Environment variables that pin the next Vulkan instance to GPU `want` of `gpus`. */
export function deviceSelectEnv(gpus: PciGpu[], want: number, mode: SelectMode): Record<string, string> {
  if (mode === "off" || gpus.length <= 1) return { NODEVICE_SELECT: "1" };
  if (want < 0 || want >= gpus.length) throw new Error(`No GPU ${want}: found ${gpus.length}`);
  const inverted = mode === "inverted" || (mode === "auto" && gpus.length === 2);
  if (inverted && gpus.length !== 2) {
    throw new Error(`GPT2_GPU_SELECT "inverted" works with two GPUs only; found ${gpus.length}`);
  }
  const target = inverted ? 1 - want : want;
  return { DRI_PRIME: pciTag(gpus[target].bus), MESA_VK_DEVICE_SELECT_FORCE_DEFAULT_DEVICE: "1" };
}

/** Every variable deviceSelectEnv() may set, so the host can clear the previous Worker's. */
export const SELECT_VARS = ["NODEVICE_SELECT", "DRI_PRIME", "MESA_VK_DEVICE_SELECT_FORCE_DEFAULT_DEVICE"];

async function run(cmd: string, args: string[]): Promise<string | null> {
  try {
    const out = await new Deno.Command(cmd, { args, stdout: "piped", stderr: "null" }).output();
    return out.success ? new TextDecoder().decode(out.stdout) : null;
  } catch {
    return null; // not installed
  }
}

/** NVIDIA GPUs from nvidia-smi (CUDA order), or null when nvidia-smi is absent. */
export async function listNvidiaGpus(): Promise<PciGpu[] | null> {
  const out = await run("nvidia-smi", ["--query-gpu=index,pci.bus_id", "--format=csv,noheader"]);
  if (out === null) return null;
  return out.trim().split("\n").filter((l) => l.trim()).map((line) => {
    const [index, bus] = line.split(",").map((s) => s.trim());
    // nvidia-smi prints an 8-digit domain ("00000000:19:00.0").
    return { index: Number(index), bus: bus.replace(/^0000([0-9A-Fa-f]{4}):/, "$1:") };
  });
}

/** Memory in use per GPU in MiB (nvidia-smi), or null when it cannot be read. */
export async function gpuMemoryUsedMiB(): Promise<number[] | null> {
  const out = await run("nvidia-smi", ["--query-gpu=memory.used", "--format=csv,noheader,nounits"]);
  if (out === null) return null;
  const values = out.trim().split("\n").map((l) => Number(l.trim()));
  return values.every(Number.isFinite) ? values : null;
}

/**
 * The GPU whose memory grew by at least `minMiB` between two readings, or null when none or
 * several did (the probe could not tell).
 */
export function grownGpu(before: number[], after: number[], minMiB: number): number | null {
  const grown = after.map((v, i) => v - (before[i] ?? v)).map((d, i) => [d, i] as const)
    .filter(([d]) => d >= minMiB);
  return grown.length === 1 ? grown[0][1] : null;
}

/** Throws when two Workers landed on one GPU although there are enough GPUs for each to have its own. */
export function checkPlacement(placed: (number | null)[], gpus: number): void {
  if (gpus <= 1) return;
  const seen = new Map<number, number>();
  placed.forEach((gpu, worker) => {
    if (gpu === null) return;
    const other = seen.get(gpu);
    if (other !== undefined && placed.length <= gpus) {
      throw new Error(
        `Workers ${other} and ${worker} both landed on GPU ${gpu} although ${gpus} GPUs exist: ` +
          `GPU pinning failed (set GPT2_GPU_SELECT to "direct" or "inverted"; see docs/operations.md)`,
      );
    }
    seen.set(gpu, worker);
  });
}
