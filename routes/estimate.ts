/**
 * `GET /estimate`: parameters, GPU bytes per category and FLOPs per step of a training config,
 * from the same memory plan the engine allocates, for the first GPU's limits once it has reported
 * them. Validates the query and delegates to jobs/model.ts.
 */

import { Hono } from "hono";
import { HTTPException } from "hono/http-exception";
import { z } from "zod";
import { PRESET_NAMES } from "../gpu/config.ts";
import { estimateJob, type JobRunner } from "../jobs/mod.ts";

const int = (max: number) => z.coerce.number().int().positive().max(max);
const bool = z.enum(["true", "false", "1", "0"]).transform((v) => v === "true" || v === "1");

/** Query of `GET /estimate` (strings, coerced). */
export const EstimateQuerySchema = z.strictObject({
  model: z.string().refine((m) => (PRESET_NAMES as readonly string[]).includes(m), {
    message: `Unknown model preset: expected one of ${PRESET_NAMES.join(", ")}`,
  }).default("gpt2-tiny"),
  batch_size: int(4096).default(4),
  seq_len: int(8192).optional(),
  precision: z.enum(["fp32", "fp16"]).default("fp32"),
  checkpoint_activations: bool.default(false),
  checkpoint_num_layers: int(96).default(1),
  tensor_parallel: int(64).default(1),
  data_parallel: int(4096).default(1),
});

/** The estimator route. */
export function estimateRoutes(runner: JobRunner): Hono {
  const app = new Hono();
  app.get("/estimate", (c) => {
    const parsed = EstimateQuerySchema.safeParse(c.req.query());
    if (!parsed.success) {
      const field = parsed.error.issues[0]?.path.join(".") || "query";
      throw new HTTPException(400, {
        message: `Invalid estimate query: ${field}`,
        cause: parsed.error.issues,
      });
    }
    const q = parsed.data;
    return c.json({ ...q, ...estimateJob(q, runner.device(0)) });
  });
  return app;
}
