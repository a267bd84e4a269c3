/**
 * HTTP routes of the data pipeline, as a Hono sub-app the server mounts with
 * `app.route("/", datasetRoutes(root))`:
 *
 * - `POST /datasets` prepares a dataset from one source (`builtin`, `path`, `urls`, `url_list`,
 *   `texts`) plus options; 201 with `{id, documents, tokens, splits}` when done within a short
 *   wait (always for a cached dataset), else 202 with the id, whose progress `GET /datasets/:id`
 *   reports.
 *   With `"format": "chat"` the `path` is a JSONL file of conversations (data/chat_dataset.ts);
 *   its bad lines fail the preparation naming file and line, or are left out with
 *   `"on_error": "skip"` (listed in the manifest's `stats.issues`).
 * - `GET /datasets` lists prepared datasets and preparations in progress or failed.
 * - `GET /datasets/:id` one of them; 404 for an unknown id.
 *
 * Bodies are validated with zod (400 naming the field). `path` and `url_list` sources are read
 * only from the sources folder (`$GPT2_HOME/sources` or `GPT2_SOURCES`), never from the data
 * directory with the job database in it: a path outside it is 403, and paths in answers are
 * relative to it. Preparations running at once are bounded (429 past the limit), each with its
 * own share of the cores, and URL sources have a download budget and reach only public
 * addresses unless `GPT2_ALLOW_PRIVATE_URLS=1`. Preparation state lives in the closure of one
 * `datasetRoutes` call; failures use the one error shape (server/routes/api_errors.ts). With
 * `auth`, a dataset belongs to whoever prepared it (built-in ones are shared): others neither list
 * nor read it (404), and cannot prepare over an id they named that is someone else's (409).
 */
import { join } from "node:path";
import { type Context, Hono } from "hono";
import { z } from "zod";
import { defaultLimits, LIMIT_SETTINGS, limitName, type Limits } from "../settings.ts";
import { type JobStore, LimitError } from "../jobs/mod.ts";
import type { Access } from "../auth/access.ts";
import { principalOf } from "./auth.ts";
import { audit } from "./admin.ts";
import { ApiError, errorHandler, jsonBody, pathAliases, scrubPaths } from "./api_errors.ts";
import {
  BUILTIN_NAMES,
  checkReplace,
  DatasetExistsError,
  type DatasetInfo,
  type DatasetSource,
  getDataset,
  isBuiltinName,
  listDatasets,
  PathOutsideRootError,
  planDataset,
  prepareDataset,
  type PrepareOptions,
  type Progress,
} from "../../data/mod.ts";

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
  max_file_ms: z.number().min(0).max(86_400_000).optional(),
  allow_partial: z.boolean().optional(),
  format: z.enum(["text", "chat"]).optional(),
  on_error: z.enum(["skip", "refuse"]).optional(),
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
  /** Tokenize workers per preparation (default: `limits.prepareWorkers`). */
  workers?: number;
  /** The folder `path` and `url_list` sources are read from (default `<root>/sources`). */
  sources?: string;
  /** Limits (preparations at once, download budget); missing ones take their defaults. */
  limits?: Partial<Limits>;
  /** Let URL sources reach loopback, private, link-local and multicast addresses (default false). */
  allowPrivateUrls?: boolean;
  /**
   * Datasets belong to whoever prepared them (built-in ones are shared): a caller lists and reads
   * only those they may use, another's answers 404, and its id cannot be prepared over (409).
   * Absent: no ownership (every caller sees every dataset).
   */
  auth?: { access: Access; store: JobStore };
}

/** What the dataset routes of one `datasetRoutes` call share: preparation state lives here. */
interface DatasetRouteState {
  root: string;
  options: DatasetRoutesOptions;
  /** Preparations started here, running or failed, by id. */
  jobs: Map<string, Job>;
  waitMs: number;
  limits: Limits;
  /** The folder `path` and `url_list` sources are read from. */
  sources: string;
  auth: DatasetRoutesOptions["auth"];
  /** Whether the caller of `c` may use dataset `id`. */
  mayUse: (c: Context, id: string) => boolean;
  /** A preparation as answered (paths in its error shown as their aliases). */
  jobView: (j: Job) => Record<string, unknown>;
}

/** The dataset routes over data root `root` (datasets in `<root>/datasets/`). */
export function datasetRoutes(root: string, options: DatasetRoutesOptions = {}): Hono {
  const app = new Hono();
  const sources = options.sources ?? join(root, "sources");
  const aliases = [...pathAliases(sources, "$GPT2_SOURCES"), ...pathAliases(root, "$GPT2_HOME")];
  app.onError(errorHandler(aliases));
  const auth = options.auth;
  const st: DatasetRouteState = {
    root,
    options,
    jobs: new Map<string, Job>(),
    waitMs: options.waitMs ?? 2000,
    limits: { ...defaultLimits(), ...options.limits },
    sources,
    auth,
    mayUse: (c, id) => !auth || auth.access.datasetAllowed(principalOf(c), id, isBuiltinName(id)),
    jobView: (j) => ({
      id: j.id,
      status: j.status,
      started_at: j.started_at,
      ...(j.progress ? { progress: j.progress } : {}),
      ...(j.error ? { error: scrubPaths(j.error, aliases) } : {}),
    }),
  };
  const { jobs, mayUse, jobView } = st;

  app.post(
    "/datasets",
    jsonBody(createDatasetSchema, "dataset request"),
    (c) => createDataset(c, c.req.valid("json"), st),
  );

  app.get("/datasets", async (c) => {
    const ready = (await listDatasets(root)).filter((d) => mayUse(c, d.id));
    const readyIds = new Set(ready.map((d) => d.id));
    const pending = [...jobs.values()].filter((j) =>
      (!readyIds.has(j.id) || j.status === "running") && mayUse(c, j.id)
    ).map(
      jobView,
    );
    return c.json({ datasets: [...ready.map(summary), ...pending] });
  });

  app.get("/datasets/:id", async (c) => {
    const id = c.req.param("id");
    const job = mayUse(c, id) ? jobs.get(id) : undefined;
    if (job) return c.json(jobView(job), 200);
    const info = mayUse(c, id) ? await getDataset(root, id) : undefined;
    if (!info) {
      throw new ApiError(404, `Dataset "${id}" not found`, { param: "id", code: "dataset_not_found" });
    }
    return c.json(summary(info), 200);
  });

  return app;
}

/** A prepared dataset as answered. */
function summary(info: DatasetInfo) {
  return { ...info, status: "ready" as const };
}

/**
 * `POST /datasets`: plans the dataset (its id), claims the id for the caller, and starts the
 * preparation: 201 with the dataset when it is done within `waitMs`, else 202 with its progress.
 */
async function createDataset(
  c: Context,
  body: z.output<typeof createDatasetSchema>,
  st: DatasetRouteState,
): Promise<Response> {
  const { root, options, limits, jobs } = st;
  const { builtin, path, urls, url_list, texts, ...rest } = body;
  const source =
    (builtin !== undefined
      ? { builtin }
      : path !== undefined
      ? { path }
      : urls !== undefined
      ? { urls }
      : url_list !== undefined
      ? { url_list }
      : { texts: texts! }) as DatasetSource;
  const kind = Object.keys(source)[0];
  const prepOptions: PrepareOptions = {
    ...rest,
    workers: options.workers ?? limits.prepareWorkers,
    sources_root: st.sources,
    download: {
      allowPrivate: options.allowPrivateUrls ?? false,
      maxTotalBytes: limits.maxDownloadBytes,
      budgetSetting: LIMIT_SETTINGS.maxDownloadBytes,
    },
  };
  const plan = await planOf(root, source, prepOptions, kind);
  const id = plan.id;
  await claimDataset(c, st, id, kind, rest.id !== undefined);
  try {
    checkReplace(
      id,
      rest.id !== undefined,
      await getDataset(root, id).catch(() => undefined),
      plan.sourceKey,
      rest.force,
    );
  } catch (e) {
    throw new ApiError(409, (e as Error).message, { param: "id", code: "conflict" });
  }
  const same = jobs.get(id);
  if (same?.status === "running") {
    c.header("Location", `/datasets/${id}`);
    return c.json(st.jobView(same), 202);
  }
  const running = () => [...jobs.values()].filter((j) => j.status === "running").length;
  if (running() >= limits.maxPreparations) {
    throw new LimitError(
      429,
      `Too many dataset preparations running: ${running()} (limit ${
        limitName(limits, "maxPreparations")
      }); retry when one finishes`,
    );
  }
  return await startPreparation(c, st, id, source, prepOptions);
}

/**
 * The plan of a request (its dataset id and source key): 403 for a path outside the sources
 * folder, 400 for a bad source, option or id, naming it.
 */
async function planOf(root: string, source: DatasetSource, prepOptions: PrepareOptions, kind: string) {
  try {
    return await planDataset(root, source, prepOptions);
  } catch (e) {
    if (e instanceof PathOutsideRootError) {
      throw new ApiError(403, `Path "${e.path}" is outside the sources folder: put sources under it`, {
        param: kind,
        code: "path_outside_sources",
      });
    }
    const message = (e as Error).message;
    const param = e instanceof DatasetExistsError || /^Invalid dataset id/.test(message)
      ? "id"
      : /^Invalid split/.test(message)
      ? "split"
      : kind;
    throw new ApiError(400, message, { param });
  }
}

/**
 * With auth: refuses (409) an id `named` in the request that is another user's, then shares a
 * built-in dataset or gives the dataset to the caller, and audits the request.
 */
async function claimDataset(c: Context, st: DatasetRouteState, id: string, kind: string, named: boolean) {
  const { auth } = st;
  // An id named in the request that is another user's is refused; one derived from the source and
  // options names the same data, which the caller may then use too.
  if (
    auth && named && !st.mayUse(c, id) &&
    (st.jobs.has(id) || (await getDataset(st.root, id)) !== undefined)
  ) {
    throw new ApiError(409, `Dataset id "${id}" is taken: choose another id`, {
      param: "id",
      code: "conflict",
    });
  }
  if (auth) {
    const p = principalOf(c);
    if (kind === "builtin") {
      auth.access.share("dataset", id);
    } else auth.access.own(p, "dataset", id);
    audit(auth.store, c, "dataset.create", id, { source: kind });
  }
}

/** Starts preparing dataset `id` and waits up to `waitMs` for it: 201 when done, 422 when failed, else 202. */
async function startPreparation(
  c: Context,
  st: DatasetRouteState,
  id: string,
  source: DatasetSource,
  prepOptions: PrepareOptions,
): Promise<Response> {
  const { root, jobs } = st;
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
    job.done.then(() => true),
    new Promise<boolean>((r) => (timer = setTimeout(() => r(false), st.waitMs))),
  ]);
  clearTimeout(timer);
  if (finished && result) {
    const { id: rid, documents, tokens, splits } = result;
    return c.json({ ...summary(result), id: rid, documents, tokens, splits }, 201);
  }
  if (finished && job.status === "failed") {
    const said = job.error!.startsWith(`Cannot prepare dataset "${id}"`); // the data layer's own words
    throw new ApiError(422, said ? job.error! : `Cannot prepare dataset "${id}": ${job.error}`, {
      code: "preparation_failed",
    });
  }
  c.header("Location", `/datasets/${id}`);
  return c.json(st.jobView(job), 202);
}
