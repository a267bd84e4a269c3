/**
 * `GET /estimate`: parameters, GPU bytes per category and FLOPs per step of a training config,
 * from the same memory plan the engine allocates. It plans for the GPU the query names (`gpu`, a
 * preset), else for the server's first GPU when that reports limits that hold the model, else for
 * the default preset (model/memory_estimate.ts), and says which in `planned_for`. Validates the query and
 * delegates to job/job_config.ts and model/memory_estimate.ts.
 */

import { Hono } from "hono";
import { z } from "zod";
import { PRESET_NAMES } from "../../model/config.ts";
import {
  estimateForGpu,
  GPU_PRESET_NAMES,
  type GpuDescription,
  knownDeviceMemory,
} from "../../model/memory_estimate.ts";
import { type DeviceBudget, estimateJob, type JobRunner } from "../jobs/mod.ts";
import { queryParams } from "./api_errors.ts";
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
  /** A GPU preset to plan for instead of the server's own. */
  gpu: z.enum(GPU_PRESET_NAMES, {
    error: `Unknown GPU preset: expected one of ${GPU_PRESET_NAMES.join(", ")}`,
  }).optional(),
});

/** The server's GPU as the Worker reported it: the adapter's description is its line up to the features. */
function serverGpu(d: DeviceBudget | null): GpuDescription | null {
  if (!d || d.max_binding_bytes === null) return null;
  return {
    name: d.adapter?.split(" [")[0] || "GPU 0",
    memoryBytes: knownDeviceMemory(d.adapter),
    maxStorageBufferBindingSize: d.max_binding_bytes,
    maxBufferSize: d.max_buffer_bytes ?? d.max_binding_bytes,
  };
}

/** The estimator route. */
export function estimateRoutes(runner: JobRunner): Hono {
  const app = new Hono();
  app.get("/estimate", queryParams(EstimateQuerySchema, "estimate query"), (c) => {
    const q = c.req.valid("query");
    // estimateJob() reads the memory of the GPU it plans for from its name, as the fit check does.
    const { estimate: est, planned_for, fits_server_gpu } = estimateForGpu(
      (gpu) =>
        estimateJob(q, {
          adapter: gpu.name,
          max_binding_bytes: gpu.maxStorageBufferBindingSize,
          max_buffer_bytes: gpu.maxBufferSize,
        }),
      serverGpu(runner.device(0)),
      q.gpu,
    );
    return c.json({ ...q, ...est, total_bytes: est.bytes_per_gpu.total, planned_for, fits_server_gpu });
  });
  return app;
}
