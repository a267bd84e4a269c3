/**
 * Tests of engine/parallel/groups.ts (Megatron-style data- and tensor-parallel groups and their
 * errors) and setup.ts (the communicator buffers a GPU host hands each rank).
 */
import assert from "node:assert/strict";
import {
  dataParallelGroups,
  parallelLayout,
  rankGroups,
  tensorParallelGroups,
} from "../engine/parallel/groups.ts";
import { createJobBuffers, RingComm } from "../engine/parallel/mod.ts";

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

Deno.test("createJobBuffers() gives the members of a group the same buffers and each its position", () => {
  const layout = parallelLayout(4, { tp: 2 });
  const bufs = createJobBuffers(layout, { capacity: 64, dtype: "bf16", lanes: 2 });
  // DP groups {0, 2} and {1, 3}; TP groups {0, 1} and {2, 3}.
  assert.equal(bufs[0].dataParallel.sabs, bufs[2].dataParallel.sabs);
  assert.notEqual(bufs[0].dataParallel.sabs, bufs[1].dataParallel.sabs);
  assert.deepEqual(bufs.map((b) => b.dataParallel.index), [0, 0, 1, 1]);
  assert.deepEqual(bufs.map((b) => b.tensorParallel!.index), [0, 1, 0, 1]);
  assert.equal(bufs[2].tensorParallel!.sabs[0], bufs[3].tensorParallel!.sabs[0]);
  assert.equal(bufs[0].dataParallel.sabs.length, 2);
  const comm = new RingComm(bufs[3].dataParallel.sabs[1], bufs[3].dataParallel.index);
  assert.deepEqual([comm.size, comm.rank, comm.dtype, comm.capacity], [2, 1, "bf16", 64]);
  assert.equal(createJobBuffers(parallelLayout(2), { capacity: 8, dtype: "f32" })[1].tensorParallel, null);
  assert.throws(
    () => createJobBuffers(layout, { capacity: 8, dtype: "f32", lanes: 0 }),
    /lanes must be an integer/,
  );
});
