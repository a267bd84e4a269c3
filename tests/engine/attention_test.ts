/**
 * The attention kernels alone (forward output and the dqkv gradient) against the float64 CPU
 * reference at head size 64, for the plain kernels and the subgroup-split variants, with
 * and without attention dropout, at a T that the tiles do not divide.
 */

import assert from "node:assert/strict";
import { readBuffer, readFloats } from "../../engine/device.ts";
import {
  attentionBackwardKVWgsl,
  attentionBackwardQWgsl,
  attentionDeltaWgsl,
  attentionForwardWgsl,
  type AttentionSpec,
  BACKWARD_KV_TILINGS,
  BACKWARD_Q_TILINGS,
  backwardKVSpec,
  backwardQSpec,
  chooseAttentionTiles,
  chooseBackwardTilings,
  chooseSplitAttentionTiles,
} from "../../engine/kernels/attention.ts";
import {
  flashBackwardKVWgsl,
  flashBackwardQWgsl,
  flashScratchBytes,
} from "../../bench/experiments/flash_backward.ts";
import {
  attentionBackwardQScoresWgsl,
  DQ_SCORES_TILES,
  type DqScoresTile,
  dqScoresTileError,
  scoresScratchBytes,
} from "../../engine/kernels/attention_dq.ts";
import { grid1d } from "../../engine/kernels/common.ts";
import { encodeOps, makeOp, type OpKind, PipelineCache } from "../../engine/ops.ts";
import { attention_backward, attention_forward } from "../reference/cpu_gpt2.ts";
import { dropThreshold } from "../../model/rng.ts";
import { assertSameFloats, noGpu, randomFloats, relNorm, testContext, upload } from "../_helpers.ts";

const B = 1, H = 2, T0 = 40;

/** Kernels of one run: the plain/split ones, or flash specs replacing the forward and/or the backward. */
interface RunOptions {
  /** Head size (default 64). */
  D?: number;
  /** qkv, y, dy and dqkv in f16 (the reference then runs on the f16-rounded inputs). */
  half?: boolean;
  /** Flash forward tiling (replaces the forward kernel). */
  flashFwd?: Pick<AttentionSpec, "BQ" | "BKV" | "flash">;
  /** Flash backward tiling (replaces the dK/dV and dQ kernels). */
  flashBwd?: Pick<AttentionSpec, "BQ" | "BKV" | "flash">;
  /** The CPU adapters' kernels without workgroup memory (AttentionSpec.direct). */
  direct?: boolean;
  /** Rows per thread group of both split backward kernels (AttentionSpec.kvRows, qRows). */
  rows?: 1 | 2 | 4;
  /** Tilings of the split backward kernels' own (AttentionSpec.bwdKV, bwdQ). */
  own?: Pick<AttentionSpec, "bwdKV" | "bwdQ">;
  /**
   * The dK/dV kernel writes dS (`writeDS`) and dQ is the matmul over it (attention_dq.ts); the
   * scratch starts as NaN, so an entry read without being written or masked shows.
   */
  scores?: boolean | DqScoresTile;
  /** Sequence length (default T0). */
  T?: number;
  /** The backward kernels' tile fills written out (AttentionSpec.writtenFills). */
  fills?: boolean;
  /** The dK/dV kernel's sums reduce-scattered (AttentionSpec.scatterSums). */
  scatter?: boolean;
}

async function run(split: 1 | 2 | 4 | 8, p: number, tiles?: { BQ: number; BKV: number }, o: RunOptions = {}) {
  const ctx = (await testContext())!;
  const D = o.D ?? 64, C = H * D, T = o.T ?? T0;
  const wg = ctx.limits.maxComputeWorkgroupStorageSize;
  tiles ??= split > 1 ? chooseSplitAttentionTiles({ T, D }, wg, split) : chooseAttentionTiles({ T, D }, wg);
  const s: AttentionSpec = {
    B,
    T,
    H,
    D,
    split,
    ...tiles,
    dropout: p > 0 ? { site: 0, nSites: 1 } : undefined,
    ...(o.half ? { dtype: "f16", gradDtype: "f16" } : {}),
    ...(o.direct ? { direct: true } : {}),
    ...(o.rows ? { kvRows: o.rows, qRows: o.rows } : {}),
    ...o.own,
    ...(o.fills ? { writtenFills: true } : {}),
    ...(o.scatter ? { scatterSums: true } : {}),
  };
  const sf: AttentionSpec = { ...s, ...o.flashFwd };
  const key = 0x1234567;
  const round = (x: Float32Array) => (o.half ? Float32Array.from(Float16Array.from(x)) : x);
  const qkv = round(randomFloats(B * T * 3 * C, 11)), dy = round(randomFloats(B * T * C, 12));
  const put = (label: string, x: Float32Array) => {
    if (!o.half) return upload(ctx, label, x);
    const h = Float16Array.from(x);
    return upload(ctx, label, new Float32Array(h.buffer, 0, Math.ceil(h.length / 2)));
  };
  const bufs = {
    qkv: await put("qkv", qkv),
    dy: await put("dy", dy),
    y: await put("y", new Float32Array(B * T * C)),
    lse: await upload(ctx, "lse", new Float32Array(B * H * T)),
    delta: await upload(ctx, "delta", new Float32Array(B * H * T)),
    dqkv: await put("dqkv", new Float32Array(B * T * 3 * C)),
  };
  const get = async (b: GPUBuffer, n: number) =>
    o.half
      ? Float32Array.from(new Float16Array(await readBuffer(ctx, b, 0, n * 2)))
      : await readFloats(ctx, b);
  const u = new Uint32Array(4);
  u[0] = key;
  u[1] = dropThreshold(p);
  new Float32Array(u.buffer)[2] = 1 / (1 - p);
  const uniform = ctx.device.createBuffer({
    size: 16,
    usage: GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST,
  });
  ctx.device.queue.writeBuffer(uniform, 0, u);
  const cache = new PipelineCache(ctx);
  const mk = async (
    label: string,
    kind: OpKind,
    wgsl: string,
    views: GPUBuffer[],
    grid: [number, number, number],
  ) =>
    makeOp(ctx, await cache.get(label, wgsl), {
      label,
      phase: "forward",
      kind,
      views: views.map((buffer) => ({ buffer })),
      grid,
      uniform: p > 0 && label !== "delta" && label !== "dq.flash" ? uniform : undefined,
    });
  const av = [bufs.qkv, bufs.dy, bufs.lse, bufs.delta, bufs.dqkv];
  const sb: AttentionSpec = { ...s, ...o.flashBwd };
  const dqTile = typeof o.scores === "object" ? o.scores : DQ_SCORES_TILES[0];
  const dst = o.flashBwd
    ? await upload(ctx, "dst", new Float32Array(flashScratchBytes(s) / 4))
    : o.scores
    ? await upload(ctx, "dst", new Float32Array(scoresScratchBytes(s) / 4).fill(NaN))
    : null;
  const backward = o.scores
    ? [
      await mk("dkv", "attention_bwd", attentionBackwardKVWgsl({ ...s, writeDS: true }), [...av, dst!], [
        Math.ceil(T / backwardKVSpec(s).BKV),
        H,
        B,
      ]),
      await mk("dq.flash", "attention_bwd", attentionBackwardQScoresWgsl(s, dqTile), [
        bufs.qkv,
        dst!,
        bufs.dqkv,
      ], [
        Math.ceil(T / dqTile.BQ),
        H,
        B,
      ]),
    ]
    : dst
    ? [
      await mk("dkv", "attention_bwd", flashBackwardKVWgsl(sb), [...av, dst], [Math.ceil(T / sb.BKV), H, B]),
      await mk("dq.flash", "attention_bwd", flashBackwardQWgsl(sb), [bufs.qkv, dst, bufs.dqkv], [
        Math.ceil(T / sb.BQ),
        H,
        B,
      ]),
    ]
    : [
      await mk("dkv", "attention_bwd", attentionBackwardKVWgsl(s), av, [
        Math.ceil(T / backwardKVSpec(s).BKV),
        H,
        B,
      ]),
      await mk("dq", "attention_bwd", attentionBackwardQWgsl(s), av, [
        Math.ceil(T / backwardQSpec(s).BQ),
        H,
        B,
      ]),
    ];
  const ops = [
    await mk("fwd", "attention_fwd", attentionForwardWgsl(sf), [bufs.qkv, bufs.y, bufs.lse], [
      Math.ceil(T / sf.BQ),
      H,
      B,
    ]),
    await mk(
      "delta",
      "attention_bwd",
      attentionDeltaWgsl(s),
      [bufs.y, bufs.dy, bufs.delta],
      grid1d(Math.ceil(B * T * H / 64)),
    ),
    ...backward,
  ];
  const enc = ctx.device.createCommandEncoder();
  encodeOps(enc, ops);
  ctx.device.queue.submit([enc.finish()]);
  const y = await get(bufs.y, B * T * C), dqkv = await get(bufs.dqkv, B * T * 3 * C);
  Object.values(bufs).forEach((b) => b.destroy());
  dst?.destroy();
  uniform.destroy();

  const q64 = Float64Array.from(qkv), dy64 = Float64Array.from(dy);
  const att = new Float64Array(B * H * T * T), attDrop = p > 0 ? new Float64Array(att.length) : att;
  const yRef = new Float64Array(B * T * C), dRef = new Float64Array(B * T * 3 * C);
  attention_forward(yRef, att, attDrop, q64, B, T, C, H, p, key);
  attention_backward(dRef, dy64, q64, att, attDrop, B, T, C, H, p, key);
  return { y: relNorm(y, yRef), dqkv: relNorm(dqkv, dRef), dqkvRaw: dqkv };
}

const cases: [1 | 2 | 4, number, { BQ: number; BKV: number }?][] = [
  [1, 0],
  [1, 0.2],
  [4, 0],
  [4, 0.2],
  [2, 0.2, { BQ: 16, BKV: 8 }],
];
for (const [split, p, tiles] of cases) {
  Deno.test({
    name: `attention D=64 T=40 split=${split} dropout=${p}${tiles ? ` BQ=${tiles.BQ} BKV=${tiles.BKV}` : ""}`,
    ignore: noGpu,
    async fn() {
      const ctx = (await testContext())!;
      if (split > 1 && !ctx.hasSubgroups) return;
      const e = await run(split, p, tiles);
      assert.ok(e.y < 1e-5, `forward rel err ${e.y}`);
      assert.ok(e.dqkv < 1e-5, `dqkv rel err ${e.dqkv}`);
    },
  });
}

/**
 * The split backward kernels with several keys (dK/dV) and queries (dQ) per thread group: rows
 * that straddle the causal diagonal and T's ragged end in one group, with dropout, and 8 threads
 * per row where the subgroups are that wide.
 */
const rowCases: Array<[4 | 8, 2 | 4, number]> = [[4, 2, 0], [4, 4, 0.2], [8, 2, 0.2]];
for (const [split, rows, p] of rowCases) {
  Deno.test({
    name:
      `attention's split backward with ${rows} rows per group (split=${split}, dropout=${p}) matches float64`,
    ignore: noGpu,
    async fn() {
      const ctx = (await testContext())!;
      if (!ctx.hasSubgroups || ctx.subgroupMinSize < split) return;
      const e = await run(split, p, undefined, { rows });
      assert.ok(e.y < 1e-5, `forward rel err ${e.y}`);
      assert.ok(e.dqkv < 1e-5, `dqkv rel err ${e.dqkv}`);
    },
  });
}

Deno.test({
  name:
    "attention's split backward on tilings of their own per kernel (chooseBackwardTilings's, dropout) matches float64",
  ignore: noGpu,
  async fn() {
    const ctx = (await testContext())!;
    if (!ctx.hasSubgroups) return;
    const lim = {
      maxWorkgroupBytes: ctx.limits.maxComputeWorkgroupStorageSize,
      maxThreads: ctx.limits.maxComputeInvocationsPerWorkgroup,
      subgroupMinSize: ctx.subgroupMinSize,
    };
    // The H200's picks where they fit, and tiles that differ between the kernels and from the forward's.
    const picks = [
      chooseBackwardTilings({ T: T0, D: 64 }, lim),
      chooseBackwardTilings({ T: T0, D: 64 }, lim, {
        kv: [{ split: 4, BQ: 16, BKV: 32, rows: 2 }],
        q: [{ split: 4, BQ: 32, BKV: 16, rows: 1 }],
      }),
    ];
    // The loops written out 2 and 4 rows per trip (with the ragged tiles' rest one at a time).
    for (const unroll of [2, 4] as const) {
      const p = picks[unroll / 2 - 1];
      picks.push({
        ...(p.bwdKV ? { bwdKV: { ...p.bwdKV, unroll } } : {}),
        ...(p.bwdQ ? { bwdQ: { ...p.bwdQ, unroll } } : {}),
      });
    }
    for (const own of picks) {
      assert.ok(own.bwdKV && own.bwdQ, `no tiling fits ${JSON.stringify(lim)}`);
      const e = await run(4, 0.2, { BQ: 32, BKV: 32 }, { own });
      assert.ok(e.dqkv < 1e-5, `${JSON.stringify(own)}: dqkv rel err ${e.dqkv}`);
    }
  },
});

Deno.test({
  name:
    "attention's backward with its tile fills written out (writtenFills) gives the loops' dqkv bit for bit: split kernels and stored dS, T=136, dropout",
  ignore: noGpu,
  async fn() {
    const ctx = (await testContext())!;
    if (!ctx.hasSubgroups || ctx.subgroupMinSize < 8) return;
    const own = {
      bwdKV: BACKWARD_KV_TILINGS[0],
      bwdQ: { split: 4 as const, BQ: 32, BKV: 16, rows: 2 as const },
    };
    // T = 136: ragged query and key tiles; the dQ tiling 32x16 c1's fills of 128 and 256 over 128
    // threads, the dK/dV tiling's of 512 and 32 (one partial trip) over 128.
    for (const o of [{ own }, { own, scores: true }, { own, scores: DQ_SCORES_TILES[1] }]) {
      const loops = await run(4, 0.2, undefined, { T: 136, ...o });
      const written = await run(4, 0.2, undefined, { T: 136, ...o, fills: true });
      assert.ok(written.dqkv < 1e-5, `${JSON.stringify(o)}: dqkv rel err ${written.dqkv}`);
      assertSameFloats(written.dqkvRaw, loops.dqkvRaw, `${JSON.stringify(o)}: dqkv`);
    }
  },
});

Deno.test({
  name:
    "attention's dK/dV with its sums reduce-scattered (scatterSums) gives the butterfly's dqkv bit for bit: split 8 and 4, 4 and 2 keys per group, stored dS, f16 storage, T=136, dropout",
  ignore: noGpu,
  async fn() {
    const ctx = (await testContext())!;
    if (!ctx.hasSubgroups || ctx.subgroupMinSize < 8) return;
    const h200 = {
      bwdKV: BACKWARD_KV_TILINGS[0],
      bwdQ: { split: 4 as const, BQ: 32, BKV: 16, rows: 2 as const },
    };
    // Split 8 with 4 keys (two halvings, then one level as the butterfly), split 4 with 2 keys
    // (one halving, one butterfly level), each with the keys spaced (no dS) and consecutive (dS);
    // and f16 storage (fp16 training), whose sums are f32 all the same.
    const two = { bwdKV: { split: 4 as const, BQ: 32, BKV: 32, rows: 2 as const }, bwdQ: h200.bwdQ };
    for (
      const o of [
        { own: h200 },
        { own: h200, scores: true },
        { own: two },
        { own: two, scores: true },
        { own: h200, scores: true, half: true },
      ]
    ) {
      if ("half" in o && !ctx.hasF16) continue;
      const butterfly = await run(4, 0.2, undefined, { T: 136, ...o });
      const scattered = await run(4, 0.2, undefined, { T: 136, ...o, scatter: true });
      const tol = "half" in o ? 3e-3 : 1e-5;
      assert.ok(scattered.dqkv < tol, `${JSON.stringify(o)}: dqkv rel err ${scattered.dqkv}`);
      assertSameFloats(scattered.dqkvRaw, butterfly.dqkvRaw, `${JSON.stringify(o)}: dqkv`);
    }
  },
});

/**
 * dS stored by the split dK/dV kernel and dQ as the matmul over it: the H200's tilings, several
 * keys per group with dropout, a T with several query and key tiles and a ragged end (T = 136:
 * three 64-query tiles, five 32-key tiles), and f16 storage.
 */
const scoreCases: Array<[string, number, RunOptions]> = [
  ["split 8, 4 keys per group (the H200's tiling)", 0, { own: { bwdKV: BACKWARD_KV_TILINGS[0] } }],
  ["split 4, 2 rows, dropout", 0.2, { rows: 2 }],
  ["split 4, T=136, dropout", 0.2, { T: 136 }],
  ["split 4, D=32, f16 storage", 0, { D: 32, half: true }],
];
// Every dQ tiling the bench chooses from, at T = 136 with dropout (lavapipe: those that fit it).
for (const t of DQ_SCORES_TILES) {
  scoreCases.push([
    `dQ tiling ${t.BQ}x${t.BK}, ${t.CP} columns, ${t.RQ ?? 4} queries a thread, T=136, dropout`,
    0.2,
    { T: 136, scores: t },
  ]);
}
for (const [label, p, o] of scoreCases) {
  Deno.test({
    name: `attention's dQ from stored dS (${label}) matches float64`,
    ignore: noGpu,
    async fn() {
      const ctx = (await testContext())!;
      const split = o.own?.bwdKV?.split ?? 4;
      if (!ctx.hasSubgroups || ctx.subgroupMinSize < split || (o.half && !ctx.hasF16)) return;
      const lim = {
        maxWorkgroupBytes: ctx.limits.maxComputeWorkgroupStorageSize,
        maxThreads: ctx.limits.maxComputeInvocationsPerWorkgroup,
      };
      const misfit = typeof o.scores === "object" ? dqScoresTileError(o.scores, o.D ?? 64, lim) : null;
      if (misfit) return console.log(`not run: this adapter does not fit the tiling (${misfit})`);
      const e = await run(4, p, undefined, { scores: true, ...o });
      const tol = o.half ? 3e-3 : 1e-5;
      assert.ok(e.dqkv < tol, `dqkv rel err ${e.dqkv}`);
    },
  });
}

Deno.test("chooseBackwardTilings() keeps to the device's subgroup size, threads and workgroup memory", () => {
  const big = { maxWorkgroupBytes: 49152, maxThreads: 1024, subgroupMinSize: 32 };
  const h200 = chooseBackwardTilings({ T: 1024, D: 64 }, big);
  assert.deepEqual(h200.bwdKV, BACKWARD_KV_TILINGS[0]);
  assert.deepEqual(h200.bwdQ, BACKWARD_Q_TILINGS[0]);
  assert.deepEqual(chooseBackwardTilings({ T: 1024, D: 64 }, { ...big, subgroupMinSize: 0 }), {});
  const small = chooseBackwardTilings({ T: 1024, D: 64 }, { ...big, subgroupMinSize: 4, maxThreads: 64 });
  for (const t of [small.bwdKV, small.bwdQ]) if (t) assert.ok(t.split <= 4);
  assert.ok(!small.bwdKV || (small.bwdKV.BKV / small.bwdKV.rows) * small.bwdKV.split <= 64);
  assert.ok(!small.bwdQ || (small.bwdQ.BQ / small.bwdQ.rows) * small.bwdQ.split <= 64);
});

for (const p of [0, 0.2]) {
  Deno.test({
    name:
      `attention's direct kernels (CPU adapters: no workgroup memory) match float64 at T=40, dropout=${p}`,
    ignore: noGpu,
    async fn() {
      for (const D of [64, 16]) {
        const e = await run(1, p, undefined, { direct: true, D });
        assert.ok(e.y < 1e-5, `D=${D} forward rel err ${e.y}`);
        assert.ok(e.dqkv < 1e-5, `D=${D} dqkv rel err ${e.dqkv}`);
      }
    },
  });
}

/**
 * The flash kernels, forward and backward in one run each (lavapipe compiles them slowly): at the
 * GPT-2 head size with subgroup row maxima and prefetch; at D = 32 with workgroup-memory maxima,
 * dropout, no prefetch, and tiles that leave whole rows masked (BQ > BKV forward, BKV < BQ
 * backward); and with f16 storage.
 */
const flashCases: Array<[string, RunOptions, number]> = [
  ["D=64, 8 lanes, subgroup", {
    flashFwd: { BQ: 32, BKV: 32, flash: { lanes: 8, reduce: "subgroup" } },
    flashBwd: { BQ: 16, BKV: 16, flash: { lanes: 4, reduce: "subgroup" } },
  }, 0],
  ["D=32, 4 lanes, shared, dropout", {
    D: 32,
    flashFwd: { BQ: 32, BKV: 16, flash: { lanes: 4, reduce: "shared", prefetch: false } },
    flashBwd: { BQ: 16, BKV: 8, flash: { lanes: 4, reduce: "shared" } },
  }, 0.2],
  ["D=32, 8 lanes, f16 storage", {
    D: 32,
    half: true,
    flashFwd: { BQ: 16, BKV: 32, flash: { lanes: 8, reduce: "shared" } },
    flashBwd: { BQ: 32, BKV: 16, flash: { lanes: 8, reduce: "shared" } },
  }, 0],
];
for (const [label, o, p] of flashCases) {
  Deno.test({
    name: `flash attention forward and backward (${label}) match float64 at T=40`,
    ignore: noGpu,
    async fn() {
      const ctx = (await testContext())!;
      if (o.flashFwd?.flash?.reduce === "subgroup" && !ctx.hasSubgroups) return;
      if (o.half && !ctx.hasF16) return;
      const e = await run(1, p, undefined, o);
      // f16: y and dqkv are rounded to f16 when stored (and the dQ/dK/dV sums see f16 dO).
      const tol = o.half ? 3e-3 : 1e-5;
      assert.ok(e.y < tol, `forward rel err ${e.y}`);
      assert.ok(e.dqkv < tol, `dqkv rel err ${e.dqkv}`);
    },
  });
}
