/**
 * Pure readers of the API's answers, kept apart from the DOM so Deno tests can check them:
 * error bodies in both shapes the API has used, the estimator's memory figure and GPU, a dataset's
 * pipeline counts, the curves of a job built from its event stream, a comparison's series drawn
 * by iteration, tokens or time, and number formats.
 */

/**
 * The message and per-field messages of an error body: OpenAI's `{error: {message, param}}` or
 * the older `{error: "...", field?, issues?: [{path, message}]}`. `fields` maps a top-level
 * request field to the first message about it.
 */
export function errorInfo(body, status = 0) {
  const fields = {};
  const note = (path, msg) => {
    const name = Array.isArray(path) ? path[0] : String(path ?? "").split(".")[0];
    if (name !== undefined && name !== "" && !(name in fields)) fields[name] = msg;
  };
  const err = body?.error;
  let message;
  if (err && typeof err === "object") {
    message = err.message ?? `HTTP ${status}`;
    if (err.param) note(err.param, message);
  } else {
    message = typeof err === "string" ? err : `HTTP ${status}`;
    if (body?.field) note(body.field, message);
  }
  const issues = (err && typeof err === "object" ? err.issues : undefined) ?? body?.issues;
  for (const issue of Array.isArray(issues) ? issues : []) {
    if (issue.code === "unrecognized_keys" && Array.isArray(issue.keys)) {
      for (const k of issue.keys) note([k], `Unknown field "${k}"`);
    } else if (issue.path?.length) note(issue.path, issue.message);
  }
  return { message, fields };
}

/** The total bytes of a `GET /estimate` answer, wherever the estimator put it; null if none. */
export function estimateBytes(body) {
  if (typeof body !== "object" || body === null) return null;
  for (const key of ["total_bytes", "total", "bytes"]) {
    const v = body[key];
    if (typeof v === "number" && Number.isFinite(v)) return v;
    if (typeof v === "object" && v !== null) {
      const inner = estimateBytes(v);
      if (inner !== null) return inner;
    }
  }
  for (const v of Object.values(body)) {
    if (typeof v === "object" && v !== null && !Array.isArray(v)) {
      const inner = estimateBytes(v);
      if (inner !== null) return inner;
    }
  }
  return null;
}

/**
 * Which GPU a `GET /estimate` answer planned for, as one short phrase ("this server's GPU (…)",
 * "NVIDIA H100 80GB", "NVIDIA H200: this server's GPU cannot hold it", or the default when the
 * server has no GPU ready); null when it does not say.
 */
export function estimateGpu(body) {
  const p = body?.planned_for;
  if (typeof p !== "object" || p === null || typeof p.name !== "string") return null;
  if (p.why === "server") return `this server's GPU (${p.name})`;
  if (p.why === "query") return p.name;
  return body.fits_server_gpu === false
    ? `${p.name}: this server's GPU cannot hold it`
    : `${p.name}, the default: this server has no GPU ready`;
}

/** A dataset's pipeline counts from its manifest stats: URLs dropped, near-duplicates, short documents. */
export function datasetCounts(d) {
  const s = d?.stats ?? {};
  const urls = s.urls;
  return {
    urls_dropped: urls ? urls.input - urls.kept : null,
    near_duplicates: typeof s.near_duplicates === "number" ? s.near_duplicates : null,
    short_dropped: typeof s.under_min_tokens === "number" ? s.under_min_tokens : null,
  };
}

/**
 * A job's curves, built from its events (`progress` of kind train or eval). One row per
 * iteration, so events replayed after a reconnect or a resumed run overwrite, never duplicate.
 */
export class JobSeries {
  #rows = new Map();
  /** Training log points seen. */
  trainPoints = 0;
  /** Whether any event carried fp16's loss scale or skipped steps. */
  hasFp16 = false;
  /**
   * The newest training progress event's data.
   * @type {Record<string, any> | null}
   */
  latest = null;

  /** Takes one event; returns whether a curve changed. */
  add(type, data) {
    if (type === "eval_task" && typeof data?.iteration === "number" && typeof data.name === "string") {
      let row = this.#rows.get(data.iteration);
      if (!row) this.#rows.set(data.iteration, row = { iteration: data.iteration });
      row[evalTaskKey(data.name)] = evalTaskValue(data);
      return true;
    }
    if (type !== "progress" || typeof data?.iteration !== "number") return false;
    let row = this.#rows.get(data.iteration);
    if (!row) this.#rows.set(data.iteration, row = { iteration: data.iteration });
    if (data.kind === "eval") {
      const p = data.split === "test" ? "test" : "val";
      row[`${p}_loss`] = data.loss;
      row[`${p}_ppl`] = data.perplexity;
      return true;
    }
    if (row.loss === undefined) this.trainPoints++;
    row.loss = data.loss;
    row.train_ppl = typeof data.loss === "number" ? Math.exp(data.loss) : null;
    for (const k of ["lr", "grad_norm", "tokens_per_s", "loss_scale", "skipped_steps"]) {
      if (typeof data[k] === "number") row[k] = data[k];
    }
    if (typeof data.loss_scale === "number" || typeof data.skipped_steps === "number") this.hasFp16 = true;
    if (!this.latest || data.iteration >= this.latest.iteration) this.latest = data;
    return true;
  }

  /** uPlot's aligned data: iterations ascending, then one column per key (null where absent). */
  columns(keys) {
    const rows = [...this.#rows.values()].sort((a, b) => a.iteration - b.iteration);
    return [rows.map((r) => r.iteration), ...keys.map((k) => rows.map((r) => r[k] ?? null))];
  }
}

/** The series key of an eval task's curve on a job's page. */
export function evalTaskKey(name) {
  return `eval:${name}`;
}

/** What an eval task's curve draws: its accuracy (multiple choice, cloze), else its loss; null when it failed. */
export function evalTaskValue(data) {
  if (typeof data?.accuracy === "number") return data.accuracy;
  return typeof data?.loss === "number" ? data.loss : null;
}

/** The x axes the compare view offers: iteration, tokens seen, seconds since the job's first point. */
export const COMPARE_AXES = ["iteration", "tokens", "time"];

/**
 * uPlot's data for one series of a `GET /jobs/compare` answer drawn against `x` (one of
 * COMPARE_AXES): the union of the jobs' x values ascending, then one column per job (in `ids`
 * order), null where that job has no point. By iteration the answer is already aligned; by tokens
 * or time each job's x values are its own, so they are merged here.
 */
export function overlayColumns(c, name, x = "iteration") {
  const s = c?.series?.[name] ?? {};
  const pairs = (c?.ids ?? []).map((id, j) => {
    const ys = s[id] ?? [];
    const perIt = c.jobs?.[j]?.tokens_per_iteration ?? 0;
    const out = [];
    c.iterations.forEach((it, k) => {
      const y = ys[k];
      if (typeof y !== "number") return;
      const xv = x === "tokens" ? it * perIt : x === "time" ? c.series.time_s?.[id]?.[k] : it;
      if (typeof xv === "number") out.push([xv, y]);
    });
    return out;
  });
  const xs = [...new Set(pairs.flat().map(([xv]) => xv))].sort((a, b) => a - b);
  const at = new Map(xs.map((v, i) => [v, i]));
  return [
    xs,
    ...pairs.map((p) => {
      const col = new Array(xs.length).fill(null);
      for (const [xv, y] of p) col[at.get(xv)] = y;
      return col;
    }),
  ];
}

/** The eval task names of a `GET /jobs/compare` answer (from its `eval:<name>:<figure>` series). */
export function compareEvalNames(c) {
  const names = new Set();
  for (const key of Object.keys(c?.series ?? {})) {
    const m = key.match(/^eval:(.+):accuracy$/);
    if (m) names.add(m[1]);
  }
  return [...names].sort();
}

/** Bytes as B, KiB, MiB or GiB with three significant digits. */
export function fmtBytes(n) {
  if (typeof n !== "number" || !Number.isFinite(n)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) {
    n /= 1024;
    i++;
  }
  return `${i === 0 ? n : n.toPrecision(3)} ${units[i]}`;
}

/** A number for a table cell: `digits` decimals, or "–" when absent. */
export function fmtNum(x, digits = 3) {
  if (typeof x !== "number" || !Number.isFinite(x)) return "–";
  if (x !== 0 && (Math.abs(x) < 1e-3 || Math.abs(x) >= 1e6)) return x.toExponential(2);
  return x.toFixed(digits);
}

/** An axis tick: three significant digits, exponent form for very small or large values. */
export function fmtTick(x) {
  if (typeof x !== "number" || !Number.isFinite(x)) return ""; // uPlot passes null for unlabelled log ticks
  if (x === 0) return "0";
  const a = Math.abs(x);
  if (a < 1e-2 || a >= 1e6) return x.toExponential(1);
  return String(Number(x.toPrecision(3)));
}

/** An integer with thousands separators, or "–". */
export function fmtInt(x) {
  return typeof x === "number" && Number.isFinite(x) ? Math.round(x).toLocaleString("en-US") : "–";
}

/** The scope each navigation entry needs (a nav `data-nav` name → scope; "any": every caller). */
export const NAV_SCOPES = {
  jobs: "read",
  train: "train",
  datasets: "read",
  playground: "generate",
  gpus: "any",
  admin: "admin",
};

/** Whether the caller `me` (`GET /auth/me`) may use what needs `scope`; null `me`: unknown, shown. */
export function mayUse(me, scope) {
  if (!me || scope === "any") return true;
  const scopes = Array.isArray(me.scopes) ? me.scopes : [];
  return me.admin === true || scopes.includes("admin") || scopes.includes(scope);
}

/**
 * The signed-in line of `GET /auth/me`: "alice · read, train · 2/20 queued, 1/2 GPUs running, 0/16
 * streams, 120/86400 GPU-s today", or "admin (no user)" for the bootstrap token or an open server.
 */
export function whoAmI(me) {
  if (!me) return "";
  if (me.user === null || me.user === undefined) {
    return me.auth_required ? "admin (bootstrap token)" : "admin (no token needed)";
  }
  const parts = [me.user, (me.scopes ?? []).join(", ")];
  const q = me.quotas, u = me.usage;
  if (q && u) {
    parts.push(
      `${u.queued_jobs}/${q.queued_jobs} queued, ${u.running_gpus}/${q.running_gpus} GPUs running, ` +
        `${u.streams}/${q.streams} streams, ${u.gpu_seconds_per_day}/${q.gpu_seconds_per_day} GPU-s today`,
    );
  }
  return parts.join(" · ");
}
