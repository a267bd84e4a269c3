/**
 * The arithmetic of evaluation, apart from the GPU: where the sliding windows of a perplexity
 * evaluation go and which of their targets each one scores, the normalisations of its summed
 * loss (per token, per word as Megatron adjusts it, per byte as lm-evaluation-harness reports
 * it), and how a LAMBADA line splits into context and last word (Megatron's strict and default
 * modes). Pure, so the definitions are tested on their own and shared by the Worker and the CLI.
 */

/**
 * One window of a perplexity evaluation: tokens [start, start + seqLen] of the stream (seqLen
 * inputs, each followed by its target), scoring its targets k in [first, end) — the target of
 * input k is stream token start + k + 1.
 */
export interface ScoreWindow {
  start: number;
  first: number;
  end: number;
}

/**
 * The sliding windows over a stream of `n` tokens (Megatron's overlapping evaluation, Hugging
 * Face's "perplexity of fixed-length models"): window w starts at w·stride; the first scores all
 * its targets, each later one only those the previous windows did not, so every token but the
 * first is scored exactly once, with the longest context the stride allows. The last window may
 * be short (`end` < seqLen): its inputs past the stream are padding, never scored. With stride ==
 * seqLen these are the non-overlapping windows of data/eval_windows.ts.
 */
export function slidingWindows(n: number, seqLen: number, stride: number): ScoreWindow[] {
  if (!(Number.isInteger(stride) && stride >= 1 && stride <= seqLen)) {
    throw new RangeError(`stride must be an integer in [1, seq_len ${seqLen}], got ${stride}`);
  }
  if (n < 2) throw new RangeError(`A stream of ${n} token(s) has nothing to score: at least 2 are needed`);
  const out: ScoreWindow[] = [];
  let scored = 0; // stream index of the last target scored
  for (let start = 0; scored < n - 1; start += stride) {
    const end = Math.min(seqLen, n - 1 - start);
    out.push({ start, first: scored - start, end });
    scored = start + end;
  }
  return out;
}

/** Summed loss of a perplexity evaluation and what it is normalised by. */
export interface PerplexityCounts {
  /** Σ −ln p(target) over the scored tokens (nats). */
  nll: number;
  /** Tokens scored. */
  tokens: number;
  /** Tokens in the stream (tokens + 1 when every token after the first is scored). */
  streamTokens: number;
  /** Words of the text as Megatron counts them (see `countWords`). */
  words: number;
  /** UTF-8 bytes of the text. */
  bytes: number;
}

/** The normalised figures of a perplexity evaluation. */
export interface PerplexityFigures {
  loss: number;
  perplexity: number;
  /** exp(loss · token_ratio), token_ratio = (streamTokens − 1) / (words − 1): Megatron's adjusted perplexity. */
  word_perplexity: number;
  token_ratio: number;
  /** exp(nll / bytes) and nll / bytes / ln 2: lm-evaluation-harness's byte_perplexity and bits_per_byte. */
  byte_perplexity: number;
  bits_per_byte: number;
}

/** Normalises a summed loss per token, per word (Megatron) and per byte (lm-evaluation-harness). */
export function perplexityFigures(c: PerplexityCounts): PerplexityFigures {
  const loss = c.nll / c.tokens;
  const token_ratio = (c.streamTokens - 1) / Math.max(1, c.words - 1);
  return {
    loss,
    perplexity: Math.exp(loss),
    word_perplexity: Math.exp(loss * token_ratio),
    token_ratio,
    byte_perplexity: Math.exp(c.nll / c.bytes),
    bits_per_byte: c.nll / c.bytes / Math.LN2,
  };
}

/** Words as Megatron's zero-shot evaluation counts them: `len(text.strip().split(" "))`. */
export function countWords(text: string): number {
  return text.trim().split(" ").length;
}

/** UTF-8 bytes of a text. */
export function countBytes(text: string): number {
  return new TextEncoder().encode(text).length;
}

/** A cloze example: the context's tokens and the last word's, which are to be predicted. */
export interface ClozeExample {
  context: number[];
  target: number[];
}

/**
 * Splits a LAMBADA line. Strict (Megatron's --strict-lambada): the last whitespace-separated word
 * is the target, tokenized on its own with its leading space, after the context tokenized
 * without trailing space. Default: the whole line is tokenized and its last token is the target.
 * Throws RangeError for a line of fewer than two words.
 */
export function clozeExample(text: string, strict: boolean, encode: (s: string) => number[]): ClozeExample {
  const words = text.trim().split(/\s+/).filter((w) => w.length > 0);
  if (words.length < 2) {
    throw new RangeError(`A cloze line needs a context and a last word; "${text.slice(0, 40)}" has one word`);
  }
  if (!strict) {
    const tokens = encode(text.trim());
    return { context: tokens.slice(0, -1), target: tokens.slice(-1) };
  }
  const last = words.at(-1)!, at = text.lastIndexOf(last);
  return { context: encode(text.slice(0, at).trim()), target: encode(" " + last) };
}

/** Accuracy and last-word perplexity of a cloze evaluation (lm-evaluation-harness's lambada figures). */
export function clozeFigures(nlls: number[], correct: boolean[]): {
  accuracy: number;
  correct: number;
  loss: number;
  perplexity: number;
} {
  const right = correct.filter((c) => c).length;
  const loss = nlls.reduce((a, b) => a + b, 0) / nlls.length;
  return { accuracy: right / correct.length, correct: right, loss, perplexity: Math.exp(loss) };
}
