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

/** Bits of a signature entry kept by {@link LshIndex} (b-bit MinHash, Li & König 2010). */
export const LSH_FINGERPRINT_BITS = 4;
/** Documents per page of stored fingerprints (pages avoid copying on growth). */
const PAGE_DOCS = 1 << 16;
/** Bits of a table slot holding the document id + 1; the rest hold a tag of the band key. */
const ID_BITS = 25;
const ID_MASK = (1 << ID_BITS) - 1;
/** Most documents an {@link LshIndex} keeps: ids + 1 must fit {@link ID_BITS} bits. */
export const LSH_MAX_DOCUMENTS = ID_MASK - 1;
/** Tables grow (double) when kept documents exceed this fraction of their slots. */
const MAX_LOAD = 0.8;
/** Smallest table (slots per band). */
const MIN_SLOTS = 1 << 12;

/** Non-zero nibbles of a 32-bit word (so 8 minus the equal 4-bit entries of two XORed words). */
function nonZeroNibbles(x: number): number {
  const y = (x | (x >>> 1) | (x >>> 2) | (x >>> 3)) & 0x11111111;
  return Math.imul(y, 0x11111111) >>> 28;
}

/**
 * Pack the low 4 bits of each entry of a signature (`sig[0 .. numPerm)`) into
 * `out[offset .. offset + ceil(numPerm / 8))`, 8 entries per word; padding nibbles are 0.
 */
export function packSignature(sig: Uint32Array, numPerm: number, out: Uint32Array, offset = 0): void {
  const words = (numPerm + 7) >>> 3;
  for (let w = 0; w < words; w++) {
    let v = 0;
    const end = Math.min(numPerm, (w + 1) * 8);
    for (let i = w * 8; i < end; i++) v |= (sig[i] & 15) << ((i & 7) << 2);
    out[offset + w] = v;
  }
}

/**
 * An LSH index over MinHash signatures. {@link LshIndex.addUnlessDuplicate} keeps the first of
 * each group of near-duplicates: documents are compared only with those already kept.
 *
 * Everything lives in typed arrays, outside the JS heap, in a fixed number of bytes per kept
 * document ({@link LshIndex.bytesPerDocument}):
 * - each kept document's signature is stored as 4-bit fingerprints of its entries (b-bit
 *   MinHash): 64 bytes for 128 entries, in pages of 65,536 documents;
 * - each band has an open-addressing hash table (linear probing) of 32-bit slots, holding the
 *   document id and 7 bits of the band key as a tag; all tables double together when the kept
 *   documents pass 80% of their slots, so a table costs 4 / load (5 to 10) bytes per document.
 *
 * Band keys hash the band's fingerprints (not the full 32-bit entries), so a doubling rehashes
 * from the stored fingerprints alone. Two documents agree on a 4-bit entry with probability
 * J + (1 − J) / 16 at Jaccard similarity J; candidates are confirmed with the unbiased estimate
 * (agree / numPerm − 1/16) / (15/16) ≥ threshold. Chance agreements make banding find a few more
 * candidates (a random pair shares a 7-entry band with probability 16⁻⁷), which only costs a
 * 64-byte comparison each. At most {@link LSH_MAX_DOCUMENTS} documents are kept.
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
  /** Words (32-bit) per stored fingerprint signature. */
  readonly words: number;
  /** Entries that must agree for a candidate to be a near-duplicate. */
  readonly agreeNeeded: number;
  #tables: Uint32Array[];
  #mask: number;
  #pages: Uint32Array[] = [];
  #count = 0;
  #packed: Uint32Array;
  #keys: Uint32Array;
  #checked: Int32Array;

  /** An empty index for signatures of `numPerm` entries and a Jaccard `threshold` in (0, 1]. */
  constructor(numPerm: number, threshold: number) {
    if (!(threshold > 0 && threshold <= 1)) {
      throw new RangeError(`Dedup threshold must be in (0, 1], got ${threshold}`);
    }
    this.threshold = threshold;
    this.numPerm = numPerm;
    ({ bands: this.bands, rows: this.rows } = lshBands(threshold, numPerm));
    this.words = (numPerm + 7) >>> 3;
    this.agreeNeeded = Math.min(numPerm, Math.ceil((numPerm * (threshold * 15 + 1)) / 16 - 1e-9));
    this.#tables = Array.from({ length: this.bands }, () => new Uint32Array(MIN_SLOTS));
    this.#mask = MIN_SLOTS - 1;
    this.#packed = new Uint32Array(this.words);
    this.#keys = new Uint32Array(this.bands);
    this.#checked = new Int32Array(this.bands * 8);
  }

  /** Kept documents. */
  get size(): number {
    return this.#count;
  }

  /** Bytes held by stored fingerprints (for memory reports). */
  get signatureBytes(): number {
    return this.#pages.length * PAGE_DOCS * this.words * 4;
  }

  /** Bytes held by the index: fingerprints and band tables. */
  get memoryBytes(): number {
    return this.signatureBytes + this.bands * (this.#mask + 1) * 4;
  }

  /** Bytes per kept document: fingerprints plus band-table slots at the lowest and highest load. */
  get bytesPerDocument(): { signature: number; tablesMin: number; tablesMax: number } {
    return {
      signature: this.words * 4,
      tablesMin: Math.ceil((this.bands * 4) / MAX_LOAD),
      tablesMax: Math.ceil((this.bands * 4 * 2) / MAX_LOAD),
    };
  }

  /** The packed fingerprints of the last signature given to {@link addUnlessDuplicate} (words entries). */
  get lastPacked(): Uint32Array {
    return this.#packed;
  }

  /** Bits `[pos, pos + n)` (n ≤ 28) of the fingerprints at `words[off ..]`. */
  #bits(words: Uint32Array, off: number, pos: number, n: number): number {
    const w = off + (pos >>> 5), sh = pos & 31;
    let v = words[w] >>> sh;
    if (sh + n > 32) v |= words[w + 1] << (32 - sh);
    return v & ((1 << n) - 1);
  }

  /** Key of band `band` of the fingerprints at `words[off ..]`: a hash of its bits, 28 at a time. */
  #bandKey(words: Uint32Array, off: number, band: number): number {
    let h = 0x27d4eb2f ^ band;
    for (let pos = band * this.rows * 4, end = pos + this.rows * 4; pos < end; pos += 28) {
      h = fmix32(h ^ this.#bits(words, off, pos, Math.min(28, end - pos)));
    }
    return h >>> 0;
  }

  /** Whether band `band` of fingerprints `a[ao ..]` and `b[bo ..]` is equal. */
  #sameBand(a: Uint32Array, ao: number, b: Uint32Array, bo: number, band: number): boolean {
    for (let pos = band * this.rows * 4, end = pos + this.rows * 4; pos < end; pos += 28) {
      const n = Math.min(28, end - pos);
      if (this.#bits(a, ao, pos, n) !== this.#bits(b, bo, pos, n)) return false;
    }
    return true;
  }

  /** Entries on which fingerprints `a[ao ..]` and `b[bo ..]` agree. */
  #agreements(a: Uint32Array, ao: number, b: Uint32Array, bo: number): number {
    let differ = 0;
    for (let w = 0; w < this.words; w++) differ += nonZeroNibbles(a[ao + w] ^ b[bo + w]);
    return this.numPerm - differ;
  }

  /** Insert document `id` with band keys `keys` into every table. */
  #insert(id: number, keys: Uint32Array): void {
    const mask = this.#mask;
    for (let b = 0; b < this.bands; b++) {
      const table = this.#tables[b], key = keys[b];
      let i = key & mask;
      while (table[i] !== 0) i = (i + 1) & mask;
      table[i] = (((key >>> ID_BITS) << ID_BITS) | (id + 1)) >>> 0;
    }
  }

  /**
   * Double every table, rebuilt from the stored fingerprints in document order (the old tables
   * are dropped first, so a doubling never holds both).
   */
  #grow(): void {
    const slots = (this.#mask + 1) * 2;
    this.#tables = [];
    this.#tables = Array.from({ length: this.bands }, () => new Uint32Array(slots));
    this.#mask = slots - 1;
    const keys = new Uint32Array(this.bands);
    for (let id = 0; id < this.#count; id++) {
      const page = this.#pages[Math.floor(id / PAGE_DOCS)], off = (id % PAGE_DOCS) * this.words;
      for (let b = 0; b < this.bands; b++) keys[b] = this.#bandKey(page, off, b);
      this.#insert(id, keys);
    }
  }

  /** Store the packed fingerprints in `this.#packed` as a new document (growing first); returns its id. */
  #store(): number {
    if (this.#count >= LSH_MAX_DOCUMENTS) {
      throw new RangeError(
        `Cannot keep document ${this.#count + 1} in the dedup index: over its cap of ${LSH_MAX_DOCUMENTS} ` +
          `kept documents; prepare the source in parts or turn dedup off`,
      );
    }
    if (this.#count + 1 > (this.#mask + 1) * MAX_LOAD) this.#grow();
    const id = this.#count++;
    const p = Math.floor(id / PAGE_DOCS);
    if (p === this.#pages.length) this.#pages.push(new Uint32Array(PAGE_DOCS * this.words));
    this.#pages[p].set(this.#packed, (id % PAGE_DOCS) * this.words);
    return id;
  }

  /**
   * Add the signature `sig` (numPerm entries) unless a kept document is a near-duplicate of it.
   * Returns true when it was a duplicate (and so not added).
   */
  addUnlessDuplicate(sig: Uint32Array): boolean {
    const packed = this.#packed, keys = this.#keys, mask = this.#mask;
    packSignature(sig, this.numPerm, packed);
    let checked = 0;
    for (let b = 0; b < this.bands; b++) {
      const key = keys[b] = this.#bandKey(packed, 0, b);
      const table = this.#tables[b], tag = key >>> ID_BITS;
      for (let i = key & mask; table[i] !== 0; i = (i + 1) & mask) {
        const slot = table[i];
        if (slot >>> ID_BITS !== tag) continue;
        const id = (slot & ID_MASK) - 1;
        const page = this.#pages[Math.floor(id / PAGE_DOCS)], off = (id % PAGE_DOCS) * this.words;
        if (!this.#sameBand(packed, 0, page, off, b)) continue;
        let seen = false;
        for (let c = 0; c < checked && !seen; c++) seen = this.#checked[c] === id;
        if (seen) continue;
        if (checked === this.#checked.length) {
          const grown = new Int32Array(checked * 2);
          grown.set(this.#checked);
          this.#checked = grown;
        }
        this.#checked[checked++] = id;
        if (this.#agreements(packed, 0, page, off) >= this.agreeNeeded) return true;
      }
    }
    this.#insert(this.#store(), keys); // band keys do not depend on the table size
    return false;
  }

  /**
   * Keep a document given its packed fingerprints (`words` entries, as {@link lastPacked} gave
   * them) without checking for duplicates: how a resumed preparation rebuilds its index.
   */
  addPacked(packed: Uint32Array, offset = 0): void {
    this.#packed.set(packed.subarray(offset, offset + this.words));
    const id = this.#store();
    for (let b = 0; b < this.bands; b++) this.#keys[b] = this.#bandKey(this.#packed, 0, b);
    this.#insert(id, this.#keys);
  }
}
