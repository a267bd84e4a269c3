/**
 * Past the binding limit: the flat arrays cut into several GPU buffers (gradient norm and AdamW
 * run per segment) and the LM head with its cross-entropy run over chunks of rows give the same
 * training as one buffer and one chunk, forced here with tiny segment and chunk sizes.
 */

import assert from "node:assert/strict";
import { makeConfig, paramLayout } from "../../model/config.ts";
import { planSegments } from "../../engine/flat.ts";
import { type StepStats, Trainer, type TrainerOptions } from "../../engine/trainer.ts";
import { noGpu, relNorm, testContext, upload } from "../_helpers.ts";
import { createPipeline, readBuffer } from "../../engine/device.ts";
import { grid1d, ZERO_WORDS_PER_GROUP, zeroWordsWgsl } from "../../engine/kernels/common.ts";

const config = makeConfig({ n_layer: 2, n_head: 2, n_embd: 32, n_positions: 32, vocab_size: 256 });
const T = 32;

function batch(B: number, seed: number): Uint16Array {
  const out = new Uint16Array(B * (T + 1));
  let s = seed;
  for (let i = 0; i < out.length; i++) {
    s = (Math.imul(s, 1103515245) + 12345) >>> 0;
    out[i] = (s >>> 16) % config.vocab_size;
  }
  return out;
}

async function trainer(B: number, extra: Partial<TrainerOptions>): Promise<Trainer> {
  const ctx = (await testContext())!;
  return await Trainer.create(ctx, {
    config,
    batchSize: B,
    seqLen: T,
    schedule: { lr: 1e-2, min_lr: 1e-3, warmup_iters: 1, decay_iters: 10, style: "cosine" },
    adamw: { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, clip_grad: 0 },
    attnDropout: 0.1,
    hiddenDropout: 0.1,
    seed: 5,
    ...extra,
  });
}

const same = (a: ArrayLike<number>, b: ArrayLike<number>) =>
  a.length === b.length && Array.prototype.every.call(a, (x: number, i: number) => Object.is(x, b[i]));

Deno.test("planSegments() cuts at tensor boundaries within the limit and covers the layout", () => {
  const layout = paramLayout(config);
  const segs = planSegments(layout, 40 * 1024);
  assert.ok(segs.length > 2, `${segs.length} segments`);
  let at = 0;
  for (const s of segs) {
    assert.equal(s.start, at);
    assert.ok(s.size * 4 <= 40 * 1024, `segment of ${s.size * 4} bytes`);
    assert.ok(layout.tensors.some((t) => t.offset === s.start), "starts at a tensor");
    at += s.size;
  }
  assert.equal(at, layout.totalSize);
  assert.deepEqual(planSegments(layout, 2 ** 31), [{ start: 0, size: layout.totalSize }]);
  assert.throws(() => planSegments(layout, 16 * 1024), /tensor "wte.weight" of 32768 bytes exceeds/);
});

Deno.test({
  name: "Trainer over segmented flat buffers trains bit-identically to one buffer",
  ignore: noGpu,
  fn: async () => {
    const whole = await trainer(2, {});
    const cut = await trainer(2, { chunks: { maxSegmentBytes: 40 * 1024 } });
    assert.equal(whole.model.params.segments.length, 1);
    assert.ok(cut.model.params.segments.length > 2, `${cut.model.params.segments.length} segments`);
    for (let i = 0; i < 3; i++) {
      whole.trainStep(batch(2, 30 + i));
      cut.trainStep(batch(2, 30 + i));
      const [a, b] = [await whole.lastStats(), await cut.lastStats()];
      assert.ok(Object.is(a.loss, b.loss), `step ${i}: loss ${a.loss} vs ${b.loss}`);
      assert.ok(
        Math.abs(a.gradNorm - b.gradNorm) <= 1e-6 * a.gradNorm,
        `norm ${a.gradNorm} vs ${b.gradNorm}`,
      );
    }
    assert.ok(same(await whole.gradients(), await cut.gradients()), "gradients identical");
    const [sa, sb] = [await whole.exportState(), await cut.exportState()];
    for (const k of ["params", "m", "v"] as const) assert.ok(same(sa[k], sb[k]), `${k} identical`);
    whole.destroy();
    cut.destroy();
  },
});

Deno.test({
  name:
    "Trainer with the LM head over row chunks matches one chunk (wte gradient to 1e-6, then 1e-4 a step later)",
  ignore: noGpu,
  fn: async () => {
    // 3·32 = 96 rows: chunks of 64 and 32.
    const whole = await trainer(3, {});
    const cut = await trainer(3, { chunks: { headChunkRows: 64 } });
    assert.equal(whole.model.headRows, 96);
    assert.equal(cut.model.headRows, 64);
    const tokens = batch(3, 40);
    whole.trainStep(tokens);
    cut.trainStep(tokens);
    const [a, b]: StepStats[] = [await whole.lastStats(), await cut.lastStats()];
    assert.ok(Object.is(a.loss, b.loss), `loss ${a.loss} vs ${b.loss}`);
    const [ga, gb] = [await whole.gradients(), await cut.gradients()];
    const wte = paramLayout(config).byName.get("wte.weight")!;
    const wteEnd = wte.offset + wte.size;
    // The chunks' wte gradients are summed chunk by chunk: rounding differs, nothing else does.
    const err = relNorm(gb.subarray(wte.offset, wteEnd), ga.subarray(wte.offset, wteEnd));
    assert.ok(err < 1e-6, `wte gradient relative error ${err}`);
    assert.ok(same(ga.subarray(wteEnd), gb.subarray(wteEnd)), "every other gradient identical");
    const [ea, eb] = [await whole.evalLoss(tokens), await cut.evalLoss(tokens)];
    assert.ok(Object.is(ea, eb), `eval loss ${ea} vs ${eb}`);
    await assert.rejects(() => cut.logits(tokens), /computed in chunks of 64/);
    // A second step: the chunks accumulate into the wte gradient after the first clears it, so
    // what the first step left there must not count (the parameters now differ by rounding).
    const next = batch(3, 41);
    whole.trainStep(next);
    cut.trainStep(next);
    const [ga2, gb2] = [await whole.gradients(), await cut.gradients()];
    const err2 = relNorm(gb2.subarray(wte.offset, wteEnd), ga2.subarray(wte.offset, wteEnd));
    assert.ok(err2 < 1e-4, `second step's wte gradient relative error ${err2}`);
    whole.destroy();
    cut.destroy();
  },
});

Deno.test({
  name: "zeroWordsWgsl clears exactly its binding's words: a ragged count, at an offset, over 2 workgroups",
  ignore: noGpu,
  fn: async () => {
    const ctx = (await testContext())!;
    const at = ctx.device.limits.minStorageBufferOffsetAlignment / 4, n = ZERO_WORDS_PER_GROUP + 5;
    const words = new Uint32Array(at + n + 64).map((_, i) => 0x3f800000 + i); // f32 1.0 and up
    const buf = await upload(ctx, "words", words);
    const pipeline = await createPipeline(ctx, "zero", zeroWordsWgsl(n));
    const bind = ctx.device.createBindGroup({
      layout: pipeline.getBindGroupLayout(0),
      entries: [{ binding: 0, resource: { buffer: buf, offset: at * 4, size: n * 4 } }],
    });
    const enc = ctx.device.createCommandEncoder(), pass = enc.beginComputePass();
    pass.setPipeline(pipeline);
    pass.setBindGroup(0, bind);
    const grid = grid1d(Math.ceil(n / ZERO_WORDS_PER_GROUP));
    assert.equal(grid[0], 2);
    pass.dispatchWorkgroups(...grid);
    pass.end();
    ctx.device.queue.submit([enc.finish()]);
    const got = new Uint32Array(await readBuffer(ctx, buf));
    for (let i = 0; i < words.length; i++) {
      const want = i >= at && i < at + n ? 0 : words[i];
      if (got[i] !== want) assert.fail(`word ${i}: ${got[i]}, expected ${want}`);
    }
    buf.destroy();
  },
});
