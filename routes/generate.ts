/**
 * Generation routes, validating and delegating to the GenerationManager:
 * - `GET /generate?prompt=&model=&max_tokens=&temperature=&top_k=&top_p=&seed=&stop=&ignore_eos=`:
 *   server-sent events, `event: token` `{id, text}` per token, then `event: done` with the finish
 *   reason (length, stop, eos, error), token counts and timings.
 * - `POST /v1/completions`: OpenAI's completions format, streamed (`data: {chunk}` …
 *   `data: [DONE]`) or whole.
 * - `GET /v1/models`: every checkpoint and model directory that can be loaded.
 * A prompt cut to fit the context is reported (`X-Prompt-Truncated` header, `truncated_tokens`).
 * A client that disconnects cancels its generation through `onAbort` (writes never fail loudly).
 */

import { type Context, Hono } from "hono";
import { HTTPException } from "hono/http-exception";
import { streamSSE } from "hono/streaming";
import { z } from "zod";
import type { DoneEvent, GenerateParams, Generation, GenerationManager } from "../jobs/mod.ts";

const MAX_PROMPT_CHARS = 1_000_000;

const stopList = z.array(z.string().min(1).max(256)).max(8);

/** Sampling and length parameters shared by both routes (JSON numbers). */
const samplingShape = {
  max_tokens: z.number().int().min(1).max(8192).optional(),
  temperature: z.number().min(0).max(10).default(1),
  top_k: z.number().int().min(0).max(50257).default(0),
  top_p: z.number().gt(0).max(1).default(1),
  seed: z.number().int().min(0).max(2 ** 32 - 1).optional(),
  ignore_eos: z.boolean().default(false),
};

/** Query of `GET /generate` (strings coerced). */
export const GenerateQuerySchema = z.strictObject({
  model: z.string().min(1).max(300),
  prompt: z.string().max(MAX_PROMPT_CHARS).default(""),
  max_tokens: z.coerce.number().int().min(1).max(8192).optional(),
  temperature: z.coerce.number().min(0).max(10).default(1),
  top_k: z.coerce.number().int().min(0).max(50257).default(0),
  top_p: z.coerce.number().gt(0).max(1).default(1),
  seed: z.coerce.number().int().min(0).max(2 ** 32 - 1).optional(),
  stop: stopList.default([]),
  ignore_eos: z.enum(["true", "false", "1", "0"]).transform((v) => v === "true" || v === "1").default(false),
});

/** Body of `POST /v1/completions` (OpenAI's fields, plus top_k and ignore_eos). */
export const CompletionRequestSchema = z.object({
  model: z.string().min(1).max(300),
  prompt: z.union([z.string().max(MAX_PROMPT_CHARS), z.array(z.string().max(MAX_PROMPT_CHARS)).length(1)])
    .default(""),
  ...samplingShape,
  max_tokens: samplingShape.max_tokens.default(16),
  stop: z.union([z.string().min(1).max(256), stopList]).nullable().optional(),
  stream: z.boolean().default(false),
  n: z.literal(1).default(1),
  user: z.string().optional(),
});

/** Throws a 400 naming every parameter zod rejected. */
function invalid(issues: z.core.$ZodIssue[]): never {
  const names = [...new Set(issues.map((i) => i.path.join(".") || "body"))];
  throw new HTTPException(400, { message: `Invalid parameters: ${names.join(", ")}`, cause: issues });
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

/** OpenAI's finish reasons: the end-of-text token is a "stop". */
function openaiReason(d: DoneEvent): string | null {
  if (d.finish_reason === "length") return "length";
  if (d.finish_reason === "stop" || d.finish_reason === "eos") return "stop";
  return d.finish_reason === "error" ? "error" : null;
}

function usage(d: DoneEvent) {
  return {
    prompt_tokens: d.prompt_tokens,
    completion_tokens: d.completion_tokens,
    total_tokens: d.prompt_tokens + d.completion_tokens,
    ...(d.truncated_tokens > 0 ? { truncated_prompt_tokens: d.truncated_tokens } : {}),
  };
}

/** Generation routes backed by `manager`. */
export function generateRoutes(manager: GenerationManager): Hono {
  const app = new Hono();

  app.get("/generate", async (c) => {
    const raw: Record<string, unknown> = { ...c.req.query() };
    const stops = c.req.queries("stop");
    if (stops) raw.stop = stops;
    const parsed = GenerateQuerySchema.safeParse(raw);
    if (!parsed.success) invalid(parsed.error.issues);
    const gen = await manager.start(parsed.data satisfies GenerateParams);
    truncationHeader(c, gen);
    return streamSSE(c, async (stream) => {
      stream.onAbort(() => gen.cancel());
      try {
        for await (const e of gen.events()) {
          if (e.type === "token") {
            await stream.writeSSE({ event: "token", data: JSON.stringify({ id: e.id, text: e.text }) });
          } else {
            await stream.writeSSE({ event: "done", data: JSON.stringify(doneData(gen, e)) });
          }
        }
      } finally {
        gen.cancel(); // no-op once finished
      }
    });
  });

  app.post("/v1/completions", async (c) => {
    let body: unknown;
    try {
      body = await c.req.json();
    } catch {
      throw new HTTPException(400, { message: "Invalid JSON body" });
    }
    const parsed = CompletionRequestSchema.safeParse(body);
    if (!parsed.success) invalid(parsed.error.issues);
    const r = parsed.data;
    const gen = await manager.start({
      model: r.model,
      prompt: Array.isArray(r.prompt) ? r.prompt[0] : r.prompt,
      max_tokens: r.max_tokens,
      temperature: r.temperature,
      top_k: r.top_k,
      top_p: r.top_p,
      seed: r.seed,
      stop: r.stop == null ? [] : typeof r.stop === "string" ? [r.stop] : r.stop,
      ignore_eos: r.ignore_eos,
    });
    truncationHeader(c, gen);
    const head = {
      id: `cmpl-${gen.id.slice(4)}`,
      object: "text_completion",
      created: Math.floor(Date.now() / 1000),
      model: gen.model.id,
    };
    if (!r.stream) {
      const abort = () => gen.cancel();
      c.req.raw.signal?.addEventListener("abort", abort);
      const { text, done } = await gen.collect();
      c.req.raw.signal?.removeEventListener("abort", abort);
      if (done.finish_reason === "error") throw new Error(done.error ?? "Generation failed");
      return c.json({
        ...head,
        choices: [{ text, index: 0, logprobs: null, finish_reason: openaiReason(done) }],
        usage: usage(done),
      });
    }
    return streamSSE(c, async (stream) => {
      stream.onAbort(() => gen.cancel());
      const chunk = (text: string, finish_reason: string | null, extra: Record<string, unknown> = {}) =>
        stream.writeSSE({
          data: JSON.stringify({
            ...head,
            choices: [{ text, index: 0, logprobs: null, finish_reason }],
            ...extra,
          }),
        });
      try {
        for await (const e of gen.events()) {
          if (e.type === "token") {
            if (e.text) await chunk(e.text, null);
          } else {
            await chunk("", openaiReason(e), {
              usage: usage(e),
              ...(e.error ? { error: { message: e.error } } : {}),
            });
          }
        }
        await stream.writeSSE({ data: "[DONE]" });
      } finally {
        gen.cancel();
      }
    });
  });

  app.get("/v1/models", async (c) => {
    const models = await manager.models();
    return c.json({
      object: "list",
      data: models.map((m) => ({
        id: m.id,
        object: "model",
        created: m.created,
        owned_by: "gpt2-webgpu",
        kind: m.kind,
        n_layer: m.config.n_layer,
        n_head: m.config.n_head,
        n_embd: m.config.n_embd,
        n_positions: m.config.n_positions,
      })),
    });
  });

  return app;
}
