/**
 * The one error handler: HTTPExceptions keep their status (with zod issues when present), the
 * job layer's caller errors map to 404/409/400, and anything else is a logged 500 whose message
 * is still shown, since this is a local tool and the message is what a user needs.
 */

import type { Context } from "hono";
import { HTTPException } from "hono/http-exception";
import type { ContentfulStatusCode } from "hono/utils/http-status";
import {
  GpuUnavailableError,
  InvalidJobError,
  JobConflictError,
  JobNotFoundError,
  ModelNotFoundError,
} from "../jobs/mod.ts";

/** Options of an {@link ApiError}: OpenAI's error type, the parameter at fault, a code, extra headers. */
export interface ApiErrorOptions {
  type?: string;
  param?: string | null;
  code?: string | null;
  headers?: Record<string, string>;
}

/** An error rendered in OpenAI's shape: `{error: {message, type, param, code}}`. */
export class ApiError extends HTTPException {
  readonly type: string;
  readonly param: string | null;
  readonly code: string | null;
  readonly headers: Record<string, string>;

  constructor(status: ContentfulStatusCode, message: string, opts: ApiErrorOptions = {}) {
    super(status, { message });
    this.type = opts.type ?? (status >= 500 ? "server_error" : "invalid_request_error");
    this.param = opts.param ?? null;
    this.code = opts.code ?? null;
    this.headers = opts.headers ?? {};
  }
}

/** Renders any thrown error as JSON `{error, ...}` with the right status. */
export function onError(err: Error, c: Context): Response {
  if (err instanceof ApiError) {
    const error = { message: err.message, type: err.type, param: err.param, code: err.code };
    return c.json({ error }, err.status, err.headers);
  }
  if (err instanceof HTTPException) {
    const body: Record<string, unknown> = { error: err.message || "HTTP error" };
    if (Array.isArray(err.cause)) body.issues = err.cause;
    return c.json(body, err.status);
  }
  if (err instanceof JobNotFoundError) return c.json({ error: err.message }, 404);
  if (err instanceof ModelNotFoundError) return c.json({ error: err.message }, 404);
  if (err instanceof GpuUnavailableError) return c.json({ error: err.message }, 503);
  if (err instanceof JobConflictError) return c.json({ error: err.message }, 409);
  if (err instanceof InvalidJobError) return c.json({ error: err.message, field: err.field }, 400);
  console.error(err);
  return c.json({ error: `Internal error: ${err.message}` }, 500);
}
