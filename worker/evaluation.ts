/**
 * Evaluation jobs inside a GPU Worker (and `deno task eval`): a model's perplexity over sliding
 * windows, LAMBADA-style cloze accuracy, and multiple-choice accuracy (every ending of an example
 * in the same batch). The windows are batched on the GPU: each batch is one
 * submission (forward pass and per-token losses, `Trainer.encodeTokenLosses`) whose B·T losses are
 * copied on the GPU into a results buffer, read back once per group of batches (up to
 * GROUP_BATCHES and GROUP_BYTES), never once per window. Cloze also copies the logits rows of the
 * last word's positions, to check that the greedy continuation is the whole word. The arithmetic
 * (which targets each window scores, the normalisations) is model/perplexity.ts and
 * model/multiple_choice.ts; sums are float64. Evaluations during training (worker/eval_tasks.ts)
 * score with the trainer itself, or in a forward-only plan sharing its weights (engine/scorer.ts).
 */

import { decode, encode } from "gpt-tokenizer/encoding/r50k_base";
import type { GpuContext } from "../engine/device.ts";
import { readBuffers } from "../engine/device.ts";
import { Trainer } from "../engine/trainer.ts";
import { TokenScorer } from "../engine/scorer.ts";
import { EOT_TOKEN, type ModelConfig, validateSeqLen } from "../model/config.ts";
import type { EvalConfig, EvalResult } from "../job/job.ts";
import {
  type ClozeExample,
  clozeExample,
  clozeFigures,
  countBytes,
  countWords,
  perplexityFigures,
  slidingWindows,
} from "../model/perplexity.ts";
import { getDataset, isBuiltinName, loadSplit, prepareDataset, readTaskFile } from "../data/mod.ts";
import { loadWeights } from "../checkpoint/model_source.ts";
import type { FromWorker, ModelSource, WorkerJob } from "../protocol.ts";
import {
  checkedChoiceJsonl,
  type ChoiceExample,
  choiceFigures,
  choiceProblem,
  choiceRow,
  type ChoiceScores,
  type ChoiceScoring,
  type ChoiceTokens,
  choiceTokens,
} from "../model/multiple_choice.ts";

/** Bytes of results (losses, logits rows) gathered on the GPU between readbacks, at most. */
const GROUP_BYTES = 64 << 20;
/** Batches between readbacks, at most (progress and cancellation are checked per group). */
const GROUP_BATCHES = 32;

/** Progress of an evaluation: `done` of `total` windows or examples, tokens scored so far. */
export interface EvalProgress {
  done: number;
  total: number;
  tokens: number;
  tokens_per_s: number;
}

/** How a running evaluation talks to the outside. */
export interface EvalHooks {
  progress?(p: EvalProgress): void;
  /** Polled between groups of batches: stop with an Error("Cancelled"). */
  cancelled?(): boolean;
}

/** One batch handed to the GPU: B rows of T+1 tokens, and the logits rows (b·T + position) to copy back. */
interface GpuBatch {
  tokens: Uint32Array;
  logitRows?: number[];
}

/** What one batch gave back: its B·T per-token losses, and the argmax (real vocabulary) of each copied row. */
interface BatchResult {
  losses: Float32Array;
  argmax: number[];
}

/** What scores a batch: a trainer's plan, or a forward-only plan sharing its weights (engine/scorer.ts). */
type Scoring = Pick<Trainer | TokenScorer, "encodeTokenLosses">;

/** A model loaded for evaluation: an engine plan of `batch` rows of `seqLen`, no dropout, weights of `source`. */
export class EvalModel {
  readonly trainer: Trainer;
  readonly batch: number;
  readonly seqLen: number;
  readonly config: ModelConfig;
  #ctx: GpuContext;
  #owned = true;
  /** A forward-only plan of its own over the trainer's weights (`sharing`), or null: the trainer's plan. */
  #scorer: TokenScorer | null = null;

  private constructor(ctx: GpuContext, trainer: Trainer, config: ModelConfig, batch: number, seqLen: number) {
    this.#ctx = ctx;
    this.trainer = trainer;
    this.config = config;
    this.batch = batch;
    this.seqLen = seqLen;
  }

  /**
   * Evaluates with a training job's current weights in a forward-only plan of its own, `batch`
   * rows of `seqLen` (shorter rows than training's cost less). Null when the trainer's weights
   * are not one fp32 buffer (tensor-parallel shards, or a layout cut in segments). `destroy()`
   * frees only the forward plan.
   */
  static async sharing(
    ctx: GpuContext,
    trainer: Trainer,
    batch: number,
    seqLen: number,
  ): Promise<EvalModel | null> {
    const { params } = trainer.model;
    if (trainer.opts.tensorParallel || params.segments.length !== 1 || params.bytesPerElement !== 4) {
      return null;
    }
    const scorer = await TokenScorer.create(
      ctx,
      trainer.opts.config,
      params.segments[0].buffer,
      batch,
      seqLen,
    );
    const model = new EvalModel(ctx, trainer, trainer.opts.config, batch, seqLen);
    model.#owned = false;
    model.#scorer = scorer;
    return model;
  }

  /** Loads `params` (flat layout of `config`, tensor-parallel size 1) into a plan of `batch` × `seqLen`. */
  static async create(
    ctx: GpuContext,
    config: ModelConfig,
    params: Float32Array,
    batch: number,
    seqLen: number,
  ): Promise<EvalModel> {
    validateSeqLen(config, seqLen);
    const zeros = new Float32Array(params.length);
    const trainer = await Trainer.create(ctx, {
      config,
      batchSize: batch,
      seqLen,
      schedule: { lr: 0, min_lr: 0, warmup_iters: 0, decay_iters: 1, style: "constant" },
      adamw: { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0, clip_grad: 0 },
      attnDropout: 0,
      hiddenDropout: 0,
      seed: 0,
    }, { step: 0, params, m: zeros, v: zeros });
    return new EvalModel(ctx, trainer, config, batch, seqLen);
  }

  /**
   * Evaluates with a training job's own trainer (its plan's batch and window, its current weights;
   * evaluations during training). `destroy()` leaves the trainer to its owner.
   */
  static over(ctx: GpuContext, trainer: Trainer): EvalModel {
    const { config, batchSize, seqLen } = trainer.opts;
    const model = new EvalModel(ctx, trainer, config, batchSize, seqLen);
    model.#owned = false;
    return model;
  }

  /** Loads a model the server knows (checkpoint of any tensor-parallel size, or a Hugging Face folder). */
  static async load(ctx: GpuContext, source: ModelSource, batch: number, seqLen: number): Promise<EvalModel> {
    return await EvalModel.create(ctx, source.config, await loadWeights(source), batch, seqLen);
  }

  /** Rows of one LM head chunk of the plan that scores. */
  get headRows(): number {
    return this.#scorer?.headRows ?? this.trainer.model.headRows;
  }

  /** Whether logits of every row of a batch are kept (the LM head runs in one chunk). */
  get holdsLogits(): boolean {
    return this.headRows >= this.batch * this.seqLen;
  }

  /**
   * Runs `batches` through the forward pass and the per-token loss: one submission each, results
   * gathered on the GPU and read back per group. Calls `each(i, result)` in order.
   */
  async run(
    batches: GpuBatch[],
    each: (i: number, r: BatchResult) => void,
    hooks: EvalHooks = {},
  ): Promise<void> {
    const { device } = this.#ctx, scoring: Scoring = this.#scorer ?? this.trainer;
    const B = this.batch, T = this.seqLen, Vp = this.config.padded_vocab_size, V = this.config.vocab_size;
    const lossBytes = B * T * 4, rowBytes = Vp * 4;
    if (batches.some((b) => b.logitRows?.length) && !this.holdsLogits) {
      throw new RangeError(
        `Cannot keep the logits of ${
          B * T
        } rows (the LM head runs in chunks of ${this.headRows}): lower batch_size`,
      );
    }
    let i = 0;
    while (i < batches.length) {
      if (hooks.cancelled?.()) throw new Error("Cancelled");
      // A group: as many batches as fit GROUP_BYTES and GROUP_BATCHES (at least one).
      let j = i, bytes = 0;
      while (j < batches.length) {
        const add = lossBytes + (batches[j].logitRows?.length ?? 0) * rowBytes;
        if (j > i && (bytes + add > GROUP_BYTES || j - i >= GROUP_BATCHES)) break;
        bytes += add;
        j++;
      }
      const out = device.createBuffer({
        size: bytes,
        usage: GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST,
      });
      const at: number[] = [];
      let offset = 0;
      for (let k = i; k < j; k++) {
        at.push(offset);
        offset += await scoring.encodeTokenLosses(batches[k].tokens, out, offset, batches[k].logitRows);
      }
      const [raw] = await readBuffers(this.#ctx, [{ buffer: out, offset: 0, bytes }]);
      out.destroy();
      for (let k = i; k < j; k++) {
        const losses = new Float32Array(raw, at[k - i], B * T);
        const argmax: number[] = [];
        let o = at[k - i] + lossBytes;
        for (const _ of batches[k].logitRows ?? []) {
          const row = new Float32Array(raw, o, V);
          let best = 0;
          for (let v = 1; v < V; v++) if (row[v] > row[best]) best = v;
          argmax.push(best);
          o += rowBytes;
        }
        each(k, { losses, argmax });
      }
      i = j;
    }
  }

  /** Frees the GPU buffers (not those of a trainer it evaluates `over` or `sharing` its weights). */
  destroy(): void {
    this.#scorer?.destroy();
    if (this.#owned) this.trainer.destroy();
  }
}

/** Text (words, bytes) and tokens of a perplexity stream. */
export interface EvalStream {
  tokens: Uint32Array;
  words: number;
  bytes: number;
}

/** Tokenizes `text` as GPT-2 does, `<|endoftext|>` in the text included as an ordinary string. */
export function tokenize(text: string): number[] {
  return encode(text, { disallowedSpecial: new Set() });
}

/** The stream of `texts`: each tokenized, joined by <|endoftext|>; words and bytes summed over the texts. */
export function textStream(texts: string[]): EvalStream {
  const ids: number[] = [];
  let words = 0, bytes = 0;
  texts.forEach((t, i) => {
    if (i > 0) ids.push(EOT_TOKEN);
    for (const id of tokenize(t)) ids.push(id);
    words += countWords(t);
    bytes += countBytes(t);
  });
  return { tokens: Uint32Array.from(ids), words, bytes };
}

/** The stream of a token split: its words and bytes from its documents (between <|endoftext|>) decoded. */
export function tokenStream(tokens: Uint16Array | Uint32Array): EvalStream {
  let words = 0, bytes = 0, from = 0;
  for (let i = 0; i <= tokens.length; i++) {
    if (i < tokens.length && tokens[i] !== EOT_TOKEN) continue;
    if (i > from) {
      const text = decode(Array.from(tokens.subarray(from, i)));
      words += countWords(text);
      bytes += countBytes(text);
    }
    from = i + 1;
  }
  return { tokens: Uint32Array.from(tokens), words, bytes };
}

/**
 * Perplexity of `stream` with sliding windows of `model.seqLen` targets advancing by `stride`.
 * Each token after the first is scored once; figures as model/perplexity.ts defines them.
 */
export async function perplexity(
  model: EvalModel,
  stream: EvalStream,
  stride: number,
  hooks: EvalHooks = {},
): Promise<Omit<EvalResult, "task" | "model">> {
  const B = model.batch, T = model.seqLen, n = stream.tokens.length;
  const windows = slidingWindows(n, T, stride);
  const batches: GpuBatch[] = [];
  for (let w = 0; w < windows.length; w += B) {
    const tokens = new Uint32Array(B * (T + 1)).fill(EOT_TOKEN);
    for (let r = 0; r < B && w + r < windows.length; r++) {
      const s = windows[w + r].start;
      tokens.set(stream.tokens.subarray(s, Math.min(n, s + T + 1)), r * (T + 1));
    }
    batches.push({ tokens });
  }
  let nll = 0, scored = 0;
  const t0 = performance.now();
  await model.run(batches, (i, { losses }) => {
    for (let r = 0; r < B && i * B + r < windows.length; r++) {
      const { first, end } = windows[i * B + r];
      for (let k = first; k < end; k++) nll += losses[r * T + k];
      scored += end - first;
    }
    const s = (performance.now() - t0) / 1000;
    hooks.progress?.({
      done: Math.min(windows.length, (i + 1) * B),
      total: windows.length,
      tokens: scored,
      tokens_per_s: scored / Math.max(s, 1e-9),
    });
  }, hooks);
  const elapsed_s = (performance.now() - t0) / 1000;
  const f = perplexityFigures({
    nll,
    tokens: scored,
    streamTokens: n,
    words: stream.words,
    bytes: stream.bytes,
  });
  return {
    loss: f.loss,
    perplexity: f.perplexity,
    tokens: scored,
    word_perplexity: f.word_perplexity,
    words: stream.words,
    byte_perplexity: f.byte_perplexity,
    bits_per_byte: f.bits_per_byte,
    bytes: stream.bytes,
    windows: windows.length,
    stride,
    seq_len: T,
    tokens_per_s: scored / Math.max(elapsed_s, 1e-9),
    elapsed_s,
  };
}

/** Cloze accuracy of LAMBADA `lines` (see clozeExample for `strict`); see `clozeTokens`. */
export async function cloze(
  model: EvalModel,
  lines: string[],
  strict: boolean,
  hooks: EvalHooks = {},
): Promise<Omit<EvalResult, "task" | "model">> {
  const examples = lines.map((line, i) => {
    try {
      return clozeExample(line, strict, tokenize);
    } catch (e) {
      throw new RangeError(`Cloze line ${i}: ${(e as Error).message}`);
    }
  });
  return await clozeTokens(model, examples, hooks);
}

/**
 * Cloze accuracy of token examples: one is right when the greedy prediction at every position of
 * the target is that target token; the loss is the mean NLL of the whole target. Contexts longer
 * than the window keep their end.
 */
export async function clozeTokens(
  model: EvalModel,
  examples: ClozeExample[],
  hooks: EvalHooks = {},
): Promise<Omit<EvalResult, "task" | "model">> {
  const B = model.batch, T = model.seqLen;
  const rows = examples.map((ex, i) => {
    const all = [...ex.context, ...ex.target].slice(-(T + 1));
    if (all.length <= ex.target.length) {
      throw new RangeError(
        `Cloze example ${i}: its last word takes ${ex.target.length} tokens, seq_len is ${T}`,
      );
    }
    // Input positions whose next token is one of the target's.
    const from = all.length - ex.target.length - 1;
    return { all, positions: ex.target.map((_, k) => from + k) };
  });
  const batches: GpuBatch[] = [];
  for (let e = 0; e < rows.length; e += B) {
    const tokens = new Uint32Array(B * (T + 1)).fill(EOT_TOKEN), logitRows: number[] = [];
    for (let r = 0; r < B && e + r < rows.length; r++) {
      tokens.set(rows[e + r].all, r * (T + 1));
      for (const p of rows[e + r].positions) logitRows.push(r * T + p);
    }
    batches.push({ tokens, logitRows });
  }
  const nlls: number[] = [], correct: boolean[] = [];
  let scored = 0;
  const t0 = performance.now();
  await model.run(batches, (i, { losses, argmax }) => {
    let a = 0;
    for (let r = 0; r < B && i * B + r < rows.length; r++) {
      const { all, positions } = rows[i * B + r];
      let nll = 0, right = true;
      for (const p of positions) {
        nll += losses[r * T + p];
        if (argmax[a++] !== all[p + 1]) right = false;
      }
      nlls.push(nll);
      correct.push(right);
      scored += positions.length;
    }
    const s = (performance.now() - t0) / 1000;
    hooks.progress?.({
      done: nlls.length,
      total: rows.length,
      tokens: scored,
      tokens_per_s: scored / Math.max(s, 1e-9),
    });
  }, hooks);
  const elapsed_s = (performance.now() - t0) / 1000;
  const f = clozeFigures(nlls, correct);
  return {
    loss: f.loss,
    perplexity: f.perplexity,
    tokens: scored,
    seq_len: T,
    accuracy: f.accuracy,
    examples: rows.length,
    correct: f.correct,
    tokens_per_s: scored / Math.max(elapsed_s, 1e-9),
    elapsed_s,
  };
}

/**
 * A multiple-choice config with its examples at hand: given, or read from its task file
 * (data/tasks.ts) and checked. Other configs as they are.
 */
export async function withChoiceExamples<T extends Pick<EvalConfig, "examples" | "examples_file">>(
  root: string,
  c: T,
): Promise<T> {
  if (c.examples_file === undefined || c.examples !== undefined) return c;
  const examples = checkedChoiceJsonl(await readTaskFile(root, c.examples_file), `${c.examples_file}.jsonl`);
  return { ...c, examples };
}

/** Tokenizes multiple-choice examples (see choiceTokens); a bad one is a RangeError naming it. */
export function tokenizeChoices(examples: ChoiceExample[]): ChoiceTokens[] {
  return examples.map((ex, i) => {
    const problem = choiceProblem(ex, i);
    if (problem) throw new RangeError(problem.message);
    return choiceTokens(ex, tokenize);
  });
}

/**
 * The window multiple choice needs: the longest row (context and ending) less one, rounded up to
 * a multiple of 32, at most `seqLen`. Rows are causal and padding follows them, so a shorter window
 * scores the same as `seqLen` with less work.
 */
export function choiceWindow(examples: ChoiceTokens[], seqLen: number): number {
  let longest = 1;
  for (const ex of examples) {
    for (const e of ex.endings) longest = Math.max(longest, ex.context.length + e.length - 1);
  }
  return Math.min(seqLen, Math.ceil(longest / 32) * 32);
}

/**
 * Each ending's summed log-probability given its context (cut from the left to the window).
 * Examples are packed whole into batches of `model.batch` rows (one ending a row), so all endings
 * of an example run in one forward pass; one with more endings than rows spills into the next.
 */
export async function scoreChoices(
  model: EvalModel,
  examples: ChoiceTokens[],
  hooks: EvalHooks = {},
): Promise<ChoiceScores[]> {
  const B = model.batch, T = model.seqLen;
  /** The batches' rows: example e's ending k in batch `batch`, row `row`. */
  const placed: { e: number; k: number; row: number; batch: number; first: number; count: number }[] = [];
  const batches: GpuBatch[] = [];
  let tokens: Uint32Array | null = null, used = B;
  for (const [e, ex] of examples.entries()) {
    const k0 = ex.endings.length;
    if (used + Math.min(k0, B) > B) used = B; // the example fits a batch: start one rather than split it
    for (const [k, ending] of ex.endings.entries()) {
      if (used === B) {
        tokens = new Uint32Array(B * (T + 1)).fill(EOT_TOKEN);
        batches.push({ tokens });
        used = 0;
      }
      const row = choiceRow(ex.context, ending, T, `example ${e} ending ${k}`);
      tokens!.set(row.tokens, used * (T + 1));
      placed.push({ e, k, row: used, batch: batches.length - 1, first: row.first, count: row.count });
      used++;
    }
  }
  const scores: ChoiceScores[] = examples.map((ex) => ({
    logprobs: new Array(ex.endings.length).fill(0),
    tokens: ex.endings.map((e) => e.length),
    bytes: ex.bytes,
    label: ex.label,
  }));
  let p = 0, scored = 0;
  const t0 = performance.now();
  await model.run(batches, (i, { losses }) => {
    for (; p < placed.length && placed[p].batch === i; p++) {
      const { e, k, row, first, count } = placed[p];
      let nll = 0;
      for (let t = first; t < first + count; t++) nll += losses[row * T + t];
      scores[e].logprobs[k] = -nll;
      scored += count;
    }
    const s = (performance.now() - t0) / 1000;
    hooks.progress?.({
      done: p < placed.length ? placed[p].e : examples.length,
      total: examples.length,
      tokens: scored,
      tokens_per_s: scored / Math.max(s, 1e-9),
    });
  }, hooks);
  return scores;
}

/** Multiple-choice accuracy of `examples` (figures as model/multiple_choice.ts defines them). */
export async function multipleChoice(
  model: EvalModel,
  examples: ChoiceTokens[],
  scoring: ChoiceScoring,
  hooks: EvalHooks = {},
): Promise<Omit<EvalResult, "task" | "model">> {
  const t0 = performance.now();
  const scores = await scoreChoices(model, examples, hooks);
  const elapsed_s = (performance.now() - t0) / 1000;
  const f = choiceFigures(scores, scoring);
  let tokens = 0, endings = 0;
  for (const s of scores) {
    endings += s.tokens.length;
    for (const n of s.tokens) tokens += n;
  }
  return {
    loss: f.loss,
    perplexity: f.perplexity,
    tokens,
    seq_len: model.seqLen,
    accuracy: f.accuracy,
    correct: f.correct,
    accuracy_norm: f.accuracy_norm,
    correct_norm: f.correct_norm,
    examples: scores.length,
    endings,
    scoring,
    tokens_per_s: tokens / Math.max(elapsed_s, 1e-9),
    endings_per_s: endings / Math.max(elapsed_s, 1e-9),
    elapsed_s,
  };
}

/** The stream an evaluation config reads: its texts, or its dataset's split (a builtin prepared on first use). */
export async function evalStream(root: string, c: EvalConfig): Promise<EvalStream> {
  let stream: EvalStream;
  if (c.texts) stream = textStream(c.texts);
  else {
    let id = c.dataset!;
    if (isBuiltinName(id)) id = (await prepareDataset(root, { builtin: id })).id;
    else if (!(await getDataset(root, id))) throw new Error(`Unknown dataset "${id}"`);
    stream = tokenStream(await loadSplit(root, id, c.split ?? "test"));
  }
  if (c.max_tokens !== undefined && stream.tokens.length > c.max_tokens + 1) {
    // Words and bytes of the tokens kept, decoded.
    stream = tokenStream(stream.tokens.subarray(0, c.max_tokens + 1));
  }
  return stream;
}

/** Runs an evaluation config on a loaded model. */
export async function runEvalConfig(
  model: EvalModel,
  root: string,
  c: EvalConfig,
  hooks: EvalHooks = {},
): Promise<EvalResult> {
  const body = c.task === "cloze"
    ? await cloze(model, c.texts ?? [], c.strict, hooks)
    : c.task === "multiple_choice"
    ? await multipleChoice(model, tokenizeChoices(c.examples ?? []), c.scoring ?? "sum", hooks)
    : await perplexity(model, await evalStream(root, c), c.stride, hooks);
  return { task: c.task, model: c.model, ...body };
}

/**
 * Loads the model an evaluation config runs on: `batch` rows of `seqLen`, except that cloze keeps
 * the rows one LM head chunk holds (it reads logits rows), and multiple choice takes the window
 * its longest example needs (choiceWindow) with as many more rows as keep `batch` × `seqLen`
 * tokens per forward pass (the memory the request asked for, used by short rows).
 */
export async function loadEvalModel(
  ctx: GpuContext,
  source: ModelSource,
  c: EvalConfig,
  batch: number,
  seqLen: number,
): Promise<EvalModel> {
  if (c.task === "multiple_choice") {
    const examples = tokenizeChoices(c.examples ?? []), window = choiceWindow(examples, seqLen);
    const endings = Math.max(1, ...examples.map((e) => e.endings.length));
    const rows = Math.max(batch, endings, Math.floor(batch * seqLen / window));
    return await EvalModel.load(ctx, source, rows, window);
  }
  const model = await EvalModel.load(ctx, source, batch, seqLen);
  if (c.task !== "cloze" || model.holdsLogits) return model;
  const rows = Math.max(1, Math.floor(model.trainer.model.headRows / seqLen));
  model.destroy();
  return await EvalModel.load(ctx, source, rows, seqLen);
}

/**
 * Runs an evaluation job (`job.config.evaluate`) on this Worker's GPU: loads `job.init_source`,
 * posts progress after each group of batches and the result at the end; never throws.
 */
export async function runEvaluationJob(
  ctx: GpuContext,
  job: WorkerJob,
  hooks: { post(msg: FromWorker): void; cancelled(): boolean },
): Promise<Extract<FromWorker, { type: "done" }>> {
  let c = job.config.evaluate!;
  const done = (status: "succeeded" | "failed" | "cancelled", error: string | null) => ({
    type: "done" as const,
    id: job.id,
    status,
    iteration: 0,
    error,
  });
  let model: EvalModel | null = null;
  try {
    if (!job.init_source) throw new Error(`Evaluation job "${job.id}" reached the Worker without its model`);
    c = await withChoiceExamples(job.root, c);
    model = await loadEvalModel(ctx, job.init_source, c, job.config.batch_size, job.config.seq_len);
    hooks.post({
      type: "started",
      id: job.id,
      iteration: 0,
      resumed_from: null,
      gpu_memory_bytes: model.trainer.memoryBytes,
    });
    const result = await runEvalConfig(model, job.root, c, {
      cancelled: hooks.cancelled,
      progress: (p) => hooks.post({ type: "evaluation", id: job.id, ...p }),
    });
    hooks.post({
      type: "evaluation",
      id: job.id,
      done: result.windows ?? result.examples ?? 0,
      total: result.windows ?? result.examples ?? 0,
      tokens: result.tokens,
      tokens_per_s: result.tokens_per_s,
      result,
    });
    return done("succeeded", null);
  } catch (e) {
    const message = (e as Error).message || String(e);
    if (message === "Cancelled" && hooks.cancelled()) return done("cancelled", null);
    return done("failed", message);
  } finally {
    model?.destroy();
  }
}
