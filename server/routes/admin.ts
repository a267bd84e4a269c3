/**
 * Users, tokens, quotas, sharing and the audit trail, over HTTP:
 * - `GET /auth/me`: the caller (user, token, scopes), their quotas and what they hold now; any
 *   valid token (the dashboard's sign-in).
 * - admin scope: `POST /admin/tokens {user, scopes, name?, expires?}` (201; the token is in this
 *   answer only), `GET /admin/tokens[?user=]`, `DELETE /admin/tokens/:id` (revoked on every host
 *   within a heartbeat), `GET /admin/users` (quotas and usage), `PUT /admin/users/:name/quotas`,
 *   `POST /admin/shares {kind, id}` (a dataset or checkpoint every user may use),
 *   `GET /admin/audit[?user=&before=&limit=]`.
 * Each change is an audit event ({@link audit}).
 */

import { type Context, Hono } from "hono";
import { z } from "zod";
import type { JobStore } from "../jobs/job_store.ts";
import type { TokenAuth } from "../auth/token_auth.ts";
import type { Access } from "../auth/access.ts";
import type { QuotaBook } from "../auth/quotas.ts";
import { parseExpiry, parseScopes, SCOPES, TOKEN_ID, USER_NAME } from "../auth/tokens.ts";
import { QUOTA_SETTINGS } from "../settings.ts";
import { ApiError, jsonBody, queryParams } from "./api_errors.ts";
import type { FailureLimiter } from "./auth.ts";
import { principalOf } from "./auth.ts";

/** The parts of multi-user service the routes share (built in app.ts). */
export interface Auth {
  tokens: TokenAuth;
  access: Access;
  quotas: QuotaBook;
  failures: FailureLimiter;
}

/** Records an audit event for the caller of `c` (a store that fails it is logged, never the request's failure). */
export function audit(
  store: JobStore,
  c: Context,
  action: string,
  target: string | null,
  detail: Record<string, unknown> = {},
): void {
  try {
    store.addAudit({ user: principalOf(c).user, action, target, detail });
  } catch (e) {
    console.error(`Cannot record audit event "${action}": ${(e as Error).message}`);
  }
}

const TokenRequestSchema = z.strictObject({
  user: z.string().regex(
    USER_NAME,
    "Use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit",
  ),
  scopes: z.array(z.enum(SCOPES)).min(1),
  name: z.string().max(100).optional(),
  expires: z.string().max(40).optional(),
});

const quota = z.number().int().min(0).max(1e12);
const QuotasSchema = z.strictObject(
  Object.fromEntries(Object.keys(QUOTA_SETTINGS).map((k) => [k, quota.optional()])) as Record<
    keyof typeof QUOTA_SETTINGS,
    z.ZodOptional<typeof quota>
  >,
);

const ShareSchema = z.strictObject({
  kind: z.enum(["dataset", "checkpoint"]),
  id: z.string().regex(/^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/),
});

const AuditQuerySchema = z.strictObject({
  user: z.string().max(64).optional(),
  before: z.coerce.number().int().min(1).optional(),
  limit: z.coerce.number().int().min(1).max(1000).default(100),
});

const TokensQuerySchema = z.strictObject({ user: z.string().max(64).optional() });

/** The routes above, over `store` and `auth`; `exists` says whether a dataset or checkpoint may be shared. */
export function adminRoutes(
  store: JobStore,
  auth: Auth,
  exists?: (kind: "dataset" | "checkpoint", id: string) => Promise<boolean>,
): Hono {
  const app = new Hono();

  app.get("/auth/me", (c) => {
    const p = principalOf(c);
    const token = p.tokenId === null
      ? null
      : auth.tokens.list(p.user ?? undefined).find((t) => t.id === p.tokenId);
    return c.json({
      user: p.user,
      token: token ? { id: token.id, name: token.name, expires_at: token.expires_at } : null,
      scopes: [...p.scopes],
      admin: p.admin,
      auth_required: auth.tokens.required,
      quotas: p.user === null ? null : auth.quotas.of(p.user),
      usage: p.user === null ? null : auth.quotas.usage(p.user),
    });
  });

  app.post("/admin/tokens", jsonBody(TokenRequestSchema, "token request"), (c) => {
    const req = c.req.valid("json");
    let expiresAt: string | null = null;
    try {
      if (req.expires !== undefined) expiresAt = parseExpiry(req.expires);
    } catch (e) {
      throw new ApiError(400, (e as Error).message, { param: "expires", code: "invalid_value" });
    }
    const { token, record } = auth.tokens.create({
      user: req.user,
      name: req.name,
      scopes: parseScopes(req.scopes),
      expiresAt,
    });
    audit(store, c, "token.create", record.id, { user: record.user, scopes: record.scopes });
    return c.json({ token, ...record }, 201);
  });

  app.get("/admin/tokens", queryParams(TokensQuerySchema, "token list query"), (c) => {
    return c.json({ tokens: auth.tokens.list(c.req.valid("query").user) });
  });

  app.delete("/admin/tokens/:id", (c) => {
    const id = c.req.param("id");
    const known = TOKEN_ID.test(id) && auth.tokens.list().find((t) => t.id === id);
    if (!known) {
      throw new ApiError(404, `Token "${id.slice(0, 40)}" not found`, {
        param: "id",
        code: "token_not_found",
      });
    }
    const revoked = auth.tokens.revoke(id);
    if (revoked) audit(store, c, "token.revoke", id, { user: known.user });
    return c.json({ id, revoked: true });
  });

  app.get("/admin/users", (c) => {
    const tokens = auth.tokens.list();
    return c.json({
      defaults: auth.quotas.defaults,
      users: store.users().map((u) => ({
        name: u.name,
        created_at: u.created_at,
        quotas: auth.quotas.of(u.name),
        own_quotas: u.quotas,
        usage: auth.quotas.usage(u.name),
        tokens: tokens.filter((t) => t.user === u.name).length,
      })),
    });
  });

  app.put("/admin/users/:name/quotas", jsonBody(QuotasSchema, "quotas"), (c) => {
    const name = c.req.param("name");
    const quotas = c.req.valid("json") as Record<string, number>;
    if (!store.setQuotas(name, quotas)) {
      throw new ApiError(404, `User "${name.slice(0, 64)}" not found`, {
        param: "name",
        code: "user_not_found",
      });
    }
    auth.quotas.changed();
    audit(store, c, "user.quotas", name, quotas);
    return c.json({ name, quotas: auth.quotas.of(name), own_quotas: quotas });
  });

  app.post("/admin/shares", jsonBody(ShareSchema, "share request"), async (c) => {
    const { kind, id } = c.req.valid("json");
    // Only what exists: a share of a name nobody holds yet would go to whoever takes it next.
    if (exists && !(await exists(kind, id))) {
      throw new ApiError(404, `No ${kind} "${id}" to share`, { param: "id", code: `${kind}_not_found` });
    }
    auth.access.share(kind, id);
    audit(store, c, "share", `${kind}/${id}`);
    return c.json({ kind, id, shared: true }, 201);
  });

  app.get("/admin/audit", queryParams(AuditQuerySchema, "audit query"), (c) => {
    const q = c.req.valid("query");
    const events = store.audit({ user: q.user, before: q.before, limit: q.limit });
    return c.json({ events, has_more: events.length === q.limit });
  });

  return app;
}
