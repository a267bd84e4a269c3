/**
 * HTTP routes of the data pipeline, as a Hono sub-app the server mounts with
 * `app.route("/", datasetRoutes(root))`:
 *
 * - `POST /datasets` prepares a dataset from one source (`builtin`, `path`, `urls`, `url_list`,
 *   `texts`) plus options; 201 with `{id, documents, tokens, splits}` when done within a short
 *   wait (always for a cached dataset), else 202 with the id, whose progress `GET /datasets/:id`
 *   reports.
 * - `GET /datasets` lists prepared datasets and preparations in progress or failed.
 * - `GET /datasets/:id` one of them; 404 for an unknown id.
 *
 * Bodies are validated with zod (400 with its issues); a path outside the data root is 403 and
 * names the path. Preparation state lives in the closure of one `datasetRoutes` call.
 */
import { Hono } from "hono";
import { z } from "zod";
import {
  BUILTIN_NAMES,
  type DatasetInfo,
  type DatasetSource,
  getDataset,
  listDatasets,
  PathOutsideRootError,
  planDataset,
  prepareDataset,
  type PrepareOptions,
  type Progress,
} from "../data/mod.ts";

/** Options shared by every source. */
const optionsShape = {
  id: z.string().regex(/^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$/, "Use 1-64 letters, digits, '.', '-' or '_'")
    .optional(),
  min_tokens: z.number().int().min(0).max(1_000_000).optional(),
  dedup: z.boolean().optional(),
  dedup_threshold: z.number().gt(0).max(1).optional(),
  num_perm: z.number().int().min(8).max(1024).optional(),
  shingle_size: z.number().int().min(1).max(32).optional(),
  split: z.union([
    z.string().regex(
      /^\s*\d+(\.\d+)?(\s*,\s*\d+(\.\d+)?){0,2}\s*$/,
      'Use up to three weights like "949,50,1"',
    ),
    z.array(z.number().min(0)).min(1).max(3),
  ]).optional(),
  seq_len: z.number().int().min(1).max(1 << 20).optional(),
  max_documents: z.number().int().min(1).optional(),
  force: z.boolean().optional(),
  blacklist: z.array(z.string().min(1).max(253)).max(10_000).optional(),
};

/** The body of `POST /datasets`: exactly one source and options. */
export const createDatasetSchema = z.object({
  builtin: z.enum(BUILTIN_NAMES).optional(),
  path: z.string().min(1).max(4096).optional(),
  urls: z.array(z.string().min(1).max(8192)).min(1).max(100_000).optional(),
  url_list: z.string().min(1).max(4096).optional(),
  texts: z.array(z.string()).min(1).max(1_000_000).optional(),
  ...optionsShape,
}).strict().refine(
  (b) =>
    ["builtin", "path", "urls", "url_list", "texts"].filter((k) => b[k as keyof typeof b] !== undefined)
      .length === 1,
  { message: 'Name exactly one source: "builtin", "path", "urls", "url_list" or "texts"' },
);

/** A preparation started by this app. */
interface Job {
  id: string;
  status: "running" | "failed";
  progress?: Progress;
  error?: string;
  started_at: string;
  done: Promise<void>;
}

/** Options of {@link datasetRoutes}. */
export interface DatasetRoutesOptions {
  /** How long POST waits for a preparation before answering 202 (default 2000 ms). */
  waitMs?: number;
  /** Tokenize workers per preparation (default: all cores). */
  workers?: number;
}

/** The dataset routes over data root `root` (datasets in `<root>/datasets/`). */
export function datasetRoutes(root: string, options: DatasetRoutesOptions = {}): Hono {
  const app = new Hono();
  const jobs = new Map<string, Job>();
  const waitMs = options.waitMs ?? 2000;
  const summary = (info: DatasetInfo) => ({ ...info, status: "ready" as const });
  const jobView = (j: Job) => ({
    id: j.id,
    status: j.status,
    started_at: j.started_at,
    ...(j.progress ? { progress: j.progress } : {}),
    ...(j.error ? { error: j.error } : {}),
  });

  app.post("/datasets", async (c) => {
    let raw: unknown;
    try {
      raw = await c.req.json();
    } catch (e) {
      return c.json({ error: `Cannot parse JSON body: ${(e as Error).message}` }, 400);
    }
    const parsed = createDatasetSchema.safeParse(raw);
    if (!parsed.success) {
      return c.json({ error: "Invalid dataset request", issues: parsed.error.issues }, 400);
    }
    const { builtin, path, urls, url_list, texts, ...rest } = parsed.data;
    const source = (builtin !== undefined
      ? { builtin }
      : path !== undefined
      ? { path }
      : urls !== undefined
      ? { urls }
      : url_list !== undefined
      ? { url_list }
      : { texts: texts! }) as DatasetSource;
    const prepOptions: PrepareOptions = { ...rest, ...(options.workers ? { workers: options.workers } : {}) };
    let id: string;
    try {
      id = (await planDataset(root, source, prepOptions)).id;
    } catch (e) {
      if (e instanceof PathOutsideRootError) {
        return c.json({ error: e.message, path: e.path }, 403);
      }
      return c.json({ error: (e as Error).message }, 400);
    }
    const running = jobs.get(id);
    if (running?.status === "running") {
      c.header("Location", `/datasets/${id}`);
      return c.json(jobView(running), 202);
    }
    const job: Job = { id, status: "running", started_at: new Date().toISOString(), done: Promise.resolve() };
    let result: DatasetInfo | undefined;
    job.done = prepareDataset(root, source, prepOptions, (p) => (job.progress = p)).then(
      (info) => {
        result = info;
        jobs.delete(id);
      },
      (e) => {
        job.status = "failed";
        job.error = (e as Error).message;
      },
    );
    jobs.set(id, job);
    let timer: ReturnType<typeof setTimeout> | undefined;
    const finished = await Promise.race([
      job.done.then(() =>
        true
      ),
      new Promise<boolean>((r) => (timer = setTimeout(() => r(false), waitMs))),
    ]);
    clearTimeout(timer);
    if (finished && result) {
      const { id: rid, documents, tokens, splits } = result;
      return c.json({ ...summary(result), id: rid, documents, tokens, splits }, 201);
    }
    if (finished && job.status === "failed") return c.json({ error: job.error, id }, 422);
    c.header("Location", `/datasets/${id}`);
    return c.json(jobView(job), 202);
  });

  app.get("/datasets", async (c) => {
    const ready = await listDatasets(root);
    const readyIds = new Set(ready.map((d) => d.id));
    const pending = [...jobs.values()].filter((j) => !readyIds.has(j.id) || j.status === "running").map(
      jobView,
    );
    return c.json({ datasets: [...ready.map(summary), ...pending] });
  });

  app.get("/datasets/:id", async (c) => {
    const id = c.req.param("id");
    const job = jobs.get(id);
    if (job) return c.json(jobView(job), 200);
    const info = await getDataset(root, id);
    if (!info) return c.json({ error: `Dataset "${id}" not found` }, 404);
    return c.json(summary(info), 200);
  });

  return app;
}
