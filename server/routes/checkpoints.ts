/**
 * `POST /checkpoints/reshard {checkpoint, tensor_parallel, name?}`: writes a copy of a saved
 * checkpoint ("<job id>" for its newest, or "<job id>/iter_N") resharded to `tensor_parallel`
 * ranks, as `checkpoints/<name>/iter_N/` under the data directory (default name
 * "<job id>-tp<N>"), where `GET /v1/models`, generation and `resume_from` find it; at
 * tensor_parallel 1 that folder is the merged Hugging Face one. 201 with the copy's id, path
 * (relative to the data directory), files and size. The handler validates and delegates to
 * checkpoint/reshard.ts; its errors become 400 (bad source or size), 404 (no such checkpoint) or 409
 * (the name is taken), naming the field.
 */

import { Hono } from "hono";
import { z } from "zod";
import type { JobRunner } from "../jobs/mod.ts";
import { RESHARD_NAME, reshardByName, ReshardError } from "../../checkpoint/reshard.ts";
import { ApiError, jsonBody } from "./api_errors.ts";
import { checkpointPath } from "./sse.ts";
import { principalOf } from "./auth.ts";
import { audit, type Auth } from "./admin.ts";

/** Body of `POST /checkpoints/reshard`. */
export const ReshardRequestSchema = z.strictObject({
  checkpoint: z.string().min(1).max(200),
  tensor_parallel: z.number().int().min(1).max(64),
  name: z.string().regex(
    RESHARD_NAME,
    "Use 1-64 letters, digits, '-' or '_', starting with a letter or digit",
  )
    .optional(),
});

/** A source the reshard accepts (others get its own wording). */
const RESHARD_SOURCE = /^[A-Za-z0-9][A-Za-z0-9_-]*(\/iter_\d+)?$/;

const CODES: Record<number, string> = { 400: "invalid_value", 404: "checkpoint_not_found", 409: "conflict" };

/**
 * The checkpoint routes, over `runner`'s checkpoint folders and job store. A checkpoint the caller
 * may not use answers as one that does not exist; the copy belongs to the caller.
 */
export function checkpointRoutes(runner: JobRunner, auth: Auth): Hono {
  const app = new Hono();
  app.post("/checkpoints/reshard", jsonBody(ReshardRequestSchema, "reshard request"), async (c) => {
    const req = c.req.valid("json");
    const p = principalOf(c);
    if (RESHARD_SOURCE.test(req.checkpoint) && !auth.access.modelAllowed(p, req.checkpoint)) {
      throw new ApiError(
        404,
        `Checkpoint "${req.checkpoint}" not found: expected a job id with saved checkpoints or "<job id>/iter_0001000" (a checkpoint as GET /jobs/:id/checkpoints names it)`,
        { param: "checkpoint", code: CODES[404] },
      );
    }
    let r;
    try {
      r = await reshardByName((id) => runner.checkpointDir(id), (id) => runner.store.hasJob(id), req);
    } catch (e) {
      if (!(e instanceof ReshardError)) throw e;
      throw new ApiError(e.status, e.message, { param: e.field, code: CODES[e.status] });
    }
    auth.access.own(p, "checkpoint", r.name);
    audit(runner.store, c, "checkpoint.reshard", r.id, { from: r.source });
    return c.json({
      id: r.id,
      name: r.name,
      checkpoint: r.source,
      from_tensor_parallel: r.from_tensor_parallel,
      tensor_parallel: r.tensor_parallel,
      iteration: r.manifest.iteration,
      path: checkpointPath(r.name, r.manifest.name),
      files: r.files,
      bytes: r.bytes,
      vocab: r.manifest.vocab,
    }, 201);
  });
  return app;
}
