/**
 * Data parallelism in the engine: N trainers (ranks) on the test adapter, their gradients summed
 * by `GradientReducer` over shared-memory communicators, reproduce one trainer that accumulates
 * the same global batch as N micro-batches (same data, same dropout masks): losses within 1e-5
 * relative over 20 steps, weights identical on every rank (checksum), and within 1e-5 of the
 * single trainer's. Three ranks use buckets whose sizes do not divide by 3. Gradient
 * accumulation alone is checked against one step on the concatenated batch. The exchange
 * overlapped with the backward pass (the default) gives the same bits as the one after it.
 */

import assert from "node:assert/strict";
import { makeConfig, paramLayout } from "../../../model/config.ts";
import { type Batch, Trainer, type TrainerOptions } from "../../../engine/trainer.ts";
import { checksumOf } from "../../../engine/kernels/checksum.ts";
import {
  type CommDtype,
  createCommBuffer,
  createControlBuffer,
  DistributedOptimizer,
  GradientReducer,
  RankControl,
  type ReducerOptions,
  RingComm,
} from "../../../engine/parallel/mod.ts";
import { noGpu, relNorm, testContext } from "../../_helpers.ts";

const config = makeConfig({ n_layer: 2, n_head: 2, n_embd: 32, n_positions: 16, vocab_size: 256 });
const B = 2, T = 16;

function batch(seed: number, rows = B): Uint32Array {
  const out = new Uint32Array(rows * (T + 1));
  let s = seed >>> 0;
  for (let i = 0; i < out.length; i++) {
    s = (Math.imul(s, 1103515245) + 12345) >>> 0;
    // Ids concentrated on a few tokens, so there is something to learn in 20 steps.
    out[i] = i % 5 === 0 ? (s >>> 16) % config.vocab_size : (s >>> 16) % 24;
  }
  return out;
}

function options(micro: number, rank: number, size: number, dropout: number): TrainerOptions {
  return {
    config,
    batchSize: B,
    seqLen: T,
    schedule: { lr: 3e-3, min_lr: 3e-4, warmup_iters: 3, decay_iters: 20, style: "cosine" },
    adamw: { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, clip_grad: 1.0 },
    attnDropout: dropout,
    hiddenDropout: dropout,
    seed: 11,
    microBatches: micro,
    dataParallel: size > 1 ? { rank, size } : undefined,
  };
}

/** The global batch of a step: `n` micro-batches, the same whatever the layout. */
const globalBatch = (step: number, n: number): Batch[] =>
  Array.from({ length: n }, (_, g) => batch(1000 * step + g));

interface Run {
  losses: number[];
  params: Float32Array[];
  checksums: number[];
  /** Whole AdamW moments (rank 0's, assembled from the shards with the distributed optimizer). */
  m: Float32Array;
  v: Float32Array;
}

/** `steps` steps of `size` ranks with `micro` micro-batches each (global batch size·micro micro-batches). */
async function run(
  size: number,
  micro: number,
  steps: number,
  o: { dropout?: number; capacity?: number; wire?: CommDtype; zero?: boolean; reducer?: ReducerOptions } = {},
): Promise<Run> {
  const ctx = (await testContext())!;
  const trainers = await Promise.all(
    Array.from(
      { length: size },
      (_, r) => Trainer.create(ctx, { ...options(micro, r, size, o.dropout ?? 0), shardedOptimizer: o.zero }),
    ),
  );
  const lanes = (dtype: CommDtype) =>
    Array.from({ length: 2 }, () => createCommBuffer({ ranks: size, capacity: o.capacity ?? 4096, dtype }));
  const grads = lanes(o.wire ?? "f32"), weights = lanes("f32"), control = createControlBuffer(size);
  const zeros = o.zero
    ? await Promise.all(trainers.map((t, r) =>
      DistributedOptimizer.create(ctx, t.zeroModel(), {
        rank: r,
        size,
        gradComms: grads.map((sab) => new RingComm(sab, r)),
        paramComms: weights.map((sab) => new RingComm(sab, r)),
        control: new RankControl(control, r),
      })
    ))
    : [];
  const reducers = size > 1 && !o.zero
    ? await Promise.all(
      trainers.map((_, r) =>
        GradientReducer.create(ctx, grads.map((sab) => new RingComm(sab, r)), o.reducer)
      ),
    )
    : [];
  const reduce = (r: number) => o.zero ? zeros[r].step : reducers[r];
  const losses: number[] = [];
  try {
    for (let step = 0; step < steps; step++) {
      const all = globalBatch(step, size * micro);
      const mine = (r: number) => all.slice(r * micro, (r + 1) * micro);
      if (size === 1) trainers[0].trainStep(all);
      else await Promise.all(trainers.map((t, r) => t.trainStepReduced(mine(r), reduce(r))));
      const stats = await Promise.all(trainers.map((t) => t.lastStats({ checksum: true })));
      losses.push(stats.reduce((a, s) => a + s.loss, 0) / size);
    }
    const states = await Promise.all(trainers.map((t) => t.exportState()));
    const stats = await Promise.all(trainers.map((t) => t.lastStats({ checksum: true })));
    const n = states[0].params.length;
    const moments = o.zero ? (await Promise.all(zeros.map((z) => z.exportMoments(n))))[0]! : states[0];
    return {
      losses,
      params: states.map((s) => s.params),
      checksums: stats.map((s) => s.checksum!),
      m: moments.m,
      v: moments.v,
    };
  } finally {
    for (const r of reducers) r.destroy();
    for (const z of zeros) z.destroy();
    for (const t of trainers) t.destroy();
  }
}

function assertClose(a: number[], b: number[], tol: number, what: string): void {
  assert.equal(a.length, b.length);
  for (let i = 0; i < a.length; i++) {
    const rel = Math.abs(a[i] - b[i]) / Math.abs(b[i]);
    assert.ok(
      rel <= tol,
      `${what}: step ${i + 1} loss ${a[i]} vs ${b[i]} (relative ${rel.toExponential(2)} > ${tol})`,
    );
  }
}

Deno.test({
  name: "gradient accumulation: 2 micro-batches of B reproduce one step on the 2B batch (fp32)",
  ignore: noGpu,
  fn: async () => {
    const ctx = (await testContext())!;
    const acc = await Trainer.create(ctx, options(2, 0, 1, 0));
    const whole = await Trainer.create(ctx, { ...options(1, 0, 1, 0), batchSize: 2 * B });
    try {
      for (let step = 0; step < 3; step++) {
        const [a, b] = globalBatch(step, 2);
        const joined = new Uint32Array(a.length + b.length);
        joined.set(a);
        joined.set(b, a.length);
        acc.trainStep([a, b]);
        whole.trainStep(joined);
        const [sa, sw] = [await acc.lastStats(), await whole.lastStats()];
        assertClose([sa.loss], [sw.loss], 1e-6, `accumulated vs whole batch, step ${step + 1}`);
        assert.ok(
          Math.abs(sa.gradNorm - sw.gradNorm) <= 1e-5 * sw.gradNorm,
          `grad norm ${sa.gradNorm} vs ${sw.gradNorm}`,
        );
      }
      const err = relNorm((await acc.exportState()).params, (await whole.exportState()).params);
      assert.ok(err < 1e-6, `weights differ by ${err}`);
    } finally {
      acc.destroy();
      whole.destroy();
    }
  },
});

Deno.test({
  name: "DP=2 with micro-batch B reproduces DP=1 with 2 accumulation steps over 20 steps (fp32, dropout on)",
  ignore: noGpu,
  fn: async () => {
    const one = await run(1, 2, 20, { dropout: 0.1 });
    const two = await run(2, 1, 20, { dropout: 0.1 });
    assertClose(two.losses, one.losses, 1e-5, "DP=2 vs DP=1×2");
    assert.equal(two.checksums[0], two.checksums[1], "ranks hold different weights");
    assert.equal(two.checksums[0], checksumOf(two.params[0]), "GPU checksum differs from the CPU twin");
    const err = relNorm(two.params[0], one.params[0]);
    assert.ok(err < 1e-5, `DP=2 weights differ from DP=1's by ${err}`);
    // The losses moved: the test is not comparing two untrained models.
    assert.ok(one.losses[19] < one.losses[0] - 0.1, `loss ${one.losses[0]} -> ${one.losses[19]}`);
  },
});

Deno.test({
  name:
    "DP=3 in buckets not divisible by 3 reproduces DP=1 with 3 accumulation steps; bf16 on the wire stays close",
  ignore: noGpu,
  fn: async () => {
    const one = await run(1, 3, 20);
    const three = await run(3, 1, 20, { capacity: 1000 });
    assertClose(three.losses, one.losses, 1e-5, "DP=3 vs DP=1×3");
    assert.ok(three.checksums.every((c) => c === three.checksums[0]), `checksums ${three.checksums}`);
    const bf16 = await run(3, 1, 5, { capacity: 1000, wire: "bf16" });
    assert.ok(bf16.checksums.every((c) => c === bf16.checksums[0]), `bf16 checksums ${bf16.checksums}`);
    assertClose(bf16.losses, one.losses.slice(0, 5), 1e-2, "DP=3 bf16 wire vs DP=1×3");
  },
});

Deno.test({
  name:
    "the distributed optimizer (moments sharded over the ranks) reproduces DP=1's losses, weights and moments",
  ignore: noGpu,
  fn: async () => {
    const one = await run(1, 2, 10);
    const two = await run(2, 1, 10, { zero: true });
    assertClose(two.losses, one.losses, 1e-5, "DP=2 distributed optimizer vs DP=1×2");
    assert.equal(two.checksums[0], two.checksums[1], "ranks hold different weights");
    for (
      const [what, a, b] of [["weights", two.params[0], one.params[0]], ["m", two.m, one.m], [
        "v",
        two.v,
        one.v,
      ]] as const
    ) {
      const err = relNorm(a, b);
      assert.ok(err < 1e-5, `${what} differ from DP=1's by ${err}`);
    }
    const three = await run(3, 1, 6, { zero: true, capacity: 1000 });
    const ref3 = await run(1, 3, 6);
    assertClose(three.losses, ref3.losses, 1e-5, "DP=3 distributed optimizer vs DP=1×3");
    assert.ok(three.checksums.every((c) => c === three.checksums[0]), `checksums ${three.checksums}`);
    assert.ok(relNorm(three.v, ref3.v) < 1e-5, "DP=3 moments");
  },
});

Deno.test({
  name:
    "DP=2: the exchange overlapped with backward, one stage per layer, equals the exchange after it bit for bit (fp32, bf16 wire)",
  ignore: noGpu,
  fn: async () => {
    // The staged path really runs: one stage per layer, top down (stageBytes 1), or all in one.
    const ctx = (await testContext())!;
    const layout = paramLayout(config);
    const buffer = ctx.device.createBuffer({ size: layout.totalSize * 4, usage: GPUBufferUsage.STORAGE });
    const flat = {
      segments: [{ start: 0, size: layout.totalSize, buffer }],
      totalSize: layout.totalSize,
      bytesPerElement: 4,
    };
    const sab = createCommBuffer({ ranks: 2, capacity: 1000, dtype: "f32" });
    for (const [opts, layers] of [[{ stageBytes: 1 }, [1, 0]], [{}, [0]]] as const) {
      const r = await GradientReducer.create(ctx, [new RingComm(sab, 0)], opts);
      assert.deepEqual(r.begin(flat, layout, config.n_layer)?.stageLayers, layers);
      r.destroy();
    }
    const off = await GradientReducer.create(ctx, [new RingComm(sab, 0)], { overlap: false });
    assert.equal(off.begin(flat, layout, config.n_layer), null);
    off.destroy();
    buffer.destroy();
    for (const wire of ["f32", "bf16"] as const) {
      // Capacity 1000: a layer's 12 288 weight gradients travel as several buckets per stage.
      const after = await run(2, 2, 4, { dropout: 0.1, wire, capacity: 1000, reducer: { overlap: false } });
      const staged = await run(2, 2, 4, { dropout: 0.1, wire, capacity: 1000, reducer: { stageBytes: 1 } });
      assert.deepEqual(staged.losses, after.losses, `${wire}: losses`);
      assert.deepEqual(staged.checksums, after.checksums, `${wire}: weight checksums`);
      assert.equal(staged.checksums[0], staged.checksums[1], `${wire}: ranks hold different weights`);
      assert.ok(relNorm(staged.params[0], after.params[0]) === 0, `${wire}: weights differ`);
    }
  },
});
