/**
 * Tests of engine/parallel/groups.ts (Megatron-style data- and tensor-parallel groups and their
 * errors) and host/comms.ts (the communicator buffers a GPU host hands each rank).
 */
import assert from "node:assert/strict";
import {
  dataParallelGroups,
  parallelLayout,
  rankGroups,
  tensorParallelGroups,
} from "../../../engine/parallel/groups.ts";
import { RingComm } from "../../../engine/parallel/mod.ts";
import { jobComm, releaseJobComm } from "../../../host/comms.ts";
import type { WorkerJob } from "../../../protocol.ts";
import type { TrainConfig } from "../../../job/job.ts";

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

Deno.test("jobComm() gives the members of a group the same lanes, and the last rank's release frees them", () => {
  // dp 2 × tp 2: DP groups {0, 2} and {1, 3}; TP groups {0, 1} and {2, 3}.
  const config = {
    model: "gpt2-tiny",
    seq_len: 32,
    batch_size: 2,
    data_parallel: 2,
    tensor_parallel: 2,
    allreduce_dtype: "bf16",
    distributed_optimizer: true,
  } as unknown as TrainConfig;
  const job = (rank: number): WorkerJob => ({
    id: "job_t",
    config,
    root: "/nonexistent",
    checkpoint_dir: "/nonexistent",
    resume_path: null,
    parallel: { rank, size: 4, run: "run_a" },
  });
  const comms = [0, 1, 2, 3].map((r) => jobComm(job(r)));
  for (const c of comms) assert.equal(c.control, comms[0].control);
  assert.deepEqual(comms[0].grads, comms[2].grads);
  assert.deepEqual(comms[1].grads, comms[3].grads);
  assert.notEqual(comms[0].grads[0], comms[1].grads[0]);
  assert.equal(comms[0].grads.length, 2);
  assert.deepEqual(comms[0].weights, comms[2].weights);
  assert.deepEqual(comms[0].tp, comms[1].tp);
  assert.deepEqual(comms[2].tp, comms[3].tp);
  assert.notEqual(comms[0].tp![0], comms[2].tp![0]);
  // A data-parallel rank opens its lane at its index in the group, on the job's wire dtype.
  const ring = new RingComm(comms[3].grads[1], 1);
  assert.deepEqual([ring.size, ring.rank, ring.dtype], [2, 1, "bf16"]);
  // Every rank released: a new run of the same id gets fresh buffers.
  for (let r = 0; r < 4; r++) releaseJobComm("run_a");
  assert.notEqual(jobComm(job(0)).control, comms[0].control);
  releaseJobComm("run_a");
});
