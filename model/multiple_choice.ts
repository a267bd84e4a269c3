/**
 * The arithmetic of multiple-choice evaluation (HellaSwag, PIQA, ARC after the usual
 * preprocessing), apart from the GPU: how an example's context and endings become token rows cut
 * to the window, and which example each score picks. Each ending is scored by the sum of its
 * tokens' log-probabilities given the context; `accuracy` takes the argmax of that sum,
 * `accuracy_norm` the argmax of the sum divided by the ending's length in UTF-8 bytes
 * (lm-evaluation-harness's acc_norm), and `scoring: "mean_token"` makes `accuracy` the argmax of
 * the mean per ending token (llm.c's completion-style HellaSwag). Pure, shared by the Worker and the CLI.
 */

import { countBytes } from "./perplexity.ts";

/** A multiple-choice example as given: the context, its candidate endings, the index of the right one. */
export interface ChoiceExample {
  context: string;
  endings: string[];
  label: number;
}

/** How `accuracy` ranks the endings: their summed log-probability, or its mean per ending token (llm.c). */
export type ChoiceScoring = "sum" | "mean_token";

/** An example tokenized: the context's tokens, each ending's tokens and its length in bytes. */
export interface ChoiceTokens {
  context: number[];
  endings: number[][];
  /** UTF-8 bytes of each ending as given (the separating space added by `choiceTokens` not counted). */
  bytes: number[];
  label: number;
}

/**
 * Tokenizes an example as llm.c's HellaSwag script and lm-evaluation-harness do: the context and
 * each ending apart, the ending preceded by one space (lm-evaluation-harness's target delimiter)
 * unless the context ends or the ending starts with whitespace.
 */
export function choiceTokens(ex: ChoiceExample, encode: (s: string) => number[]): ChoiceTokens {
  const joined = /\s$/.test(ex.context);
  return {
    context: encode(ex.context),
    endings: ex.endings.map((e) => encode(joined || /^\s/.test(e) ? e : " " + e)),
    bytes: ex.endings.map((e) => countBytes(e)),
    label: ex.label,
  };
}

/**
 * The problem with example `i` (message and field), or null: no endings, an empty context or
 * ending, a label that is not an index of the endings. The routes' 400s and the CLI name the same
 * field; `where` names the example in the message (default "example i").
 */
export function choiceProblem(
  ex: ChoiceExample,
  i: number,
  where = `example ${i}`,
): { field: string; message: string } | null {
  if (ex.context.trim() === "") {
    return { field: "context", message: `Cannot evaluate ${where}: its context is empty` };
  }
  if (ex.endings.length === 0) {
    return { field: "endings", message: `Cannot evaluate ${where}: it has no endings` };
  }
  const empty = ex.endings.findIndex((e) => e.trim() === "");
  if (empty >= 0) {
    return { field: `endings.${empty}`, message: `Cannot evaluate ${where}: ending ${empty} is empty` };
  }
  if (!Number.isInteger(ex.label) || ex.label < 0 || ex.label >= ex.endings.length) {
    return {
      field: "label",
      message:
        `Cannot evaluate ${where}: label ${ex.label} is not an index of its ${ex.endings.length} endings`,
    };
  }
  return null;
}

/** One ending placed in a row of `seqLen + 1` tokens: the row, and the input positions whose targets are its tokens. */
export interface ChoiceRow {
  tokens: number[];
  /** Input position p predicts tokens[p + 1]; the ending's tokens are the targets of [first, first + count). */
  first: number;
  count: number;
}

/**
 * The row of one ending: context then ending, cut from the left to `seqLen + 1` tokens, so the
 * ending keeps the longest context the window allows. Throws RangeError when the ending leaves no
 * context token.
 */
export function choiceRow(context: number[], ending: number[], seqLen: number, what: string): ChoiceRow {
  if (ending.length === 0) throw new RangeError(`Cannot evaluate ${what}: the ending has no tokens`);
  if (ending.length >= seqLen + 1) {
    throw new RangeError(
      `Cannot evaluate ${what}: its ending takes ${ending.length} tokens, and seq_len ${seqLen} leaves no context`,
    );
  }
  const tokens = [...context, ...ending].slice(-(seqLen + 1));
  return { tokens, first: tokens.length - ending.length - 1, count: ending.length };
}

/** What scoring found for one example: each ending's summed log-probability and token count. */
export interface ChoiceScores {
  logprobs: number[];
  tokens: number[];
  bytes: number[];
  label: number;
}

/** Index of the largest value (the first of equals, as numpy's argmax). */
export function argmax(xs: number[]): number {
  let best = 0;
  for (let i = 1; i < xs.length; i++) if (xs[i] > xs[best]) best = i;
  return best;
}

/** The figures of a multiple-choice evaluation. */
export interface ChoiceFigures {
  accuracy: number;
  correct: number;
  accuracy_norm: number;
  correct_norm: number;
  /** Mean nats per token of the right endings, and its exponential. */
  loss: number;
  perplexity: number;
}

/** Accuracies (see the file's header) and the right endings' loss over scored examples. */
export function choiceFigures(scores: ChoiceScores[], scoring: ChoiceScoring): ChoiceFigures {
  let correct = 0, correct_norm = 0, nll = 0, tokens = 0;
  for (const s of scores) {
    const ranked = scoring === "mean_token" ? s.logprobs.map((l, k) => l / s.tokens[k]) : s.logprobs;
    if (argmax(ranked) === s.label) correct++;
    if (argmax(s.logprobs.map((l, k) => l / Math.max(1, s.bytes[k]))) === s.label) correct_norm++;
    nll -= s.logprobs[s.label];
    tokens += s.tokens[s.label];
  }
  const n = Math.max(1, scores.length), loss = nll / Math.max(1, tokens);
  return {
    accuracy: correct / n,
    correct,
    accuracy_norm: correct_norm / n,
    correct_norm,
    loss,
    perplexity: Math.exp(loss),
  };
}

/**
 * Reads and checks a JSONL file of examples (see parseChoiceJsonl), none of them bad (see
 * choiceProblem). Throws RangeError naming the file and the line.
 */
export function checkedChoiceJsonl(text: string, name: string): ChoiceExample[] {
  const examples = parseChoiceJsonl(text, name), lines = choiceLines(text);
  for (const [i, ex] of examples.entries()) {
    const problem = choiceProblem(ex, i, `"${name}" line ${lines[i]}`);
    if (problem) throw new RangeError(problem.message);
  }
  if (examples.length === 0) throw new RangeError(`Cannot evaluate "${name}": it has no examples`);
  return examples;
}

/** The 1-based line number of each example (non-blank line) of a JSONL text. */
function choiceLines(text: string): number[] {
  return text.split("\n").flatMap((line, i) => line.trim() === "" ? [] : [i + 1]);
}

/**
 * Reads a JSONL file of examples (`{"context", "endings", "label"}` per line; blank lines
 * skipped). Throws RangeError naming the line for one that is not such an object.
 */
export function parseChoiceJsonl(text: string, name: string): ChoiceExample[] {
  const out: ChoiceExample[] = [];
  for (const [i, line] of text.split("\n").entries()) {
    if (line.trim() === "") continue;
    let v: Record<string, unknown>;
    try {
      v = JSON.parse(line);
    } catch (e) {
      throw new RangeError(`Cannot read "${name}" line ${i + 1}: ${(e as Error).message}`);
    }
    if (
      typeof v !== "object" || v === null || typeof v.context !== "string" || !Array.isArray(v.endings) ||
      !v.endings.every((e) => typeof e === "string") || typeof v.label !== "number"
    ) {
      throw new RangeError(
        `Cannot read "${name}" line ${
          i + 1
        }: expected {"context": string, "endings": [string], "label": number}`,
      );
    }
    out.push({ context: v.context, endings: v.endings as string[], label: v.label });
  }
  return out;
}
