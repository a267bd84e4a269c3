/**
 * Builds the Hono app and its guards, in order: request counting, the Host check (against DNS
 * rebinding), the Origin and Sec-Fetch-Site checks (against cross-site requests from any page a
 * user visits), CORS for an explicit allow-list, the token check (server/routes/auth.ts: users'
 * tokens and the bootstrap GPT2_API_TOKEN, constant-time, scopes per route class, wrong tokens
 * limited per address, none in a query string), `application/json` on state-changing methods,
 * body-size limits and the bound on open streams (per client: its token when auth is on, else its
 * address, taken from `X-Forwarded-For` or `Forwarded` only behind a trusted proxy); then the job,
 * health, admin, estimate, checkpoint, generation and extra route groups, and the one error handler.
 * No state of its own beyond per-app counters: everything comes from the arguments.
 */

import { Hono, type MiddlewareHandler } from "hono";
import { bodyLimit } from "hono/body-limit";
import { cors } from "hono/cors";
import { defaultLimits, type Limits, LOOPBACK_HOSTS, WILDCARD_HOSTS } from "../settings.ts";
import { type GenerationManager } from "../generate/mod.ts";
import { type JobRunner } from "../jobs/mod.ts";
import { ApiError, errorHandler, pathAliases } from "./api_errors.ts";
import { healthRoutes } from "./health.ts";
import { jobRoutes } from "./jobs.ts";
import { ARRIVED, generateRoutes } from "./generate.ts";
import { isRehearsal, markRehearsal } from "../rehearsal.ts";
import { chatRoutes } from "./chat_completions.ts";
import { type AppMetrics, createMetrics, type MetricsHook, userMetrics } from "./metrics.ts";
import { clientKey, type StreamCounter, streamLimit } from "./sse.ts";
import { authGuard, FailureLimiter } from "./auth.ts";
import { adminRoutes, type Auth } from "./admin.ts";
import { TokenAuth } from "../auth/token_auth.ts";
import { Access } from "../auth/access.ts";
import { QuotaBook } from "../auth/quotas.ts";
import { listCheckpoints } from "../../checkpoint/checkpoint.ts";
import { defaultQuotas } from "../settings.ts";
import { AddressRanges } from "../addresses.ts";
import { webRoutes } from "./web.ts";
import { estimateRoutes } from "./estimate.ts";
import { checkpointRoutes } from "./checkpoints.ts";

/** What the app is built from. */
export interface AppOptions {
  /** While `active()` (a graceful stop), every request gets 503 with `Retry-After`, health included. */
  draining?: { active: () => boolean; retryAfterSeconds: number };
  runner: JobRunner;
  /**
   * The bootstrap bearer token (GPT2_API_TOKEN; any one of several): an admin with no user. Null
   * for none: then, while no user token is live either, no token is asked (loopback only). Each
   * token is one client of the per-client stream limit.
   */
  token: string | readonly string[] | null;
  /**
   * Users' tokens, ownership and quotas (server/auth/); missing parts are made over the runner's
   * store (a TokenAuth that reloads only when asked, the default quotas).
   */
  auth?: Partial<Auth>;
  /** Largest accepted body for the job routes, in bytes (overrides `limits.maxBodyBytes`). */
  maxBodyBytes?: number;
  /** Largest accepted body for any other route (overrides `limits.maxUploadBytes`). */
  maxUploadBytes?: number;
  /** Resource limits; missing ones take their defaults (server/settings.ts). */
  limits?: Partial<Limits>;
  /** Generation (`GET /generate`, `/v1/completions`, `/v1/models`); absent: not served. */
  generation?: GenerationManager;
  /** Other route groups mounted at "/" (e.g. datasets). */
  extra?: Hono[];
  /** Server start time in ms (for uptime). */
  startedAt?: number;
  /** The address the server is bound to (default 127.0.0.1): requests must name it in Host. */
  host?: string;
  /** The bound port; when given (and not 0) the Host header's port must match it. */
  port?: number;
  /** More host names requests may use (GPT2_ALLOWED_HOSTS). */
  allowedHosts?: string[];
  /** Origins allowed to call from a browser (GPT2_CORS_ORIGINS). */
  corsOrigins?: string[];
  /**
   * Proxies (addresses, CIDR ranges) whose `X-Forwarded-For` or `Forwarded` names the client of
   * the per-client stream limit (GPT2_TRUSTED_PROXIES); from other peers those headers are ignored.
   */
  trustedProxies?: string[];
  /** The data directory: cut from error messages. */
  home?: string;
  /** The variable `home` is shown as in messages (default "$GPT2_HOME"; "$GPT2_SHARED_DIR" on a cluster's shared folder). */
  homeName?: string;
  /** Called with the app's Prometheus registry to add collectors (server/routes/metrics.ts). */
  metrics?: MetricsHook[];
}

const JSON_TYPE = /^application\/([\w.-]+\+)?json$/i;

/** Splits a Host header into a lower-case name (IPv6 without brackets) and a port (null if absent). */
export function parseHost(value: string): { name: string; port: number | null } | null {
  const m = /^(\[[0-9a-f:.]+\]|[^:\[\]]+)(?::(\d{1,5}))?$/i.exec(value.trim());
  if (!m) return null;
  const name = m[1].replace(/^\[|\]$/g, "").toLowerCase().replace(/\.$/, "");
  const port = m[2] === undefined ? null : Number(m[2]);
  return port !== null && port > 65535 ? null : { name, port };
}

function hostGuard(opts: AppOptions): MiddlewareHandler {
  const bound = (opts.host ?? "127.0.0.1").toLowerCase();
  const extra = (opts.allowedHosts ?? []).map((h) => h.toLowerCase());
  // A wildcard bind is reachable under any of the machine's names: only an explicit list narrows it.
  const any = WILDCARD_HOSTS.has(bound) && extra.length === 0;
  const names = new Set([...extra, ...(LOOPBACK_HOSTS.has(bound) ? LOOPBACK_HOSTS : [bound])]);
  if (WILDCARD_HOSTS.has(bound)) { for (const h of LOOPBACK_HOSTS) names.add(h); }
  const port = opts.port || null;
  return async (c, next) => {
    const raw = c.req.header("Host") ?? new URL(c.req.url).host;
    const host = parseHost(raw);
    const portOk = port === null || (host?.port ?? 80) === port;
    if (!host || (!any && !names.has(host.name)) || !portOk) {
      throw new ApiError(
        400,
        `Host "${raw.slice(0, 200)}" does not name this server: expected ${[...names].join(", ")}${
          port ? ` on port ${port}` : ""
        } (add names with GPT2_ALLOWED_HOSTS)`,
        { param: "Host", code: "invalid_host" },
      );
    }
    await next();
  };
}

function originGuard(allowed: ReadonlySet<string>): MiddlewareHandler {
  return async (c, next) => {
    const origin = c.req.header("Origin");
    const host = c.req.header("Host") ?? new URL(c.req.url).host;
    let sameOrigin = false;
    if (origin !== undefined) {
      try {
        sameOrigin = new URL(origin).host === host.toLowerCase();
      } catch { /* "null" or garbage: not same-origin */ }
      if (!sameOrigin && !allowed.has(origin)) {
        throw new ApiError(
          403,
          `Origin "${
            origin.slice(0, 200)
          }" is not allowed: list it in GPT2_CORS_ORIGINS to call this server from it`,
          { param: "Origin", code: "origin_not_allowed" },
        );
      }
    }
    // <img>, <form> and friends send no Origin on GET, but browsers mark them cross-site.
    const site = c.req.header("Sec-Fetch-Site");
    if ((site === "cross-site" || site === "same-site") && !sameOrigin && !(origin && allowed.has(origin))) {
      throw new ApiError(
        403,
        `Cross-site request refused (Sec-Fetch-Site "${site}" without an allowed Origin)`,
        {
          param: "Origin",
          code: "cross_site_request",
        },
      );
    }
    await next();
  };
}

const requireJson: MiddlewareHandler = async (c, next) => {
  if (c.req.method === "POST" || c.req.method === "PUT" || c.req.method === "PATCH") {
    const type = c.req.header("Content-Type");
    const media = type?.split(";")[0].trim() ?? "";
    if (!JSON_TYPE.test(media)) {
      throw new ApiError(
        415,
        type === undefined
          ? "Missing Content-Type: send application/json"
          : `Unsupported Content-Type "${type.slice(0, 100)}": send application/json`,
        { param: "Content-Type", code: "unsupported_media_type" },
      );
    }
  }
  await next();
};

/** Builds the HTTP app. */
export function createApp(opts: AppOptions): Hono {
  const limits: Limits = { ...defaultLimits(), ...opts.limits };
  if (opts.maxBodyBytes !== undefined) limits.maxBodyBytes = opts.maxBodyBytes;
  if (opts.maxUploadBytes !== undefined) limits.maxUploadBytes = opts.maxUploadBytes;
  const startedAt = opts.startedAt ?? Date.now();
  const metrics = createMetrics(opts.runner, startedAt, opts.generation);
  for (const hook of opts.metrics ?? []) metrics.register(hook);
  const aliases = opts.home ? pathAliases(opts.home, opts.homeName ?? "$GPT2_HOME") : [];
  const render = errorHandler(aliases);

  const app = new Hono();
  app.onError(render);
  app.notFound((c) =>
    render(new ApiError(404, `No route for ${c.req.method} ${c.req.path.slice(0, 200)}`), c)
  );
  useGuards(app, opts, metrics);
  app.route("/", webRoutes()); // ahead of the token check: the page is where the token is typed
  const store = opts.runner.store;
  const { auth, trusted } = useAuth(app, opts, metrics);
  app.use("*", requireJson);
  useLimits(app, limits, trusted);
  app.route("/", healthRoutes(opts.runner, startedAt, metrics));
  app.route(
    "/",
    adminRoutes(
      store,
      auth,
      (kind, id) =>
        kind === "dataset"
          ? opts.runner.datasetExists(id)
          : listCheckpoints(opts.runner.checkpointDir(id)).then((c) => c.length > 0),
    ),
  );
  app.route("/", jobRoutes(opts.runner, limits, aliases, auth));
  app.route("/", estimateRoutes(opts.runner));
  app.route("/", checkpointRoutes(opts.runner, auth));
  if (opts.generation) app.route("/", generateRoutes(opts.generation, {}, auth));
  if (opts.generation) app.route("/", chatRoutes(opts.generation, auth));
  for (const extra of opts.extra ?? []) app.route("/", extra);
  return app;
}

/**
 * The middleware ahead of everything: refusing requests while draining, stamping each request's
 * arrival (and a warm-up's mark) and counting it, the Host and Origin checks, and CORS.
 */
function useGuards(app: Hono, opts: AppOptions, metrics: AppMetrics): void {
  const draining = opts.draining;
  if (draining) {
    app.use("*", async (_c, next) => {
      if (draining.active()) {
        throw new ApiError(503, "Server is shutting down: retry once it is back", {
          type: "unavailable",
          code: "shutting_down",
          headers: { "Retry-After": String(draining.retryAfterSeconds) },
        });
      }
      await next();
    });
  }
  app.use("*", async (c, next) => {
    c.set(ARRIVED as never, performance.now() as never);
    const warm = markRehearsal(c);
    await next();
    if (!warm) metrics.countRequest(c.req.method, c.res.status);
  });
  app.use("*", hostGuard(opts));
  const origins = new Set(opts.corsOrigins ?? []);
  app.use("*", originGuard(origins));
  if (origins.size > 0) {
    app.use(
      "*",
      cors({
        origin: [...origins],
        allowMethods: ["GET", "POST", "DELETE", "OPTIONS"],
        allowHeaders: ["Authorization", "Content-Type", "Last-Event-ID"],
        exposeHeaders: ["Location", "X-Prompt-Truncated", "X-Model"],
        maxAge: 600,
      }),
    );
  }
}

/** The token check (users, access, quotas and failed attempts over the job store); returns them. */
function useAuth(app: Hono, opts: AppOptions, metrics: AppMetrics): { auth: Auth; trusted: AddressRanges } {
  const tokens = (typeof opts.token === "string" ? [opts.token] : opts.token ?? []).filter((t) => t !== "");
  const store = opts.runner.store;
  const auth: Auth = {
    tokens: opts.auth?.tokens ?? new TokenAuth(store, { bootstrap: tokens }),
    access: opts.auth?.access ?? new Access(store, (id) => opts.runner.checkpointDir(id)),
    quotas: opts.auth?.quotas ?? new QuotaBook(store, defaultQuotas()),
    failures: opts.auth?.failures ?? new FailureLimiter(),
  };
  metrics.register(userMetrics(store, auth.quotas));
  const trusted = new AddressRanges(opts.trustedProxies ?? []);
  app.use(
    "*",
    authGuard(auth.tokens, {
      trusted,
      failures: auth.failures,
      skip: isRehearsal,
      onUse: (p, cls) => {
        metrics.countUse(p.user, cls);
        auth.tokens.noteUse(p, cls);
      },
    }),
  );
  return { auth, trusted };
}

/** Body size limits (small for everything but dataset uploads) and the bound on open streams. */
function useLimits(app: Hono, limits: Limits, trusted: AddressRanges): void {
  const limit = (maxSize: number) =>
    bodyLimit({
      maxSize,
      onError: () => {
        throw new ApiError(413, `Request body is larger than ${maxSize} bytes`, { code: "body_too_large" });
      },
    });
  // Training configs are small; dataset uploads ({"texts": [...]}) may be large.
  app.use("*", limit(limits.maxUploadBytes));
  const small = limit(limits.maxBodyBytes);
  app.use("/train", small);
  app.use("/jobs/*", small);
  app.use("/v1/*", small);
  app.use("/generate", small);
  app.use("/checkpoints/*", small);
  const streams: StreamCounter = { total: 0, perClient: new Map() };
  const limited = streamLimit(limits, streams, (c) => clientKey(c, trusted));
  // The warm-up's streams are counted apart and never refused: they take no user's slot (64 of
  // them from the loopback address would otherwise fill a local proxy's or its own share).
  const rehearsals = streamLimit(
    { ...limits, maxStreamsPerClient: Infinity, maxStreams: Infinity },
    { total: 0, perClient: new Map() },
    (c) => clientKey(c, trusted),
  );
  const bounded: MiddlewareHandler = (c, next) => isRehearsal(c) ? rehearsals(c, next) : limited(c, next);
  app.use("/jobs/:id/events", bounded);
  app.use("/generate", bounded);
  app.use("/v1/completions", bounded);
  app.use("/v1/chat/completions", bounded);
}
