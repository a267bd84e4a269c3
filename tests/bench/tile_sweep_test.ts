/**
 * The in-step tile sweep (bench/tile_sweep.ts) is worth its device time: on an H200's limits its
 * candidate tiles run every GPT-2 124M and 345M training matmul (few refused), a shape whose pick
 * splits K keeps that split, and the rule it emits for a shape is what chooseTile then picks
 * there, while other shapes keep their picks. No GPU needed.
 */

import assert from "node:assert/strict";
import { presetConfig } from "../../model/config.ts";
import { MATMUL_PART_FLOATS } from "../../model/plan.ts";
import { chooseTile, MATMUL_TILE_RULES, tileName } from "../../engine/kernels/matmul.ts";
import { gpt2MatmulShapes } from "../../bench/matmul_bench.ts";
import { ruleFor, splitShapes } from "../../bench/split_sweep.ts";
import { sweepRefusal, sweepTiles, withPickSplit } from "../../bench/tile_sweep.ts";
import { mergeTileRules } from "../../bench/merge_tile_rules.ts";

const H200 = { maxInvocations: 1024, maxWorkgroupBytes: 49152 };

Deno.test("tile_sweep's candidates run every GPT-2 training matmul on an H200's limits, and an emitted rule is picked", () => {
  const tiles = sweepTiles();
  assert.ok(tiles.length >= 8);
  for (const model of ["gpt2-124M", "gpt2-345M"]) {
    const config = presetConfig(model);
    const scratchBytes = 4 * Math.min(MATMUL_PART_FLOATS, 8 * 4 * config.n_embd ** 2);
    // 8 × 1024 tokens, the LM head in chunks of 2048 rows (an H200's 2 GiB bindings).
    const shapes = gpt2MatmulShapes(model, config, 8192, 2048, "fp32");
    assert.equal(shapes.length, 15);
    for (const s of shapes) {
      const opts = { maxWorkgroupBytes: H200.maxWorkgroupBytes, splitK: true };
      const pick = chooseTile(s.spec, H200.maxInvocations, opts);
      const runs = tiles.map((t) => withPickSplit(t, pick))
        .filter((t) => sweepRefusal(s.spec, t, { ...H200, scratchBytes }) === null);
      assert.ok(runs.length >= 8, `${model} ${s.op}: ${runs.length} of ${tiles.length} candidates run`);
      for (const t of runs) {
        assert.equal(t.splitK ?? 1, pick.splitK ?? 1, `${model} ${s.op}: the pick's split-K kept`);
        const rules = [ruleFor(s, t), ...MATMUL_TILE_RULES];
        assert.deepEqual(
          chooseTile(s.spec, H200.maxInvocations, { ...opts, rules }),
          t,
          `${model} ${s.op}: the rule for ${tileName(t)} is picked`,
        );
      }
      // A rule for this shape does not reach the others.
      const other = shapes.find((o) =>
        o.spec.M !== s.spec.M || o.spec.N !== s.spec.N || o.spec.K !== s.spec.K
      )!;
      const rules = [ruleFor(s, runs[0]), ...MATMUL_TILE_RULES];
      assert.deepEqual(
        chooseTile(other.spec, H200.maxInvocations, { ...opts, rules }),
        chooseTile(other.spec, H200.maxInvocations, opts),
        `${model}: ${s.op}'s rule left ${other.op} alone`,
      );
    }
  }
});

Deno.test("merge_tile_rules puts measured rules first, each in place of the table's rules for exactly its shape and kind (split-K or not)", () => {
  const t = (BK: number) => ({ BM: 128, BN: 128, BK, TM: 8, TN: 8 });
  const table = [
    { M: 1, N: 2, K: 3, layout: "NN" as const, tile: t(8) },
    { M: 1, N: 2, K: 3, layout: "TN" as const, tile: t(8) },
    { M: 1, N: 2, K: 3, layout: "NN" as const, tile: t(32) },
    { layout: "NN" as const, tile: t(16) },
    { M: 1, N: 2, K: 3, layout: "NN" as const, tile: { ...t(8), gen: 2 as const, splitK: 2 } },
  ];
  const merged = mergeTileRules(table, [{ M: 1, N: 2, K: 3, layout: "NN", tile: t(16), note: "new" }]);
  assert.deepEqual(merged.map((r) => [r.layout, r.tile.BK, r.note ?? ""]), [
    ["NN", 16, "new"],
    ["TN", 8, ""],
    ["NN", 16, ""],
    ["NN", 8, ""],
  ]);
  // A split rule replaces the shape's split rule, not its unsplit one.
  const split = mergeTileRules(table, [{
    M: 1,
    N: 2,
    K: 3,
    layout: "NN",
    tile: { ...t(16), gen: 2, splitK: 3 },
  }]);
  assert.deepEqual(split.map((r) => [r.layout, r.tile.BK, r.tile.splitK ?? 1]), [
    ["NN", 16, 3],
    ["NN", 8, 1],
    ["TN", 8, 1],
    ["NN", 32, 1],
    ["NN", 16, 1],
  ]);
  assert.throws(() => mergeTileRules(table, [table[0], table[0]]), RangeError);
});

Deno.test("split_sweep's shapes: few-block weight gradients and the LM head dx, or with --only the backward ops it names", () => {
  const shapes = gpt2MatmulShapes("gpt2-124M", presetConfig("gpt2-124M"), 8192, 2048, "fp32");
  const ops = (only?: RegExp) => splitShapes(shapes, only).map((s) => s.op).sort();
  assert.deepEqual(ops(), ["attn_proj.dw", "fc.dw", "fc_proj.dw", "lm_head.dx", "qkv.dw"]);
  assert.deepEqual(ops(/^attn_proj\.dx$/), ["attn_proj.dx"]);
  // A forward matmul never splits K in a training step, so --only leaves it out.
  assert.deepEqual(ops(/^attn_proj/), ["attn_proj.dw", "attn_proj.dx"]);
  assert.deepEqual(ops(/^qkv$/), []);
});
