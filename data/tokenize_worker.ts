/**
 * Worker body of the tokenize stage: for a batch of raw documents it cleans the text, encodes it
 * with GPT-2 BPE (r50k_base), drops documents under the token minimum, appends `<|endoftext|>`
 * after each kept one and computes its MinHash signature.
 *
 * Doing clean + tokenize + signature in one worker pass keeps every core busy on the costly part
 * while the main thread only reads input, runs the LSH index and writes tokens.
 */
/// <reference lib="deno.worker" />
import { encode } from "gpt-tokenizer/encoding/r50k_base";
import { cleanText } from "./text.ts";
import { hashFamily, type MinHashParams, minhashSignature } from "./minhash.ts";
import type { WorkerBatch, WorkerConfig, WorkerResult } from "./tokenize_pool.ts";

/** `<|endoftext|>` in r50k_base. */
const EOT = 50256;
/** Treat a literal "<|endoftext|>" inside a document as ordinary text, never as the special token. */
const ENCODE_OPTS = { disallowedSpecial: new Set<string>() };

let config: WorkerConfig | undefined;
let family: ReturnType<typeof hashFamily> | undefined;

/** Process one batch. */
function run(batch: WorkerBatch, cfg: WorkerConfig): WorkerResult {
  const n = batch.texts.length;
  const lengths = new Uint32Array(n);
  const encoded: ArrayLike<number>[] = [];
  const kept: string[] = [];
  let total = 0, short = 0, empty = 0, chars = 0;
  for (let i = 0; i < n; i++) {
    const text = cleanText(batch.texts[i]);
    if (text.length === 0) {
      empty++;
      continue;
    }
    const ids = encode(text, ENCODE_OPTS);
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
  const mh = cfg.minhash;
  const sigs = new Uint32Array(mh ? kept.length * mh.numPerm : 0);
  if (mh) {
    family ??= hashFamily(mh);
    for (let i = 0; i < kept.length; i++) {
      minhashSignature(kept[i], family, mh.shingleSize, sigs, i * mh.numPerm);
    }
  }
  return { seq: batch.seq, lengths, tokens, sigs, short, empty, chars };
}

self.onmessage = (e: MessageEvent<{ config?: WorkerConfig; batch?: WorkerBatch }>) => {
  if (e.data.config) {
    config = e.data.config;
    family = undefined;
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
