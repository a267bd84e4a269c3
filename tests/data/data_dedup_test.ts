/** Tests of stage 5: MinHash signatures and LSH banding remove planted near-duplicates and keep distinct documents. */
import assert from "node:assert/strict";
import {
  candidateProbability,
  DEFAULT_MINHASH,
  estimateJaccard,
  lshBands,
  LshIndex,
  minhashFromWords,
  minhashSignature,
} from "../../data/mod.ts";
import { makeDocs, nearDuplicate, rng } from "../data_fixtures.ts";

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

/** Signatures of a pair at Jaccard similarity `j`: each bin agrees with probability `j`, as MinHash's do. */
function pairAt(j: number, numPerm: number, rand: () => number): [Uint32Array, Uint32Array] {
  const a = new Uint32Array(numPerm), b = new Uint32Array(numPerm);
  for (let i = 0; i < numPerm; i++) {
    a[i] = (rand() * 2 ** 32) >>> 0;
    b[i] = rand() < j ? a[i] : (a[i] ^ (1 + ((rand() * 2 ** 31) >>> 0))) >>> 0;
  }
  return [a, b];
}

Deno.test("lshBands makes a pair at the threshold a candidate at least 95% of the time (9 × 13 gave 40% at 0.8)", () => {
  for (const t of [0.5, 0.7, 0.8, 0.85, 0.9, 0.95]) {
    for (const n of [64, 128, 256]) {
      const { bands, rows } = lshBands(t, n);
      assert.ok(bands * rows <= n);
      assert.ok(candidateProbability(t, bands, rows) >= 0.95, `${t} ${n}: ${bands} x ${rows}`);
    }
  }
  assert.deepEqual(lshBands(0.8, 128), { bands: 18, rows: 7 });
  assert.ok(candidateProbability(0.8, 9, 13) < 0.45); // the old layout
  // Monte Carlo over banded signatures: the measured candidate rate at the threshold.
  const rand = rng(11);
  const { bands, rows } = lshBands(0.8, 128);
  let hits = 0;
  const trials = 2000;
  for (let k = 0; k < trials; k++) {
    const [a, b] = pairAt(0.8, 128, rand);
    let hit = false;
    for (let band = 0; band < bands && !hit; band++) {
      hit = true;
      for (let r = band * rows; r < (band + 1) * rows; r++) if (a[r] !== b[r]) hit = false;
    }
    if (hit) hits++;
  }
  assert.ok(hits / trials >= 0.96, `candidate rate ${hits / trials}`);
});

Deno.test("LshIndex removes pairs well above the threshold and keeps pairs well below it", () => {
  const rand = rng(12);
  const removedAt = (j: number) => {
    let removed = 0;
    for (let k = 0; k < 300; k++) {
      const index = new LshIndex(128, 0.8);
      const [a, b] = pairAt(j, 128, rand);
      index.addUnlessDuplicate(a);
      if (index.addUnlessDuplicate(b)) removed++;
    }
    return removed / 300;
  };
  assert.ok(removedAt(0.9) >= 0.97, "J = 0.9 removed");
  assert.ok(removedAt(0.6) <= 0.01, "J = 0.6 kept");
});

/** Exact Jaccard similarity of the 5-word shingle sets of two texts (words as minhash.ts reads them). */
function trueJaccard(a: string, b: string): number {
  const shingles = (t: string) => {
    const w = t.toLowerCase().match(/[a-z]+|[0-9]+/g) ?? [];
    const set = new Set<string>();
    for (let i = 0; i + 5 <= w.length; i++) set.add(w.slice(i, i + 5).join(" "));
    return set;
  };
  const sa = shingles(a), sb = shingles(b);
  let both = 0;
  for (const s of sa) if (sb.has(s)) both++;
  return both / (sa.size + sb.size - both);
}

Deno.test("LshIndex on planted pairs of real documents: ≥ 0.95 removed at Jaccard 0.85-0.9, none below 0.7", () => {
  const rand = rng(27);
  const docs = makeDocs(1500, 400, 27);
  const index = new LshIndex(128, 0.8);
  for (const d of docs) assert.equal(index.addUnlessDuplicate(sig(d)), false, "distinct documents kept");
  const high = { pairs: 0, removed: 0 }, low = { pairs: 0, removed: 0 };
  for (let k = 0; k < docs.length; k++) {
    // Replace 3 to 18 words at random places: Jaccard from about 0.93 down to about 0.6.
    const words = docs[k].split(" ");
    const changes = 3 + Math.floor(rand() * 16);
    for (let c = 0; c < changes; c++) words[Math.floor(rand() * words.length)] = `planted${k}x${c}`;
    const variant = words.join(" ");
    const j = trueJaccard(docs[k], variant);
    const bucket = j >= 0.85 && j <= 0.9 ? high : j < 0.7 ? low : undefined;
    const removed = index.addUnlessDuplicate(sig(variant));
    if (!bucket) continue;
    bucket.pairs++;
    if (removed) bucket.removed++;
  }
  assert.ok(high.pairs >= 150 && low.pairs >= 300, `pairs: ${high.pairs} high, ${low.pairs} low`);
  assert.ok(high.removed / high.pairs >= 0.95, `removed at 0.85-0.9: ${high.removed}/${high.pairs}`);
  assert.equal(low.removed, 0, `removed below 0.7: ${low.removed}/${low.pairs}`);
});

Deno.test("LshIndex grows its typed-array tables: 300,000 distinct signatures kept, copies found after growth", () => {
  const rand = rng(5);
  const index = new LshIndex(128, 0.8);
  const n = 300_000, s = new Uint32Array(128);
  const keepEvery = 1000, kept: Uint32Array[] = [];
  for (let d = 0; d < n; d++) {
    for (let i = 0; i < 128; i++) s[i] = (rand() * 2 ** 32) >>> 0;
    if (d % keepEvery === 0) kept.push(s.slice());
    assert.equal(index.addUnlessDuplicate(s), false);
  }
  assert.equal(index.size, n);
  // Each early signature, with 10 of 128 entries changed (Jaccard about 0.92), is found again.
  for (const k of kept) {
    const copy = k.slice();
    for (let c = 0; c < 10; c++) copy[Math.floor(rand() * 128)] ^= 0x5a5a5a5a;
    assert.equal(index.addUnlessDuplicate(copy), true);
  }
  // Bytes per document as stated (pages of 65,536 documents round the per-document part up).
  const per = index.memoryBytes / n, { signature, tablesMax, keys } = index.bytesPerDocument;
  const paged = (signature + keys) * Math.ceil(n / 65536) * 65536 / n;
  assert.ok(per <= paged + tablesMax, `${per} bytes per document`);
  // An index kept in a folder, flushed, is restored by a new one: it finds the same copies, and
  // documents after the restored count are dropped.
  const dir = Deno.makeTempDirSync({ prefix: "lsh-test-" });
  try {
    const saved = new LshIndex(128, 0.8, { dir });
    for (const k of kept) saved.addUnlessDuplicate(k);
    saved.flush();
    saved.close();
    const restored = new LshIndex(128, 0.8, { dir });
    restored.restore(kept.length - 1);
    assert.equal(restored.size, kept.length - 1);
    for (const k of kept.slice(0, -1)) assert.equal(restored.addUnlessDuplicate(k), true);
    assert.equal(restored.addUnlessDuplicate(kept.at(-1)!), false);
    assert.equal(restored.bytesPerDocument.keys, 0);
    restored.close();
  } finally {
    Deno.removeSync(dir, { recursive: true });
  }
});

Deno.test("minhashFromWords: the tabulated densification gives the signatures of the sequence walk", () => {
  // The reference: each empty bin walks hash(i, 1), hash(i, 2), ... to the first filled bin.
  const fmix = (h: number) => {
    h ^= h >>> 16;
    h = Math.imul(h, 0x85ebca6b);
    h ^= h >>> 13;
    h = Math.imul(h, 0xc2b2ae35);
    return h ^ (h >>> 16);
  };
  const rand = rng(9);
  for (const k of [16, 128, 200]) {
    const params = { numPerm: k, shingleSize: 5, seed: 1 };
    const seed = fmix(params.seed ^ 0x5bd1e995);
    for (let trial = 0; trial < 60; trial++) {
      const count = 1 + Math.floor(rand() * 60);
      const words = Int32Array.from({ length: count }, () => (rand() * 2 ** 32) | 0);
      const got = new Uint32Array(k);
      minhashFromWords(words, count, params, got);
      // Which bins the shingles fill, then the reference densification of the filled values.
      const want = new Uint32Array(k).fill(0xffffffff), filled = new Uint8Array(k);
      const size = Math.min(5, count);
      for (let end = size; end <= count; end++) {
        let s = seed;
        for (let j = end - size; j < end; j++) s = Math.imul(s ^ words[j], 0x01000193) + j - end;
        s = fmix(s);
        const bin = (s >>> 0) % k, v = fmix(s ^ 0x27d4eb2f) >>> 0;
        if (v <= want[bin]) [want[bin], filled[bin]] = [v, 1];
      }
      for (let i = 0; i < k; i++) {
        if (filled[i]) continue;
        for (let a = 1;; a++) {
          const j = (fmix(Math.imul(i + 1, 0x9e3779b1) ^ Math.imul(a, 0x85ebca77) ^ seed) >>> 0) % k;
          if (filled[j]) {
            want[i] = want[j];
            break;
          }
        }
      }
      assert.deepEqual(got, want, `k ${k}, ${count} words`);
    }
  }
});

Deno.test("an index with a folder keeps the newest fingerprint pages in memory and reads older ones from its file, deciding alike", () => {
  const dir = Deno.makeTempDirSync({ prefix: "lsh-resident-" });
  try {
    // 1 resident page of 65,536 documents; 150,000 documents, so most fingerprints are on disk.
    const paged = new LshIndex(128, 0.8, { dir, residentPages: 1 }), whole = new LshIndex(128, 0.8);
    const rand = rng(41), n = 150_000, s = new Uint32Array(128), early: Uint32Array[] = [];
    for (let d = 0; d < n; d++) {
      for (let i = 0; i < 128; i++) s[i] = (rand() * 2 ** 32) >>> 0;
      if (d % 5000 === 0) early.push(s.slice());
      assert.equal(paged.addUnlessDuplicate(s), whole.addUnlessDuplicate(s));
    }
    assert.ok(paged.signatureBytes <= 2 * 65536 * 64, `${paged.signatureBytes} bytes of fingerprints`);
    // Copies of early documents with 8 of 128 entries changed (Jaccard about 0.94) and with 60
    // changed (about 0.5): found, and not, by both.
    let found = 0;
    for (const changes of [8, 60]) {
      for (const k of early) {
        const copy = k.slice();
        for (let c = 0; c < changes; c++) copy[(c * 37 + changes) % 128] ^= 0x5a5a5a5a;
        const dup = paged.addUnlessDuplicate(copy);
        assert.equal(dup, whole.addUnlessDuplicate(copy));
        if (changes === 8) found += dup ? 1 : 0;
        else assert.equal(dup, false);
      }
    }
    assert.equal(found, early.length);
    paged.close();
    whole.close();
  } finally {
    Deno.removeSync(dir, { recursive: true });
  }
});
