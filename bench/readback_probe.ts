/**
 * The two readback paths of engine/readback.ts side by side (issue 26): for each size, the median
 * (and min, max) wall time of `Readback.read()` through the canvas path (forced at every size with
 * `maxCanvasBytes: Infinity`) and through mapAsync (`canvas: false`), each read right after a small
 * write to the buffer so that there is queued work to wait for, as after a decode step. The first
 * read of each size and path is timed apart ("first": it makes that size's canvas) and checked byte
 * for byte against the data written. It is the measurement behind CANVAS_MAX_BYTES; a final line
 * holds the rows as JSON.
 *
 *   deno run -A bench/readback_probe.ts [--sizes 4096,65536,1048576,16777216] [--reps 21]
 */

import { createStorage, describeDevice, openDevice } from "../engine/device.ts";
import { CANVAS_MAX_BYTES, createReadback, type Readback, type ReadbackPath } from "../engine/readback.ts";

function arg(name: string, def: string): string {
  const i = Deno.args.indexOf(`--${name}`);
  return i >= 0 && i + 1 < Deno.args.length ? Deno.args[i + 1] : def;
}
const sizes = arg("sizes", "4096,65536,1048576,16777216").split(",").map(Number);
const reps = +arg("reps", "21");
const sorted = (xs: number[]) => [...xs].sort((a, b) => a - b);
const median = (xs: number[]) => sorted(xs)[Math.floor((xs.length - 1) / 2)];
const f = (x: number) => x.toFixed(2).padStart(7);
const label = (n: number) => n >= 1 << 20 ? `${n / (1 << 20)} MB` : n >= 1024 ? `${n / 1024} KB` : `${n} B`;

const ctx = await openDevice();
console.log(describeDevice(ctx));
const readers: Record<ReadbackPath, Readback> = {
  canvas: await createReadback(ctx, { maxCanvasBytes: Infinity }),
  mapAsync: await createReadback(ctx, { canvas: false }),
};
if (!readers.canvas.canvas) console.log(`canvas path unavailable: ${readers.canvas.fallbackReason}`);
console.log(`reps ${reps} per size and path; CANVAS_MAX_BYTES ${label(CANVAS_MAX_BYTES)}`);
console.log("size      path       median     min     max   first  (ms)");

const rows: Record<string, unknown>[] = [];
for (const bytes of sizes) {
  const buf = await createStorage(ctx, `probe ${bytes}`, bytes);
  const data = new Uint8Array(bytes);
  for (let i = 0; i < bytes; i += 65536) crypto.getRandomValues(data.subarray(i, Math.min(bytes, i + 65536)));
  ctx.device.queue.writeBuffer(buf, 0, data);
  const row: Record<string, unknown> = { bytes };
  for (const path of ["canvas", "mapAsync"] as const) {
    const rb = readers[path];
    if (rb.pathFor(bytes) !== path) {
      console.log(
        `${label(bytes).padEnd(9)} ${path.padEnd(9)}  (not served: ${rb.fallbackReason ?? "too large"})`,
      );
      continue;
    }
    const t = performance.now();
    const first = new Uint8Array(await rb.read(buf));
    const firstMs = performance.now() - t;
    const bad = data.findIndex((b, i) => first[i] !== b);
    if (bad >= 0) throw new Error(`${path} read of ${bytes} bytes differs at byte ${bad}`);
    const ms: number[] = [];
    for (let r = 0; r < reps; r++) {
      ctx.device.queue.writeBuffer(buf, 0, data, 0, 4);
      const t0 = performance.now();
      await rb.read(buf);
      ms.push(performance.now() - t0);
    }
    if (rb.lastPath !== path) {
      throw new Error(`${path} reads went through ${rb.lastPath}: ${rb.fallbackReason}`);
    }
    const s = sorted(ms);
    row[path] = { median_ms: median(ms), min_ms: s[0], max_ms: s[s.length - 1], first_ms: firstMs };
    console.log(
      `${label(bytes).padEnd(9)} ${path.padEnd(9)} ${f(median(ms))} ${f(s[0])} ${f(s[s.length - 1])} ${
        f(firstMs)
      }`,
    );
  }
  rows.push(row);
  buf.destroy();
}
readers.canvas.destroy();
console.log(JSON.stringify(rows));
ctx.device.destroy();
