/**
 * Training job routes: submit (`POST /train`, also fine-tuning with `init_from`; `POST /evaluate`
 * from evaluate.ts queues evaluation jobs beside them), list (paged), inspect, follow (SSE), cancel,
 * delete, list checkpoints and download their files, metrics history (JSON or CSV), and several
 * jobs compared (server/jobs/compare.ts). Handlers validate and
 * delegate to the runner; limits (queue length, checkpoint disk) are checked before a job is
 * stored. Paths in answers are relative to the data directory. A job belongs to the user who
 * submitted it: others get 404 for it, as for an unknown id, and never see it listed.
 */

import { type Context, Hono } from "hono";
import { admitTrainJob, type Limits } from "../settings.ts";
import { type CheckpointInfo } from "../../checkpoint/checkpoint.ts";
import {
  compareJobs,
  DEFAULT_MODEL,
  evalTaskPoints,
  initModel,
  type Job,
  type JobRunner,
  metricsCsv,
} from "../jobs/mod.ts";
import { evaluateRoutes } from "./evaluate.ts";
import { ApiError, jsonBody, type PathAlias, queryParams, scrubPaths } from "./api_errors.ts";
import {
  CompareQuerySchema,
  EventsQuerySchema,
  JobListQuerySchema,
  MetricsQuerySchema,
  TrainRequestSchema,
} from "./schemas.ts";
import { checkpointPath, streamJobEvents } from "./sse.ts";
import { checkSources, principalOf } from "./auth.ts";
import { audit, type Auth } from "./admin.ts";

/** Files of a checkpoint directory that `GET /jobs/:id/checkpoints/:name/:file` serves. */
const CHECKPOINT_FILES = ["model.safetensors", "config.json", "manifest.json", "optimizer.safetensors"];
/** The shard files of a checkpoint written at tensor-parallel size N > 1 (see checkpoint/checkpoint.ts). */
const SHARD_FILE = /^(model|optimizer)-tp\d{2}-of-\d{2}\.safetensors$/;

/**
 * Routes for training jobs, backed by `runner`, within `limits`; `aliases` are cut from messages.
 * A caller sees only their own jobs (an admin every job), and another's answers 404.
 */
export function jobRoutes(
  runner: JobRunner,
  limits: Limits,
  aliases: readonly PathAlias[],
  auth: Auth,
): Hono {
  const app = new Hono();
  // Errors and resumed_from may carry the data directory's absolute path: show it as $GPT2_HOME.
  const inJson = aliases.map(([p, name]) => [JSON.stringify(p).slice(1, -1), name] as const);
  const ctx: JobRouteContext = {
    runner,
    limits,
    aliases,
    auth,
    visible: (c, id) => auth.access.job(principalOf(c), id, (i) => runner.get(i)),
    shown: (job) => (aliases.length ? JSON.parse(scrubPaths(JSON.stringify(job), inJson)) : job),
  };
  jobListRoutes(app, ctx);
  jobProgressRoutes(app, ctx);
  jobCheckpointRoutes(app, ctx);
  return app;
}

/** What the job route groups share. */
interface JobRouteContext {
  runner: JobRunner;
  limits: Limits;
  aliases: readonly PathAlias[];
  auth: Auth;
  /** The job `id` if the caller of `c` may see it; 404 otherwise. */
  visible: (c: Context, id: string) => Job;
  /** A job as answered: the data directory's path shown as its alias. */
  shown: (job: Job) => Job;
}

/** Submitting jobs (training, and evaluation from evaluate.ts), listing, comparing, inspecting and deleting them. */
function jobListRoutes(app: Hono, { runner, limits, auth, visible, shown }: JobRouteContext): void {
  app.post("/train", jsonBody(TrainRequestSchema, "training config"), async (c) => {
    const req = c.req.valid("json");
    const p = principalOf(c);
    checkSources(runner, auth.access, p, req, "init_from");
    // A fine-tuning job's model is its source's unless given (and then it must agree).
    const source = req.init_from ? await runner.modelSource(req.init_from, "init_from") : null;
    const model = source ? initModel(req.model, source) : req.model ?? DEFAULT_MODEL;
    admitTrainJob(limits, runner.store.waitingCount(), { ...req, model });
    auth.quotas.admitJob(p);
    const job = await runner.submit(req, p.user);
    audit(runner.store, c, "job.create", job.id, { kind: "train" });
    return c.json({ id: job.id, status: job.status, job: shown(job) }, 202, { Location: `/jobs/${job.id}` });
  });

  app.route("/", evaluateRoutes(runner, limits, auth));

  app.get("/jobs", queryParams(JobListQuerySchema, "job list query"), (c) => {
    const { status, limit, after } = c.req.valid("query");
    const p = principalOf(c);
    const owner = p.admin ? undefined : p.user ?? "";
    const known = (id: string) => {
      const job = runner.store.getJob(id);
      return job !== null && auth.access.canSeeJob(p, job);
    };
    if (after !== undefined && !known(after)) {
      throw new ApiError(400, `Unknown job "${after}" in after: expected the id of a listed job`, {
        param: "after",
        code: "invalid_value",
      });
    }
    const page = runner.store.listJobs({ status, after, limit: limit + 1, owner });
    const jobs = page.slice(0, limit).map(shown);
    return c.json({
      jobs,
      has_more: page.length > limit,
      first_id: jobs[0]?.id ?? null,
      last_id: jobs.at(-1)?.id ?? null,
    });
  });

  // Ahead of /jobs/:id, which would take "compare" for an id. Another user's job is unknown here too.
  app.get("/jobs/compare", queryParams(CompareQuerySchema, "compare query"), (c) => {
    const histories = c.req.valid("query").ids.map((id) => ({
      job: shown(visible(c, id)),
      metrics: runner.store.metrics(id),
      evals: evalTaskPoints(runner.store.eventsAfter(id, 0)),
    }));
    return c.json(compareJobs(histories));
  });

  app.get("/jobs/:id", (c) => c.json(shown(visible(c, c.req.param("id")))));

  app.delete("/jobs/:id", async (c) => {
    const id = c.req.param("id");
    visible(c, id);
    await runner.remove(id);
    audit(runner.store, c, "job.delete", id);
    return c.json({ id, deleted: true });
  });
}

/** A job's metrics history, its event stream and cancelling it. */
function jobProgressRoutes(app: Hono, { runner, aliases, visible }: JobRouteContext): void {
  app.get("/jobs/:id/metrics", queryParams(MetricsQuerySchema, "metrics query"), (c) => {
    const id = c.req.param("id");
    visible(c, id);
    const metrics = runner.store.metrics(id);
    const evaluations = evalTaskPoints(runner.store.eventsAfter(id, 0));
    if (c.req.valid("query").format === "csv") {
      return c.body(metricsCsv(metrics, evaluations), 200, {
        "Content-Type": "text/csv; charset=utf-8",
        "Content-Disposition": `attachment; filename="${id}_metrics.csv"`,
      });
    }
    return c.json({ id, metrics, evaluations });
  });

  app.get("/jobs/:id/events", queryParams(EventsQuerySchema, "event stream query"), (c) => {
    const id = c.req.param("id");
    visible(c, id);
    const header = c.req.header("Last-Event-ID");
    const raw = header ?? c.req.valid("query").last_event_id ?? "0";
    const after = Number(raw);
    if (!/^\d+$/.test(raw) || !Number.isSafeInteger(after)) {
      throw new ApiError(400, `Invalid Last-Event-ID "${raw}": expected a non-negative integer`, {
        param: header !== undefined ? "Last-Event-ID" : "last_event_id",
        code: "invalid_value",
      });
    }
    return streamJobEvents(c, runner, id, after, aliases);
  });

  app.post("/jobs/:id/cancel", (c) => {
    const id = c.req.param("id");
    visible(c, id);
    const job = runner.cancel(id);
    audit(runner.store, c, "job.cancel", id);
    return c.json({ id: job.id, status: job.status, cancel_requested: job.cancel_requested }, 202);
  });
}

/** A job's checkpoints and their files. */
function jobCheckpointRoutes(app: Hono, { runner, visible }: JobRouteContext): void {
  const view = (id: string, c: CheckpointInfo) => ({ ...c, path: checkpointPath(id, c.name) });

  app.get("/jobs/:id/checkpoints", async (c) => {
    const id = c.req.param("id");
    visible(c, id);
    return c.json({ id, checkpoints: (await runner.checkpoints(id)).map((ck) => view(id, ck)) });
  });

  app.get("/jobs/:id/checkpoints/:name/:file", async (c) => {
    const { id, name, file } = c.req.param();
    visible(c, id);
    if (!CHECKPOINT_FILES.includes(file) && !SHARD_FILE.test(file)) {
      throw new ApiError(
        404,
        `Unknown checkpoint file "${file}": expected one of ${CHECKPOINT_FILES.join(", ")} ` +
          `or a shard such as model-tp00-of-02.safetensors`,
        {
          param: "file",
        },
      );
    }
    const ckpt = (await runner.checkpoints(id)).find((k) => k.name === name);
    if (!ckpt) throw new ApiError(404, `Job "${id}" has no checkpoint "${name}"`, { param: "name" });
    let f: Deno.FsFile;
    try {
      f = await Deno.open(`${ckpt.path}/${file}`);
    } catch (e) {
      if (!(e instanceof Deno.errors.NotFound)) throw e;
      throw new ApiError(404, `Checkpoint "${name}" of job "${id}" has no "${file}"`, { param: "file" });
    }
    const { size } = await f.stat();
    return c.body(f.readable, 200, {
      "Content-Type": file.endsWith(".json") ? "application/json" : "application/octet-stream",
      "Content-Length": String(size),
      "Content-Disposition": `attachment; filename="${id}_${name}_${file}"`,
    });
  });
}
