/**
 * `GET /estimate`: parameters, GPU bytes per category and FLOPs per step of a training config,
 * from the same memory plan the engine allocates, for the first GPU's limits once it has reported
 * them. Validates the query and delegates to jobs/model.ts.
 */

import { Hono } from "hono";
import { z } from "zod";
import { PRESET_NAMES } from "../gpu/config.ts";
import { estimateJob, type JobRunner } from "../jobs/mod.ts";
import { queryParams } from "./errors.ts";
import { ModelDimsSchema } from "./schemas.ts";

const int = (max: number) => z.coerce.number().int().positive().max(max);
const bool = z.enum(["true", "false", "1", "0"]).transform((v) => v === "true" || v === "1");

/** Query of `GET /estimate` (strings, coerced). */
export const EstimateQuerySchema = z.strictObject({
  /** A preset name, or explicit dimensions as JSON (`{"n_layer":2,...}`). */
  model: z.string().default("gpt2-tiny").transform((m, ctx) => {
    if (m.startsWith("{")) {
      try {
        const dims = ModelDimsSchema.safeParse(JSON.parse(m));
        if (dims.success) return dims.data;
        for (const i of dims.error.issues) ctx.addIssue({ code: "custom", message: i.message, path: i.path });
      } catch {
        ctx.addIssue({ code: "custom", message: "Invalid JSON model dimensions" });
      }
      return z.NEVER;
    }
    if (!(PRESET_NAMES as readonly string[]).includes(m)) {
      ctx.addIssue({
        code: "custom",
        message: `Unknown model preset: expected one of ${PRESET_NAMES.join(", ")} or JSON dimensions`,
      });
      return z.NEVER;
    }
    return m;
  }),
  batch_size: int(4096).default(4),
  seq_len: int(8192).optional(),
  precision: z.enum(["fp32", "fp16"]).default("fp32"),
  checkpoint_activations: bool.default(false),
  checkpoint_num_layers: int(96).default(1),
  tensor_parallel: int(64).default(1),
  data_parallel: int(4096).default(1),
  distributed_optimizer: bool.default(false),
});

/** The estimator route. */
export function estimateRoutes(runner: JobRunner): Hono {
  const app = new Hono();
  app.get("/estimate", queryParams(EstimateQuerySchema, "estimate query"), (c) => {
    const q = c.req.valid("query");
    const est = estimateJob(q, runner.device(0));
    return c.json({ ...q, ...est, total_bytes: est.bytes_per_gpu.total });
  });
  return app;
}
