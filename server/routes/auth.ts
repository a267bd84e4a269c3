/**
 * The token check of every route but the dashboard's files: who the caller is (server/auth/
 * token_auth.ts), which scope the route needs, and the guards around it. A token in the query
 * string is refused (it would end in logs and browser history); a client address that presented
 * too many wrong tokens is answered 429 for the rest of its window, whatever it sends; a valid
 * token without the route's scope is 403. The caller is kept on the context ({@link principalOf})
 * for the routes' ownership checks. No answer or log line ever carries the presented token.
 */

import type { Context, MiddlewareHandler } from "hono";
import { ApiError } from "./api_errors.ts";
import { LOCAL_ADMIN, type Principal, type TokenAuth } from "../auth/token_auth.ts";
import { type Scope, TOKEN_FORM } from "../auth/tokens.ts";
import { clientKey, identifyByToken } from "./sse.ts";
import type { AddressRanges } from "../addresses.ts";
import { createHash } from "node:crypto";
import { InvalidJobError, type JobRunner } from "../jobs/mod.ts";
import { isBuiltinName } from "../../data/mod.ts";
import type { Access } from "../auth/access.ts";

const PRINCIPAL = "gpt2.principal";
const AUTH_CHALLENGE = 'Bearer realm="gpt2-webgpu"';
/** Query keys a client might put a token in. */
const TOKEN_KEYS = new Set([
  "access_token",
  "token",
  "api_key",
  "apikey",
  "key",
  "bearer",
  "auth",
  "authorization",
]);

/** What a route needs: a scope, `models` (read or generate), or `any` valid caller. */
export type RouteClass = Scope | "models" | "any";

/** The caller of request `c` (a server with no token configured: the local admin). */
export function principalOf(c: Context): Principal {
  return (c.get(PRINCIPAL as never) as Principal | undefined) ?? LOCAL_ADMIN;
}

/** The class of a route, by method and path (server/routes/*.ts's routes). */
export function routeClass(method: string, path: string): RouteClass {
  if (path === "/admin" || path.startsWith("/admin/") || path === "/metrics") return "admin";
  if (path === "/health" || path === "/ready" || path === "/auth/me") return "any";
  if (
    path === "/generate" || path === "/v1/completions" || path === "/v1/chat/completions" ||
    path === "/tokenize" || path === "/detokenize"
  ) {
    return "generate";
  }
  if (path === "/v1/models" || path.startsWith("/v1/models/")) return "models";
  if (method === "GET" || method === "HEAD") return "read";
  return "train";
}

/** Whether `p` may call a route of class `cls`. */
export function allowed(p: Principal, cls: RouteClass): boolean {
  if (p.admin || cls === "any") return true;
  if (cls === "models") return p.scopes.has("read") || p.scopes.has("generate");
  return p.scopes.has(cls);
}

/** Wrong tokens from one client address: at most `max` per `windowMs`, then 429 until the window ends. */
export class FailureLimiter {
  #windows = new Map<string, { start: number; count: number }>();
  constructor(readonly max = 20, readonly windowMs = 60_000, readonly now: () => number = Date.now) {}

  /** Seconds `key` must wait, or 0 when it may try. */
  blockedFor(key: string): number {
    const w = this.#windows.get(key);
    if (!w) return 0;
    const left = w.start + this.windowMs - this.now();
    if (left <= 0) {
      this.#windows.delete(key);
      return 0;
    }
    return w.count >= this.max ? Math.ceil(left / 1000) : 0;
  }

  /** Counts one wrong token from `key`. */
  fail(key: string): void {
    const now = this.now();
    let w = this.#windows.get(key);
    if (!w || now - w.start >= this.windowMs) this.#windows.set(key, w = { start: now, count: 0 });
    w.count++;
    if (this.#windows.size > 100_000) {
      for (const [k, v] of this.#windows) if (now - v.start >= this.windowMs) this.#windows.delete(k);
    }
  }
}

function unauthorized(message: string, code: string, error?: string): ApiError {
  return new ApiError(401, message, {
    code,
    headers: { "WWW-Authenticate": error ? `${AUTH_CHALLENGE}, error="${error}"` : AUTH_CHALLENGE },
  });
}

const WORDS: Record<"invalid" | "revoked" | "expired", [string, string]> = {
  invalid: ["Invalid bearer token", "invalid_api_key"],
  revoked: ["Bearer token was revoked", "revoked_api_key"],
  expired: ["Bearer token has expired", "expired_api_key"],
};

/**
 * The token check. `skip(c)` lets a request past unchecked (the warm-up's own, server/rehearsal.ts);
 * `onUse` is told each caller and route class (the per-user counters of /metrics).
 */
export function authGuard(
  auth: TokenAuth,
  opts: {
    trusted: AddressRanges;
    failures: FailureLimiter;
    skip?: (c: Context) => boolean;
    onUse?: (p: Principal, cls: RouteClass) => void;
  },
): MiddlewareHandler {
  return async (c, next) => {
    if (opts.skip?.(c)) return await next();
    const url = new URL(c.req.url);
    for (const [k, v] of url.searchParams) {
      if (TOKEN_KEYS.has(k.toLowerCase()) || TOKEN_FORM.test(v)) {
        throw new ApiError(
          400,
          `Tokens are not accepted in the query string ("${
            k.slice(0, 40)
          }"): send "Authorization: Bearer <token>" and revoke a token that was sent in a URL`,
          { param: k.slice(0, 40), code: "token_in_query" },
        );
      }
    }
    const cls = routeClass(c.req.method, c.req.path);
    if (!auth.required) {
      c.set(PRINCIPAL as never, LOCAL_ADMIN as never);
      opts.onUse?.(LOCAL_ADMIN, cls);
      return await next();
    }
    const address = clientKey(c, opts.trusted);
    const wait = opts.failures.blockedFor(address);
    if (wait > 0) {
      throw new ApiError(429, `Too many wrong tokens from this address: retry in ${wait} s`, {
        code: "too_many_auth_failures",
        headers: { "Retry-After": String(wait) },
      });
    }
    const header = c.req.header("Authorization");
    if (header === undefined) {
      throw unauthorized('Missing bearer token: send "Authorization: Bearer <token>"', "missing_api_key");
    }
    const m = /^Bearer +(.+)$/i.exec(header);
    const got = m ? auth.check(m[1].trimEnd()) : "invalid";
    if (typeof got === "string") {
      opts.failures.fail(address);
      const [message, code] = WORDS[got];
      // Another scheme (Basic, Token, a bare token) is said so, without echoing what was sent.
      const how = m ? message : 'Authorization is not "Bearer <token>": send "Authorization: Bearer <token>"';
      throw unauthorized(how, code, "invalid_token");
    }
    if (!allowed(got, cls)) {
      throw new ApiError(
        403,
        `Token "${got.tokenId}" lacks the "${cls === "models" ? "read" : cls}" scope this route needs`,
        {
          code: "insufficient_scope",
          headers: { "WWW-Authenticate": `${AUTH_CHALLENGE}, error="insufficient_scope", scope="${cls}"` },
        },
      );
    }
    c.set(PRINCIPAL as never, got as never);
    identifyByToken(c, createHash("sha256").update(got.tokenId ?? m![1]).digest());
    opts.onUse?.(got, cls);
    await next();
  };
}

/** A resume_from of the form the runner accepts (others get its own wording). */
const RESUME_SPEC = /^[A-Za-z0-9_-]+(\/iter_\d+)?$/;

/**
 * Refuses a job's sources that `p` may not use exactly as ones that do not exist (so another
 * user's ids do not leak): init_from (or an evaluation's model), resume_from and the dataset.
 */
export function checkSources(
  runner: JobRunner,
  access: Access,
  p: Principal,
  req: { init_from?: string; resume_from?: string; dataset?: string; model?: unknown },
  modelField: "init_from" | "model",
): void {
  const model = modelField === "model" ? req.model : req.init_from;
  if (typeof model === "string" && !access.modelAllowed(p, model)) {
    throw runner.unknownModel(model, modelField);
  }
  const resume = req.resume_from;
  if (resume && RESUME_SPEC.test(resume) && !access.modelAllowed(p, resume)) {
    throw new InvalidJobError("resume_from", `Unknown checkpoint "${resume}"`);
  }
  if (req.dataset !== undefined && !access.datasetAllowed(p, req.dataset, isBuiltinName(req.dataset))) {
    throw new InvalidJobError("dataset", `Unknown dataset "${req.dataset}"`);
  }
}
