/**
 * Tensor-parallel shard specs without a GPU: which way every parameter splits, the head-aware
 * q/k/v split of c_attn, the padded vocabulary per tp, refusal of sizes that cannot shard, and
 * cut-then-merge bit for bit for every parameter kind at tp 1, 2, 3, 4 and 6, tensor by tensor
 * and for whole flat buffers.
 */

import assert from "node:assert/strict";
import { ConfigError, makeConfig, paramLayout, presetConfig } from "../../model/config.ts";
import { parametersPerGpu } from "../../model/memory_estimate.ts";
import {
  checkTensorParallel,
  cutShard,
  mergeParams,
  mergeShards,
  shardLayout,
  shardSlices,
  shardSpecs,
  splitParams,
  tensorParallelConfig,
  tensorParallelVocab,
  vocabShard,
  vocabSizes,
} from "../../engine/parallel/mod.ts";

/** Deterministic floats in [-1, 1) from `seed` (a 32-bit LCG; no GPU helper needed here). */
function randomFloats(n: number, seed: number): Float32Array {
  const out = new Float32Array(n);
  let x = seed >>> 0;
  for (let i = 0; i < n; i++) {
    x = (Math.imul(x, 1664525) + 1013904223) >>> 0;
    out[i] = x / 2 ** 31 - 1;
  }
  return out;
}

/** 6 heads of 8 and a small vocabulary: shardable at tp 1, 2, 3 and 6. */
const SIX = makeConfig({ n_layer: 2, n_head: 6, n_embd: 48, n_positions: 16, vocab_size: 1000 });

function same(a: Float32Array, b: Float32Array): boolean {
  if (a.length !== b.length) return false;
  for (let i = 0; i < a.length; i++) if (!Object.is(a[i], b[i])) return false;
  return true;
}

Deno.test("tensorParallelVocab() pads to a multiple of 128·tp: 50304 at tp 1, 50432 at tp 2, 50688 at tp 4", () => {
  assert.equal(tensorParallelVocab(50257, 1), 50304);
  assert.equal(tensorParallelVocab(50257, 2), 50432);
  assert.equal(tensorParallelVocab(50257, 3), 50304);
  assert.equal(tensorParallelVocab(50257, 4), 50688);
  assert.equal(tensorParallelVocab(50257, 8), 51200);
  const tiny = presetConfig("gpt2-tiny");
  assert.equal(tensorParallelConfig(tiny, 1).padded_vocab_size, tiny.padded_vocab_size);
  assert.deepEqual(tensorParallelConfig(tiny, 1), tiny);
  const two = tensorParallelConfig(tiny, 2);
  assert.equal(two.padded_vocab_size, 50432);
  assert.equal(two.vocab_size, 50257);
  assert.deepEqual(vocabSizes(two, 2), {
    vocab_size: 50257,
    padded_vocab_size: 50304,
    tensor_parallel_vocab_size: 50432,
    rank_vocab_size: 25216,
    tensor_parallel: 2,
  });
});

Deno.test("vocabShard() gives each rank its wte rows and how many of them are real", () => {
  const four = tensorParallelConfig(presetConfig("gpt2-tiny"), 4);
  const shards = [0, 1, 2, 3].map((r) => vocabShard(four, 4, r));
  assert.deepEqual(shards.map((s) => s.start), [0, 12672, 25344, 38016]);
  assert.ok(shards.every((s) => s.rows === 12672));
  assert.deepEqual(shards.map((s) => s.real), [12672, 12672, 12672, 50257 - 38016]);
  assert.equal(shards.reduce((a, s) => a + s.real, 0), 50257);
  // A small vocabulary spread thin: the last rank holds only padding.
  const small = makeConfig({ n_layer: 1, n_head: 4, n_embd: 16, n_positions: 8, vocab_size: 100 });
  const padded = tensorParallelConfig(small, 4);
  assert.equal(padded.padded_vocab_size, 512);
  assert.deepEqual([0, 1, 2, 3].map((r) => vocabShard(padded, 4, r).real), [100, 0, 0, 0]);
  assert.throws(() => vocabShard(padded, 4, 4), /rank must be in \[0, 4\), got "4"/);
});

Deno.test("checkTensorParallel() refuses a tp that does not divide n_head, naming tensor_parallel", () => {
  const tiny = presetConfig("gpt2-tiny"); // 4 heads
  for (const tp of [1, 2, 4]) checkTensorParallel(tensorParallelConfig(tiny, tp), tp);
  assert.throws(() => tensorParallelConfig(tiny, 3), (e: unknown) => {
    assert.ok(e instanceof ConfigError);
    assert.equal(e.field, "tensor_parallel");
    assert.equal(
      e.message,
      "Invalid model config: tensor_parallel: 3 does not divide n_head 4: each rank must hold whole attention heads",
    );
    return true;
  });
  assert.throws(() => shardSpecs(tiny, 8), /tensor_parallel: 8 does not divide n_head 4/);
  assert.throws(() => tensorParallelConfig(tiny, 0), /tensor_parallel: must be a positive integer, got 0/);
  assert.throws(
    () => tensorParallelConfig(tiny, 1.5),
    /tensor_parallel: must be a positive integer, got 1.5/,
  );
  // tp 3 divides 6 heads but not the 1024 rows padded for tp 1: shard the config padded for tp 3.
  assert.throws(
    () => checkTensorParallel(SIX, 3),
    /tensor_parallel: 3 does not divide padded_vocab_size 1024 \(use tensorParallelConfig\(\)\)/,
  );
  assert.equal(tensorParallelConfig(SIX, 3).padded_vocab_size, 1152);
});

Deno.test("shardSpecs() splits c_attn by heads and c_fc by columns, c_proj by rows, wte by vocabulary rows, and replicates the rest", () => {
  const cfg = tensorParallelConfig(presetConfig("gpt2-tiny"), 2);
  const byName = new Map(shardSpecs(cfg, 2).map((s) => [s.name, s]));
  const pick = (n: string) => {
    const s = byName.get(n)!;
    return [s.split, s.axis, s.globalShape, s.shape];
  };
  assert.deepEqual(pick("wte.weight"), ["vocab", 0, [50432, 64], [25216, 64]]);
  assert.deepEqual(pick("wpe.weight"), ["replicated", 0, [64, 64], [64, 64]]);
  assert.deepEqual(pick("h.0.ln_1.weight"), ["replicated", 0, [64], [64]]);
  assert.deepEqual(pick("h.0.attn.c_attn.weight"), ["qkv", 1, [64, 192], [64, 96]]);
  assert.deepEqual(pick("h.0.attn.c_attn.bias"), ["qkv", 0, [192], [96]]);
  assert.deepEqual(pick("h.0.attn.c_proj.weight"), ["row", 0, [64, 64], [32, 64]]);
  assert.deepEqual(pick("h.0.attn.c_proj.bias"), ["replicated", 0, [64], [64]]);
  assert.deepEqual(pick("h.1.mlp.c_fc.weight"), ["column", 1, [64, 256], [64, 128]]);
  assert.deepEqual(pick("h.1.mlp.c_fc.bias"), ["column", 0, [256], [128]]);
  assert.deepEqual(pick("h.1.mlp.c_proj.weight"), ["row", 0, [256, 64], [128, 64]]);
  assert.deepEqual(pick("h.1.mlp.c_proj.bias"), ["replicated", 0, [64], [64]]);
  assert.deepEqual(pick("ln_f.bias"), ["replicated", 0, [64], [64]]);
  assert.equal(byName.size, paramLayout(cfg).tensors.length);
  // Rank 1 of 2 holds heads 2 and 3 of q, of k and of v: columns [32, 64), [96, 128), [160, 192).
  assert.deepEqual(shardSlices(byName.get("h.0.attn.c_attn.weight")!, 1), [
    { offset: [0, 32], shape: [64, 32] },
    { offset: [0, 96], shape: [64, 32] },
    { offset: [0, 160], shape: [64, 32] },
  ]);
  assert.deepEqual(shardSlices(byName.get("h.0.attn.c_attn.bias")!, 0), [
    { offset: [0], shape: [32] },
    { offset: [64], shape: [32] },
    { offset: [128], shape: [32] },
  ]);
  assert.deepEqual(shardSlices(byName.get("wte.weight")!, 1), [{ offset: [25216, 0], shape: [25216, 64] }]);
  assert.deepEqual(shardSlices(byName.get("h.0.attn.c_proj.weight")!, 1), [
    { offset: [32, 0], shape: [32, 64] },
  ]);
});

Deno.test("cutShard() of c_attn gives rank r the q, k and v columns of its heads, each value where it belongs", () => {
  const C = SIX.n_embd, H = SIX.n_head, hd = C / H, tp = 3;
  const spec = shardSpecs(tensorParallelConfig(SIX, tp), tp).find((s) =>
    s.name === "h.0.attn.c_attn.weight"
  )!;
  // Value = 10000·row + column of the global [C, 3C] tensor.
  const global = new Float32Array(C * 3 * C).map((_, i) => 10000 * Math.floor(i / (3 * C)) + (i % (3 * C)));
  for (let r = 0; r < tp; r++) {
    const local = cutShard(spec, r, global), w = (3 * C) / tp;
    for (let row = 0; row < C; row++) {
      for (let j = 0; j < w; j++) {
        const block = Math.floor(j / (C / tp)); // 0 q, 1 k, 2 v
        const head = r * (H / tp) + Math.floor((j % (C / tp)) / hd);
        const col = block * C + head * hd + (j % hd);
        assert.equal(local[row * w + j], 10000 * row + col, `rank ${r} row ${row} col ${j}`);
      }
    }
  }
});

Deno.test("mergeShards(cutShard()) is bit-exact for every parameter at tp 1, 2, 3 and 6, and tp 4 of gpt2-tiny", () => {
  const cases: Array<[ReturnType<typeof makeConfig>, number]> = [
    [SIX, 1],
    [SIX, 2],
    [SIX, 3],
    [SIX, 6],
    [presetConfig("gpt2-tiny"), 4],
  ];
  for (const [base, tp] of cases) {
    const cfg = tensorParallelConfig(base, tp);
    const kinds = new Set<string>();
    for (const [i, spec] of shardSpecs(cfg, tp).entries()) {
      kinds.add(spec.split);
      const n = spec.globalShape.reduce((a, b) => a * b, 1);
      const global = randomFloats(n, 17 + i);
      global[0] = -0; // signed zero survives
      const shards = Array.from({ length: tp }, (_, r) => cutShard(spec, r, global));
      for (const s of shards) assert.equal(s.length, spec.shape.reduce((a, b) => a * b, 1), spec.name);
      assert.ok(same(mergeShards(spec, shards), global), `${spec.name} at tp ${tp}`);
      if (spec.split !== "replicated" && tp > 1) assert.ok(!same(shards[0], shards[1]), spec.name);
    }
    assert.deepEqual([...kinds].sort(), ["column", "qkv", "replicated", "row", "vocab"]);
  }
});

Deno.test("splitParams() and mergeParams() round-trip a whole flat buffer through per-rank shardLayout() buffers", () => {
  for (const tp of [1, 2, 3, 6]) {
    const cfg = tensorParallelConfig(SIX, tp);
    const full = paramLayout(cfg), local = shardLayout(cfg, tp);
    const flat = new Float32Array(full.totalSize);
    for (const t of full.tensors) flat.set(randomFloats(t.size, t.offset + 1), t.offset); // gaps stay zero
    const ranks = splitParams(cfg, tp, flat);
    assert.equal(ranks.length, tp);
    for (const r of ranks) assert.equal(r.length, local.totalSize);
    assert.ok(same(mergeParams(cfg, tp, ranks), flat), `tp ${tp}`);
    // A rank's layout is paramLayout's over the shard shapes: decayed weights first, aligned
    // offsets, as many parameters as the estimator's formula gives one GPU.
    assert.equal(local.numParams, parametersPerGpu(cfg, tp));
    assert.ok(local.tensors.every((t) => t.offset % 128 === 0));
    assert.ok(local.tensors.filter((t) => t.decay).every((t) => t.offset < local.decayEnd));
  }
  const cfg = presetConfig("gpt2-tiny");
  assert.deepEqual(shardLayout(cfg, 1), paramLayout(cfg));
  const two = tensorParallelConfig(cfg, 2);
  const l2 = shardLayout(two, 2);
  assert.deepEqual(l2.byName.get("h.0.attn.c_attn.weight")!.shape, [64, 96]);
  assert.throws(() => splitParams(two, 2, new Float32Array(10)), /10 floats, the layout has/);
  assert.throws(() => mergeParams(two, 2, [new Float32Array(l2.totalSize)]), /expected 2 buffers/);
});
