/**
 * Stage 7: train/valid/test split sizes by weights (Megatron's `--split 949,50,1`).
 *
 * The split is by tokens over the document stream in order (valid and test are the tail), so a
 * small corpus still gets a usable test set. A split with a positive weight that is too small for
 * one sequence is an error naming it: the seed's training died with StopIteration on exactly that.
 */
import type { SplitCounts } from "./store.ts";

/** Megatron's default split weights. */
export const DEFAULT_SPLIT: readonly [number, number, number] = [949, 50, 1];

/** Parse split weights: "949,50,1", "98,2" (missing weights are 0) or an array. */
export function parseSplitWeights(spec: string | readonly number[]): [number, number, number] {
  // "1,,1" is a mistake, not 1,1,0: an empty field is refused.
  const parts = typeof spec === "string"
    ? spec.trim().split(/ *[,/] *| +/).map((s) => s === "" ? NaN : Number(s))
    : [...spec];
  if (parts.length < 1 || parts.length > 3 || parts.some((w) => !Number.isFinite(w) || w < 0)) {
    throw new Error(
      `Invalid split "${String(spec)}": expected up to three non-negative weights like "949,50,1"`,
    );
  }
  while (parts.length < 3) parts.push(0);
  if (parts[0] + parts[1] + parts[2] <= 0) {
    throw new Error(`Invalid split "${String(spec)}": weights sum to 0`);
  }
  return parts as [number, number, number];
}

/**
 * Token counts of the three splits of `total` tokens. Every split with a positive weight must get
 * at least `seqLen + 1` tokens (one training window); otherwise throws naming the split.
 */
export function splitSizes(total: number, weights: readonly number[], seqLen: number): SplitCounts {
  const w = parseSplitWeights(weights);
  const sum = w[0] + w[1] + w[2];
  const b1 = Math.round((total * w[0]) / sum);
  const b2 = Math.round((total * (w[0] + w[1])) / sum);
  const sizes: SplitCounts = { train: b1, valid: b2 - b1, test: total - b2 };
  const names = ["train", "valid", "test"] as const;
  for (let i = 0; i < 3; i++) {
    const name = names[i];
    if (w[i] > 0 && sizes[name] < seqLen + 1) {
      throw new Error(
        `Split "${name}" gets ${sizes[name]} tokens (weight ${
          w[i]
        } of ${sum}, ${total} tokens in all), fewer than one ` +
          `sequence of seq_len + 1 = ${seqLen + 1} tokens: add data, raise its weight or lower seq_len`,
      );
    }
  }
  return sizes;
}
