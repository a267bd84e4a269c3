/**
 * Worker body of the tokenize stage: for a batch of raw documents it cleans the text, encodes it
 * with GPT-2 BPE (r50k_base), drops documents under the token minimum, appends `<|endoftext|>`
 * after each kept one and computes its MinHash signature from the word hashes collected while
 * encoding.
 *
 * Doing clean + tokenize + signature in one worker pass keeps every core busy on the costly part
 * while the main thread only reads input, runs the LSH index and writes tokens. The worker's
 * state (configuration, encoder cache) lives for the worker's lifetime and is created by the
 * first "config" message.
 */
/// <reference lib="deno.worker" />
import { createFastEncoder, encodeInto, type FastEncoder } from "./fast_encode.ts";
import { minhashFromWords } from "./minhash.ts";
import { createWordList, type WordList } from "./pretokenize.ts";
import { cleanText } from "./text.ts";
import type { WorkerBatch, WorkerConfig, WorkerResult } from "./tokenize_pool.ts";

/** `<|endoftext|>` in r50k_base. */
const EOT = 50256;

/** What one worker keeps between batches. */
interface WorkerState {
  config: WorkerConfig;
  encoder: FastEncoder;
  words: WordList;
}

/** Process one batch. */
function run(state: WorkerState, batch: WorkerBatch): WorkerResult {
  const { config: cfg, encoder, words } = state;
  const mh = cfg.minhash;
  const n = batch.texts.length;
  const lengths = new Uint32Array(n);
  const sigs = new Uint32Array(mh ? n * mh.numPerm : 0);
  let tokens = new Uint16Array(1 << 16);
  let total = 0, short = 0, empty = 0, chars = 0, kept = 0;
  let tClean = 0, tEncode = 0, tSign = 0;
  for (let i = 0; i < n; i++) {
    const t0 = performance.now();
    const text = cleanText(batch.texts[i]);
    const t1 = performance.now();
    tClean += t1 - t0;
    if (text.length === 0) {
      empty++;
      continue;
    }
    // Tokens go straight after the kept ones (at most one per UTF-8 byte, 3 per UTF-16 unit).
    if (total + text.length * 3 + 1 > tokens.length) {
      let size = tokens.length * 2;
      while (size < total + text.length * 3 + 1) size *= 2;
      const grown = new Uint16Array(size);
      grown.set(tokens.subarray(0, total));
      tokens = grown;
    }
    words.count = 0;
    const end = encodeInto(encoder, text, tokens, total, mh ? words : undefined);
    const count = end - total;
    const t2 = performance.now();
    tEncode += t2 - t1;
    if (count < cfg.minTokens) {
      short++;
      continue;
    }
    tokens[end] = EOT;
    total = end + 1;
    lengths[i] = count + 1;
    chars += text.length;
    if (mh) minhashFromWords(words.hashes, words.count, mh, sigs, kept * mh.numPerm);
    kept++;
    tSign += performance.now() - t2;
  }
  return {
    seq: batch.seq,
    lengths,
    tokens: tokens.slice(0, total),
    sigs: mh ? sigs.slice(0, kept * mh.numPerm) : sigs,
    short,
    empty,
    chars,
    ms: [tClean, tEncode, tSign],
  };
}

let state: WorkerState | undefined;

self.onmessage = (e: MessageEvent<{ config?: WorkerConfig; batch?: WorkerBatch }>) => {
  if (e.data.config) {
    state = { config: e.data.config, encoder: createFastEncoder(), words: createWordList() };
    return;
  }
  const batch = e.data.batch!;
  try {
    if (!state) throw new Error("No configuration received");
    const out = run(state, batch);
    self.postMessage(out, [
      out.lengths.buffer as ArrayBuffer,
      out.tokens.buffer as ArrayBuffer,
      out.sigs.buffer as ArrayBuffer,
    ]);
  } catch (err) {
    self.postMessage({
      seq: batch.seq,
      error: `Cannot tokenize batch ${batch.seq}: ${(err as Error).message}`,
    });
  }
};
