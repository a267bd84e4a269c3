/**
 * Tests of engine/parallel/allreduce.ts: the 16-bit rounding helpers against the built-in
 * Float16Array, and the ring allreduce, reduce-scatter and all-gather run by 2, 3 and 4 real
 * Workers (half of them with blocking waits, half async) against a serial sum.
 */
import assert from "node:assert/strict";
import {
  abortCommBuffer,
  type CommAlgorithm,
  type CommDtype,
  createCommBuffer,
  f32BitsToBf16,
  f32BitsToF16,
  type Payload,
  RingComm,
  shardRange,
} from "../../../engine/parallel/allreduce.ts";
import type { RankTask } from "../../_parallel_worker.ts";
import { randomFloats } from "../../_helpers.ts";

const bitsOf = (x: number) => new Uint32Array(Float32Array.of(x).buffer)[0];
const f16 = (x: number) => new Float16Array(new Uint16Array([f32BitsToF16(bitsOf(x))]).buffer)[0];
const bf16 = (x: number) => new Float32Array(new Uint32Array([f32BitsToBf16(bitsOf(x)) << 16]).buffer)[0];

Deno.test("f32BitsToF16() rounds like Float16Array, subnormals, ties and overflow included", () => {
  const xs = [...randomFloats(20000, 3)].map((x, i) => x * 2 ** ((i % 40) - 28));
  xs.push(
    0,
    -0,
    65504,
    65519.99,
    65520,
    1e9,
    -1e9,
    2 ** -24,
    2 ** -25,
    3 * 2 ** -26,
    2 ** -14,
    1 + 2 ** -11,
    Infinity,
  );
  const want = new Float16Array(xs);
  for (let i = 0; i < xs.length; i++) assert.equal(f16(xs[i]), want[i], `f16(${xs[i]})`);
  assert.ok(Number.isNaN(f16(NaN)));
});

Deno.test("f32BitsToBf16() rounds to nearest even", () => {
  assert.equal(bf16(1 + 2 ** -8), 1);
  assert.equal(bf16(1 + 3 * 2 ** -8), 1 + 2 ** -6);
  assert.equal(bf16(1 + 2 ** -8 + 2 ** -20), 1 + 2 ** -7);
  assert.equal(bf16(-3.0), -3.0);
  assert.ok(Number.isNaN(bf16(NaN)));
});

Deno.test("shardRange() splits any count into near-equal parts covering it once", () => {
  for (const [count, n] of [[1, 4], [7, 3], [10, 4], [1_000_003, 3]]) {
    let at = 0;
    for (let i = 0; i < n; i++) {
      const [a, b] = shardRange(count, n, i);
      assert.equal(a, at);
      assert.ok(b - a <= Math.ceil(count / n));
      at = b;
    }
    assert.equal(at, count);
  }
});

Deno.test("createCommBuffer() and RingComm name their bad arguments", () => {
  assert.throws(() => createCommBuffer({ ranks: 0, capacity: 8, dtype: "f32" }), /ranks must be an integer/);
  assert.throws(() => createCommBuffer({ ranks: 2, capacity: 0, dtype: "f32" }), /capacity must be/);
  assert.throws(
    () => createCommBuffer({ ranks: 2, capacity: 8, dtype: "f8" as CommDtype }),
    /dtype must be one of/,
  );
  const sab = createCommBuffer({ ranks: 2, capacity: 8, dtype: "f16" });
  assert.throws(() => new RingComm(sab, 2), /rank must be in \[0, 2\), got "2"/);
  assert.throws(() => new RingComm(new SharedArrayBuffer(64), 0), /Not a communicator buffer/);
  const comm = new RingComm(sab, 0);
  assert.throws(() => comm.allreduceSync(9), /count must be an integer in \[0, 8\], got "9"/);
  assert.throws(
    () => comm.allreduceArraySync(new Float32Array(3)),
    /"f16" communicator reduces a Uint16Array/,
  );
});

Deno.test("Two ranks in one thread (async waits) round each fp32 sum to nearest even, exactly", async () => {
  const n = 30_000, x = randomFloats(2 * n, 8), big = 2 ** 17;
  for (const dtype of ["f16", "bf16"] as const) {
    const sab = createCommBuffer({ ranks: 2, capacity: n, dtype });
    const comms = [new RingComm(sab, 0), new RingComm(sab, 1)];
    const enc = dtype === "f16" ? f32BitsToF16 : f32BitsToBf16;
    const dec = (h: number) => dtype === "f16" ? f16Values[h] : bf16Values[h];
    const inputs = [0, 1].map((r) => {
      const out = new Uint16Array(n);
      // Wide magnitudes: subnormal, normal and overflowing fp16 sums all occur.
      for (let i = 0; i < n; i++) {
        out[i] = enc(bitsOf(x[r * n + i] * 2 ** ((i % 48) - 30) * big ** (i % 3 === 0 ? 1 : 0)));
      }
      return out;
    });
    await Promise.all(comms.map(async (c, r) => {
      (await c.acquire()).set(inputs[r]);
      await c.allreduce(n);
    }));
    for (let i = 0; i < n; i++) {
      const want = enc(bitsOf(Math.fround(dec(inputs[0][i]) + dec(inputs[1][i]))));
      for (const c of comms) {
        const got = c.slot[i];
        if (got !== want && !(Number.isNaN(dec(got)) && Number.isNaN(dec(want)))) {
          assert.fail(
            `${dtype} [${i}]: ${dec(inputs[0][i])} + ${dec(inputs[1][i])} gave ${dec(got)}, want ${
              dec(want)
            }`,
          );
        }
      }
    }
  }
});

Deno.test("A one-rank group reduces to the identity", () => {
  const comm = new RingComm(createCommBuffer({ ranks: 1, capacity: 4, dtype: "f32" }), 0);
  const data = Float32Array.of(1, 2, 3, 4, 5, 6);
  comm.allreduceArraySync(data);
  assert.deepEqual([...data], [1, 2, 3, 4, 5, 6]);
});

/** N Workers, one per rank, that run tasks and answer with their result. */
class Ranks {
  workers: Worker[];
  constructor(n: number) {
    this.workers = Array.from(
      { length: n },
      () => new Worker(new URL("../../_parallel_worker.ts", import.meta.url).href, { type: "module" }),
    );
  }
  /** Runs one task per rank (rank i gets tasks[i]) and collects the answers in rank order. */
  run(tasks: Omit<RankTask, "rank">[]): Promise<{ ok: boolean; data?: Payload; error?: string }[]> {
    return Promise.all(
      this.workers.map((w, rank) =>
        new Promise<{ ok: boolean; data?: Payload; error?: string }>((resolve) => {
          w.onmessage = (e) => resolve(e.data);
          w.postMessage({ ...tasks[rank], rank });
        })
      ),
    );
  }
  close(): void {
    for (const w of this.workers) w.terminate();
  }
}

/** Rank inputs: random floats in [-1, 1), as fp32 or as 16-bit bits. */
function inputs(n: number, count: number, dtype: CommDtype, seed: number): Payload[] {
  return Array.from({ length: n }, (_, r) => {
    const x = randomFloats(count, seed * 31 + r + 1);
    if (dtype === "f32") return x;
    const bits = new Uint32Array(x.buffer);
    const enc = dtype === "f16" ? f32BitsToF16 : f32BitsToBf16, out = new Uint16Array(count);
    for (let i = 0; i < count; i++) out[i] = enc(bits[i]); // (TypedArray.from with a map function is 10× slower)
    return out;
  });
}

const f16Values = new Float32Array(new Float16Array(new Uint16Array(65536).map((_, i) => i).buffer));
const bf16Values = new Float32Array(new Uint32Array(65536).map((_, i) => i << 16).buffer);

/** Decodes a payload to floats. */
function decode(p: Payload, dtype: CommDtype): Float32Array {
  if (dtype === "f32") return p as Float32Array;
  const table = dtype === "f16" ? f16Values : bf16Values, out = new Float32Array(p.length);
  for (let i = 0; i < p.length; i++) out[i] = table[p[i]];
  return out;
}

/** Payload, algorithm and the largest size run (10^6+3 for fp32 and fp16; bf16 only checks the rounding path). */
const cases: [CommDtype, CommAlgorithm, number][] = [
  ["f32", "ring", 1_000_003],
  ["f16", "ring", 1_000_003],
  ["f32", "direct", 1_000_003],
  ["f16", "direct", 1_000_003],
  ["bf16", "ring", 70_001],
];

for (const n of [2, 3, 4]) {
  Deno.test(`allreduceArray() over ${n} Workers matches a serial sum (sizes 1, 7, N-1, 10^6+3; ring and direct)`, async () => {
    const ranks = new Ranks(n);
    try {
      for (const [dtype, algorithm, large] of cases) {
        const sab = createCommBuffer({ ranks: n, capacity: 1 << 16, dtype, algorithm });
        for (const count of [1, 7, n - 1, large]) {
          const what = `${algorithm} ${dtype} count ${count}`;
          const data = inputs(n, count, dtype, count + n);
          const want = new Float64Array(count);
          for (const d of data) {
            const v = decode(d, dtype);
            for (let i = 0; i < count; i++) want[i] += v[i];
          }
          const got = await ranks.run(
            data.map((d, r) => ({ sab, task: "allreduce", data: d, async: r % 2 === 1 })),
          );
          for (let r = 0; r < n; r++) assert.ok(got[r].ok, `${what}: ${got[r].error}`);
          // fp32 sums in ring order differ from the double sum by a few fp32 ulps; 16-bit results by one rounding.
          const tol = dtype === "f32" ? 4e-7 : dtype === "f16" ? 2 ** -10 : 2 ** -7;
          const first = got[0].data!, v = decode(first, dtype);
          for (let i = 0; i < count; i++) {
            if (!(Math.abs(v[i] - want[i]) <= tol * Math.abs(want[i]) + 1e-6)) {
              assert.fail(`${what} [${i}]: ${v[i]} vs ${want[i]}`);
            }
          }
          for (let r = 1; r < n; r++) {
            const mine = got[r].data!;
            for (let i = 0; i < count; i++) {
              if (mine[i] !== first[i]) assert.fail(`${what}: rank ${r} differs from rank 0 at [${i}]`);
            }
          }
        }
      }
    } finally {
      ranks.close();
    }
  });
}

Deno.test("allreduceArray() over 5 Workers (the direct algorithm's blocked path) matches a serial sum", async () => {
  const ranks = new Ranks(5);
  try {
    for (const [dtype, algorithm] of [["f32", "direct"], ["f16", "direct"], ["f32", "ring"]] as const) {
      const count = 9001, sab = createCommBuffer({ ranks: 5, capacity: 4000, dtype, algorithm });
      const data = inputs(5, count, dtype, 5);
      const want = new Float64Array(count);
      for (const d of data) decode(d, dtype).forEach((v, i) => want[i] += v);
      const got = await ranks.run(
        data.map((d, r) => ({ sab, task: "allreduce", data: d, async: r % 2 === 0 })),
      );
      const tol = dtype === "f32" ? 4e-7 : 2 ** -10;
      for (let r = 0; r < 5; r++) {
        assert.ok(got[r].ok, `${algorithm} ${dtype}: ${got[r].error}`);
        const v = decode(got[r].data!, dtype);
        for (let i = 0; i < count; i++) {
          if (!(Math.abs(v[i] - want[i]) <= tol * Math.abs(want[i]) + 1e-6)) {
            assert.fail(`${algorithm} ${dtype} rank ${r} [${i}]: ${v[i]} vs ${want[i]}`);
          }
        }
      }
    }
  } finally {
    ranks.close();
  }
});

Deno.test("reduceScatter() then allGather() over 3 Workers: each rank updates its shard, all get every shard", async () => {
  const ranks = new Ranks(3);
  try {
    for (const algorithm of ["ring", "direct"] as CommAlgorithm[]) {
      const count = 1001, sab = createCommBuffer({ ranks: 3, capacity: count, dtype: "f32", algorithm });
      const data = inputs(3, count, "f32", 9) as Float32Array[];
      const got = await ranks.run(data.map((d, r) => ({ sab, task: "rsag", data: d, async: r === 1 })));
      for (let r = 0; r < 3; r++) assert.ok(got[r].ok, `${algorithm}: ${got[r].error}`);
      for (let i = 0; i < count; i++) {
        const want = (data[0][i] + data[1][i] + data[2][i]) * 0.5;
        for (let r = 0; r < 3; r++) {
          const v = got[r].data![i];
          if (!(Math.abs(v - want) <= 1e-6)) assert.fail(`${algorithm} rank ${r} [${i}]: ${v} vs ${want}`);
        }
      }
    }
  } finally {
    ranks.close();
  }
});

Deno.test("abort(), a timeout or abortCommBuffer() fail the waiting ranks with a CommError instead of hanging", async () => {
  const ranks = new Ranks(3);
  try {
    const sab = createCommBuffer({ ranks: 3, capacity: 16, dtype: "f32" });
    const data = new Float32Array(16);
    const got = await ranks.run([
      { sab, task: "allreduce", data, async: false },
      { sab, task: "allreduce", data, async: true },
      { sab, task: "abort", data, async: false },
    ]);
    assert.match(got[0].error!, /CommError: Communicator aborted by rank "2"/);
    assert.match(got[1].error!, /CommError: Communicator aborted by rank "2"/);
    const idle = createCommBuffer({ ranks: 2, capacity: 16, dtype: "f32" });
    const late = await ranks.run([
      { sab: idle, task: "allreduce", data, async: true, timeoutMs: 200 },
      { sab: idle, task: "idle", data, async: false },
      { sab: idle, task: "idle", data, async: false },
    ]);
    assert.match(late[0].error!, /timed out after 200 ms: rank "0" waited for rank "1" to finish step 1/);
    const orphan = createCommBuffer({ ranks: 3, capacity: 16, dtype: "f16" });
    const pending = ranks.run([
      { sab: orphan, task: "allreduce", data: new Uint16Array(16), async: false },
      { sab: orphan, task: "allreduce", data: new Uint16Array(16), async: true },
      { sab: orphan, task: "idle", data, async: false },
    ]);
    await new Promise((r) => setTimeout(r, 100));
    abortCommBuffer(orphan);
    const orphaned = await pending;
    assert.match(orphaned[0].error!, /CommError: Communicator aborted by the host/);
    assert.match(orphaned[1].error!, /CommError: Communicator aborted by the host/);
  } finally {
    ranks.close();
  }
});
