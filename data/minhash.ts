/**
 * Stage 5: near-duplicate detection with MinHash signatures over word shingles and LSH banding.
 *
 * Signatures are computed in the tokenize workers (pure functions here); the {@link LshIndex}
 * lives on the main thread and decides, in document order, whether each document has a
 * near-duplicate among those already kept. Candidates from banding are verified with the
 * signatures' Jaccard estimate, so the threshold is honoured, not just approximated by the bands.
 */
import { collectWords, createWordList } from "./pretokenize.ts";

/** Parameters of MinHash signatures. */
export interface MinHashParams {
  /** Signature length: bins of one-permutation MinHash (default 128). */
  numPerm: number;
  /** Words per shingle (default 5). */
  shingleSize: number;
  /** Seed of the shingle hash (default 1). */
  seed: number;
}

/** Default MinHash parameters. */
export const DEFAULT_MINHASH: MinHashParams = { numPerm: 128, shingleSize: 5, seed: 1 };

/** A 32-bit finaliser (murmur3 fmix32). */
function fmix32(h: number): number {
  h ^= h >>> 16;
  h = Math.imul(h, 0x85ebca6b);
  h ^= h >>> 13;
  h = Math.imul(h, 0xc2b2ae35);
  return h ^ (h >>> 16);
}

/**
 * Write the MinHash signature of `text` into `out[offset .. offset + numPerm)`: the words (maximal
 * runs of letters or of digits, ASCII case-folded; see pretokenize.ts) go to
 * {@link minhashFromWords}.
 */
export function minhashSignature(text: string, params: MinHashParams, out: Uint32Array, offset = 0): void {
  const words = collectWords(new Map(), text, createWordList(Math.max(16, text.length >> 3)));
  minhashFromWords(words.hashes, words.count, params, out, offset);
}

/**
 * Write the MinHash signature of a document given its word hashes (`words[0 .. count)`) into
 * `out[offset .. offset + numPerm)`. Shingles are `shingleSize` consecutive words (a shorter
 * document is one shingle).
 *
 * The signature is one-permutation MinHash with optimal densification (Li, Owen & Zhang 2012;
 * Shrivastava 2017): each shingle is hashed once into one of `numPerm` bins, each bin keeps its
 * minimum, and empty bins borrow from a bin chosen by a fixed hash sequence. Two signatures agree
 * in a bin with probability equal to the Jaccard similarity of the shingle sets, as with
 * `numPerm` independent permutations, at the cost of one hash per shingle instead of `numPerm`.
 * A document without words gets an all-0xffffffff signature.
 */
export function minhashFromWords(
  words: Int32Array,
  count: number,
  params: MinHashParams,
  out: Uint32Array,
  offset = 0,
): void {
  const k = params.numPerm;
  const seed = fmix32(params.seed ^ 0x5bd1e995);
  const sig = out.subarray(offset, offset + k);
  sig.fill(0xffffffff);
  if (count === 0) return;
  const filled = new Uint8Array(k);
  const size = Math.min(params.shingleSize, count);
  for (let end = size; end <= count; end++) {
    let s = seed;
    for (let j = end - size; j < end; j++) s = Math.imul(s ^ words[j], 0x01000193) + j - end;
    s = fmix32(s);
    const bin = (s >>> 0) % k;
    const v = fmix32(s ^ 0x27d4eb2f) >>> 0;
    if (v <= sig[bin]) {
      sig[bin] = v;
      filled[bin] = 1;
    }
  }
  // Optimal densification: an empty bin i takes the value of the first filled bin in the sequence
  // hash(i, 1), hash(i, 2), ... (the same sequence for every document).
  for (let i = 0; i < k; i++) {
    if (filled[i]) continue;
    for (let attempt = 1;; attempt++) {
      const j = (fmix32(Math.imul(i + 1, 0x9e3779b1) ^ Math.imul(attempt, 0x85ebca77) ^ seed) >>> 0) % k;
      if (filled[j] === 1) {
        sig[i] = sig[j];
        break;
      }
    }
  }
}

/** Estimated Jaccard similarity of two signatures (fraction of equal entries). */
export function estimateJaccard(a: Uint32Array, b: Uint32Array): number {
  let eq = 0;
  for (let i = 0; i < a.length; i++) if (a[i] === b[i]) eq++;
  return eq / a.length;
}

/** Probability that a pair at Jaccard similarity `s` shares at least one of `bands` bands of `rows` rows. */
export function candidateProbability(s: number, bands: number, rows: number): number {
  return 1 - (1 - s ** rows) ** bands;
}

/** The smallest probability with which {@link lshBands} makes a pair at the threshold a candidate. */
export const LSH_RECALL_AT_THRESHOLD = 0.95;

/**
 * Bands and rows for an LSH threshold: among the layouts (bands × rows ≤ numPerm) under which a
 * pair at exactly the threshold becomes a candidate with probability at least
 * {@link LSH_RECALL_AT_THRESHOLD}, the one with the least false-positive mass below the threshold
 * (fewest needless comparisons). Candidates are then confirmed by the signatures' Jaccard
 * estimate, which is what keeps pairs below the threshold from being removed; the bands only
 * decide which pairs get compared. (Minimising false positives and negatives with equal weight,
 * as datasketch does, gives 9 × 13 at 0.8, which finds a pair at 0.8 only 40% of the time.) If no
 * layout reaches the bound (a tiny numPerm), the one with the highest probability is used.
 */
export function lshBands(threshold: number, numPerm: number): { bands: number; rows: number } {
  const integrate = (f: (s: number) => number, a: number, b: number) => {
    const steps = 200, dx = (b - a) / steps;
    let area = 0;
    for (let i = 0; i < steps; i++) area += f(a + (i + 0.5) * dx) * dx;
    return area;
  };
  let best: { bands: number; rows: number } | null = null, bestFp = Infinity;
  let fallback = { bands: numPerm, rows: 1 }, fallbackP = -1;
  for (let r = 1; r <= numPerm; r++) {
    const b = Math.floor(numPerm / r); // more bands only raise the probability: use all of them
    const p = candidateProbability(threshold, b, r);
    if (p > fallbackP) [fallback, fallbackP] = [{ bands: b, rows: r }, p];
    if (p < LSH_RECALL_AT_THRESHOLD) continue;
    const fp = integrate((s) => candidateProbability(s, b, r), 0, threshold);
    if (fp < bestFp) [best, bestFp] = [{ bands: b, rows: r }, fp];
  }
  return best ?? fallback;
}

/**
 * An LSH index over MinHash signatures. {@link LshIndex.addUnlessDuplicate} keeps the first of
 * each group of near-duplicates: documents are compared only with those already kept.
 */
export class LshIndex {
  /** Jaccard threshold at or above which a document is a near-duplicate. */
  readonly threshold: number;
  /** Signature length. */
  readonly numPerm: number;
  /** LSH bands. */
  readonly bands: number;
  /** Rows per band. */
  readonly rows: number;
  #tables: Map<number, number | number[]>[];
  #sigs: Uint32Array;
  #count = 0;

  /** An empty index for signatures of `numPerm` entries and a Jaccard `threshold` in (0, 1]. */
  constructor(numPerm: number, threshold: number) {
    if (!(threshold > 0 && threshold <= 1)) {
      throw new RangeError(`Dedup threshold must be in (0, 1], got ${threshold}`);
    }
    this.threshold = threshold;
    this.numPerm = numPerm;
    ({ bands: this.bands, rows: this.rows } = lshBands(threshold, numPerm));
    this.#tables = Array.from({ length: this.bands }, () => new Map());
    this.#sigs = new Uint32Array(numPerm * 1024);
  }

  /** Kept documents. */
  get size(): number {
    return this.#count;
  }

  /** Bytes held by signatures (for memory reports). */
  get signatureBytes(): number {
    return this.#sigs.byteLength;
  }

  /** Band keys of `sig`. */
  #bandKey(sig: Uint32Array, band: number): number {
    let h = 0x27d4eb2f ^ band;
    const start = band * this.rows;
    for (let i = start; i < start + this.rows; i++) h = Math.imul(h ^ sig[i], 0x01000193) ^ (h >>> 13);
    return fmix32(h);
  }

  /**
   * Add the signature `sig` (numPerm entries) unless a kept document is a near-duplicate of it.
   * Returns true when it was a duplicate (and so not added).
   */
  addUnlessDuplicate(sig: Uint32Array): boolean {
    const n = this.numPerm;
    const keys = new Array<number>(this.bands);
    const checked = new Set<number>();
    for (let b = 0; b < this.bands; b++) {
      const key = this.#bandKey(sig, b);
      keys[b] = key;
      const hit = this.#tables[b].get(key);
      if (hit === undefined) continue;
      for (const doc of typeof hit === "number" ? [hit] : hit) {
        if (checked.has(doc)) continue;
        checked.add(doc);
        if (estimateJaccard(sig, this.#sigs.subarray(doc * n, doc * n + n)) >= this.threshold) return true;
      }
    }
    const id = this.#count++;
    if (this.#count * n > this.#sigs.length) {
      const grown = new Uint32Array(this.#sigs.length * 2);
      grown.set(this.#sigs);
      this.#sigs = grown;
    }
    this.#sigs.set(sig.subarray(0, n), id * n);
    for (let b = 0; b < this.bands; b++) {
      const table = this.#tables[b], prev = table.get(keys[b]);
      if (prev === undefined) table.set(keys[b], id);
      else if (typeof prev === "number") table.set(keys[b], [prev, id]);
      else prev.push(id);
    }
    return false;
  }
}
