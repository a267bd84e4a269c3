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
  if (filledScratch.length < k) filledScratch = new Uint8Array(k);
  const filled = filledScratch;
  filled.fill(0, 0, k);
  const size = Math.min(params.shingleSize, count);
  const shingles = count - size + 1;
  const hs = shingleHashes(words, count, size, seed);
  fillBins(hs, shingles, k, sig, filled);
  densify(sig, filled, k, seed);
}

/**
 * The hash of each shingle of `size` words of `words[0 .. count)`, in a scratch array. Everything
 * here and in fillBins stays in 32-bit integers (`| 0` wraps as the ToInt32 of each use would).
 */
function shingleHashes(words: Int32Array, count: number, size: number, seed: number): Int32Array {
  const shingles = count - size + 1;
  if (shingleScratch.length < shingles) shingleScratch = new Int32Array(shingles * 2);
  const hs = shingleScratch;
  // First every shingle's hash (independent iterations the CPU overlaps), then the bins.
  if (size === 5) {
    for (let end = 5; end <= count; end++) {
      let s = (Math.imul(seed ^ words[end - 5], 0x01000193) - 5) | 0;
      s = (Math.imul(s ^ words[end - 4], 0x01000193) - 4) | 0;
      s = (Math.imul(s ^ words[end - 3], 0x01000193) - 3) | 0;
      s = (Math.imul(s ^ words[end - 2], 0x01000193) - 2) | 0;
      hs[end - 5] = (Math.imul(s ^ words[end - 1], 0x01000193) - 1) | 0;
    }
  } else {
    for (let end = size; end <= count; end++) {
      let s = seed;
      for (let j = end - size; j < end; j++) s = (Math.imul(s ^ words[j], 0x01000193) + j - end) | 0;
      hs[end - size] = s;
    }
  }
  return hs;
}

/**
 * One-permutation MinHash: each shingle hash `hs[0 .. shingles)` picks one of the `k` bins of
 * `sig` and a value, each bin keeping its minimum; `filled` marks the bins that got one.
 */
function fillBins(hs: Int32Array, shingles: number, k: number, sig: Uint32Array, filled: Uint8Array): void {
  // A power-of-two k picks the bin with a mask instead of a division; the values are unchanged.
  const mask = (k & (k - 1)) === 0 ? k - 1 : -1;
  for (let x = 0; x < shingles; x++) {
    let s = hs[x];
    s ^= s >>> 16;
    s = Math.imul(s, 0x85ebca6b);
    s ^= s >>> 13;
    s = Math.imul(s, 0xc2b2ae35);
    s ^= s >>> 16;
    const bin = mask >= 0 ? s & mask : (s >>> 0) % k;
    let v = s ^ 0x27d4eb2f;
    v ^= v >>> 16;
    v = Math.imul(v, 0x85ebca6b);
    v ^= v >>> 13;
    v = Math.imul(v, 0xc2b2ae35);
    v = (v ^ (v >>> 16)) >>> 0;
    if (v <= sig[bin]) {
      sig[bin] = v;
      filled[bin] = 1;
    }
  }
}

/** Fills the empty bins of `sig[0 .. k)` (those `filled` does not mark) from filled ones. */
function densify(sig: Uint32Array, filled: Uint8Array, k: number, seed: number): void {
  // Optimal densification: an empty bin i takes the value of the first filled bin in the sequence
  // hash(i, 1), hash(i, 2), ... (the same sequence for every document, so it is tabulated once).
  // With few filled bins (short documents) the first filled one is found as the filled bin with
  // the earliest place in the sequence; otherwise by walking the sequence.
  let m = 0;
  for (let i = 0; i < k; i++) if (filled[i]) m++;
  if (m === k) return;
  const { steps, first } = densifyTables(k, seed);
  if (m <= DENSIFY_FEW) {
    const bins = binsScratch;
    for (let i = 0, c = 0; i < k; i++) if (filled[i]) bins[c++] = i;
    for (let i = 0; i < k; i++) {
      if (filled[i]) continue;
      const row = i * k;
      let best = bins[0], bestAt = first[row + best];
      for (let c = 1; c < m; c++) {
        const at = first[row + bins[c]];
        if (at < bestAt) {
          best = bins[c];
          bestAt = at;
        }
      }
      sig[i] = sig[best];
    }
    return;
  }
  for (let i = 0; i < k; i++) {
    if (filled[i]) continue;
    let attempt = 1;
    for (const base = i * DENSIFY_STEPS; attempt <= DENSIFY_STEPS; attempt++) {
      const j = steps[base + attempt - 1];
      if (filled[j] === 1) {
        sig[i] = sig[j];
        break;
      }
    }
    if (attempt <= DENSIFY_STEPS) continue;
    for (;; attempt++) {
      const j = densifyBin(i, attempt, k, seed);
      if (filled[j] === 1) {
        sig[i] = sig[j];
        break;
      }
    }
  }
}

/** Scratch of minhashFromWords: which bins a document's shingles filled, and their list. */
let filledScratch = new Uint8Array(128);
/** Scratch of minhashFromWords: the shingle hashes of a document. */
let shingleScratch = new Int32Array(4096);
const binsScratch = new Int32Array(16);

/** Attempts of the densification sequence tabulated per bin (later ones are computed). */
const DENSIFY_STEPS = 64;
/** Up to this many filled bins, densification looks up each filled bin's place in the sequence. */
const DENSIFY_FEW = 16; // binsScratch holds this many

/** The `attempt`-th bin of bin `i`'s densification sequence. */
function densifyBin(i: number, attempt: number, k: number, seed: number): number {
  return (fmix32(Math.imul(i + 1, 0x9e3779b1) ^ Math.imul(attempt, 0x85ebca77) ^ seed) >>> 0) % k;
}

/** Densification tables of one signature length and seed. */
interface DensifyTables {
  /** `steps[i * DENSIFY_STEPS + a - 1]`: the a-th bin of bin i's sequence. */
  steps: Uint16Array;
  /** `first[i * k + j]`: the attempt at which bin j first appears in bin i's sequence. */
  first: Uint32Array;
}

/** Tabulated densification sequences, per signature length and seed (computed once per worker). */
const densifyCache = new Map<string, DensifyTables>();
/** The tables used last (one signature length and seed is the usual case). */
let lastDensify: { k: number; seed: number; tables: DensifyTables } = {
  k: -1,
  seed: 0,
  tables: { steps: new Uint16Array(0), first: new Uint32Array(0) },
};

/** The densification tables for `k` bins and `seed`. */
function densifyTables(k: number, seed: number): DensifyTables {
  if (k === lastDensify.k && seed === lastDensify.seed) return lastDensify.tables;
  const key = `${k}:${seed}`;
  let t = densifyCache.get(key);
  if (!t) {
    const steps = new Uint16Array(k * DENSIFY_STEPS), first = new Uint32Array(k * k);
    for (let i = 0; i < k; i++) {
      for (let a = 1; a <= DENSIFY_STEPS; a++) steps[i * DENSIFY_STEPS + a - 1] = densifyBin(i, a, k, seed);
      // Every bin appears eventually (a coupon collector: about k ln k attempts); one that did not
      // within 2^24 attempts (never seen) would rank last.
      let left = k;
      for (let a = 1; left > 0 && a < 1 << 24; a++) {
        const j = densifyBin(i, a, k, seed);
        if (first[i * k + j] === 0) {
          first[i * k + j] = a;
          left--;
        }
      }
      for (let j = 0; left > 0 && j < k; j++) if (first[i * k + j] === 0) first[i * k + j] = 0xffffffff;
    }
    densifyCache.set(key, t = { steps, first });
  }
  lastDensify = { k, seed, tables: t };
  return t;
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

/** Documents per page of stored fingerprints and keys (pages avoid copying on growth). */
const PAGE_DOCS = 1 << 16;
/** Bits of a table slot holding the document id + 1; the rest hold a tag of the band key. */
const ID_BITS = 25;
const ID_MASK = (1 << ID_BITS) - 1;
/** Most documents an {@link LshIndex} keeps: ids + 1 must fit {@link ID_BITS} bits. */
export const LSH_MAX_DOCUMENTS = ID_MASK - 1;
/**
 * Fingerprint pages kept in memory by an index with a folder, by default: the newest 16
 * (1,048,576 documents, 64 MiB at 128 entries). Older documents' fingerprints are read back from
 * the fingerprint file when a candidate needs them, which is rare (a shared band, or a 7-bit tag
 * collision), so memory does not grow with them.
 */
export const LSH_RESIDENT_PAGES = 16;
/** Tables grow (double) when kept documents exceed this fraction of their slots. */
const MAX_LOAD = 0.8;
/** Smallest table (slots per band). */
const MIN_SLOTS = 1 << 12;
/** File names of a persisted index (see {@link LshIndexOptions.dir}). */
const KEYS_FILE = "lsh-keys.u32", FINGERPRINTS_FILE = "lsh-fingerprints.u32";

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

/** Options of {@link LshIndex}. */
export interface LshIndexOptions {
  /**
   * A folder where the index keeps its band keys (read back only when the tables double, so they
   * cost disk, not memory) and a copy of its fingerprints, both appended in document order; what
   * {@link LshIndex.flush} wrote there, {@link LshIndex.restore} reads back after a crash. Without
   * it, band keys are kept in memory (72 more bytes per document at 18 bands).
   */
  dir?: string;
  /**
   * With `dir`: fingerprint pages (65,536 documents each) kept in memory, the newest ones; older
   * fingerprints are read from the folder's file when needed (default {@link LSH_RESIDENT_PAGES}).
   */
  residentPages?: number;
}

/** Append-only file of fixed-size records, written through a buffer, read back sequentially. */
class RecordFile {
  readonly file: Deno.FsFile;
  readonly words: number;
  #buf: Uint32Array;
  #pending = 0;
  /** Records on disk. */
  written = 0;
  constructor(path: string, words: number) {
    this.file = Deno.openSync(path, { read: true, write: true, create: true });
    this.words = words;
    this.#buf = new Uint32Array(words * 16384);
  }
  append(src: Uint32Array, offset = 0): void {
    this.#buf.set(src.subarray(offset, offset + this.words), this.#pending * this.words);
    if (++this.#pending * this.words === this.#buf.length) this.flush();
  }
  flush(): void {
    if (this.#pending === 0) return;
    const bytes = new Uint8Array(this.#buf.buffer, 0, this.#pending * this.words * 4);
    this.file.seekSync(this.written * this.words * 4, Deno.SeekMode.Start);
    for (let off = 0; off < bytes.length;) off += this.file.writeSync(bytes.subarray(off));
    this.written += this.#pending;
    this.#pending = 0;
  }
  /** Read record `index` into `into[0 .. words)`, from the buffer or the file. */
  read(index: number, into: Uint32Array): void {
    if (index >= this.written) {
      const at = (index - this.written) * this.words;
      into.set(this.#buf.subarray(at, at + this.words));
      return;
    }
    const bytes = new Uint8Array(into.buffer, into.byteOffset, this.words * 4);
    this.file.seekSync(index * this.words * 4, Deno.SeekMode.Start);
    for (let off = 0; off < bytes.length;) {
      const r = this.file.readSync(bytes.subarray(off));
      if (r === null) throw new Error(`Cannot read the dedup index: record ${index} is past the file's end`);
      off += r;
    }
  }
  /** Call `each(records, count)` over the first `n` records on disk, in chunks. */
  scan(n: number, each: (records: Uint32Array, count: number) => void): void {
    const chunk = new Uint32Array(this.words * 16384), bytes = new Uint8Array(chunk.buffer);
    this.file.seekSync(0, Deno.SeekMode.Start);
    for (let done = 0; done < n;) {
      const count = Math.min(16384, n - done), want = count * this.words * 4;
      for (let off = 0; off < want;) {
        const r = this.file.readSync(bytes.subarray(off, want));
        if (r === null) throw new Error(`Cannot read the dedup index: a file ends after ${done} records`);
        off += r;
      }
      each(chunk, count);
      done += count;
    }
  }
}

/**
 * An LSH index over MinHash signatures. {@link LshIndex.addUnlessDuplicate} keeps the first of
 * each group of near-duplicates: documents are compared only with those already kept.
 *
 * Everything lives in typed arrays, outside the JS heap, in a fixed number of bytes per kept
 * document ({@link LshIndex.bytesPerDocument}):
 * - each band has an open-addressing hash table (linear probing) of 32-bit slots, holding the
 *   document id and 7 bits of the band key (a hash of the band's full 32-bit entries) as a tag; all
 *   tables double together when the kept documents pass 80% of their slots, so a table costs
 *   4 / load (5 to 10) bytes per document;
 * - each kept document's signature is stored as 4-bit fingerprints of its entries (b-bit
 *   MinHash): 64 bytes for 128 entries, in pages of 65,536 documents; when `dir` is given they
 *   are also appended to a file there, and only the newest pages stay in memory (64 MiB by
 *   default), so memory per document is the tables' alone;
 * - the band keys (4 bytes per band) are needed only to rebuild the tables when they double: in a
 *   file when `dir` is given (read back sequentially), in memory otherwise.
 *
 * A candidate shares a whole band of full entries with the document; it is confirmed with the
 * fingerprints: two documents agree on a 4-bit entry with probability J + (1 − J) / 16 at Jaccard
 * similarity J, so the unbiased estimate (agree / numPerm − 1/16) / (15/16) ≥ threshold decides.
 * At most {@link LSH_MAX_DOCUMENTS} documents are kept.
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
  /** Fingerprint pages; with a folder, only the newest `residentPages` (older ones undefined). */
  #pages: (Uint32Array | undefined)[] = [];
  #fpScratch: Uint32Array;
  #residentPages: number;
  #keyPages: Uint32Array[] = [];
  #keyFile?: RecordFile;
  #fpFile?: RecordFile;
  #count = 0;
  #packed: Uint32Array;
  #keys: Uint32Array;
  #free: Int32Array;
  #checked: Int32Array;

  /** An empty index for signatures of `numPerm` entries and a Jaccard `threshold` in (0, 1]. */
  constructor(numPerm: number, threshold: number, options: LshIndexOptions = {}) {
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
    this.#fpScratch = new Uint32Array(this.words);
    this.#residentPages = Math.max(1, options.residentPages ?? LSH_RESIDENT_PAGES);
    this.#keys = new Uint32Array(this.bands);
    this.#free = new Int32Array(this.bands);
    this.#checked = new Int32Array(this.bands * 8);
    if (options.dir !== undefined) {
      this.#keyFile = new RecordFile(`${options.dir}/${KEYS_FILE}`, this.bands);
      this.#fpFile = new RecordFile(`${options.dir}/${FINGERPRINTS_FILE}`, this.words);
    }
  }

  /** Kept documents. */
  get size(): number {
    return this.#count;
  }

  /** Bytes held by stored fingerprints (for memory reports). */
  get signatureBytes(): number {
    return this.#pages.filter((p) => p !== undefined).length * PAGE_DOCS * this.words * 4;
  }

  /** Bytes of memory held by the index: fingerprints, band tables and in-memory band keys. */
  get memoryBytes(): number {
    return this.signatureBytes + this.bands * (this.#mask + 1) * 4 +
      this.#keyPages.length * PAGE_DOCS * this.bands * 4;
  }

  /**
   * Bytes of memory per kept document: fingerprints (with a folder, held only for the newest
   * `residentPages` × 65,536 documents: a fixed 64 MiB by default, the rest on disk), band-table
   * slots at the lowest and highest load, and band keys (0 when they are kept in a file).
   */
  get bytesPerDocument(): { signature: number; tablesMin: number; tablesMax: number; keys: number } {
    return {
      signature: this.words * 4,
      tablesMin: Math.ceil((this.bands * 4) / MAX_LOAD),
      tablesMax: Math.ceil((this.bands * 4 * 2) / MAX_LOAD),
      keys: this.#keyFile ? 0 : this.bands * 4,
    };
  }

  /** Key of band `band` of a full signature. */
  #bandKey(sig: Uint32Array, band: number): number {
    let h = 0x27d4eb2f ^ band;
    const start = band * this.rows;
    for (let i = start; i < start + this.rows; i++) h = Math.imul(h ^ sig[i], 0x01000193) ^ (h >>> 13);
    return fmix32(h) >>> 0;
  }

  /** Entries on which fingerprints `a[ao ..]` and `b[bo ..]` agree. */
  #agreements(a: Uint32Array, ao: number, b: Uint32Array, bo: number): number {
    let differ = 0;
    for (let w = 0; w < this.words; w++) differ += nonZeroNibbles(a[ao + w] ^ b[bo + w]);
    return this.numPerm - differ;
  }

  /** Insert document `id` with band keys `keys[ko ..]` into every table. */
  #insert(id: number, keys: Uint32Array, ko = 0): void {
    const mask = this.#mask;
    for (let b = 0; b < this.bands; b++) {
      const table = this.#tables[b], key = keys[ko + b];
      let i = key & mask;
      while (table[i] !== 0) i = (i + 1) & mask;
      table[i] = (((key >>> ID_BITS) << ID_BITS) | (id + 1)) >>> 0;
    }
  }

  /**
   * Insert documents `first .. first + count` with band keys `keys` (`bands` per document), one
   * table at a time: the writes of a pass stay in one table, which is kinder to caches and TLB.
   */
  #insertMany(first: number, keys: Uint32Array, count: number): void {
    const mask = this.#mask, bands = this.bands;
    for (let b = 0; b < bands; b++) {
      const table = this.#tables[b];
      for (let d = 0; d < count; d++) {
        const key = keys[d * bands + b];
        let i = key & mask;
        while (table[i] !== 0) i = (i + 1) & mask;
        table[i] = (((key >>> ID_BITS) << ID_BITS) | (first + d + 1)) >>> 0;
      }
    }
  }

  /** Make the tables large enough for `docs` documents, rebuilding them from the band keys. */
  #reserve(docs: number): void {
    let slots = this.#mask + 1;
    while (docs > slots * MAX_LOAD) slots *= 2;
    if (slots === this.#mask + 1) return;
    // The old tables are freed first (detached now, not at some later GC), so a doubling never
    // holds both.
    for (const t of this.#tables) (t.buffer as ArrayBuffer).transfer(0);
    this.#tables = [];
    this.#tables = Array.from({ length: this.bands }, () => new Uint32Array(slots));
    this.#mask = slots - 1;
    if (this.#keyFile) {
      this.#keyFile.flush();
      let id = 0;
      this.#keyFile.scan(this.#count, (keys, count) => {
        this.#insertMany(id, keys, count);
        id += count;
      });
    } else {
      for (let id = 0; id < this.#count; id++) {
        this.#insert(id, this.#keyPages[Math.floor(id / PAGE_DOCS)], (id % PAGE_DOCS) * this.bands);
      }
    }
  }

  /**
   * Add a fingerprint page; with a folder, free the one that leaves the resident window (its
   * records went to the fingerprint file long before: the file buffers 16,384).
   */
  #newPage(): void {
    this.#pages.push(new Uint32Array(PAGE_DOCS * this.words));
    const old = this.#pages.length - 1 - this.#residentPages;
    if (this.#fpFile && old >= 0 && this.#pages[old]) {
      (this.#pages[old]!.buffer as ArrayBuffer).transfer(0);
      this.#pages[old] = undefined;
    }
  }

  /** Keep a new document: fingerprints `packed[po ..]`, band keys `keys[ko ..]`; returns its id. */
  #keep(
    packed: Uint32Array,
    po: number,
    keys: Uint32Array,
    ko: number,
    persist: boolean,
    free?: Int32Array,
  ): number {
    if (this.#count >= LSH_MAX_DOCUMENTS) {
      throw new RangeError(
        `Cannot keep document ${this.#count + 1} in the dedup index: over its cap of ${LSH_MAX_DOCUMENTS} ` +
          `kept documents; prepare the source in parts or turn dedup off`,
      );
    }
    const mask = this.#mask;
    this.#reserve(this.#count + 1);
    const id = this.#count++;
    const p = Math.floor(id / PAGE_DOCS);
    if (p === this.#pages.length) this.#newPage();
    this.#pages[p]!.set(packed.subarray(po, po + this.words), (id % PAGE_DOCS) * this.words);
    if (this.#keyFile) {
      if (persist) {
        this.#keyFile.append(keys, ko);
        this.#fpFile!.append(packed, po);
      }
    } else {
      if (p === this.#keyPages.length) this.#keyPages.push(new Uint32Array(PAGE_DOCS * this.bands));
      this.#keyPages[p].set(keys.subarray(ko, ko + this.bands), (id % PAGE_DOCS) * this.bands);
    }
    if (free && mask === this.#mask) {
      for (let b = 0; b < this.bands; b++) {
        this.#tables[b][free[b]] = (((keys[ko + b] >>> ID_BITS) << ID_BITS) | (id + 1)) >>> 0;
      }
    } else this.#insert(id, keys, ko);
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
      const key = keys[b] = this.#bandKey(sig, b);
      const table = this.#tables[b], tag = key >>> ID_BITS;
      let i = key & mask;
      for (; table[i] !== 0; i = (i + 1) & mask) {
        const slot = table[i];
        if (slot >>> ID_BITS !== tag) continue;
        const id = (slot & ID_MASK) - 1;
        let seen = false;
        for (let c = 0; c < checked && !seen; c++) seen = this.#checked[c] === id;
        if (seen) continue;
        if (checked === this.#checked.length) {
          const grown = new Int32Array(checked * 2);
          grown.set(this.#checked);
          this.#checked = grown;
        }
        this.#checked[checked++] = id;
        const page = this.#pages[Math.floor(id / PAGE_DOCS)];
        let agree: number;
        if (page) agree = this.#agreements(packed, 0, page, (id % PAGE_DOCS) * this.words);
        else {
          this.#fpFile!.read(id, this.#fpScratch);
          agree = this.#agreements(packed, 0, this.#fpScratch, 0);
        }
        if (agree >= this.agreeNeeded) return true;
      }
      this.#free[b] = i; // where the document goes in this band's table, unless the tables grow
    }
    this.#keep(packed, 0, keys, 0, true, this.#free);
    return false;
  }

  /** Write what is buffered to the index's folder (before a preparation commits a shard). */
  flush(): void {
    this.#keyFile?.flush();
    this.#fpFile?.flush();
  }

  /**
   * Rebuild the index from the first `documents` documents persisted in its folder (what the
   * last {@link flush} before an interruption wrote), dropping anything after them. The index
   * must be new and have a folder.
   */
  restore(documents: number): void {
    const keyFile = this.#keyFile, fpFile = this.#fpFile;
    if (!keyFile || !fpFile || this.#count > 0) {
      throw new Error("Cannot restore the dedup index: it needs a folder and must be empty");
    }
    for (const f of [keyFile, fpFile]) {
      f.file.truncateSync(documents * f.words * 4);
      f.written = documents;
    }
    this.#reserve(documents);
    let id = 0;
    fpFile.scan(documents, (packed, count) => {
      for (let i = 0; i < count; i++) {
        const p = Math.floor(id / PAGE_DOCS);
        if (p === this.#pages.length) this.#newPage();
        this.#pages[p]!.set(
          packed.subarray(i * this.words, (i + 1) * this.words),
          (id % PAGE_DOCS) * this.words,
        );
        id++;
      }
    });
    id = 0;
    keyFile.scan(documents, (keys, count) => {
      this.#insertMany(id, keys, count);
      id += count;
    });
    this.#count = documents;
  }

  /** Close the index's files and free its memory (the index is not usable afterwards). */
  close(): void {
    this.#keyFile?.file.close();
    this.#fpFile?.file.close();
    // Free the tables and fingerprints now (detached), not at some later GC: the stages after
    // deduplication then run without the index's memory.
    for (const a of [...this.#tables, ...this.#pages, ...this.#keyPages]) {
      if (a) (a.buffer as ArrayBuffer).transfer(0);
    }
    this.#tables = [];
    this.#pages = [];
    this.#keyPages = [];
  }
}
