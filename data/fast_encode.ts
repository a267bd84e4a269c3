/**
 * A faster GPT-2 (r50k_base) encoder for bulk tokenization: a hand-written scanner that splits
 * text exactly like GPT-2's pre-tokenizer regex, and a bounded cache from piece to tokens, with
 * gpt-tokenizer's `encode` doing the byte-pair merges for pieces not seen before.
 *
 * gpt-tokenizer spends most of its time in `matchAll` over a Unicode-property regex and in
 * per-piece map lookups; scanning char codes directly roughly halves the cost on English text.
 * Output is identical to `encode(text, {disallowedSpecial: new Set()})` (tested): `<|endoftext|>`
 * inside a document is ordinary text, and the separator is appended by the caller.
 */
import { encode } from "gpt-tokenizer/encoding/r50k_base";
import { addWord, type ClassCache, scanPieces, type WordList } from "./pretokenize.ts";

const ENCODE_OPTS = { disallowedSpecial: new Set<string>() };

/**
 * Encoder state owned by one worker (no module-level state): an open-addressing hash table from
 * piece (compared in place, never sliced on a hit) to its tokens, and the classes of non-ASCII
 * code points seen.
 */
export interface FastEncoder {
  /** Slots: entry index + 1, or 0 when empty (length a power of two). */
  table: Int32Array;
  /** Per entry: the piece's hash. */
  hashes: Int32Array;
  /** Per entry: the piece. */
  keys: string[];
  /** Per entry: first token in `pool`. */
  starts: Int32Array;
  /** Per entry: token count. */
  lengths: Int32Array;
  /** Token storage. */
  pool: Uint16Array;
  /** Tokens used in `pool`. */
  poolUsed: number;
  /** Entries used. */
  count: number;
  /** Entries allowed before the cache is cleared (at most half the table). */
  maxEntries: number;
  /** Code point → class, for non-ASCII. */
  classes: ClassCache;
}

/** A new encoder caching at most `maxEntries` pieces (default 2^18). */
export function createFastEncoder(maxEntries = 1 << 18): FastEncoder {
  let size = 16;
  while (size < maxEntries * 2) size *= 2;
  return {
    table: new Int32Array(size),
    hashes: new Int32Array(maxEntries),
    keys: [],
    starts: new Int32Array(maxEntries),
    lengths: new Int32Array(maxEntries),
    pool: new Uint16Array(maxEntries * 4),
    poolUsed: 0,
    count: 0,
    maxEntries,
    classes: new Map(),
  };
}

/** A copy of `text[start, end)` that shares no memory with `text`. */
function flatCopy(text: string, start: number, end: number): string {
  let out = "";
  for (let i = start; i < end; i += 4096) {
    out += String.fromCharCode(
      ...Array.from({ length: Math.min(4096, end - i) }, (_, k) => text.charCodeAt(i + k)),
    );
  }
  return out;
}

/** Append the tokens of the piece `text[start, end)`. */
function pushPiece(enc: FastEncoder, text: string, start: number, end: number, out: number[]): void {
  let h = 0x811c9dc5 | 0;
  for (let i = start; i < end; i++) h = Math.imul(h ^ text.charCodeAt(i), 0x01000193);
  h ^= h >>> 15;
  const len = end - start;
  const mask = enc.table.length - 1;
  let slot = h & mask;
  while (true) {
    const e = enc.table[slot] - 1;
    if (e < 0) break;
    if (enc.hashes[e] === h) {
      const key = enc.keys[e];
      if (key.length === len) {
        let same = true;
        for (let i = 0; i < len; i++) {
          if (key.charCodeAt(i) !== text.charCodeAt(start + i)) {
            same = false;
            break;
          }
        }
        if (same) {
          const s = enc.starts[e], n = enc.lengths[e], pool = enc.pool;
          for (let j = 0; j < n; j++) out.push(pool[s + j]);
          return;
        }
      }
    }
    slot = (slot + 1) & mask;
  }
  // A flat copy: a slice of 13+ characters would be a view that keeps the whole document alive
  // in this cache and in gpt-tokenizer's.
  const piece = len >= 13 ? flatCopy(text, start, end) : text.slice(start, end);
  const ids = encode(piece, ENCODE_OPTS);
  for (let j = 0; j < ids.length; j++) out.push(ids[j]);
  if (enc.count >= enc.maxEntries || enc.poolUsed + ids.length > enc.pool.length) {
    if (ids.length > enc.pool.length) return; // A piece too long to cache.
    enc.table.fill(0);
    enc.keys.length = 0;
    enc.count = 0;
    enc.poolUsed = 0;
    slot = h & mask;
  }
  const e = enc.count++;
  enc.table[slot] = e + 1;
  enc.hashes[e] = h;
  enc.keys[e] = piece;
  enc.starts[e] = enc.poolUsed;
  enc.lengths[e] = ids.length;
  enc.pool.set(ids, enc.poolUsed);
  enc.poolUsed += ids.length;
}

/**
 * Encode `text` with GPT-2 BPE, appending token ids to `out` (and returning it). When `words` is
 * given, the hashes of the text's words (its letter and number pieces) are appended to it, as
 * `collectWords` (pretokenize.ts) computes them, for MinHash without a second scan.
 */
export function fastEncode(enc: FastEncoder, text: string, out: number[] = [], words?: WordList): number[] {
  scanPieces(enc.classes, text, (start, end, wordStart) => {
    pushPiece(enc, text, start, end, out);
    if (words && wordStart >= 0) addWord(words, text, wordStart, end);
  });
  return out;
}
