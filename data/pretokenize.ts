/**
 * Character classes of GPT-2's pre-tokenizer (letter, number, whitespace, other) and the word
 * hashes derived from them, shared by the fast encoder and MinHash.
 *
 * A "word" for near-duplicate detection is a letter or number piece of the GPT-2 pre-tokenizer
 * (a maximal run of letters or of digits, without its leading space), with ASCII case folded. Sharing the definition lets the tokenize workers collect word hashes during
 * tokenization instead of scanning every document a second time.
 */

/** Letter class (`\p{L}`). */
export const CLASS_L = 0;
/** Number class (`\p{N}`). */
export const CLASS_N = 1;
/** Whitespace class (`\s`). */
export const CLASS_S = 2;
/** Any other character. */
export const CLASS_O = 3;

/** Classes of the ASCII characters. */
const ASCII_CLASS = new Uint8Array(128).map((_, c) =>
  (c >= 65 && c <= 90) || (c >= 97 && c <= 122)
    ? CLASS_L
    : c >= 48 && c <= 57
    ? CLASS_N
    : (c >= 9 && c <= 13) || c === 32
    ? CLASS_S
    : CLASS_O
);
const LETTER_RE = /^\p{L}$/u, NUMBER_RE = /^\p{N}$/u, SPACE_RE = /^\s$/u;

/** Classes of non-ASCII code points seen so far (owned by its caller). */
export type ClassCache = Map<number, number>;

/** The class of the code point at `i`. */
export function classAt(cache: ClassCache, text: string, i: number): number {
  const c = text.charCodeAt(i);
  if (c < 128) return ASCII_CLASS[c];
  const cp = text.codePointAt(i)!;
  let k = cache.get(cp);
  if (k === undefined) {
    const ch = String.fromCodePoint(cp);
    k = LETTER_RE.test(ch) ? CLASS_L : NUMBER_RE.test(ch) ? CLASS_N : SPACE_RE.test(ch) ? CLASS_S : CLASS_O;
    if (cache.size < 65536) cache.set(cp, k);
  }
  return k;
}

/** UTF-16 length of the code point at `i`. */
export function widthAt(text: string, i: number): number {
  const c = text.charCodeAt(i);
  return c >= 0xd800 && c <= 0xdbff && i + 1 < text.length ? 2 : 1;
}

/** A growable list of 32-bit word hashes. */
export interface WordList {
  /** Hashes; only the first `count` are used. */
  hashes: Int32Array;
  /** Words in the list. */
  count: number;
}

/** An empty word list. */
export function createWordList(capacity = 4096): WordList {
  return { hashes: new Int32Array(capacity), count: 0 };
}

/** Append the hash of the word `text[from, to)` (ASCII case-folded, FNV-1a then murmur3's finaliser). */
export function addWord(words: WordList, text: string, from: number, to: number): void {
  let h = 0x811c9dc5 | 0;
  for (let i = from; i < to; i++) {
    let c = text.charCodeAt(i);
    if (c >= 65 && c <= 90) c += 32;
    h = Math.imul(h ^ c, 0x01000193);
  }
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

/** Whether a GPT-2 contraction ('s 't 're 've 'm 'll 'd) starts at `i` (text[i] is an apostrophe); its length or 0. */
function contraction(text: string, i: number): number {
  const a = text.charCodeAt(i + 1);
  if (a === 115 || a === 116 || a === 109 || a === 100) return 2; // s t m d
  const b = text.charCodeAt(i + 2);
  if ((a === 114 && b === 101) || (a === 118 && b === 101) || (a === 108 && b === 108)) return 3; // re ve ll
  return 0;
}

/**
 * Split `text` into pieces exactly like GPT-2's pre-tokenizer regex
 * `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`, calling
 * `piece(start, end, wordStart)` for each: `wordStart` is where the word begins (after an optional
 * leading space) for letter and number pieces, and -1 for the others.
 */
export function scanPieces(
  cache: ClassCache,
  text: string,
  piece: (start: number, end: number, wordStart: number) => void,
): void {
  const n = text.length;
  let i = 0;
  while (i < n) {
    const start = i;
    const c = text.charCodeAt(i);
    if (c === 39) {
      const k = contraction(text, i);
      if (k > 0) {
        piece(i, i + k, -1);
        i += k;
        continue;
      }
    }
    let cls = classAt(cache, text, i);
    let j = i;
    if (c === 32 && i + 1 < n) {
      const next = classAt(cache, text, i + 1);
      if (next !== CLASS_S) {
        cls = next;
        j = i + 1;
      }
    }
    if (cls !== CLASS_S) {
      // ` ?\p{L}+`, ` ?\p{N}+` or ` ?[^\s\p{L}\p{N}]+`: a run of one class.
      const wordStart = cls === CLASS_L || cls === CLASS_N ? j : -1;
      j += widthAt(text, j);
      while (j < n && classAt(cache, text, j) === cls) j += widthAt(text, j);
      piece(start, j, wordStart);
      i = j;
      continue;
    }
    // Whitespace: `\s+(?!\S)` leaves the run's last character to the next piece when one follows; else `\s+`.
    let last = j;
    j += widthAt(text, j);
    while (j < n && classAt(cache, text, j) === CLASS_S) {
      last = j;
      j += widthAt(text, j);
    }
    const end = j < n && last > start ? last : j;
    piece(start, end, -1);
    i = end;
  }
}

/** Collect the word hashes of `text` (its letter and number pieces, see {@link scanPieces}) into `words`. */
export function collectWords(cache: ClassCache, text: string, words: WordList): WordList {
  scanPieces(cache, text, (_start, end, wordStart) => {
    if (wordStart >= 0) addWord(words, text, wordStart, end);
  });
  return words;
}
