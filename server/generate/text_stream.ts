/**
 * Text in and out of generation. Prompts become GPT-2 tokens (a literal `<|endoftext|>` anywhere
 * becomes token 50256; an empty prompt starts from it), cut from the left to fit the context.
 * Generated tokens become text through a per-stream UTF-8 decoder over each token's bytes, so a
 * character split across tokens comes out whole. gpt-tokenizer's own `decode` is avoided: it
 * shares one streaming TextDecoder between all calls, so a partial character left by one stream
 * would leak into the next call. Stop sequences are found in the text; text that could still
 * become a stop sequence is held back until the next token decides.
 */

import { encode } from "gpt-tokenizer/encoding/r50k_base";
import bpe from "gpt-tokenizer/bpeRanks/r50k_base";
import { EOT_TOKEN } from "../../model/config.ts";

const EOT_TEXT = "<|endoftext|>";
const utf8 = new TextEncoder();

/** A tokenized prompt: the tokens kept and how many were cut from the left. */
export interface PromptTokens {
  tokens: number[];
  /** Tokens of the full prompt (before cutting). */
  total: number;
  /** Tokens dropped from the left to fit `maxTokens`. */
  truncated: number;
}

/** Tokenizes `prompt` and keeps its last `maxTokens` tokens; an empty prompt is `<|endoftext|>`. */
export function encodePrompt(prompt: string, maxTokens: number): PromptTokens {
  const tokens: number[] = [];
  // gpt-tokenizer matches allowed special tokens only at the start: split on them ourselves.
  for (const [i, part] of prompt.split(EOT_TEXT).entries()) {
    if (i > 0) tokens.push(EOT_TOKEN);
    if (part) tokens.push(...encode(part, { disallowedSpecial: new Set() }));
  }
  if (tokens.length === 0) tokens.push(EOT_TOKEN);
  const keep = Math.max(1, maxTokens);
  return {
    tokens: tokens.slice(Math.max(0, tokens.length - keep)),
    total: tokens.length,
    truncated: Math.max(0, tokens.length - keep),
  };
}

/** Keeps the last `maxTokens` of a prompt given as token ids; an empty one is `<|endoftext|>`. */
export function fitPromptTokens(ids: readonly number[], maxTokens: number): PromptTokens {
  const tokens = ids.length === 0 ? [EOT_TOKEN] : [...ids];
  const keep = Math.max(1, maxTokens);
  return {
    tokens: tokens.slice(Math.max(0, tokens.length - keep)),
    total: tokens.length,
    truncated: Math.max(0, tokens.length - keep),
  };
}

/** The text of token ids (bytes decoded together; an incomplete character becomes U+FFFD). */
export function decodeTokens(ids: readonly number[]): string {
  const parts = ids.map(tokenBytes);
  const all = new Uint8Array(parts.reduce((a, p) => a + p.length, 0));
  let at = 0;
  for (const p of parts) {
    all.set(p, at);
    at += p.length;
  }
  return new TextDecoder().decode(all);
}

/** The UTF-8 bytes of GPT-2 token `id`. */
export function tokenBytes(id: number): Uint8Array {
  if (id === EOT_TOKEN) return utf8.encode(EOT_TEXT);
  const entry = (bpe as (string | number[])[])[id];
  if (entry === undefined) throw new RangeError(`Token ${id} is not in the GPT-2 vocabulary`);
  return typeof entry === "string" ? utf8.encode(entry) : new Uint8Array(entry);
}

/** What one token added: its complete new text (maybe empty, held back) and whether a stop sequence ended it. */
export interface TextStep {
  text: string;
  stopped: boolean;
}

/** Incremental detokenizer of one generation, with stop sequences. */
export class TextStream {
  #decoder = new TextDecoder("utf-8");
  #stops: string[];
  #text = "";
  #emitted = 0;
  #stopped = false;

  constructor(stops: string[] = []) {
    this.#stops = stops.filter((s) => s.length > 0);
  }

  /** Text emitted so far. */
  get text(): string {
    return this.#text.slice(0, this.#emitted);
  }

  /** Whether a stop sequence was found (nothing more is emitted). */
  get stopped(): boolean {
    return this.#stopped;
  }

  /** Adds one token. */
  push(id: number): TextStep {
    if (this.#stopped) return { text: "", stopped: true };
    this.#text += this.#decoder.decode(tokenBytes(id), { stream: true });
    return this.#advance(false);
  }

  /** Ends the stream: a trailing partial character becomes U+FFFD, held-back text is released. */
  finish(): TextStep {
    if (this.#stopped) return { text: "", stopped: true };
    this.#text += this.#decoder.decode();
    return this.#advance(true);
  }

  #advance(final: boolean): TextStep {
    let stopAt = -1;
    for (const s of this.#stops) {
      const i = this.#text.indexOf(s, Math.max(0, this.#emitted - s.length + 1));
      if (i >= 0 && (stopAt < 0 || i < stopAt)) stopAt = i;
    }
    let end = this.#text.length;
    if (stopAt >= 0) {
      end = stopAt;
      this.#stopped = true;
    } else if (!final) {
      // Hold back a tail that is the start of some stop sequence.
      let hold = 0;
      for (const s of this.#stops) {
        for (let k = Math.min(s.length - 1, this.#text.length); k > hold; k--) {
          if (this.#text.endsWith(s.slice(0, k))) {
            hold = k;
            break;
          }
        }
      }
      end -= hold;
    }
    end = Math.max(end, this.#emitted);
    const text = this.#text.slice(this.#emitted, end);
    this.#emitted = end;
    return { text, stopped: this.#stopped };
  }
}
