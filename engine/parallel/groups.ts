/**
 * Rank groups, Megatron `parallel_state` style: a world of `tp × dp` ranks is cut into
 * tensor-parallel groups (consecutive ranks, so a TP group shares the fastest links) and
 * data-parallel groups (ranks with the same TP rank, `tp` apart). Everything that communicates
 * asks this module "which group am I in, and at which position"; nothing else derives ranks.
 *
 * Rank r has tensor-parallel rank `r % tp` and data-parallel rank `floor(r / tp)`.
 */

/** The parallel layout of one job. */
export interface ParallelLayout {
  /** Number of ranks (Workers, one per GPU). */
  worldSize: number;
  /** Tensor-parallel size: ranks that shard each layer. */
  tp: number;
  /** Data-parallel size: replicas that split each global batch. */
  dp: number;
}

/** One group as a rank sees it. */
export interface RankGroup {
  /** Global ranks of the group, in group order. */
  ranks: number[];
  /** Position of the asking rank in `ranks`. */
  index: number;
}

/** The groups of one rank. */
export interface RankGroups {
  /** The global rank. */
  rank: number;
  /** Its data-parallel group (gradient allreduce, distributed optimizer). */
  dataParallel: RankGroup;
  /** Its tensor-parallel group (activation allreduce inside a layer). */
  tensorParallel: RankGroup;
}

function positiveInt(name: string, v: number): void {
  if (!Number.isInteger(v) || v < 1) throw new RangeError(`${name} must be a positive integer, got "${v}"`);
}

/**
 * Completes and checks a layout: `dp` defaults to `worldSize / tp` and `tp` to 1. Throws a
 * RangeError naming the field when the sizes do not multiply to the world size.
 */
export function parallelLayout(worldSize: number, opts: { tp?: number; dp?: number } = {}): ParallelLayout {
  positiveInt("worldSize", worldSize);
  const tp = opts.tp ?? 1;
  positiveInt("tp", tp);
  if (worldSize % tp !== 0) {
    throw new RangeError(`tp must divide worldSize: tp "${tp}" does not divide worldSize "${worldSize}"`);
  }
  const dp = opts.dp ?? worldSize / tp;
  positiveInt("dp", dp);
  if (tp * dp !== worldSize) {
    throw new RangeError(`tp × dp must equal worldSize: "${tp}" × "${dp}" is not "${worldSize}"`);
  }
  return { worldSize, tp, dp };
}

/** All data-parallel groups of the layout: `tp` groups of `dp` ranks, group t = {t, t+tp, ...}. */
export function dataParallelGroups(layout: ParallelLayout): number[][] {
  return Array.from(
    { length: layout.tp },
    (_, t) => Array.from({ length: layout.dp }, (_, d) => d * layout.tp + t),
  );
}

/** All tensor-parallel groups of the layout: `dp` groups of `tp` consecutive ranks. */
export function tensorParallelGroups(layout: ParallelLayout): number[][] {
  return Array.from(
    { length: layout.dp },
    (_, d) => Array.from({ length: layout.tp }, (_, t) => d * layout.tp + t),
  );
}

/** The groups rank `rank` belongs to, with its position in each. */
export function rankGroups(layout: ParallelLayout, rank: number): RankGroups {
  if (!Number.isInteger(rank) || rank < 0 || rank >= layout.worldSize) {
    throw new RangeError(`rank must be in [0, ${layout.worldSize}), got "${rank}"`);
  }
  const t = rank % layout.tp, d = Math.floor(rank / layout.tp);
  return {
    rank,
    dataParallel: { ranks: dataParallelGroups(layout)[t], index: d },
    tensorParallel: { ranks: tensorParallelGroups(layout)[d], index: t },
  };
}
