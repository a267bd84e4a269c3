/**
 * Builds the Hono app: bearer-token check (when a token is configured), body-size limits,
 * the job, health and any extra route groups, and the single error handler. No state of its own:
 * everything comes from the arguments.
 */

import { Hono } from "hono";
import { bearerAuth } from "hono/bearer-auth";
import { bodyLimit } from "hono/body-limit";
import { HTTPException } from "hono/http-exception";
import type { GenerationManager, JobRunner } from "../jobs/mod.ts";
import { onError } from "./errors.ts";
import { healthRoutes } from "./health.ts";
import { jobRoutes } from "./jobs.ts";
import { generateRoutes } from "./generate.ts";
import { estimateRoutes } from "./estimate.ts";

/** What the app is built from. */
export interface AppOptions {
  runner: JobRunner;
  /** Bearer token required on every route, or null for none (loopback only). */
  token: string | null;
  /** Largest accepted body for the job routes, in bytes. */
  maxBodyBytes?: number;
  /** Largest accepted body for any other route (dataset uploads), in bytes. */
  maxUploadBytes?: number;
  /** Generation (`GET /generate`, `/v1/completions`, `/v1/models`); absent: not served. */
  generation?: GenerationManager;
  /** Other route groups mounted at "/" (e.g. datasets). */
  extra?: Hono[];
  /** Server start time in ms (for uptime). */
  startedAt?: number;
}

/** The default request body limit: 64 KiB is plenty for a training config. */
export const DEFAULT_MAX_BODY_BYTES = 64 * 1024;
/** The default limit for other routes, such as dataset uploads. */
export const DEFAULT_MAX_UPLOAD_BYTES = 64 * 1024 * 1024;

/** Builds the HTTP app. */
export function createApp(opts: AppOptions): Hono {
  const app = new Hono();
  app.onError(onError);
  app.notFound((c) => c.json({ error: `No route for ${c.req.method} ${c.req.path}` }, 404));
  if (opts.token) app.use("*", bearerAuth({ token: opts.token }));
  const limit = (maxSize: number) =>
    bodyLimit({
      maxSize,
      onError: () => {
        throw new HTTPException(413, { message: `Request body is larger than ${maxSize} bytes` });
      },
    });
  // Training configs are small; dataset uploads ({"texts": [...]}) may be large.
  app.use("*", limit(opts.maxUploadBytes ?? DEFAULT_MAX_UPLOAD_BYTES));
  const small = limit(opts.maxBodyBytes ?? DEFAULT_MAX_BODY_BYTES);
  app.use("/train", small);
  app.use("/jobs/*", small);
  app.use("/v1/*", small);
  app.route("/", healthRoutes(opts.runner, opts.startedAt ?? Date.now(), opts.generation));
  app.route("/", jobRoutes(opts.runner));
  app.route("/", estimateRoutes(opts.runner));
  if (opts.generation) app.route("/", generateRoutes(opts.generation));
  for (const extra of opts.extra ?? []) app.route("/", extra);
  return app;
}
