/**
 * Communicator buffers for a whole job, made once by the GPU host before it starts the rank
 * Workers: one set of lanes per data-parallel group (and one buffer per tensor-parallel group
 * when tp > 1), handed to each rank with its position in the group. A Worker then opens its
 * communicators with `new RingComm(sab, index)` and needs to know nothing about the layout.
 */

import { type CommAlgorithm, type CommDtype, createCommBuffer } from "./allreduce.ts";
import { dataParallelGroups, type ParallelLayout, rankGroups, tensorParallelGroups } from "./groups.ts";

/** What one rank receives to talk to one of its groups. */
export interface GroupBuffers {
  /** Position of the rank in the group (the `rank` argument of `RingComm`). */
  index: number;
  /** One buffer per lane, the same objects for every member of the group. */
  sabs: SharedArrayBuffer[];
}

/** The communicator buffers of one rank. */
export interface RankBuffers {
  dataParallel: GroupBuffers;
  /** Null when tp is 1. */
  tensorParallel: GroupBuffers | null;
}

/** Options of {@link createJobBuffers}. */
export interface JobBufferOptions {
  /** Elements per slot of the data-parallel buffers (the largest gradient bucket). */
  capacity: number;
  /** Gradient payload on the wire (`allreduce_dtype`). */
  dtype: CommDtype;
  /** Data-parallel lanes (default 2: one bucket read back while the previous one is reduced). */
  lanes?: number;
  algorithm?: CommAlgorithm;
  /** Elements per slot of the tensor-parallel buffers (default `capacity`). */
  tpCapacity?: number;
}

/** Buffers for every rank of `layout`, indexed by global rank. */
export function createJobBuffers(layout: ParallelLayout, opts: JobBufferOptions): RankBuffers[] {
  const lanes = opts.lanes ?? 2;
  if (!Number.isInteger(lanes) || lanes < 1 || lanes > 8) {
    throw new RangeError(`lanes must be an integer in [1, 8], got "${lanes}"`);
  }
  const { capacity, dtype, algorithm } = opts;
  const dp = dataParallelGroups(layout).map(() =>
    Array.from({ length: lanes }, () => createCommBuffer({ ranks: layout.dp, capacity, dtype, algorithm }))
  );
  const tp = layout.tp === 1
    ? null
    : tensorParallelGroups(layout).map(() =>
      createCommBuffer({ ranks: layout.tp, capacity: opts.tpCapacity ?? capacity, dtype: "f32", algorithm })
    );
  return Array.from({ length: layout.worldSize }, (_, rank) => {
    const g = rankGroups(layout, rank);
    const t = rank % layout.tp, d = Math.floor(rank / layout.tp);
    return {
      dataParallel: { index: g.dataParallel.index, sabs: dp[t] },
      tensorParallel: tp && { index: g.tensorParallel.index, sabs: [tp[d]] },
    };
  });
}
