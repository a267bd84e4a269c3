/**
 * Evaluation batches: every non-overlapping window of a split once, in order, so validation and
 * test losses are the same for every run and every split large enough for one sequence gets a
 * loss. The trainer runs fixed-size batches of `batchSize` rows; a split with fewer windows than
 * that fills each batch by cycling through its windows over lcm(windows, batchSize) rows, so
 * every window is counted equally often and the mean of the batch means is the split's mean.
 */

/** Batches of windows (each `seqLen + 1` tokens, rows back to back) and how many distinct tokens they score. */
export interface EvalBatches {
  batches: Uint16Array[];
  /** Distinct target tokens evaluated: windows used × seqLen. */
  tokens: number;
  /** Distinct windows used. */
  windows: number;
}

function gcd(a: number, b: number): number {
  while (b) [a, b] = [b, a % b];
  return a;
}

/** Windows a split of `length` tokens holds: inputs `seqLen` long, each followed by its last target. */
export function windowCount(length: number, seqLen: number): number {
  return Math.max(0, Math.floor((length - 1) / seqLen));
}

/**
 * Up to `maxBatches` batches of distinct windows when the split holds at least one batch; else
 * the fewest batches that count each of its windows equally often (at most `batchSize - 1`).
 * Throws when the split is shorter than one sequence, naming `what`.
 */
export function evalBatches(
  tokens: Uint16Array,
  batchSize: number,
  seqLen: number,
  maxBatches: number,
  what = "split",
): EvalBatches {
  const w = windowCount(tokens.length, seqLen);
  if (w < 1) {
    throw new RangeError(
      `The ${what} split has ${tokens.length} tokens, fewer than one sequence of seq_len + 1 = ${seqLen + 1}`,
    );
  }
  const row = (window: number) => tokens.subarray(window * seqLen, window * seqLen + seqLen + 1);
  const build = (count: number, windowOf: (r: number) => number) =>
    Array.from({ length: count }, (_, b) => {
      const out = new Uint16Array(batchSize * (seqLen + 1));
      for (let r = 0; r < batchSize; r++) out.set(row(windowOf(b * batchSize + r)), r * (seqLen + 1));
      return out;
    });
  if (w >= batchSize) {
    const n = Math.max(1, Math.min(maxBatches, Math.floor(w / batchSize)));
    return { batches: build(n, (r) => r), tokens: n * batchSize * seqLen, windows: n * batchSize };
  }
  const n = w / gcd(w, batchSize);
  return { batches: build(n, (r) => r % w), tokens: w * seqLen, windows: w };
}
