/**
 * Training job routes: submit (`POST /train`), list, inspect, follow (SSE), cancel, list checkpoints
 * and download their files, and metrics history. Handlers validate and delegate to the runner.
 */

import { Hono } from "hono";
import { HTTPException } from "hono/http-exception";
import type { JobRunner, JobStatus } from "../jobs/mod.ts";
import { TrainRequestSchema } from "./schemas.ts";
import { streamJobEvents } from "./sse.ts";

/** Files of a checkpoint directory that `GET /jobs/:id/checkpoints/:name/:file` serves. */
const CHECKPOINT_FILES = ["model.safetensors", "config.json", "manifest.json", "optimizer.safetensors"];

const STATUSES = ["queued", "running", "succeeded", "failed", "cancelled", "interrupted"];

/** Routes for training jobs, backed by `runner`. */
export function jobRoutes(runner: JobRunner): Hono {
  const app = new Hono();

  app.post("/train", async (c) => {
    let body: unknown;
    try {
      body = await c.req.json();
    } catch {
      throw new HTTPException(400, { message: "Invalid JSON body" });
    }
    const parsed = TrainRequestSchema.safeParse(body);
    if (!parsed.success) {
      throw new HTTPException(400, { message: "Invalid training config", cause: parsed.error.issues });
    }
    const job = await runner.submit(parsed.data);
    return c.json({ id: job.id, status: job.status, job }, 202, { Location: `/jobs/${job.id}` });
  });

  app.get("/jobs", (c) => {
    const status = c.req.query("status");
    if (status !== undefined && !STATUSES.includes(status)) {
      throw new HTTPException(400, {
        message: `Unknown status "${status}": expected one of ${STATUSES.join(", ")}`,
      });
    }
    return c.json({ jobs: runner.store.listJobs({ status: status as JobStatus | undefined }) });
  });

  app.get("/jobs/:id", (c) => c.json(runner.get(c.req.param("id"))));

  app.get("/jobs/:id/metrics", (c) => {
    const id = c.req.param("id");
    runner.get(id);
    return c.json({ id, metrics: runner.store.metrics(id) });
  });

  app.get("/jobs/:id/events", (c) => {
    const id = c.req.param("id");
    runner.get(id);
    const raw = c.req.header("Last-Event-ID") ?? c.req.query("last_event_id") ?? "0";
    const after = Number(raw);
    if (!Number.isSafeInteger(after) || after < 0) {
      throw new HTTPException(400, {
        message: `Invalid Last-Event-ID "${raw}": expected a non-negative integer`,
      });
    }
    return streamJobEvents(c, runner, id, after);
  });

  app.post("/jobs/:id/cancel", (c) => {
    const job = runner.cancel(c.req.param("id"));
    return c.json({ id: job.id, status: job.status, cancel_requested: job.cancel_requested }, 202);
  });

  app.get("/jobs/:id/checkpoints", async (c) => {
    const id = c.req.param("id");
    return c.json({ id, checkpoints: await runner.checkpoints(id) });
  });

  app.get("/jobs/:id/checkpoints/:name/:file", async (c) => {
    const { id, name, file } = c.req.param();
    if (!CHECKPOINT_FILES.includes(file)) {
      throw new HTTPException(404, {
        message: `Unknown checkpoint file "${file}": expected one of ${CHECKPOINT_FILES.join(", ")}`,
      });
    }
    const ckpt = (await runner.checkpoints(id)).find((k) => k.name === name);
    if (!ckpt) throw new HTTPException(404, { message: `Job "${id}" has no checkpoint "${name}"` });
    let f: Deno.FsFile;
    try {
      f = await Deno.open(`${ckpt.path}/${file}`);
    } catch (e) {
      if (!(e instanceof Deno.errors.NotFound)) throw e;
      throw new HTTPException(404, { message: `Checkpoint "${name}" of job "${id}" has no "${file}"` });
    }
    const { size } = await f.stat();
    return c.body(f.readable, 200, {
      "Content-Type": file.endsWith(".json") ? "application/json" : "application/octet-stream",
      "Content-Length": String(size),
      "Content-Disposition": `attachment; filename="${id}_${name}_${file}"`,
    });
  });

  return app;
}
