/**
 * `POST /evaluate`: measure a model the server knows, as Megatron's zero-shot evaluation and
 * lm-evaluation-harness do (perplexity over sliding windows; LAMBADA-style cloze accuracy). The
 * handler validates the body and queues an evaluation job through the runner; progress and the
 * result are that job's events (`GET /jobs/:id/events`) and its `metrics.evaluation`.
 */

import { Hono } from "hono";
import type { JobRunner } from "../jobs/mod.ts";
import type { Limits } from "../settings.ts";
import { LimitError } from "../jobs/mod.ts";
import { jsonBody } from "./api_errors.ts";
import { EvaluateRequestSchema } from "./schemas.ts";
import { checkSources, principalOf } from "./auth.ts";
import { audit, type Auth } from "./admin.ts";

/**
 * The evaluation route, backed by `runner`, within the queue limit of `limits` and the caller's
 * quotas; a model or dataset the caller may not use answers as an unknown one.
 */
export function evaluateRoutes(runner: JobRunner, limits: Limits, auth: Auth): Hono {
  const app = new Hono();
  app.post("/evaluate", jsonBody(EvaluateRequestSchema, "evaluation request"), async (c) => {
    const waiting = runner.store.waitingCount();
    if (waiting >= limits.maxQueuedJobs) {
      throw new LimitError(429, `Too many queued jobs: ${waiting} are waiting; retry when one starts`);
    }
    const req = c.req.valid("json");
    const p = principalOf(c);
    checkSources(runner, auth.access, p, req, "model");
    auth.quotas.admitJob(p);
    const job = await runner.submitEvaluation(req, p.user);
    audit(runner.store, c, "job.create", job.id, { kind: "evaluate" });
    return c.json({ id: job.id, status: job.status, job }, 202, { Location: `/jobs/${job.id}` });
  });
  return app;
}
