/**
 * `deno run -A bench/exit_probe.ts <strategy> [workers]`: why a process whose Workers held WebGPU
 * devices crashes at exit on NVIDIA's Vulkan driver (wgpu issue 8365), measured by exit status.
 * Each Worker opens a device, runs one dispatch, then the main thread ends the process by one
 * strategy:
 * - `exit`: Workers destroy their devices and close; the main thread exits 50 ms later (what the
 *   GPU host did first);
 * - `join`: as `exit`, then terminate() each Worker and wait 1 s before exiting;
 * - `gc`: Workers also drop every WebGPU reference and run a garbage collection (needs
 *   `--v8-flags=--expose-gc`) before closing, then as `join`;
 * - `keep`: Workers keep their devices (no destroy) and the main thread exits at once.
 * Run it several times per strategy; `bench/RESULTS.md` has the table.
 */

const strategy = Deno.args[0] ?? "exit";
const n = Number(Deno.args[1] ?? "2");

const workerSource = `
  let adapter = await navigator.gpu.requestAdapter();
  let device = await adapter.requestDevice();
  const m = device.createShaderModule({ code: "@group(0) @binding(0) var<storage, read_write> a: array<f32>; @compute @workgroup_size(64) fn main(@builtin(global_invocation_id) i: vec3u) { a[i.x] = a[i.x] + 1.0; }" });
  const p = device.createComputePipeline({ layout: "auto", compute: { module: m, entryPoint: "main" } });
  let buf = device.createBuffer({ size: 1 << 20, usage: GPUBufferUsage.STORAGE });
  const bg = device.createBindGroup({ layout: p.getBindGroupLayout(0), entries: [{ binding: 0, resource: { buffer: buf } }] });
  const enc = device.createCommandEncoder(); const pass = enc.beginComputePass(); pass.setPipeline(p); pass.setBindGroup(0, bg); pass.dispatchWorkgroups(4096); pass.end();
  device.queue.submit([enc.finish()]);
  await device.queue.onSubmittedWorkDone();
  self.onmessage = async (e) => {
    if (e.data !== "keep") { buf.destroy(); device.destroy(); }
    if (e.data === "gc") { buf = null; device = null; adapter = null; globalThis.gc?.(); await new Promise((r) => setTimeout(r, 100)); globalThis.gc?.(); }
    self.postMessage("closed");
    if (e.data !== "keep") self.close();
  };
  self.postMessage("ready");
`;
const url = URL.createObjectURL(new Blob([workerSource], { type: "application/javascript" }));
const workers: Worker[] = [];
for (let i = 0; i < n; i++) {
  const w = new Worker(url, { type: "module" });
  await new Promise<void>((r) => w.onmessage = () => r());
  workers.push(w);
}
await Promise.all(workers.map((w) =>
  new Promise<void>((r) => {
    w.onmessage = () => r();
    w.postMessage(strategy);
  })
));
if (strategy === "join" || strategy === "gc") {
  await new Promise((r) => setTimeout(r, 200));
  for (const w of workers) w.terminate();
  await new Promise((r) => setTimeout(r, 1000));
} else if (strategy === "exit") {
  await new Promise((r) => setTimeout(r, 50));
}
Deno.exit(0);
