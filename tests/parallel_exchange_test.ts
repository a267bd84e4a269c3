/**
 * Tests of gpu/parallel/exchange.ts on lavapipe: two Workers, each with its own device, sum a
 * bucket of their GPU buffers by the host path (readback, CPU ring, writeBuffer) and by the GPU
 * path (peers' slots uploaded and added by a kernel); both buffers must hold the sum, identical
 * bits on both ranks, and the bytes outside the bucket must stay untouched.
 */
import assert from "node:assert/strict";
import { type CommDtype, createCommBuffer, f32BitsToF16 } from "../gpu/parallel/allreduce.ts";
import type { ReducePath } from "../gpu/parallel/exchange.ts";
import type { ExchangeTask } from "./_parallel_gpu_worker.ts";
import { noGpu, randomFloats } from "./_helpers.ts";

const ranks = 2, words = 1500, offset = 84, count = { f32: 1000, f16: 1800, bf16: 1800 } as const;

/** Rank r's buffer contents: random fp32 values, or random 16-bit values packed two per word. */
function bufferFor(r: number, dtype: CommDtype): Uint8Array {
  const x = randomFloats(words * (dtype === "f32" ? 1 : 2), 17 + r);
  if (dtype === "f32") return new Uint8Array(x.buffer);
  const bits = new Uint32Array(x.buffer);
  const h = Uint16Array.from(bits, dtype === "f16" ? f32BitsToF16 : (b) => b >>> 16);
  return new Uint8Array(h.buffer);
}

function decode(bytes: Uint8Array, dtype: CommDtype): Float32Array {
  if (dtype === "f32") return new Float32Array(bytes.buffer, bytes.byteOffset, bytes.byteLength / 4);
  const h = new Uint16Array(bytes.buffer, bytes.byteOffset, bytes.byteLength / 2);
  return dtype === "f16"
    ? new Float32Array(new Float16Array(h.buffer, h.byteOffset, h.length))
    : new Float32Array(Uint32Array.from(h, (b) => b << 16).buffer);
}

Deno.test({
  name:
    "BucketExchange.run() leaves both ranks' GPU buckets holding the sum (host and GPU paths; fp32, fp16, bf16)",
  ignore: noGpu,
  async fn() {
    const workers = Array.from(
      { length: ranks },
      () => new Worker(new URL("./_parallel_gpu_worker.ts", import.meta.url).href, { type: "module" }),
    );
    try {
      const cases: [ReducePath, CommDtype][] = [["host", "f32"], ["gpu", "f32"], ["host", "f16"], [
        "gpu",
        "f16",
      ], [
        "gpu",
        "bf16",
      ]];
      for (const [path, dtype] of cases) {
        const n = count[dtype], elem = dtype === "f32" ? 4 : 2;
        const sab = createCommBuffer({ ranks, capacity: 2048, dtype });
        const inputs = Array.from({ length: ranks }, (_, r) => bufferFor(r, dtype));
        const got = await Promise.all(
          workers.map((w, rank) =>
            new Promise<{ ok: boolean; data?: Uint8Array; error?: string }>((resolve) => {
              w.onmessage = (e) => resolve(e.data);
              const task: ExchangeTask = {
                sab,
                rank,
                path,
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
        const lo = offset, hi = offset + n * elem, what = `${path} ${dtype}`;
        const want = new Float32Array(n);
        for (const input of inputs) decode(input.subarray(lo, hi), dtype).forEach((v, i) => want[i] += v);
        const tol = dtype === "f32" ? 1e-7 : dtype === "f16" ? 2 ** -10 : 2 ** -7;
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
            if (!(Math.abs(v[i] - want[i]) <= tol * Math.abs(want[i]) + 1e-6)) {
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
