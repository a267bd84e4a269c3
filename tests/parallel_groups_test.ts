/** Tests of gpu/parallel/groups.ts: Megatron-style data- and tensor-parallel groups and their errors. */
import assert from "node:assert/strict";
import {
  dataParallelGroups,
  parallelLayout,
  rankGroups,
  tensorParallelGroups,
} from "../gpu/parallel/groups.ts";

Deno.test("parallelLayout() completes dp from worldSize / tp and names a bad field", () => {
  assert.deepEqual(parallelLayout(8, { tp: 2 }), { worldSize: 8, tp: 2, dp: 4 });
  assert.deepEqual(parallelLayout(3), { worldSize: 3, tp: 1, dp: 3 });
  assert.throws(
    () => parallelLayout(6, { tp: 4 }),
    /tp must divide worldSize: tp "4" does not divide worldSize "6"/,
  );
  assert.throws(() => parallelLayout(8, { tp: 2, dp: 2 }), /tp × dp must equal worldSize/);
  assert.throws(() => parallelLayout(0), /worldSize must be a positive integer, got "0"/);
  assert.throws(() => parallelLayout(4, { tp: 1.5 }), /tp must be a positive integer/);
});

Deno.test("Groups of 8 ranks at tp 2 match Megatron's layout (TP consecutive, DP strided)", () => {
  const layout = parallelLayout(8, { tp: 2 });
  assert.deepEqual(tensorParallelGroups(layout), [[0, 1], [2, 3], [4, 5], [6, 7]]);
  assert.deepEqual(dataParallelGroups(layout), [[0, 2, 4, 6], [1, 3, 5, 7]]);
  assert.deepEqual(rankGroups(layout, 5), {
    rank: 5,
    dataParallel: { ranks: [1, 3, 5, 7], index: 2 },
    tensorParallel: { ranks: [4, 5], index: 1 },
  });
  assert.throws(() => rankGroups(layout, 8), /rank must be in \[0, 8\), got "8"/);
});

Deno.test("Every rank is in exactly one group of each kind, at the index rankGroups() reports", () => {
  for (const [world, tp] of [[1, 1], [2, 1], [3, 1], [4, 2], [6, 3], [12, 4]]) {
    const layout = parallelLayout(world, { tp });
    for (const groups of [dataParallelGroups(layout), tensorParallelGroups(layout)]) {
      assert.deepEqual(groups.flat().sort((a, b) => a - b), Array.from({ length: world }, (_, i) => i));
    }
    for (let r = 0; r < world; r++) {
      const g = rankGroups(layout, r);
      assert.equal(g.dataParallel.ranks[g.dataParallel.index], r);
      assert.equal(g.tensorParallel.ranks[g.tensorParallel.index], r);
      assert.equal(g.dataParallel.ranks.length, layout.dp);
      assert.equal(g.tensorParallel.ranks.length, tp);
    }
  }
});
