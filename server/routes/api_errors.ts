/**
 * The API's one error shape, OpenAI's `{error: {message, type, param, code}}`, produced here and
 * nowhere else. Route code throws {@link ApiError} (or Hono's HTTPException, or the job layer's
 * error classes); {@link onError} renders all of them, zod issues included (`param` is the first
 * issue's path), keeping the headers a thrown exception carries (`WWW-Authenticate` on a 401).
 * Anything else is a logged 500 whose message is still shown, since the message is what a user
 * of this local tool needs; the data and sources folders are cut from messages ("$GPT2_HOME").
 * The OpenAI-compatible generation routes word bad requests their own way ({@link ErrorStyle}).
 */

import type { Context, MiddlewareHandler } from "hono";
import { HTTPException } from "hono/http-exception";
import type { ContentfulStatusCode } from "hono/utils/http-status";
import { zValidator } from "@hono/zod-validator";
import type { z } from "zod";
import { GenerationOverloadedError } from "../generate/mod.ts";
import {
  GpuUnavailableError,
  InvalidJobError,
  JobConflictError,
  JobNotFoundError,
  LimitError,
  ModelNotFoundError,
  QuotaError,
} from "../jobs/mod.ts";
import { isStoreUnavailable } from "../jobs/job_store.ts";
import { PathOutsideRootError } from "../../data/mod.ts";

/** Options of an {@link ApiError}: OpenAI's `type` (default from the status), `param`, `code`, extra headers. */
export interface ApiErrorOptions {
  type?: string;
  param?: string | null;
  code?: string | null;
  headers?: HeadersInit;
}

/** The OpenAI error type for a status. */
export function errorType(status: number): string {
  if (status === 401) return "authentication_error";
  if (status === 403) return "permission_error";
  if (status === 404) return "not_found_error";
  if (status === 429) return "rate_limit_error";
  if (status === 507) return "insufficient_storage_error";
  return status >= 500 ? "server_error" : "invalid_request_error";
}

/** An error the API answers with `status` and the one error shape. */
export class ApiError extends HTTPException {
  readonly type: string;
  readonly param: string | null;
  readonly code: string | null;
  readonly headers: HeadersInit | undefined;

  constructor(status: ContentfulStatusCode, message: string, opts: ApiErrorOptions = {}) {
    super(status, { message });
    this.name = "ApiError";
    this.type = opts.type ?? errorType(status);
    this.param = opts.param ?? null;
    this.code = opts.code ?? null;
    this.headers = opts.headers;
  }
}

/** The body of every error response. */
export interface ErrorBody {
  error: { message: string; type: string; param: string | null; code: string | null };
}

type Issue = z.core.$ZodIssue;

/**
 * An issue as a user can act on it: a union none of whose options matched ("Invalid input") is
 * replaced by the issues of the one option whose type matched (an object given for `string |
 * {n_layer, …}` reports the missing field), when there is exactly one.
 */
function actionable(issue: Issue): Issue[] {
  if (issue.code !== "invalid_union") return [issue];
  const typed = issue.errors.filter((b) =>
    !(b.length === 1 && b[0].code === "invalid_type" && b[0].path.length === 0)
  );
  if (typed.length !== 1 || typed[0].length === 0) return [issue];
  return typed[0].map((b) => ({ ...b, path: [...issue.path, ...b.path] }) as Issue);
}

/** The parameter an issue is about: its path joined by ".", or the first unknown key. */
export function issueParam(issue: Issue): string | null {
  const path = issue.path.map(String).join(".");
  if (issue.code === "unrecognized_keys" && issue.keys.length > 0) {
    return path ? `${path}.${issue.keys[0]}` : issue.keys[0];
  }
  return path || null;
}

/**
 * How a route words its errors, in the one shape either way:
 * - "detailed" (the default): a validation error is `Invalid <what>: a: problem; b: problem` with
 *   `code` the first zod issue's; a body that is not JSON is Hono's "Malformed JSON in request
 *   body"; an InvalidJobError has code "invalid_value".
 * - "openai": the OpenAI-compatible generation routes' (generate.ts: `/v1/completions`, ...):
 *   `Invalid parameters: a (problem), b (problem)` naming each parameter once (the first as `param`), a body that is
 *   not JSON is "Invalid JSON body" (param "body"), and these and an InvalidJobError have code null.
 */
export type ErrorStyle = "detailed" | "openai";

/** Context key of a route's {@link ErrorStyle}. */
const ERROR_STYLE = "gpt2.errorStyle";

/** Middleware putting a route's errors in `style`: list it before the route's validators. */
export function errorStyle(style: ErrorStyle): MiddlewareHandler {
  return async (c, next) => {
    c.set(ERROR_STYLE as never, style as never);
    await next();
  };
}

function styleOf(c: Context): ErrorStyle {
  return (c.get(ERROR_STYLE as never) as unknown) === "openai" ? "openai" : "detailed";
}

/** The parameter an issue names in OpenAI's wording: its path, the unknown keys, or "body". */
function parameterName(issue: Issue): string {
  if (issue.code === "unrecognized_keys") return issue.keys.join(", ");
  return issue.path.join(".") || "body";
}

/**
 * An ApiError 400 in OpenAI's wording, each parameter once with why:
 * `Invalid parameters: a (problem), b (unknown parameter)`, param the first, code null.
 */
export function parametersError(issues: readonly Issue[]): ApiError {
  const why = new Map<string, string>();
  for (const i of issues.flatMap(actionable)) {
    const named: [string, string][] = i.code === "unrecognized_keys"
      ? i.keys.map((k) => [[...i.path, k].join("."), "unknown parameter"])
      : [[parameterName(i), i.message]];
    for (const [name, problem] of named) if (!why.has(name)) why.set(name, problem);
  }
  const parts = [...why].map(([name, problem]) => `${name} (${problem})`);
  return new ApiError(400, `Invalid parameters: ${parts.join(", ")}`, {
    param: why.keys().next().value ?? null,
  });
}

function validationError(c: Context, what: string, issues: readonly Issue[]): ApiError {
  return styleOf(c) === "openai" ? parametersError(issues) : zodError(what, issues);
}

/** An ApiError 400 describing zod's issues: `Invalid <what>: a: problem; b: problem`, param of the first. */
export function zodError(what: string, raw: readonly Issue[]): ApiError {
  const issues = raw.flatMap(actionable);
  const parts = issues.slice(0, 10).map((i) => {
    const p = issueParam(i);
    return p ? `${p}: ${i.message}` : i.message;
  });
  const more = issues.length > 10 ? `; and ${issues.length - 10} more` : "";
  return new ApiError(400, `Invalid ${what}: ${parts.join("; ")}${more}`, {
    param: issues[0] ? issueParam(issues[0]) : null,
    code: issues[0]?.code ?? null,
  });
}

/**
 * Validates a JSON body against `schema` (the route's `c.req.valid("json")` is then typed); a
 * failure is a 400 naming the fields, worded in the route's {@link ErrorStyle}. The content type
 * itself is checked in app.ts (415).
 */
export function jsonBody<T extends z.ZodType>(schema: T, what: string) {
  const check = zValidator("json", schema, (result, c) => {
    if (!result.success) throw validationError(c, what, result.error.issues);
  });
  const run: typeof check = async (c, next) => {
    if (styleOf(c) === "openai") {
      // Parsed here to word the failure; the validator reads the request's cached result.
      try {
        await c.req.json();
      } catch {
        throw new ApiError(400, "Invalid JSON body", { param: "body" });
      }
    }
    return await check(c, next);
  };
  return run;
}

/** Validates a query string against `schema`, as {@link jsonBody} does a body. */
export function queryParams<T extends z.ZodType>(schema: T, what: string) {
  return zValidator("query", schema, (result, c) => {
    if (!result.success) throw validationError(c, what, result.error.issues);
  });
}

/** A folder to cut from messages, and the name shown instead (e.g. `["/srv/gpt2", "$GPT2_HOME"]`). */
export type PathAlias = readonly [path: string, name: string];

/** The aliases of a folder: as given, and its real absolute path when it exists. */
export function pathAliases(path: string, name: string): PathAlias[] {
  const out: PathAlias[] = [[path, name]];
  try {
    out.unshift([Deno.realPathSync(path), name]);
  } catch { /* not there (yet): only the form given */ }
  return out;
}

/** Replaces each alias's folder in `message` by its name (longest folders first). */
export function scrubPaths(message: string, aliases: readonly PathAlias[]): string {
  let out = message;
  const sorted = [...aliases].sort((a, b) => b[0].length - a[0].length);
  for (const [path, name] of sorted) {
    const p = path.replace(/\/+$/, "");
    if (p.length > 1 && p !== ".") out = out.replaceAll(p, name);
  }
  return out;
}

/** Renders a thrown error as the one error shape; `aliases` are cut from messages. */
export function errorHandler(aliases: readonly PathAlias[] = []): (err: Error, c: Context) => Response {
  return (err, c) => {
    const r = toApiError(err, styleOf(c));
    const body: ErrorBody = {
      error: { message: scrubPaths(r.message, aliases), type: r.type, param: r.param, code: r.code },
    };
    return c.json(body, r.status, headersOf(r, err));
  };
}

/** {@link errorHandler} without path scrubbing. */
export const onError: (err: Error, c: Context) => Response = errorHandler();

function headersOf(r: ApiError, err: Error): Record<string, string> {
  const out: Record<string, string> = {};
  if (err instanceof HTTPException && !(err instanceof ApiError) && err.res) {
    err.res.headers.forEach((v, k) => {
      if (k !== "content-type" && k !== "content-length") out[k] = v;
    });
  }
  new Headers(r.headers).forEach((v, k) => (out[k] = v));
  return out;
}

/** The ApiError a thrown error is answered with, worded in `style`. */
export function toApiError(err: Error, style: ErrorStyle = "detailed"): ApiError {
  if (err instanceof ApiError) return err;
  if (err instanceof HTTPException) {
    const status = err.status as ContentfulStatusCode;
    if (Array.isArray(err.cause) && err.cause.length > 0) {
      const issues = err.cause as Issue[];
      return new ApiError(status, err.message || zodError("request", issues).message, {
        param: issueParam(issues[0]),
        code: issues[0].code ?? null,
      });
    }
    const fallback = status === 401 ? "Unauthorized" : `HTTP error ${status}`;
    return new ApiError(status, err.message || fallback);
  }
  if (err instanceof JobNotFoundError) {
    return new ApiError(404, err.message, { param: "id", code: "job_not_found" });
  }
  if (err instanceof ModelNotFoundError) {
    return new ApiError(404, err.message, {
      type: "invalid_request_error",
      param: "model",
      code: "model_not_found",
    });
  }
  if (err instanceof GpuUnavailableError) return new ApiError(503, err.message, { code: "gpu_unavailable" });
  if (isStoreUnavailable(err)) {
    return new ApiError(503, `The job store is unreachable, try again shortly: ${err.message}`, {
      code: "store_unavailable",
    });
  }
  if (err instanceof JobConflictError) return new ApiError(409, err.message, { code: "conflict" });
  if (err instanceof InvalidJobError) {
    return new ApiError(400, err.message, {
      param: err.field,
      code: style === "openai" ? null : "invalid_value",
    });
  }
  if (err instanceof GenerationOverloadedError) {
    return new ApiError(429, err.message, {
      type: "server_error",
      code: "too_many_requests",
      headers: { "Retry-After": String(err.retryAfter) },
    });
  }
  if (err instanceof LimitError) {
    return new ApiError(err.status, err.message, { param: err.param, code: "limit_exceeded" });
  }
  if (err instanceof QuotaError) {
    return new ApiError(429, err.message, {
      code: "quota_exceeded",
      headers: err.retryAfter === null ? undefined : { "Retry-After": String(err.retryAfter) },
    });
  }
  if (err instanceof PathOutsideRootError) {
    return new ApiError(403, `Path "${err.path}" is outside the sources folder`, {
      param: "path",
      code: "path_outside_sources",
    });
  }
  console.error(err);
  return new ApiError(500, `Internal error: ${err.message}`, { code: "internal_error" });
}
