/** Tests of stage 6: the fast encoder matches gpt-tokenizer exactly, and tokens round-trip to the text. */
import assert from "node:assert/strict";
import { decode, encode } from "gpt-tokenizer/encoding/r50k_base";
import { createFastEncoder, encodeInto, fastEncode } from "../../data/fast_encode.ts";
import { collectWords, createWordList } from "../../data/pretokenize.ts";
import { getDataset, loadSplit, prepareDataset } from "../../data/mod.ts";
import { makeDocs, rng, withRoot } from "../data_fixtures.ts";

const TRICKY = [
  "  leading spaces",
  "a  \n\n  b\t\tc   ",
  "don't 's 'S 'll 'LL ''s '",
  "x\u00a0y \u3000z \u2028w",
  "😀😀 abc 123 4.5e10 $%^&*",
  "日本語のテキスト、です。 Ünïcödé—dash ça",
  "𝔘𝔫𝔦 𝟙𝟚 e\u0301\u0301",
  "<|endoftext|> literal special token",
  "\n",
  " ",
  "",
];

Deno.test("fastEncode matches gpt-tokenizer r50k_base on tricky text", () => {
  const enc = createFastEncoder(4); // tiny cache: exercises eviction too
  for (const text of [...TRICKY, TRICKY.join(""), ...makeDocs(3, 200, 9)]) {
    assert.deepEqual(
      fastEncode(enc, text),
      encode(text, { disallowedSpecial: new Set() }),
      JSON.stringify(text),
    );
  }
});

/** Random text over letters, digits, punctuation, spaces and non-ASCII (no lone surrogates). */
function randomTexts(count: number, seed: number): string[] {
  const rand = rng(seed);
  const alphabet = [..."aeiou tnrsl TNRS 0123 .,;'-!? \n\t é ß ж 日本 한 😀 👍🏽 𝟙 \u00a0 \u3000 ٣ Ⅻ ﬁ"];
  return Array.from({ length: count }, () => {
    let t = "";
    const n = 1 + Math.floor(rand() * 80);
    for (let i = 0; i < n; i++) t += alphabet[Math.floor(rand() * alphabet.length)];
    return t;
  });
}

Deno.test("fastEncode's own byte-pair merges match gpt-tokenizer on pieces never seen before", () => {
  // A cache of 8 pieces: nearly every piece is merged afresh.
  const enc = createFastEncoder(8);
  for (const text of randomTexts(3000, 27)) {
    assert.deepEqual(
      fastEncode(enc, text),
      encode(text, { disallowedSpecial: new Set() }),
      JSON.stringify(text),
    );
  }
});

Deno.test("encodeInto collects the words collectWords does, and writes the tokens fastEncode returns", () => {
  const enc = createFastEncoder();
  const texts = [...TRICKY, TRICKY.join(""), ...randomTexts(500, 5), "\ud835 3 a\ud835 b \udc00x \ud83dA"];
  for (const text of texts) {
    const words = createWordList(4), expected = collectWords(new Map(), text, createWordList());
    const out = new Uint16Array(text.length * 3 + 2);
    const end = encodeInto(enc, text, out, 1, words);
    assert.deepEqual(
      Array.from(out.subarray(1, end)),
      fastEncode(createFastEncoder(), text),
      JSON.stringify(text),
    );
    assert.deepEqual(
      Array.from(words.hashes.subarray(0, words.count)),
      Array.from(expected.hashes.subarray(0, expected.count)),
    );
  }
});

Deno.test("prepareDataset tokens decode back to the cleaned documents, each followed by <|endoftext|>", async () => {
  await withRoot(async (root) => {
    const texts = makeDocs(12, 150, 21);
    texts[3] = "Caf\u00e9 \u201cquotes\u201d and emoji 😀 " + texts[3];
    const info = await prepareDataset(root, { texts }, {
      min_tokens: 16,
      seq_len: 8,
      split: "8,1,1",
      workers: 2,
    });
    assert.equal(info.documents, 12);
    const parts = await Promise.all(
      (["train", "valid", "test"] as const).map((s) => loadSplit(root, info.id, s)),
    );
    const all = new Uint16Array(info.tokens);
    let off = 0;
    for (const p of parts) {
      all.set(p, off);
      off += p.length;
    }
    assert.equal(off, info.tokens);
    const eots = all.reduce((n, t) => n + (t === 50256 ? 1 : 0), 0);
    assert.equal(eots, 12);
    assert.equal(all[all.length - 1], 50256);
    assert.equal(decode(Array.from(all)), texts.join("<|endoftext|>") + "<|endoftext|>");
    assert.equal((await getDataset(root, info.id))?.tokenizer?.eot, 50256);
  });
});
