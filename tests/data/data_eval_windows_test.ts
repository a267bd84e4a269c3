/** evalBatches(): every window once, equal weights when a split is smaller than a batch, and a clear refusal. */

import assert from "node:assert/strict";
import { evalBatches, windowCount } from "../../data/mod.ts";

const seq = (n: number) => Uint16Array.from({ length: n }, (_, i) => i);
/** First token of each row of each batch. */
const starts = (batches: Uint16Array[], rowLen: number) =>
  batches.map((b) => Array.from({ length: b.length / rowLen }, (_, r) => b[r * rowLen]));

Deno.test("evalBatches() takes distinct consecutive windows, at most maxBatches", () => {
  const e = evalBatches(seq(4 * 10 + 1), 2, 4, 3);
  assert.equal(windowCount(41, 4), 10);
  assert.deepEqual(starts(e.batches, 5), [[0, 4], [8, 12], [16, 20]]);
  assert.deepEqual(Array.from(e.batches[0].subarray(0, 5)), [0, 1, 2, 3, 4]);
  assert.equal(e.tokens, 3 * 2 * 4);
});

Deno.test("evalBatches() on a split smaller than one batch counts each window equally often", () => {
  // sotu's test split: 2,074 tokens, seq_len 1024 -> 2 windows; batch 8 -> one batch, each window 4 times.
  const sotu = evalBatches(seq(2074), 8, 1024, 10);
  assert.equal(sotu.batches.length, 1);
  assert.deepEqual(starts(sotu.batches, 1025), [[0, 1024, 0, 1024, 0, 1024, 0, 1024]]);
  assert.equal(sotu.tokens, 2048);
  // 3 windows, batch 4: lcm 12 rows over 3 batches, each window 4 times.
  const e = evalBatches(seq(13), 4, 4, 1);
  assert.deepEqual(starts(e.batches, 5), [[0, 4, 8, 0], [4, 8, 0, 4], [8, 0, 4, 8]]);
  assert.equal(e.windows, 3);
});

Deno.test("evalBatches() refuses a split shorter than one sequence, naming it", () => {
  assert.throws(() => evalBatches(seq(1024), 8, 1024, 1, "test"), {
    message: "The test split has 1024 tokens, fewer than one sequence of seq_len + 1 = 1025",
  });
});
