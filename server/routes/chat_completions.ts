/**
 * `POST /v1/chat/completions`: OpenAI's chat completions (streamed `chat.completion.chunk`s …
 * `data: [DONE]`, or one `chat.completion`) for models that carry a chat template (SFT
 * checkpoints and models fine-tuned from them: `chat_template` in their `tokenizer_config.json`).
 * The messages go through the template (data/chat.ts) with its generation prompt, and the
 * completion stops at `<|endoftext|>`, the end of an assistant turn. `n`, `stop`, `max_tokens`
 * (or `max_completion_tokens`), `temperature`, `top_p`, `seed`, `logprobs` with `top_logprobs`
 * and `stream_options.include_usage` are OpenAI's; unknown fields are refused (400). A model
 * without a template is a 400 naming `model`; roles out of order a 400 naming
 * `messages.N.role`. Errors, auth and quotas are those of /v1/completions (routes/generate.ts).
 */

import { type Context, Hono } from "hono";
import { type SSEStreamingApi, streamSSE } from "hono/streaming";
import { z } from "zod";
import {
  type DoneEvent,
  type Generation,
  type GenerationManager,
  tokenBytes,
  type TokenEvent,
} from "../generate/mod.ts";
import { ModelNotFoundError } from "../jobs/mod.ts";
import { CHAT_TEMPLATE, type ChatMessage, checkMessages, encodeChat } from "../../data/chat.ts";
import { ApiError, errorStyle, jsonBody } from "./api_errors.ts";
import { principalOf } from "./auth.ts";
import type { Auth } from "./admin.ts";
import { ARRIVED } from "./generate.ts";
import { isRehearsal } from "../rehearsal.ts";

const MAX_CONTENT_CHARS = 1_000_000;

/** A field OpenAI defines that we accept only at its neutral value (so nothing is silently ignored). */
const neutral = <T extends z.ZodType>(t: T, ok: (v: z.infer<T>) => boolean, what: string) =>
  t.nullable().optional().refine((v) => v === null || v === undefined || ok(v as z.infer<T>), {
    message: `Only ${what} is supported`,
  });

/** Body of `POST /v1/chat/completions`: OpenAI's fields, plus top_k and ignore_eos; nothing else. */
export const ChatCompletionRequestSchema = z.strictObject({
  model: z.string().min(1).max(300),
  // Roles and contents are checked by checkMessages (data/chat.ts) for messages.N.* errors.
  messages: z.array(z.strictObject({
    role: z.string().max(32),
    content: z.string().max(MAX_CONTENT_CHARS),
    name: z.never({ error: "not supported: the chat template renders no participant names" }).optional(),
  })).min(1).max(1000),
  max_tokens: z.number().int().min(1).max(8192).nullable().optional(),
  max_completion_tokens: z.number().int().min(1).max(8192).nullable().optional(),
  temperature: z.number().min(0).max(2).nullable().optional(),
  top_p: z.number().gt(0).max(1).nullable().optional(),
  top_k: z.number().int().min(0).max(50257).optional(),
  seed: z.number().int().min(0).max(2 ** 32 - 1).nullable().optional(),
  stop: z.union([z.string().min(1).max(256), z.array(z.string().min(1).max(256)).max(8)]).nullable()
    .optional(),
  n: z.number().int().min(1).max(8).nullable().optional(),
  stream: z.boolean().nullable().optional(),
  stream_options: z.strictObject({ include_usage: z.boolean().optional() }).nullable().optional(),
  logprobs: z.boolean().nullable().optional(),
  top_logprobs: z.number().int().min(0).max(5).nullable().optional(),
  ignore_eos: z.boolean().optional(),
  presence_penalty: neutral(z.number(), (v) => v === 0, "presence_penalty 0"),
  frequency_penalty: neutral(z.number(), (v) => v === 0, "frequency_penalty 0"),
  logit_bias: neutral(
    z.record(z.string(), z.number()),
    (v) => Object.keys(v).length === 0,
    "an empty logit_bias",
  ),
  user: z.string().max(256).optional(),
}).refine((r) => r.stream_options == null || r.stream === true, {
  path: ["stream_options"],
  message: "only allowed when stream is true",
}).refine((r) => r.top_logprobs == null || r.logprobs === true, {
  path: ["top_logprobs"],
  message: "only allowed when logprobs is true",
});

/** OpenAI's finish reasons: the end-of-text token is a "stop", a time limit a "length". */
function openaiReason(d: DoneEvent): string | null {
  if (d.finish_reason === "length" || d.finish_reason === "timeout") return "length";
  if (d.finish_reason === "stop" || d.finish_reason === "eos") return "stop";
  return d.finish_reason === "error" ? "error" : null;
}

/** One token's entry of OpenAI's chat logprobs. */
function logprobEntry(id: number, lp: NonNullable<TokenEvent["logprobs"]>) {
  const entry = (t: number, logprob: number) => {
    const bytes = tokenBytes(t);
    return { token: new TextDecoder().decode(bytes), logprob, bytes: [...bytes] };
  };
  return { ...entry(id, lp.logprob), top_logprobs: lp.top.map(([t, v]) => entry(t, v)) };
}

/** Events of several generations merged as they come, in batches, each tagged with its index. */
async function* mergedBatches(gens: Generation[]): AsyncGenerator<{ i: number; es: TokenOrDone[] }> {
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
type TokenOrDone = TokenEvent | DoneEvent;

/** The template answers start with the space after "Assistant:": the first piece of a reply drops it. */
class ReplyText {
  #started = false;
  /** `text` with the reply's leading space removed. */
  push(text: string): string {
    if (this.#started || text === "") return text;
    this.#started = true;
    return text.startsWith(" ") ? text.slice(1) : text;
  }
}

/** The caller's access to a model and stream quota (no `auth`: everyone, unlimited). */
type Hold = (c: Context, model: string, n: number) => () => void;

/** When request `c` reached the server, if the app stamped it. */
function arrived(c: Context): number | undefined {
  const t = c.get(ARRIVED as never) as unknown;
  return typeof t === "number" ? t : undefined;
}

/** Checks the model, then holds `n` of the caller's streams: call the answer to give them back. */
function holdStreams(auth: Pick<Auth, "access" | "quotas"> | undefined): Hold {
  return (c, model, n) => {
    if (auth && !isRehearsal(c) && !auth.access.modelAllowed(principalOf(c), model)) {
      throw new ModelNotFoundError(model);
    }
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
}

/** Chat completion routes backed by `manager` (auth and quotas as generateRoutes). */
export function chatRoutes(manager: GenerationManager, auth?: Pick<Auth, "access" | "quotas">): Hono {
  const app = new Hono();
  const hold = holdStreams(auth);

  app.post(
    "/v1/chat/completions",
    errorStyle("openai"),
    jsonBody(ChatCompletionRequestSchema, "chat completion request"),
    async (c) => {
      const r = c.req.valid("json");
      const bad = checkMessages(r.messages, true);
      if (bad) throw new ApiError(400, `Invalid parameters: ${bad[0]} (${bad[1]})`, { param: bad[0] });
      const run = await startChat(c, r, manager, hold);
      if (!r.stream) {
        try {
          return await wholeChat(c, run);
        } finally {
          run.release();
        }
      }
      return streamSSE(c, (stream) => streamChat(stream, run));
    },
  );
  return app;
}

/** A started chat completion: its generations and what its answer is built from. */
interface ChatRun {
  r: z.output<typeof ChatCompletionRequestSchema>;
  gens: Generation[];
  /** Gives back the caller's held streams. */
  release: () => void;
  cancelAll: () => void;
  /** The fields every answer and chunk starts with. */
  head: { id: string; created: number; model: string; system_fingerprint: null };
  wantLp: boolean;
  usage: (dones: DoneEvent[]) => { prompt_tokens: number; completion_tokens: number; total_tokens: number };
  replies: ReplyText[];
}

/**
 * Holds the caller's streams, renders the conversation with the model's chat template (400 for a
 * model without one, or with one this server cannot render) and starts the `n` generations.
 */
async function startChat(
  c: Context,
  r: z.output<typeof ChatCompletionRequestSchema>,
  manager: GenerationManager,
  hold: Hold,
): Promise<ChatRun> {
  const n = r.n ?? 1;
  const release = hold(c, r.model, n);
  let gens: Generation[];
  try {
    const template = await manager.chatTemplateOf(r.model);
    if (template === undefined) {
      throw new ApiError(
        400,
        `Model "${r.model}" has no chat template: use /v1/completions, or fine-tune it with ` +
          `"objective": "sft" on a chat dataset`,
        { param: "model" },
      );
    }
    if (template !== CHAT_TEMPLATE) {
      throw new ApiError(
        400,
        `Model "${r.model}" has a chat template this server cannot render (only its own, data/chat.ts)`,
        { param: "model" },
      );
    }
    const prompt = encodeChat(r.messages as ChatMessage[], true).tokens;
    const wantLp = r.logprobs === true;
    gens = await manager.startChoices({
      model: r.model,
      prompt,
      max_tokens: r.max_completion_tokens ?? r.max_tokens ?? undefined,
      temperature: r.temperature ?? 1,
      top_k: r.top_k ?? 0,
      top_p: r.top_p ?? 1,
      seed: r.seed ?? undefined,
      stop: r.stop == null ? [] : typeof r.stop === "string" ? [r.stop] : r.stop,
      ignore_eos: r.ignore_eos ?? false,
      logprobs: wantLp ? r.top_logprobs ?? 0 : null,
      // Cut from the left, a conversation would lose its first turn's role marker: refused instead.
      whole: "messages",
      arrived: arrived(c),
      rehearsal: isRehearsal(c),
    }, n);
  } catch (e) {
    release();
    throw e;
  }
  const wantLp = r.logprobs === true;
  const cancelAll = () => gens.forEach((g) => g.cancel());
  const head = {
    id: `chatcmpl-${gens[0].id.slice(4, 16)}`,
    created: Math.floor(Date.now() / 1000),
    model: gens[0].model.id,
    system_fingerprint: null,
  };
  const usage = (dones: DoneEvent[]) => {
    const prompt_tokens = gens[0].prompt_tokens;
    const completion_tokens = dones.reduce((a, d) => a + (d?.completion_tokens ?? 0), 0);
    return { prompt_tokens, completion_tokens, total_tokens: prompt_tokens + completion_tokens };
  };
  const replies = gens.map(() => new ReplyText());
  return { r, gens, release, cancelAll, head, wantLp, usage, replies };
}

/** A chat completion answered whole (not streamed): every choice's message once all are done. */
async function wholeChat(c: Context, run: ChatRun): Promise<Response> {
  const { gens, cancelAll, head, wantLp, usage, replies } = run;
  c.req.raw.signal?.addEventListener("abort", cancelAll);
  const texts = gens.map(() => ""), lps = gens.map(() => [] as unknown[]);
  const dones: DoneEvent[] = [];
  for await (const { i, es } of mergedBatches(gens)) {
    for (const e of es) {
      if (e.type === "token") {
        texts[i] += replies[i].push(e.text);
        if (wantLp && e.id !== null && e.logprobs) lps[i].push(logprobEntry(e.id, e.logprobs));
      } else dones[i] = e;
    }
  }
  c.req.raw.signal?.removeEventListener("abort", cancelAll);
  const failed = dones.find((d) => d.finish_reason === "error");
  if (failed) throw new ApiError(500, failed.error ?? "Generation failed");
  return c.json({
    ...head,
    object: "chat.completion",
    choices: gens.map((_, i) => ({
      index: i,
      message: { role: "assistant", content: texts[i], refusal: null },
      logprobs: wantLp ? { content: lps[i], refusal: null } : null,
      finish_reason: openaiReason(dones[i]),
    })),
    usage: usage(dones),
  });
}

/**
 * A streamed chat completion: each choice opened with its role, a chunk per piece of reply, a
 * final chunk per choice with its finish reason, the usage when asked, then `[DONE]`.
 */
async function streamChat(stream: SSEStreamingApi, run: ChatRun): Promise<void> {
  const { r, gens, release, cancelAll, head, wantLp, usage, replies } = run;
  const includeUsage = r.stream_options?.include_usage === true;
  stream.onAbort(cancelAll);
  const chunk = (choices: unknown[], extra: Record<string, unknown> = {}) =>
    `data: ${
      JSON.stringify({
        ...head,
        object: "chat.completion.chunk",
        choices,
        ...(includeUsage ? { usage: null } : {}),
        ...extra,
      })
    }\n\n`;
  try {
    // OpenAI opens every choice with its role.
    await stream.write(
      gens.map((_, i) =>
        chunk([{
          index: i,
          delta: { role: "assistant", content: "" },
          logprobs: null,
          finish_reason: null,
        }])
      ).join(""),
    );
    const dones: DoneEvent[] = [];
    for await (const { i, es } of mergedBatches(gens)) {
      let out = "", wrote = false;
      for (const e of es) {
        if (e.type === "token") {
          const text = replies[i].push(e.text);
          const lp = wantLp && e.id !== null && e.logprobs ? [logprobEntry(e.id, e.logprobs)] : [];
          if (text || lp.length) {
            out += chunk([{
              index: i,
              delta: { content: text },
              logprobs: wantLp ? { content: lp, refusal: null } : null,
              finish_reason: null,
            }]);
            wrote = true;
          }
        } else {
          dones[i] = e;
          out += chunk(
            [{ index: i, delta: {}, logprobs: null, finish_reason: openaiReason(e) }],
            e.error ? { error: { message: e.error, type: "server_error", param: null, code: null } } : {},
          );
        }
      }
      if (out) await stream.write(out);
      if (wrote) gens[i].markWritten();
    }
    const tail = includeUsage ? chunk([], { usage: usage(dones) }) : "";
    await stream.write(tail + "data: [DONE]\n\n");
  } finally {
    cancelAll();
    release();
  }
}
