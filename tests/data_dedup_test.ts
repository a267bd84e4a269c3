/** Tests of stage 5: MinHash signatures and LSH banding remove planted near-duplicates and keep distinct documents. */
import assert from "node:assert/strict";
import { DEFAULT_MINHASH, estimateJaccard, lshBands, LshIndex, minhashSignature } from "../data/mod.ts";
import { makeDocs, nearDuplicate } from "./data_fixtures.ts";

/** Signature of a text with the default parameters. */
function sig(text: string): Uint32Array {
  const out = new Uint32Array(DEFAULT_MINHASH.numPerm);
  minhashSignature(text, DEFAULT_MINHASH, out);
  return out;
}

Deno.test("minhashSignature estimates Jaccard: identical 1, near-duplicate high, distinct near 0", () => {
  const [a, b] = makeDocs(2, 300, 3);
  assert.equal(estimateJaccard(sig(a), sig(a)), 1);
  assert.equal(estimateJaccard(sig(a), sig(a.toUpperCase())), 1); // case-folded
  assert.ok(estimateJaccard(sig(a), sig(nearDuplicate(a, 60))) > 0.75);
  assert.ok(estimateJaccard(sig(a), sig(b)) < 0.1);
});

Deno.test("lshBands picks more rows per band for higher thresholds", () => {
  const low = lshBands(0.5, 128), high = lshBands(0.9, 128);
  assert.ok(low.bands * low.rows <= 128 && high.bands * high.rows <= 128);
  assert.ok(high.rows > low.rows);
});

Deno.test("LshIndex removes planted near-duplicates and keeps distinct documents", () => {
  const docs = makeDocs(60, 200, 11);
  const planted = [0, 7, 19, 33, 59].map((i) => nearDuplicate(docs[i], 100));
  const index = new LshIndex(DEFAULT_MINHASH.numPerm, 0.8);
  const kept = [...docs, ...planted, docs[5]].filter((d) => !index.addUnlessDuplicate(sig(d)));
  assert.equal(kept.length, 60);
  assert.deepEqual(kept, docs);
  assert.equal(index.size, 60);
});

Deno.test("LshIndex threshold is configurable: a stricter threshold keeps looser copies", () => {
  const [doc] = makeDocs(1, 300, 5);
  const variant = nearDuplicate(doc, 50); // Jaccard of 5-word shingles about 0.8
  const loose = new LshIndex(128, 0.5), strict = new LshIndex(128, 0.95);
  for (const idx of [loose, strict]) idx.addUnlessDuplicate(sig(doc));
  assert.equal(loose.addUnlessDuplicate(sig(variant)), true);
  assert.equal(strict.addUnlessDuplicate(sig(variant)), false);
  assert.throws(() => new LshIndex(128, 0), /Dedup threshold must be in \(0, 1\], got 0/);
});
