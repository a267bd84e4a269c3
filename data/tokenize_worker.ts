/**
 * Worker body of the tokenize stage: for a batch of raw documents it cleans the text, encodes it
 * with GPT-2 BPE (r50k_base), drops documents under the token minimum, appends `<|endoftext|>`
 * after each kept one and computes its MinHash signature.
 *
 * Doing clean + tokenize + signature in one worker pass keeps every core busy on the costly part
 * while the main thread only reads input, runs the LSH index and writes tokens.
 */
/// <reference lib="deno.worker" />
import { createFastEncoder, fastEncode } from "./fast_encode.ts";
import { cleanText } from "./text.ts";
import { type MinHashParams, minhashSignature } from "./minhash.ts";
import type { WorkerBatch, WorkerConfig, WorkerResult } from "./tokenize_pool.ts";

/** `<|endoftext|>` in r50k_base. */
const EOT = 50256;
let config: WorkerConfig | undefined;
/** This worker's encoder caches (a literal "<|endoftext|>" in a document is encoded as text). */
const encoder = createFastEncoder();

/** Process one batch. */
function run(batch: WorkerBatch, cfg: WorkerConfig): WorkerResult {
  const n = batch.texts.length;
  const lengths = new Uint32Array(n);
  const encoded: ArrayLike<number>[] = [];
  const kept: string[] = [];
  let total = 0, short = 0, empty = 0, chars = 0;
  const t0 = performance.now();
  let tClean = 0;
  for (let i = 0; i < n; i++) {
    const c0 = performance.now();
    const text = cleanText(batch.texts[i]);
    tClean += performance.now() - c0;
    if (text.length === 0) {
      empty++;
      continue;
    }
    const ids = fastEncode(encoder, text);
    if (ids.length < cfg.minTokens) {
      short++;
      continue;
    }
    lengths[i] = ids.length + 1;
    total += ids.length + 1;
    chars += text.length;
    encoded.push(ids);
    kept.push(text);
  }
  const tokens = new Uint16Array(total);
  let off = 0;
  for (const ids of encoded) {
    tokens.set(ids, off);
    off += ids.length;
    tokens[off++] = EOT;
  }
  const t1 = performance.now();
  const mh = cfg.minhash;
  const sigs = new Uint32Array(mh ? kept.length * mh.numPerm : 0);
  if (mh) {
    for (let i = 0; i < kept.length; i++) {
      minhashSignature(kept[i], mh, sigs, i * mh.numPerm);
    }
  }
  const t2 = performance.now();
  return {
    seq: batch.seq,
    lengths,
    tokens,
    sigs,
    short,
    empty,
    chars,
    ms: [tClean, t1 - t0 - tClean, t2 - t1],
  };
}

self.onmessage = (e: MessageEvent<{ config?: WorkerConfig; batch?: WorkerBatch }>) => {
  if (e.data.config) {
    config = e.data.config;
    return;
  }
  const batch = e.data.batch!;
  try {
    const out = run(batch, config!);
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

export type { MinHashParams };
