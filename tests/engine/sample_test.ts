/**
 * The sampling kernel against a CPU twin of its definition: for each row, keep the top-k ids (all
 * ties at the k-th value), then the nucleus (the fewest largest kept ids whose mass reaches top_p
 * of the kept mass), and pick the first id in vocabulary order where the running mass passes
 * u · total, u drawn from the row's seed and position. Rows are random logits, so a draw that
 * falls on a boundary within float rounding is vanishingly rare: every token must match. Covers
 * the compacted top-k path (k ≤ 256, few candidates), the fallback over the vocabulary (k > 256;
 * or more candidates than workgroup memory holds), top-p with and without top-k (peaked logits,
 * whose nucleus is bounded by the threads' maxima, and nearly flat ones), and greedy, with
 * the workgroup reductions of GPUs (a tree, or subgroups where the adapter has them) and of CPU
 * adapters (one invocation), and the direct
 * kernel of CPU adapters (one invocation per row, no barriers).
 */

import assert from "node:assert/strict";
import { createPipeline, readBuffers } from "../../engine/device.ts";
import {
  LP_WORDS,
  PARAM_WORDS,
  type SampleSpec,
  sampleWgsl,
  STATE_WORDS,
} from "../../engine/kernels/sample.ts";
import { pcg } from "../../model/rng.ts";
import { noGpu, testContext } from "../_helpers.ts";

const V = 3000, Vp = 3072, S = 48;

interface Params {
  temperature: number;
  top_k: number;
  top_p: number;
}

/** What the kernel should pick for one row (float64 arithmetic; see the file header). */
function referencePick(logits: Float32Array, p: Params, seed: number, pos: number): number {
  const xs = Array.from(logits.subarray(0, V));
  const mx = Math.max(...xs);
  if (p.temperature <= 0) return xs.indexOf(mx);
  const sorted = [...xs].sort((a, b) => b - a);
  let cut = -Infinity;
  if (p.top_k > 0 && p.top_k < V) cut = sorted[p.top_k - 1];
  const w = (x: number) => Math.exp((x - mx) / p.temperature);
  if (p.top_p > 0 && p.top_p < 1) {
    const kept = sorted.filter((x) => x >= cut);
    const z = kept.reduce((a, x) => a + w(x), 0);
    let m = 0;
    for (const x of kept) {
      m += w(x);
      if (m >= p.top_p * z) {
        cut = Math.max(cut, x);
        break;
      }
    }
  }
  const total = xs.reduce((a, x) => a + (x >= cut ? w(x) : 0), 0);
  const r = pcg((pcg(seed) ^ pcg((pos + 0x68e31da4) >>> 0)) >>> 0);
  const u = ((r >>> 8) + 0.5) / 16777216 * total;
  let acc = 0, last = -1;
  for (let v = 0; v < V; v++) {
    if (xs[v] < cut) continue;
    last = v;
    acc += w(xs[v]);
    if (u < acc) return v;
  }
  return last;
}

/** Runs the kernel once over S rows; returns each row's pick. */
async function gpuPicks(
  logits: Float32Array<ArrayBuffer>,
  params: Params[],
  seeds: number[],
  pos: number[],
  serialReductions: boolean,
  direct = false,
  subgroups = false,
  writtenRest = false,
): Promise<number[]> {
  const spec = { serialReductions, direct, subgroups, writtenRest };
  return (await runSampler(logits, params, seeds, pos, spec, 0)).picks;
}

/** Runs the kernel once over S rows with `logprobs` (0 … 5) asked of each: picks and the lp words. */
async function runSampler(
  logits: Float32Array<ArrayBuffer>,
  params: Params[],
  seeds: number[],
  pos: number[],
  spec: Pick<SampleSpec, "serialReductions" | "direct" | "subgroups" | "writtenRest">,
  logprobs: number,
): Promise<{ picks: number[]; lp: Uint32Array }> {
  const ctx = (await testContext())!;
  const pipeline = await createPipeline(
    ctx,
    "sample test",
    sampleWgsl({ V, Vp, streams: S, chunk: 1, rows: "stream", maxPos: 1 << 20, ...spec }),
  );
  const usage = GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST;
  const buf = (data: ArrayBufferView<ArrayBuffer>) => {
    const b = ctx.device.createBuffer({ size: Math.max(16, data.byteLength), usage });
    ctx.device.queue.writeBuffer(b, 0, data);
    return b;
  };
  const state = new Uint32Array(S * STATE_WORDS), prm = new Uint32Array(S * PARAM_WORDS);
  const pf = new Float32Array(prm.buffer);
  for (let r = 0; r < S; r++) {
    state[r * STATE_WORDS + 1] = pos[r];
    state[r * STATE_WORDS + 2] = seeds[r];
    pf[r * PARAM_WORDS] = params[r].temperature;
    prm[r * PARAM_WORDS + 1] = params[r].top_k;
    pf[r * PARAM_WORDS + 2] = params[r].top_p;
    prm[r * PARAM_WORDS + 3] = logprobs > 0 ? logprobs + 1 : 0;
  }
  const bufs = [
    buf(logits),
    buf(state),
    buf(prm),
    buf(new Uint32Array(S)),
    buf(new Float32Array(S * LP_WORDS)),
  ];
  try {
    const group = ctx.device.createBindGroup({
      layout: pipeline.getBindGroupLayout(0),
      entries: bufs.map((b, binding) => ({ binding, resource: { buffer: b } })),
    });
    const enc = ctx.device.createCommandEncoder();
    const pass = enc.beginComputePass();
    pass.setPipeline(pipeline);
    pass.setBindGroup(0, group);
    pass.dispatchWorkgroups(S);
    pass.end();
    ctx.device.queue.submit([enc.finish()]);
    const [out, lp] = await readBuffers(ctx, [
      { buffer: bufs[3], bytes: S * 4 },
      { buffer: bufs[4], bytes: S * LP_WORDS * 4 },
    ]);
    return { picks: Array.from(new Uint32Array(out)), lp: new Uint32Array(lp) };
  } finally {
    for (const b of bufs) b.destroy();
  }
}

function randomLogits(seed: number): Float32Array<ArrayBuffer> {
  const out = new Float32Array(S * Vp);
  let s = seed >>> 0;
  const next = () => (s = pcg(s)) / 4294967296;
  for (let r = 0; r < S; r++) {
    for (let v = 0; v < V; v++) {
      // Roughly normal, scale 2 (sum of uniforms), so the top few dozen ids carry the mass.
      out[r * Vp + v] = 2 * (next() + next() + next() + next() - 2);
    }
    // Padded ids hold huge logits: they must never be picked.
    for (let v = V; v < Vp; v++) out[r * Vp + v] = 1e4;
  }
  return out;
}

Deno.test({
  name: "the sampling kernel picks what its CPU twin picks: top-k compacted and not, top-p, greedy",
  ignore: noGpu,
  fn: async () => {
    const ctx = (await testContext())!;
    const cases: [string, Params, (l: Float32Array<ArrayBuffer>) => void][] = [
      ["top-k 40 (compacted)", { temperature: 0.8, top_k: 40, top_p: 1 }, () => {}],
      ["top-k 1", { temperature: 1, top_k: 1, top_p: 1 }, () => {}],
      ["top-k 256 (compacted, the largest k)", { temperature: 1.3, top_k: 256, top_p: 1 }, () => {}],
      ["top-k 300 (over the vocabulary)", { temperature: 1.3, top_k: 300, top_p: 1 }, () => {}],
      ["top-k 40 and top-p 0.8", { temperature: 1, top_k: 40, top_p: 0.8 }, () => {}],
      ["top-p 0.9 alone", { temperature: 1, top_k: 0, top_p: 0.9 }, () => {}],
      // 20 ids well above the rest carry most of the mass: the threads' maxima bound the nucleus.
      ["top-p 0.9 alone, peaked (compacted)", { temperature: 1, top_k: 0, top_p: 0.9 }, (l) => {
        for (let r = 0; r < S; r++) for (let i = 0; i < 20; i++) l[r * Vp + ((i * 149 + r * 7) % V)] += 9;
      }],
      // Nearly flat: the maxima carry a small share of the mass, so no bound (over the vocabulary).
      ["top-p 0.5 alone, flat", { temperature: 1, top_k: 0, top_p: 0.5 }, (l) => {
        for (let r = 0; r < S; r++) for (let v = 0; v < V; v++) l[r * Vp + v] *= 0.01;
      }],
      ["temperature alone", { temperature: 0.7, top_k: 0, top_p: 1 }, () => {}],
      ["greedy", { temperature: 0, top_k: 0, top_p: 1 }, () => {}],
      // 2,600 ids tied at the top: more candidates than the workgroup memory holds (falls back).
      ["top-k 10 with 2600 tied ids", { temperature: 1, top_k: 10, top_p: 1 }, (l) => {
        for (let r = 0; r < S; r++) for (let v = 0; v < 2600; v++) l[r * Vp + v] = 5;
      }],
    ];
    for (const [i, [what, p, shape]] of cases.entries()) {
      const logits = randomLogits(100 + i);
      shape(logits);
      const seeds = Array.from({ length: S }, (_, r) => pcg(7 * r + i) >>> 0);
      const pos = Array.from({ length: S }, (_, r) => 3 * r + i);
      const want = Array.from(
        { length: S },
        (_, r) => referencePick(logits.subarray(r * Vp, (r + 1) * Vp), p, seeds[r], pos[r]),
      );
      // The tree reductions (GPUs) and the serial ones (CPU adapters) pick the same.
      const serial = await gpuPicks(logits, Array(S).fill(p), seeds, pos, true);
      assert.deepEqual(serial, want, `${what}, serial reductions`);
      // The one-invocation kernel of CPU adapters (no barriers) picks the same.
      const direct = await gpuPicks(logits, Array(S).fill(p), seeds, pos, true, true);
      if (JSON.stringify(direct) !== JSON.stringify(want)) {
        console.log(
          what,
          direct.map((d, r) => d === want[r] ? "." : `${r}:${d}/${want[r]}`).join(" "),
        );
      }
      assert.deepEqual(direct, want, `${what}, direct kernel`);
      const got = await gpuPicks(logits, Array(S).fill(p), seeds, pos, false);
      assert.deepEqual(got, want, what);
      // GPUs with subgroups: reductions, prefix sums and the draw's owner through subgroups.
      if (ctx.subgroupMinSize > 0) {
        const sub = await gpuPicks(logits, Array(S).fill(p), seeds, pos, false, false, true);
        assert.deepEqual(sub, want, `${what}, subgroup reductions`);
        // The passes' rests and the rank loops written out (SampleSpec.writtenRest).
        const written = await gpuPicks(logits, Array(S).fill(p), seeds, pos, false, false, true, true);
        assert.deepEqual(written, want, `${what}, subgroup reductions, rests written out`);
      }
      const writtenTree = await gpuPicks(logits, Array(S).fill(p), seeds, pos, false, false, false, true);
      assert.deepEqual(writtenTree, want, `${what}, rests written out`);
      assert.ok(got.every((t) => t < V), `${what}: a padded id was picked`);
      if (p.top_k > 1 && p.temperature > 0) {
        // Not a degenerate draw: the picks spread over several ids.
        assert.ok(new Set(got).size > 1, `${what}: every row picked the same id`);
      }
    }
  },
});

Deno.test({
  name:
    "the sampling kernel with its passes' rests written out (writtenRest) reports the same picks and logprobs, top 5, bit for bit",
  ignore: noGpu,
  fn: async () => {
    const ctx = (await testContext())!;
    const settings: Params[] = [
      { temperature: 0.8, top_k: 40, top_p: 1 },
      { temperature: 1, top_k: 40, top_p: 0.8 },
      { temperature: 1, top_k: 0, top_p: 0.9 },
      { temperature: 0, top_k: 0, top_p: 1 },
    ];
    for (const [i, p] of settings.entries()) {
      const logits = randomLogits(300 + i);
      const seeds = Array.from({ length: S }, (_, r) => pcg(11 * r + i) >>> 0);
      const pos = Array.from({ length: S }, (_, r) => r + i);
      for (const subgroups of ctx.subgroupMinSize > 0 ? [false, true] : [false]) {
        const spec = { serialReductions: false, subgroups };
        const loops = await runSampler(logits, Array(S).fill(p), seeds, pos, spec, 5);
        const written = await runSampler(
          logits,
          Array(S).fill(p),
          seeds,
          pos,
          { ...spec, writtenRest: true },
          5,
        );
        const what = `${JSON.stringify(p)}, subgroups ${subgroups}`;
        assert.deepEqual(written.picks, loops.picks, `${what}: picks`);
        assert.deepEqual(written.lp, loops.lp, `${what}: logprobs`);
        // Filled in: each row's chosen logprob and its top 5 (ids below V, logprobs ≤ 0).
        const f = new Float32Array(loops.lp.buffer);
        for (let r = 0; r < S; r++) {
          const o = r * LP_WORDS;
          assert.ok(f[o] <= 0 && f[o] > -100, `${what}: row ${r}'s chosen logprob ${f[o]}`);
          for (let k = 0; k < 5; k++) assert.ok(loops.lp[o + 2 + 2 * k] < V && f[o + 3 + 2 * k] <= 0);
        }
      }
    }
  },
});
