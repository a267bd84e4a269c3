/**
 * A faster GPT-2 (r50k_base) encoder for bulk tokenization: a hand-written scanner that splits
 * text exactly like GPT-2's pre-tokenizer regex, a bounded cache from piece to tokens, and, for
 * pieces not seen before, byte-pair merges over typed arrays with gpt-tokenizer's ranks.
 *
 * gpt-tokenizer spends most of its time in `matchAll` over a Unicode-property regex and in
 * per-piece map lookups, and a piece it has not seen costs about 14 µs (the split regex again, a
 * `TextDecoder` call per candidate pair). Here one pass over the characters finds each piece and
 * hashes it (and its MinHash word, see pretokenize.ts) as it goes, tokens are written straight
 * into a typed array, and a new piece's merges look byte pairs up in an open-addressing table of
 * the ranks. Output is identical to `encode(text, {disallowedSpecial: new Set()})` (tested):
 * `<|endoftext|>` inside a document is ordinary text, and the separator is appended by the caller.
 */
import bpeRanks from "gpt-tokenizer/bpeRanks/r50k_base";
import { CLASS_L, CLASS_N, CLASS_S, classAt, type ClassCache, type WordList } from "./pretokenize.ts";

/** The rank tables, built once per thread from gpt-tokenizer's r50k_base ranks. */
interface Ranks {
  /** Open-addressing table over byte sequences: entry index + 1, or 0 (length a power of two). */
  table: Int32Array;
  /** Per entry: start of its bytes in `bytes`, its length and its rank. */
  starts: Int32Array;
  lengths: Int32Array;
  ranks: Int32Array;
  bytes: Uint8Array;
  /** The token of each ASCII character alone. */
  ascii: Uint16Array;
}

/** The rank tables of this thread. */
let ranksCache: Ranks | undefined;

/** FNV-1a over `b[from, to)`. */
function hashBytes(b: Uint8Array, from: number, to: number): number {
  let h = 0x811c9dc5 | 0;
  for (let i = from; i < to; i++) h = Math.imul(h ^ b[i], 0x01000193);
  return (h ^ (h >>> 15)) | 0;
}

/** Set by {@link utf8Into} when the text it encoded held a lone surrogate. */
let loneSurrogate = false;

/**
 * Write the UTF-8 bytes of `text[from, to)` to `out[at ..]` (room for 3 per unit) and return how
 * many; a lone surrogate becomes EF BF BD, as `TextEncoder` writes it, and sets {@link loneSurrogate}.
 */
function utf8Into(text: string, from: number, to: number, out: Uint8Array, at: number): number {
  const begin = at;
  loneSurrogate = false;
  for (let i = from; i < to; i++) {
    const c = text.charCodeAt(i);
    if (c < 0x80) out[at++] = c;
    else if (c < 0x800) {
      out[at++] = 0xc0 | (c >> 6);
      out[at++] = 0x80 | (c & 63);
    } else if (c >= 0xd800 && c <= 0xdfff) {
      const d = i + 1 < to ? text.charCodeAt(i + 1) : 0;
      if (c <= 0xdbff && d >= 0xdc00 && d <= 0xdfff) {
        const cp = 0x10000 + ((c - 0xd800) << 10) + (d - 0xdc00);
        out[at++] = 0xf0 | (cp >> 18);
        out[at++] = 0x80 | ((cp >> 12) & 63);
        out[at++] = 0x80 | ((cp >> 6) & 63);
        out[at++] = 0x80 | (cp & 63);
        i++;
      } else {
        out[at++] = 0xef;
        out[at++] = 0xbf;
        out[at++] = 0xbd;
        loneSurrogate = true;
      }
    } else {
      out[at++] = 0xe0 | (c >> 12);
      out[at++] = 0x80 | ((c >> 6) & 63);
      out[at++] = 0x80 | (c & 63);
    }
  }
  return at - begin;
}

/** Whether bytes are valid UTF-8 (gpt-tokenizer's `isValidUTF8`: no overlongs, surrogates or code points past U+10FFFF). */
function validUtf8(b: ArrayLike<number>): boolean {
  for (let i = 0; i < b.length;) {
    const b1 = b[i];
    let n: number, cp: number;
    if (b1 <= 0x7f) [n, cp] = [1, b1];
    else if ((b1 & 0xe0) === 0xc0 && b1 > 0xc1) [n, cp] = [2, b1 & 0x1f];
    else if ((b1 & 0xf0) === 0xe0) [n, cp] = [3, b1 & 0x0f];
    else if ((b1 & 0xf8) === 0xf0 && b1 <= 0xf4) [n, cp] = [4, b1 & 0x07];
    else return false;
    if (i + n > b.length) return false;
    for (let j = 1; j < n; j++) {
      if ((b[i + j] & 0xc0) !== 0x80) return false;
      cp = (cp << 6) | (b[i + j] & 0x3f);
    }
    if ((n === 2 && cp < 0x80) || (n === 3 && cp < 0x800) || (n === 4 && cp < 0x10000)) return false;
    if ((cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff) return false;
    i += n;
  }
  return true;
}

/**
 * Build the rank tables. A byte sequence gets the rank gpt-tokenizer's `getBpeRankFromBytes`
 * gives it: a token stored as text is found by its UTF-8 bytes (a later rank of the same text
 * wins, as its Map does), a token stored as bytes only when those bytes are not valid UTF-8
 * (valid ones are looked up as text there). A token's text never holds a lone surrogate (checked).
 */
function buildRanks(): Ranks {
  const values = bpeRanks as (string | number[])[];
  let room = 0, entries = 0;
  values.forEach((v) => {
    room += typeof v === "string" ? v.length * 3 : v.length;
    entries++;
  });
  let size = 16;
  while (size < entries * 2) size *= 2;
  const r: Ranks = {
    table: new Int32Array(size),
    starts: new Int32Array(entries),
    lengths: new Int32Array(entries),
    ranks: new Int32Array(entries),
    bytes: new Uint8Array(room + 1),
    ascii: new Uint16Array(128),
  };
  let used = 0, count = 0;
  values.forEach((value, rank) => {
    let len: number;
    if (typeof value === "string") {
      len = utf8Into(value, 0, value.length, r.bytes, used);
      if (loneSurrogate) throw new Error(`Token ${rank} of r50k_base holds a lone surrogate`);
    } else {
      if (validUtf8(value)) return;
      r.bytes.set(value, used);
      len = value.length;
    }
    const e = findBytes(r, r.bytes, used, used + len);
    if (e >= 0) return void (r.ranks[e] = rank); // the same bytes again: the later rank wins
    let slot = hashBytes(r.bytes, used, used + len) & (size - 1);
    while (r.table[slot] !== 0) slot = (slot + 1) & (size - 1);
    r.table[slot] = count + 1;
    r.starts[count] = used;
    r.lengths[count] = len;
    r.ranks[count] = rank;
    count++;
    used += len;
  });
  for (let c = 0; c < 128; c++) {
    r.bytes[used] = c;
    const rank = rankOf(r, r.bytes, used, used + 1);
    if (rank === NO_RANK) throw new Error(`r50k_base has no token for the byte ${c}`);
    r.ascii[c] = rank;
  }
  return r;
}

/** The entry of the byte sequence `b[from, to)` in the rank table, or -1. */
function findBytes(r: Ranks, b: Uint8Array, from: number, to: number): number {
  const mask = r.table.length - 1, len = to - from, pool = r.bytes;
  for (let slot = hashBytes(b, from, to) & mask;; slot = (slot + 1) & mask) {
    const e = r.table[slot] - 1;
    if (e < 0) return -1;
    if (r.lengths[e] !== len) continue;
    const s = r.starts[e];
    let i = 0;
    while (i < len && pool[s + i] === b[from + i]) i++;
    if (i === len) return e;
  }
}

/** Rank of the byte sequence `b[from, to)`, or {@link NO_RANK}. */
function rankOf(r: Ranks, b: Uint8Array, from: number, to: number): number {
  const e = findBytes(r, b, from, to);
  return e < 0 ? NO_RANK : r.ranks[e];
}

const NO_RANK = 0x7fffffff;

/** Scratch of {@link bytePairMerge}: UTF-8 bytes of the piece, part starts and pair ranks. */
let mergeBytes = new Uint8Array(1024);
let mergeStarts = new Int32Array(1025);
let mergeRanks = new Int32Array(1025);

/**
 * The tokens of a piece not in the cache, written to `out[at ..]`; returns their count. As
 * gpt-tokenizer: the whole piece if it is a token, else its UTF-8 bytes merged pair by pair,
 * lowest rank first (the leftmost of equal ranks).
 */
function encodePiece(
  r: Ranks,
  text: string,
  start: number,
  end: number,
  out: Uint16Array,
  at: number,
): number {
  if (mergeBytes.length < (end - start) * 3) {
    mergeBytes = new Uint8Array((end - start) * 3);
    mergeStarts = new Int32Array((end - start) * 3 + 1);
    mergeRanks = new Int32Array((end - start) * 3 + 1);
  }
  const b = mergeBytes, starts = mergeStarts, ranks = mergeRanks;
  const len = utf8Into(text, start, end, b, 0);
  // gpt-tokenizer looks the piece itself up as text first (text with a lone surrogate is no token).
  const whole = loneSurrogate ? NO_RANK : rankOf(r, b, 0, len);
  if (whole !== NO_RANK) {
    out[at] = whole;
    return 1;
  }
  let parts = len + 1; // entries of `starts` (and of `ranks`)
  for (let i = 0; i <= len; i++) {
    starts[i] = i;
    ranks[i] = i < len - 1 ? rankOf(r, b, i, i + 2) : NO_RANK;
  }
  while (parts > 1) {
    let lowest = NO_RANK, at_ = -1;
    for (let i = 0; i < parts - 1; i++) {
      if (ranks[i] < lowest) {
        lowest = ranks[i];
        at_ = i;
      }
    }
    if (lowest === NO_RANK) break;
    // Merge part at_ with the next: drop starts[at_ + 1] and ranks[at_], then rank the new pairs.
    starts.copyWithin(at_ + 1, at_ + 2, parts);
    ranks.copyWithin(at_, at_ + 1, parts);
    parts--;
    ranks[at_] = at_ + 2 < parts ? rankOf(r, b, starts[at_], starts[at_ + 2]) : NO_RANK;
    if (at_ > 0) ranks[at_ - 1] = at_ + 1 < parts ? rankOf(r, b, starts[at_ - 1], starts[at_ + 1]) : NO_RANK;
  }
  for (let i = 0; i < parts - 1; i++) {
    const rank = rankOf(r, b, starts[i], starts[i + 1]);
    if (rank === NO_RANK) throw new Error(`The byte-pair encoding has no rank for bytes ${starts[i]}..`);
    out[at + i] = rank;
  }
  return parts - 1;
}

/**
 * Encoder state owned by one worker (no module-level state but the rank tables): a cache from
 * piece to tokens in flat typed arrays (an open-addressing table of entry numbers, and per entry
 * its hash, where its characters and tokens lie in two pools), compared in place and never sliced
 * on a hit; the table grows with the entries, so a small vocabulary stays in a small, cache-warm
 * table. And the classes of non-ASCII code points seen.
 */
export interface FastEncoder {
  /** Slots: entry index + 1, or 0 when empty (length a power of two, at most half full). */
  table: Int32Array;
  /** Per entry, {@link ENTRY} ints: hash, first character in `chars`, length, first token in `pool`, tokens. */
  entries: Int32Array;
  /** Characters of the cached pieces. */
  chars: Uint16Array;
  /** Characters used in `chars`. */
  charsUsed: number;
  /** Token storage. */
  pool: Uint16Array;
  /** Tokens used in `pool`. */
  poolUsed: number;
  /** Entries used. */
  count: number;
  /** Entries allowed before the cache is cleared. */
  maxEntries: number;
  /** Code point → class, for non-ASCII. */
  classes: ClassCache;
  /** The rank tables. */
  ranks: Ranks;
  /** Scratch for {@link fastEncode}. */
  scratch: Uint16Array;
}

/** Ints per cache entry. */
const ENTRY = 5;
/** Smallest cache table. */
const MIN_TABLE = 1 << 12;

/** A new encoder caching at most `maxEntries` pieces (default 2^18). */
export function createFastEncoder(maxEntries = 1 << 18): FastEncoder {
  return {
    table: new Int32Array(MIN_TABLE),
    entries: new Int32Array(maxEntries * ENTRY),
    chars: new Uint16Array(maxEntries * 8),
    charsUsed: 0,
    pool: new Uint16Array(maxEntries * 4),
    poolUsed: 0,
    count: 0,
    maxEntries,
    classes: new Map(),
    ranks: ranksCache ??= buildRanks(),
    scratch: new Uint16Array(1024),
  };
}

/** Double the cache table, placing every entry again by its hash. */
function growTable(enc: FastEncoder): void {
  const table = new Int32Array(enc.table.length * 2), mask = table.length - 1, entries = enc.entries;
  for (let e = 0; e < enc.count; e++) {
    let slot = entries[e * ENTRY] & mask;
    while (table[slot] !== 0) slot = (slot + 1) & mask;
    table[slot] = e + 1;
  }
  enc.table = table;
}

/**
 * Write the tokens of the piece `text[start, end)` (whose {@link pieceHash} is `h`) to
 * `out[at ..]`; returns the new end.
 */
function emitPiece(
  enc: FastEncoder,
  text: string,
  start: number,
  end: number,
  h: number,
  out: Uint16Array,
  at: number,
): number {
  const len = end - start;
  if (len === 1) {
    // One ASCII character (punctuation, a lone space or newline): its byte's token.
    const c = text.charCodeAt(start);
    if (c < 128) {
      out[at] = enc.ranks.ascii[c];
      return at + 1;
    }
  }
  h ^= h >>> 15;
  const table = enc.table, entries = enc.entries;
  const mask = table.length - 1;
  let slot = h & mask;
  while (true) {
    const e = table[slot] - 1;
    if (e < 0) break;
    const m = e * ENTRY;
    if (entries[m] === h && entries[m + 2] === len) {
      const chars = enc.chars, ks = entries[m + 1];
      let i = 0;
      while (i < len && chars[ks + i] === text.charCodeAt(start + i)) i++;
      if (i === len) {
        const s = entries[m + 3], n = entries[m + 4], pool = enc.pool;
        for (let j = 0; j < n; j++) out[at + j] = pool[s + j];
        return at + n;
      }
    }
    slot = (slot + 1) & mask;
  }
  const n = encodePiece(enc.ranks, text, start, end, out, at);
  if (n > enc.pool.length || len > enc.chars.length) return at + n; // too long to cache
  if (
    enc.count >= enc.maxEntries || enc.poolUsed + n > enc.pool.length ||
    enc.charsUsed + len > enc.chars.length
  ) {
    enc.table = new Int32Array(MIN_TABLE);
    enc.count = 0;
    enc.poolUsed = 0;
    enc.charsUsed = 0;
  } else if ((enc.count + 1) * 2 > table.length) growTable(enc);
  const t = enc.table, tmask = t.length - 1;
  slot = h & tmask;
  while (t[slot] !== 0) slot = (slot + 1) & tmask;
  const e = enc.count++, m = e * ENTRY;
  t[slot] = e + 1;
  entries[m] = h;
  entries[m + 1] = enc.charsUsed;
  entries[m + 2] = len;
  entries[m + 3] = enc.poolUsed;
  entries[m + 4] = n;
  for (let i = 0; i < len; i++) enc.chars[enc.charsUsed + i] = text.charCodeAt(start + i);
  enc.charsUsed += len;
  enc.pool.set(out.subarray(at, at + n), enc.poolUsed);
  enc.poolUsed += n;
  return at + n;
}

/** FNV-1a of `text[from, to)` (UTF-16 code units): the cache's piece hash, before its final mix. */
function pieceHash(text: string, from: number, to: number): number {
  let h = 0x811c9dc5 | 0;
  for (let i = from; i < to; i++) h = Math.imul(h ^ text.charCodeAt(i), 0x01000193);
  return h;
}

/** Classes of the ASCII characters (as pretokenize.ts's classAt). */
const ASCII_CLASS = new Uint8Array(128).map((_, c) =>
  (c >= 65 && c <= 90) || (c >= 97 && c <= 122)
    ? CLASS_L
    : c >= 48 && c <= 57
    ? CLASS_N
    : (c >= 9 && c <= 13) || c === 32
    ? CLASS_S
    : 3
);

/** Whether a GPT-2 contraction ('s 't 're 've 'm 'll 'd) starts at `i` (text[i] is an apostrophe); its length or 0. */
function contraction(text: string, i: number): number {
  const a = text.charCodeAt(i + 1);
  if (a === 115 || a === 116 || a === 109 || a === 100) return 2; // s t m d
  const b = text.charCodeAt(i + 2);
  if ((a === 114 && b === 101) || (a === 118 && b === 101) || (a === 108 && b === 108)) return 3; // re ve ll
  return 0;
}

/** Append a finished word hash (FNV-1a of the case-folded word, then murmur3's finaliser). */
function pushWord(words: WordList, h: number): void {
  h ^= h >>> 16;
  h = Math.imul(h, 0x85ebca6b);
  h ^= h >>> 13;
  h = Math.imul(h, 0xc2b2ae35);
  h ^= h >>> 16;
  if (words.count === words.hashes.length) {
    const grown = new Int32Array(words.hashes.length * 2);
    grown.set(words.hashes);
    words.hashes = grown;
  }
  words.hashes[words.count++] = h;
}

/**
 * Encode `text` with GPT-2 BPE into `out[at ..]` and return the new end. `out` must have room
 * for `3 * text.length` tokens after `at` (a token is at least one UTF-8 byte). When `words` is
 * given, the hashes of the text's words (its letter and number pieces) are appended to it, exactly
 * as `collectWords` (pretokenize.ts) computes them, for MinHash without a second scan.
 *
 * The pieces are those of pretokenize.ts's `scanPieces` (the GPT-2 regex
 * `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`), found in the
 * same pass that hashes them.
 */
export function encodeInto(
  enc: FastEncoder,
  text: string,
  out: Uint16Array,
  at: number,
  words?: WordList,
): number {
  const n = text.length, classes = enc.classes;
  let i = 0;
  while (i < n) {
    const start = i;
    const c = text.charCodeAt(i);
    if (c === 39) {
      const k = contraction(text, i);
      if (k > 0) {
        at = emitPiece(enc, text, i, i + k, pieceHash(text, i, i + k), out, at);
        i += k;
        continue;
      }
    }
    let cls = c < 128 ? ASCII_CLASS[c] : classAt(classes, text, i);
    let j = i, h = 0x811c9dc5 | 0;
    if (c === 32 && i + 1 < n) {
      const d = text.charCodeAt(i + 1);
      const next = d < 128 ? ASCII_CLASS[d] : classAt(classes, text, i + 1);
      if (next !== CLASS_S) {
        cls = next;
        j = i + 1;
        h = Math.imul(h ^ 32, 0x01000193);
      }
    }
    if (cls !== CLASS_S) {
      // ` ?\p{L}+`, ` ?\p{N}+` or ` ?[^\s\p{L}\p{N}]+`: a run of one class, hashed as it is read.
      const word = words !== undefined && (cls === CLASS_L || cls === CLASS_N);
      let w = 0x811c9dc5 | 0;
      while (true) {
        const u = text.charCodeAt(j);
        if (u < 128) {
          h = Math.imul(h ^ u, 0x01000193);
          if (word) w = Math.imul(w ^ (u >= 65 && u <= 90 ? u + 32 : u), 0x01000193);
          j++;
        } else {
          h = Math.imul(h ^ u, 0x01000193);
          if (word) w = Math.imul(w ^ u, 0x01000193);
          j++;
          if (u >= 0xd800 && u <= 0xdbff && j < n) {
            // A high surrogate takes the next unit with it (as widthAt does).
            const v = text.charCodeAt(j);
            h = Math.imul(h ^ v, 0x01000193);
            if (word) w = Math.imul(w ^ (v >= 65 && v <= 90 ? v + 32 : v), 0x01000193);
            j++;
          }
        }
        if (j >= n) break;
        const v = text.charCodeAt(j);
        if ((v < 128 ? ASCII_CLASS[v] : classAt(classes, text, j)) !== cls) break;
      }
      at = emitPiece(enc, text, start, j, h, out, at);
      if (word) pushWord(words!, w);
      i = j;
      continue;
    }
    // Whitespace: `\s+(?!\S)` leaves the run's last character to the next piece when one follows; else `\s+`.
    let last = j;
    j += c >= 0xd800 && c <= 0xdbff && j + 1 < n ? 2 : 1;
    while (j < n) {
      const v = text.charCodeAt(j);
      if ((v < 128 ? ASCII_CLASS[v] : classAt(classes, text, j)) !== CLASS_S) break;
      last = j;
      j += v >= 0xd800 && v <= 0xdbff && j + 1 < n ? 2 : 1;
    }
    const end = j < n && last > start ? last : j;
    at = emitPiece(enc, text, start, end, pieceHash(text, start, end), out, at);
    i = end;
  }
  return at;
}

/**
 * Encode `text` with GPT-2 BPE, appending token ids to `out` (and returning it). When `words` is
 * given, the hashes of the text's words are appended to it (see {@link encodeInto}).
 */
export function fastEncode(enc: FastEncoder, text: string, out: number[] = [], words?: WordList): number[] {
  if (enc.scratch.length < text.length * 3) enc.scratch = new Uint16Array(text.length * 3);
  const n = encodeInto(enc, text, enc.scratch, 0, words);
  for (let i = 0; i < n; i++) out.push(enc.scratch[i]);
  return out;
}
