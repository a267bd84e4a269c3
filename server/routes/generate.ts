/**
 * Generation routes, validating and delegating to the GenerationManager:
 * - `GET /generate?prompt=&model=&max_tokens=&temperature=&top_k=&top_p=&seed=&stop=&ignore_eos=`:
 *   server-sent events, `event: token` `{id, text}` per token, then `event: done` with the finish
 *   reason (length, stop, eos, timeout, error), token counts and timings.
 * - `POST /v1/completions`: OpenAI's completions (streamed `data: {chunk}` … `data: [DONE]`, or
 *   whole), with `n`, `logprobs`, `echo`, `stream_options.include_usage` and token-array prompts;
 *   unknown fields are refused (400), never dropped.
 * - `GET /v1/models`, `GET /v1/models/{id}`: the checkpoints and model directories that can be loaded.
 * - `POST /tokenize`, `POST /detokenize`: GPT-2 tokens of a text and back (vLLM's shapes).
 * Every error of these routes is OpenAI's `{error: {message, type, param, code}}`, in the
 * "openai" ErrorStyle of api_errors.ts (`Invalid parameters: a (why), b (why)`, code null); too many waiting
 * requests is 429 with Retry-After. Streams send a keepalive comment while no token
 * comes; a client that disconnects cancels its generation through `onAbort`. A model another user
 * owns answers as an unknown one (404), and each user's open streams count against their quota.
 */

import { type Context, Hono } from "hono";
import { type SSEStreamingApi, streamSSE } from "hono/streaming";
import { z } from "zod";
import {
  decodeTokens,
  type DoneEvent,
  encodePrompt,
  type GenerateParams,
  type Generation,
  type GenerationEvent,
  type GenerationManager,
  tokenBytes,
  type TokenEvent,
} from "../generate/mod.ts";
import { type ModelInfo } from "../../checkpoint/model_source.ts";
import { ModelNotFoundError } from "../jobs/mod.ts";
import { ApiError, errorStyle, jsonBody, queryParams } from "./api_errors.ts";
import { principalOf } from "./auth.ts";
import type { Auth } from "./admin.ts";
import { isRehearsal } from "../rehearsal.ts";

const MAX_PROMPT_CHARS = 1_000_000;
/** Token ids accepted in a prompt (GPT-2's real vocabulary). */
const tokenId = z.number().int().min(0).max(50256);
const tokenList = z.array(tokenId).max(65536);
const stopList = z.array(z.string().min(1).max(256)).max(8);

/** An optional JSON field where null means absent, as in OpenAI's API: `dflt` then. */
const orNull = <T extends z.ZodType, D extends z.output<T> | undefined>(t: T, dflt: D) =>
  t.nullish().transform((v) => (v ?? dflt) as z.output<T> | D);

/** Sampling and length parameters of `POST /v1/completions` (JSON numbers; null is absent). */
const samplingShape = {
  max_tokens: orNull(z.number().int().min(1).max(8192), 16),
  temperature: orNull(z.number().min(0).max(10), 1),
  top_k: orNull(z.number().int().min(0).max(50257), 0),
  top_p: orNull(z.number().gt(0).max(1), 1),
  seed: orNull(z.number().int().min(0).max(2 ** 32 - 1), undefined),
  ignore_eos: orNull(z.boolean(), false),
};

/**
 * A query as Hono's validator gives it (a repeated key as an array), as `GET /generate` reads it:
 * every `stop` given, the first value of any other key; a key given empty (`temperature=`) is
 * absent, not 0 (an empty prompt stays a prompt).
 */
function firstValues(query: unknown): unknown {
  if (typeof query !== "object" || query === null) return query;
  return Object.fromEntries(
    Object.entries(query)
      .map(([k, v]) => [k, k === "stop" ? [v].flat() : Array.isArray(v) ? v[0] : v])
      .filter(([k, v]) => k === "prompt" || v !== ""),
  );
}

/** A number in a query string ("hot" is refused as not a number, not as NaN). */
const queryNumber = () =>
  z.coerce.number({
    error: (issue) =>
      issue.code !== "invalid_type"
        ? undefined
        : issue.expected === "int"
        ? "expected a whole number"
        : "expected a number",
  });

/** Query of `GET /generate` (strings coerced). */
export const GenerateQuerySchema = z.preprocess(
  firstValues,
  z.strictObject({
    model: z.string().min(1).max(300),
    prompt: z.string().max(MAX_PROMPT_CHARS).default(""),
    max_tokens: queryNumber().int().min(1).max(8192).optional(),
    temperature: queryNumber().min(0).max(10).default(1),
    top_k: queryNumber().int().min(0).max(50257).default(0),
    top_p: queryNumber().gt(0).max(1).default(1),
    seed: queryNumber().int().min(0).max(2 ** 32 - 1).optional(),
    stop: stopList.default([]),
    ignore_eos: z.enum(["true", "false", "1", "0"]).transform((v) => v === "true" || v === "1").default(
      false,
    ),
  }),
);

/** A field OpenAI defines that we accept only at its neutral value (so nothing is silently ignored). */
const neutral = <T extends z.ZodType>(t: T, ok: (v: z.infer<T>) => boolean, what: string) =>
  t.nullable().optional().refine((v) => v === null || v === undefined || ok(v as z.infer<T>), {
    message: `Only ${what} is supported`,
  });

/** Body of `POST /v1/completions`: OpenAI's fields, plus top_k and ignore_eos; nothing else. */
export const CompletionRequestSchema = z.strictObject({
  model: z.string().min(1).max(300),
  prompt: z.union([
    z.string().max(MAX_PROMPT_CHARS),
    z.array(z.string().max(MAX_PROMPT_CHARS)).length(1),
    tokenList,
    z.array(tokenList).length(1),
  ], {
    error:
      "expected a text, a list of token ids (0-50256), or a list holding one of either: one prompt per request",
  }).default(""),
  ...samplingShape,
  stop: z.union([z.string().min(1).max(256), stopList], {
    error: "expected a string or a list of up to 8 strings, each of 1 to 256 characters",
  }).nullable().optional(),
  stream: orNull(z.boolean(), false),
  stream_options: z.strictObject({ include_usage: orNull(z.boolean(), false) }).nullable().optional(),
  n: orNull(z.number().int().min(1).max(8), 1),
  logprobs: z.number().int().min(0).max(5).nullable().optional(),
  echo: orNull(z.boolean(), false),
  best_of: neutral(z.number().int(), (v) => v === 1, "best_of 1"),
  presence_penalty: neutral(z.number(), (v) => v === 0, "presence_penalty 0"),
  frequency_penalty: neutral(z.number(), (v) => v === 0, "frequency_penalty 0"),
  logit_bias: neutral(
    z.record(z.string(), z.number()),
    (v) => Object.keys(v).length === 0,
    "an empty logit_bias",
  ),
  suffix: neutral(z.string(), (v) => v === "", "an empty suffix"),
  user: z.string().max(256).optional(),
}).refine((r) => r.stream_options == null || r.stream, {
  path: ["stream_options"],
  message: "only allowed when stream is true",
});

/** Body of `POST /tokenize`. */
const TokenizeSchema = z.strictObject({
  model: z.string().min(1).max(300).optional(),
  prompt: z.string().max(MAX_PROMPT_CHARS),
  add_special_tokens: z.boolean().optional(),
});

/** Body of `POST /detokenize`. */
const DetokenizeSchema = z.strictObject({
  model: z.string().min(1).max(300).optional(),
  tokens: tokenList,
});

/** Options of the generation routes. */
export interface GenerateRoutesOptions {
  /** Milliseconds without an event before a stream sends a `: keepalive` comment (default 15 s). */
  keepaliveMs?: number;
}

function truncationHeader(c: Context, gen: Generation): void {
  if (gen.truncated_tokens > 0) c.header("X-Prompt-Truncated", String(gen.truncated_tokens));
  c.header("X-Model", gen.model.id);
}

/** The final event as `GET /generate` sends it. */
function doneData(gen: Generation, d: DoneEvent): Record<string, unknown> {
  return {
    finish_reason: d.finish_reason,
    ...(d.error ? { error: d.error } : {}),
    model: gen.model.id,
    prompt_tokens: d.prompt_tokens,
    completion_tokens: d.completion_tokens,
    truncated_tokens: d.truncated_tokens,
    seed: d.seed,
    timings: {
      ttft_ms: d.ttft_ms,
      tokens_per_s: d.tokens_per_s,
      total_ms: d.total_ms,
      load_ms: d.load_ms,
    },
  };
}

/** OpenAI's finish reasons: the end-of-text token is a "stop", a time limit a "length". */
function openaiReason(d: DoneEvent): string | null {
  if (d.finish_reason === "length" || d.finish_reason === "timeout") return "length";
  if (d.finish_reason === "stop" || d.finish_reason === "eos") return "stop";
  return d.finish_reason === "error" ? "error" : null;
}

function usage(gens: Generation[], dones: DoneEvent[]) {
  const prompt_tokens = gens[0].prompt_tokens;
  const completion_tokens = dones.reduce((a, d) => a + d.completion_tokens, 0);
  const truncated = gens[0].truncated_tokens;
  return {
    prompt_tokens,
    completion_tokens,
    total_tokens: prompt_tokens + completion_tokens,
    ...(truncated > 0 ? { truncated_prompt_tokens: truncated } : {}),
  };
}

/** A token's text for logprobs: its bytes as UTF-8 (an incomplete character shows as U+FFFD). */
function tokenText(id: number): string {
  return new TextDecoder().decode(tokenBytes(id));
}

/** OpenAI's legacy logprobs object for some tokens, offsets counted from `offset`. */
class LogprobsBuilder {
  tokens: string[] = [];
  token_logprobs: (number | null)[] = [];
  top_logprobs: (Record<string, number> | null)[] = [];
  text_offset: number[] = [];
  #offset: number;
  constructor(offset = 0) {
    this.#offset = offset;
  }
  add(id: number, lp: TokenEvent["logprobs"] | null): void {
    const text = tokenText(id);
    this.tokens.push(text);
    this.text_offset.push(this.#offset);
    this.#offset += text.length;
    this.token_logprobs.push(lp ? lp.logprob : null);
    this.top_logprobs.push(lp ? Object.fromEntries(lp.top.map(([t, v]) => [tokenText(t), v])) : null);
  }
  take(): Record<string, unknown> {
    const out = {
      tokens: this.tokens,
      token_logprobs: this.token_logprobs,
      top_logprobs: this.top_logprobs,
      text_offset: this.text_offset,
    };
    this.tokens = [];
    this.token_logprobs = [];
    this.top_logprobs = [];
    this.text_offset = [];
    return out;
  }
}

/** Batches of events (Generation.batches) of several generations merged as they come, each tagged with its index. */
async function* mergedBatches(gens: Generation[]): AsyncGenerator<{ i: number; es: GenerationEvent[] }> {
  const its = gens.map((g) => g.batches());
  const next = (i: number) => its[i].next().then((r) => ({ i, r }));
  const pending = new Map(gens.map((_, i) => [i, next(i)]));
  while (pending.size > 0) {
    const { i, r } = await Promise.race(pending.values());
    if (r.done) {
      pending.delete(i);
      continue;
    }
    pending.set(i, next(i));
    yield { i, es: r.value };
  }
}

/** Events of several generations merged as they come, each tagged with its index. */
async function* merged(gens: Generation[]): AsyncGenerator<{ i: number; e: GenerationEvent }> {
  for await (const { i, es } of mergedBatches(gens)) for (const e of es) yield { i, e };
}

/** One server-sent event as Hono's writeSSE writes it (`data` holds no line break: JSON or a word). */
function sseEvent(data: string, event?: string): string {
  return `${event ? `event: ${event}\n` : ""}data: ${data}\n\n`;
}

/** Sends `: keepalive` comments while the stream is idle for `ms`; returns a stopper. */
function keepalive(stream: SSEStreamingApi, ms: number): { touch(): void; stop(): void } {
  let last = Date.now();
  const timer = setInterval(() => {
    if (Date.now() - last >= ms) {
      last = Date.now();
      stream.write(": keepalive\n\n");
    }
  }, Math.max(10, Math.floor(ms / 2)));
  return { touch: () => (last = Date.now()), stop: () => clearInterval(timer) };
}

function modelObject(m: ModelInfo) {
  return {
    id: m.id,
    object: "model",
    created: m.created,
    owned_by: "gpt2-webgpu",
    kind: m.kind,
    max_model_len: m.config.n_positions,
    n_layer: m.config.n_layer,
    n_head: m.config.n_head,
    n_embd: m.config.n_embd,
    n_positions: m.config.n_positions,
  };
}

/**
 * Context key: when the request reached the server (performance.now()), set by createApp's first
 * middleware, so that time to first token and its stages count the middleware too.
 */
export const ARRIVED = "gpt2.arrived";

/** When request `c` reached the server (ARRIVED), if the app stamped it, and whether it is a rehearsal. */
function origin(c: Context): { arrived: number | undefined; rehearsal: boolean } {
  const t = c.get(ARRIVED as never) as unknown;
  return {
    arrived: typeof t === "number" ? t : undefined,
    rehearsal: isRehearsal(c),
  };
}

/** Who may use which model, and each caller's stream quota (no `auth`: everyone, unlimited). */
interface Access {
  /** Whether the caller of `c` may use `model` (rehearsals may use any). */
  mayUse(c: Context, model: string): boolean;
  /** Checks the model, then holds `n` of the caller's streams: call the answer to give them back. */
  hold(c: Context, model: string, n: number): () => void;
}

function routeAccess(auth: Pick<Auth, "access" | "quotas"> | undefined): Access {
  const mayUse = (c: Context, model: string) =>
    !auth || isRehearsal(c) || auth.access.modelAllowed(principalOf(c), model);
  const hold = (c: Context, model: string, n: number): () => void => {
    if (!mayUse(c, model)) throw new ModelNotFoundError(model);
    if (!auth || isRehearsal(c)) return () => {};
    const releases = [] as Array<() => void>;
    try {
      for (let i = 0; i < n; i++) {
        releases.push(auth.quotas.openStream(principalOf(c), { needs: n, held: i }));
      }
    } catch (e) {
      releases.forEach((r) => r());
      throw e;
    }
    return () => releases.forEach((r) => r());
  };
  return { mayUse, hold };
}

/**
 * Generation routes backed by `manager`. With `auth`, a caller may use only the models they may
 * see (another user's answers as an unknown model, 404) and holds their streams within their
 * `streams` quota.
 */
export function generateRoutes(
  manager: GenerationManager,
  opts: GenerateRoutesOptions = {},
  auth?: Pick<Auth, "access" | "quotas">,
): Hono {
  const app = new Hono();
  const keepaliveMs = opts.keepaliveMs ?? 15_000;
  const access = routeAccess(auth);
  const { mayUse } = access;
  // Every route words its errors, its parameters' included, in the "openai" ErrorStyle.
  const openai = errorStyle("openai");

  app.get("/generate", openai, queryParams(GenerateQuerySchema, "generation query"), async (c) => {
    const q = c.req.valid("query");
    const release = access.hold(c, q.model, 1);
    let gen: Generation;
    try {
      gen = await manager.start({ ...(q satisfies GenerateParams), ...origin(c) });
    } catch (e) {
      release();
      throw e;
    }
    truncationHeader(c, gen);
    return streamSSE(c, (stream) => streamGeneration(stream, gen, keepaliveMs, release));
  });

  app.post("/v1/completions", openai, jsonBody(CompletionRequestSchema, "completion request"), async (c) => {
    const run = await startCompletion(c, c.req.valid("json"), manager, access);
    if (!run.r.stream) {
      try {
        return await wholeCompletion(c, run);
      } finally {
        run.release();
      }
    }
    return streamSSE(c, (stream) => streamCompletion(stream, run, keepaliveMs));
  });

  app.get("/v1/models", openai, async (c) => {
    const models = (await manager.models()).filter((m) => mayUse(c, m.id));
    return c.json({ object: "list", data: models.map(modelObject) });
  });

  app.get("/v1/models/:id{.+}", openai, async (c) => {
    const id = c.req.param("id");
    if (!mayUse(c, id)) throw new ModelNotFoundError(id);
    const m = await manager.model(id);
    return c.json(modelObject(m));
  });

  app.post("/tokenize", openai, jsonBody(TokenizeSchema, "tokenize request"), async (c) => {
    const r = c.req.valid("json");
    if (r.model && !mayUse(c, r.model)) throw new ModelNotFoundError(r.model);
    const ctx = r.model ? await manager.contextOf(r.model) : 1024;
    const tokens = r.prompt === "" ? [] : encodePrompt(r.prompt, Infinity).tokens;
    return c.json({ count: tokens.length, max_model_len: ctx, tokens });
  });

  app.post("/detokenize", openai, jsonBody(DetokenizeSchema, "detokenize request"), async (c) => {
    const r = c.req.valid("json");
    if (r.model && !mayUse(c, r.model)) throw new ModelNotFoundError(r.model);
    if (r.model) await manager.contextOf(r.model);
    return c.json({ prompt: decodeTokens(r.tokens) });
  });

  return app;
}

/** `GET /generate`'s stream: token events, then the done event; the held stream is released at the end. */
async function streamGeneration(
  stream: SSEStreamingApi,
  gen: Generation,
  keepaliveMs: number,
  release: () => void,
): Promise<void> {
  stream.onAbort(() => gen.cancel());
  const ka = keepalive(stream, keepaliveMs);
  try {
    // The events that came together (a chunk's tokens) go out in one write.
    for await (const batch of gen.batches()) {
      ka.touch();
      let out = "";
      for (const e of batch) {
        out += e.type === "token"
          ? sseEvent(JSON.stringify({ id: e.id, text: e.text }), "token")
          : sseEvent(JSON.stringify(doneData(gen, e)), "done");
      }
      await stream.write(out);
      if (batch[0].type === "token") gen.markWritten();
    }
  } finally {
    ka.stop();
    gen.cancel(); // no-op once finished
    release();
  }
}

/** A started `POST /v1/completions`: its generations and what its answer is built from. */
interface CompletionRun {
  r: z.output<typeof CompletionRequestSchema>;
  /** The prompt as given (a text or tokens). */
  prompt: string | number[];
  gens: Generation[];
  /** Gives back the caller's held streams. */
  release: () => void;
  cancelAll: () => void;
  /** The fields every answer and chunk starts with. */
  head: { id: string; object: string; created: number; model: string };
  wantLp: boolean;
  /** Echo: the prompt comes first, its tokens without logprobs (none are computed for the prompt). */
  echoText: string;
  lps: LogprobsBuilder[];
  /** Adds choice `i`'s echoed prompt tokens to its logprobs (when echoing with logprobs). */
  echoLp: (i: number) => void;
}

/** Holds the caller's streams and starts the `n` generations of a completion request. */
async function startCompletion(
  c: Context,
  r: z.output<typeof CompletionRequestSchema>,
  manager: GenerationManager,
  access: Access,
): Promise<CompletionRun> {
  const prompt: string | number[] = Array.isArray(r.prompt)
    ? (typeof r.prompt[0] === "string" || Array.isArray(r.prompt[0]) ? r.prompt[0] : r.prompt as number[])
    : r.prompt;
  const release = access.hold(c, r.model, r.n);
  let gens: Generation[];
  try {
    gens = await manager.startChoices({
      model: r.model,
      prompt,
      max_tokens: r.max_tokens,
      temperature: r.temperature,
      top_k: r.top_k,
      top_p: r.top_p,
      seed: r.seed,
      stop: r.stop == null ? [] : typeof r.stop === "string" ? [r.stop] : r.stop,
      ignore_eos: r.ignore_eos,
      logprobs: r.logprobs ?? null,
      ...origin(c),
    }, r.n);
  } catch (e) {
    release();
    throw e;
  }
  const cancelAll = () => gens.forEach((g) => g.cancel());
  truncationHeader(c, gens[0]);
  const head = {
    id: `cmpl-${gens[0].id.slice(4, 16)}`,
    object: "text_completion",
    created: Math.floor(Date.now() / 1000),
    model: gens[0].model.id,
  };
  const wantLp = r.logprobs !== null && r.logprobs !== undefined;
  // The echo is the prompt the model read: what was kept of a cut one, nothing of an empty one
  // (whose model input is the end-of-text token alone), so text, logprobs and usage agree.
  const seen = prompt.length === 0 ? [] : gens[0].prompt;
  const echoText = r.echo ? decodeTokens(seen) : "";
  const lps = gens.map(() => new LogprobsBuilder(0));
  const echoLp = (i: number) => {
    if (!wantLp || !r.echo) return;
    for (const id of seen) lps[i].add(id, null);
  };
  return { r, prompt, gens, release, cancelAll, head, wantLp, echoText, lps, echoLp };
}

/** A completion answered whole (not streamed): every choice's text once all are done. */
async function wholeCompletion(c: Context, run: CompletionRun): Promise<Response> {
  const { gens, cancelAll, head, wantLp, echoText, lps, echoLp } = run;
  c.req.raw.signal?.addEventListener("abort", cancelAll);
  const texts = gens.map(() => echoText);
  gens.forEach((_, i) => echoLp(i));
  const dones: DoneEvent[] = [];
  for await (const { i, e } of merged(gens)) {
    if (e.type === "token") {
      texts[i] += e.text;
      if (wantLp && e.id !== null) lps[i].add(e.id, e.logprobs ?? null);
    } else dones[i] = e;
  }
  c.req.raw.signal?.removeEventListener("abort", cancelAll);
  const failed = dones.find((d) => d.finish_reason === "error");
  if (failed) throw new ApiError(500, failed.error ?? "Generation failed");
  return c.json({
    ...head,
    choices: gens.map((_, i) => ({
      text: texts[i],
      index: i,
      logprobs: wantLp ? lps[i].take() : null,
      finish_reason: openaiReason(dones[i]),
    })),
    usage: usage(gens, dones),
  });
}

/**
 * A streamed completion: the echoed prompts, a chunk per choice's text as it comes, a final
 * chunk per choice with its finish reason, the usage when asked, then `[DONE]`.
 */
async function streamCompletion(
  stream: SSEStreamingApi,
  run: CompletionRun,
  keepaliveMs: number,
): Promise<void> {
  const { r, gens, cancelAll, head, wantLp, echoText, lps, echoLp } = run;
  const includeUsage = r.stream_options?.include_usage === true;
  stream.onAbort(cancelAll);
  const ka = keepalive(stream, keepaliveMs);
  const chunk = (i: number, text: string, finish_reason: string | null, logprobs: unknown = null) =>
    sseEvent(JSON.stringify({
      ...head,
      choices: [{ text, index: i, logprobs, finish_reason }],
      ...(includeUsage ? { usage: null } : {}),
    }));
  try {
    if (r.echo) {
      let out = "";
      for (let i = 0; i < gens.length; i++) {
        echoLp(i);
        out += chunk(i, echoText, null, wantLp ? lps[i].take() : null);
      }
      await stream.write(out);
    }
    const dones: DoneEvent[] = [];
    // The events that came together (a chunk's tokens) go out in one write.
    for await (const { i, es } of mergedBatches(gens)) {
      ka.touch();
      let out = "", wrote = false;
      for (const e of es) {
        if (e.type === "token") {
          if (wantLp && e.id !== null) lps[i].add(e.id, e.logprobs ?? null);
          if (e.text || (wantLp && lps[i].tokens.length > 0)) {
            out += chunk(i, e.text, null, wantLp ? lps[i].take() : null);
            wrote = true;
          }
        } else {
          dones[i] = e;
          out += finishChunk(run, i, e, includeUsage);
        }
      }
      if (out) await stream.write(out);
      if (wrote) gens[i].markWritten();
    }
    let tail = "";
    if (includeUsage) {
      tail += sseEvent(JSON.stringify({ ...head, choices: [], usage: usage(gens, dones) }));
    }
    await stream.write(tail + sseEvent("[DONE]"));
  } finally {
    ka.stop();
    cancelAll();
    run.release();
  }
}

/** The last chunk of streamed choice `i`: its finish reason, and the error when it failed. */
function finishChunk(run: CompletionRun, i: number, e: DoneEvent, includeUsage: boolean): string {
  return sseEvent(JSON.stringify({
    ...run.head,
    choices: [{ text: "", index: i, logprobs: null, finish_reason: openaiReason(e) }],
    ...(includeUsage ? { usage: null } : {}),
    ...(e.error ? { error: { message: e.error, type: "server_error", param: null, code: null } } : {}),
  }));
}
