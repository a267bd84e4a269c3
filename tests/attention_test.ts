/**
 * The attention kernels alone (forward output and the dqkv gradient) against the float64 CPU
 * reference at head size 64, for the plain kernels and the subgroup-split variants, with
 * and without attention dropout, at a T that the tiles do not divide.
 */

import assert from "node:assert/strict";
import { readFloats } from "../gpu/device.ts";
import {
  attentionBackwardKVWgsl,
  attentionBackwardQWgsl,
  attentionDeltaWgsl,
  attentionForwardWgsl,
  type AttentionSpec,
  chooseAttentionTiles,
  chooseSplitAttentionTiles,
} from "../gpu/kernels/attention.ts";
import { grid1d } from "../gpu/kernels/common.ts";
import { encodeOps, makeOp, type OpKind, PipelineCache } from "../gpu/ops.ts";
import { attention_backward, attention_forward } from "../gpu/reference.ts";
import { dropThreshold } from "../gpu/rng.ts";
import { noGpu, randomFloats, relNorm, testContext, upload } from "./_helpers.ts";

const B = 1, H = 2, T = 40, D = 64, C = H * D;

async function run(split: 1 | 2 | 4, p: number, tiles?: { BQ: number; BKV: number }) {
  const ctx = (await testContext())!;
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
  };
  const key = 0x1234567;
  const qkv = randomFloats(B * T * 3 * C, 11), dy = randomFloats(B * T * C, 12);
  const bufs = {
    qkv: await upload(ctx, "qkv", qkv),
    dy: await upload(ctx, "dy", dy),
    y: await upload(ctx, "y", new Float32Array(B * T * C)),
    lse: await upload(ctx, "lse", new Float32Array(B * H * T)),
    delta: await upload(ctx, "delta", new Float32Array(B * H * T)),
    dqkv: await upload(ctx, "dqkv", new Float32Array(B * T * 3 * C)),
  };
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
      uniform: p > 0 && label !== "delta" ? uniform : undefined,
    });
  const av = [bufs.qkv, bufs.dy, bufs.lse, bufs.delta, bufs.dqkv];
  const ops = [
    await mk("fwd", "attention_fwd", attentionForwardWgsl(s), [bufs.qkv, bufs.y, bufs.lse], [
      Math.ceil(T / s.BQ),
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
    await mk("dkv", "attention_bwd", attentionBackwardKVWgsl(s), av, [Math.ceil(T / s.BKV), H, B]),
    await mk("dq", "attention_bwd", attentionBackwardQWgsl(s), av, [Math.ceil(T / s.BQ), H, B]),
  ];
  const enc = ctx.device.createCommandEncoder();
  encodeOps(enc, ops);
  ctx.device.queue.submit([enc.finish()]);
  const y = await readFloats(ctx, bufs.y), dqkv = await readFloats(ctx, bufs.dqkv);
  Object.values(bufs).forEach((b) => b.destroy());
  uniform.destroy();

  const q64 = Float64Array.from(qkv), dy64 = Float64Array.from(dy);
  const att = new Float64Array(B * H * T * T), attDrop = p > 0 ? new Float64Array(att.length) : att;
  const yRef = new Float64Array(B * T * C), dRef = new Float64Array(B * T * 3 * C);
  attention_forward(yRef, att, attDrop, q64, B, T, C, H, p, key);
  attention_backward(dRef, dy64, q64, att, attDrop, B, T, C, H, p, key);
  return { y: relNorm(y, yRef), dqkv: relNorm(dqkv, dRef) };
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
