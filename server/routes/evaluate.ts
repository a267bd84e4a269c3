/**
 * `POST /evaluate`: measure a model the server knows, as Megatron's zero-shot evaluation and
 * lm-evaluation-harness do (perplexity over sliding windows; LAMBADA-style cloze accuracy). The
 * handler validates the body and queues an evaluation job through the runner; progress and the
 * result are that job's events (`GET /jobs/:id/events`) and its `metrics.evaluation`.
 */

import { Hono } from "hono";
import type { JobRunner, Limits } from "../jobs/mod.ts";
import { LimitError } from "../jobs/mod.ts";
import { jsonBody } from "./api_errors.ts";
import { EvaluateRequestSchema } from "./schemas.ts";

/** The evaluation route, backed by `runner`, within the queue limit of `limits`. */
export function evaluateRoutes(runner: JobRunner, limits: Limits): Hono {
  const app = new Hono();
  app.post("/evaluate", jsonBody(EvaluateRequestSchema, "evaluation request"), async (c) => {
    const waiting = runner.store.waitingCount();
    if (waiting >= limits.maxQueuedJobs) {
      throw new LimitError(429, `Too many queued jobs: ${waiting} are waiting; retry when one starts`);
    }
    const job = await runner.submitEvaluation(c.req.valid("json"));
    return c.json({ id: job.id, status: job.status, job }, 202, { Location: `/jobs/${job.id}` });
  });
  return app;
}
