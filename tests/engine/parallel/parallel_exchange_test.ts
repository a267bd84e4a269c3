/**
 * Tests of engine/parallel/exchange.ts on lavapipe: two Workers, each with its own device, sum a
 * bucket of their GPU buffers by the host path (readback, CPU ring, writeBuffer) and by the GPU
 * path (peers' slots uploaded and added by a kernel), with one lane or two (three sub-buckets
 * issued at once), and by reduce-scatter then all-gather; both buffers must hold the sum,
 * identical bits on both ranks, and the bytes outside the bucket must stay untouched.
 */
import assert from "node:assert/strict";
import { type CommDtype, createCommBuffer, f32BitsToF16 } from "../../../engine/parallel/allreduce.ts";
import type { ExchangeTask } from "../../_parallel_gpu_worker.ts";
import { noGpu, randomFloats } from "../../_helpers.ts";

const ranks = 2, words = 1500, offset = 84, count = { f32: 1000, f16: 1800, bf16: 1800 } as const;

/** Rank r's buffer contents: random fp32 values, or random 16-bit values packed two per word. */
function bufferFor(r: number, dtype: CommDtype): Uint8Array {
  const x = randomFloats(words * (dtype === "f32" ? 1 : 2), 17 + r);
  if (dtype === "f32") return new Uint8Array(x.buffer);
  const bits = new Uint32Array(x.buffer), h = new Uint16Array(bits.length);
  for (let i = 0; i < bits.length; i++) h[i] = dtype === "f16" ? f32BitsToF16(bits[i]) : bits[i] >>> 16;
  return new Uint8Array(h.buffer);
}

function decode(bytes: Uint8Array, dtype: CommDtype): Float32Array {
  if (dtype === "f32") return new Float32Array(bytes.slice().buffer);
  const h = new Uint16Array(bytes.slice().buffer);
  if (dtype === "f16") return new Float32Array(new Float16Array(h.buffer));
  const out = new Uint32Array(h.length);
  for (let i = 0; i < h.length; i++) out[i] = h[i] << 16;
  return new Float32Array(out.buffer);
}

/**
 * [path, wire dtype, lanes, op, GPU buffer dtype]: "rsag" is reduce-scatter then all-gather (host
 * path); an fp32 buffer with a 16-bit wire is packed on the GPU before it travels.
 */
const cases = [
  ["host", "f32", 1, "allreduce", "f32"],
  ["gpu", "f32", 2, "allreduce", "f32"],
  ["host", "f16", 2, "allreduce", "f16"],
  ["gpu", "f16", 1, "allreduce", "f16"],
  ["gpu", "bf16", 2, "allreduce", "bf16"],
  ["host", "f32", 1, "rsag", "f32"],
  ["host", "bf16", 2, "rsag", "bf16"],
  ["host", "bf16", 2, "allreduce", "f32"],
  ["gpu", "f16", 1, "allreduce", "f32"],
  ["gpu", "bf16", 2, "allreduce", "f32"],
] as const;

/** Largest rounding of one value on the wire, relative. */
const unit = { f32: 2 ** -24, f16: 2 ** -11, bf16: 2 ** -8 } as const;

Deno.test({
  name:
    "BucketExchange leaves both ranks' GPU buckets holding the sum (host/GPU paths, 1-2 lanes, reduce-scatter)",
  ignore: noGpu,
  async fn() {
    const workers = Array.from(
      { length: ranks },
      () => new Worker(new URL("../../_parallel_gpu_worker.ts", import.meta.url).href, { type: "module" }),
    );
    try {
      for (const [path, wire, lanes, op, dtype] of cases) {
        const n = count[dtype], elem = dtype === "f32" ? 4 : 2;
        const what = `${op} ${path} ${wire} ${lanes} lanes ${dtype}`;
        const sabs = Array.from(
          { length: lanes },
          () => createCommBuffer({ ranks, capacity: 2048, dtype: wire }),
        );
        const inputs = Array.from({ length: ranks }, (_, r) => bufferFor(r, dtype));
        const got = await Promise.all(
          workers.map((w, rank) =>
            new Promise<{ ok: boolean; data?: Uint8Array; error?: string }>((resolve) => {
              w.onmessage = (e) => resolve(e.data);
              const task: ExchangeTask = {
                sabs,
                op,
                rank,
                path,
                bufferDtype: dtype,
                data: inputs[rank],
                offset,
                count: n,
                stagingBytes: 1024,
                inFlight: 3,
              };
              w.postMessage(task);
            })
          ),
        );
        const lo = offset, hi = offset + n * elem;
        const want = new Float64Array(n), mag = new Float64Array(n);
        for (const input of inputs) {
          const v = decode(input.subarray(lo, hi), dtype);
          for (let i = 0; i < n; i++) want[i] += v[i], mag[i] += Math.abs(v[i]);
        }
        // Each value may be rounded once on the wire and the sum once more: within 2 units of Σ|x|.
        const tol = 2 * unit[wire];
        for (let r = 0; r < ranks; r++) {
          assert.ok(got[r].ok, `${what}: ${got[r].error}`);
          const out = got[r].data!;
          assert.deepEqual(
            out.subarray(0, lo),
            inputs[r].subarray(0, lo),
            `${what}: bytes before the bucket`,
          );
          assert.deepEqual(out.subarray(hi), inputs[r].subarray(hi), `${what}: bytes after the bucket`);
          assert.deepEqual(out.subarray(lo, hi), got[0].data!.subarray(lo, hi), `${what}: rank ${r} differs`);
          const v = decode(out.subarray(lo, hi), dtype);
          for (let i = 0; i < n; i++) {
            if (!(Math.abs(v[i] - want[i]) <= tol * mag[i] + 1e-7)) {
              assert.fail(`${what} rank ${r} [${i}]: ${v[i]} vs ${want[i]}`);
            }
          }
        }
      }
    } finally {
      for (const w of workers) w.terminate();
    }
  },
});
