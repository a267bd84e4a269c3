/**
 * Runs side by side (`#/compare?ids=a,b`, up to 8 jobs picked on the jobs list): their training
 * and validation loss overlaid by iteration, tokens seen or time, the accuracy of each evaluation
 * during training (`eval_tasks`), their final figures with a CSV export of each, and a table of
 * the config fields where they differ. One `GET /jobs/compare`, refreshed while a job runs.
 */

import { apiFetch, getJson, getToken } from "./api.js";
import { COLORS, lineChart } from "./charts.js";
import { badge, h, setChildren } from "./dom.js";
import { COMPARE_AXES, compareEvalNames, fmtInt, fmtNum, overlayColumns } from "./shapes.js";

const FINISHED = ["succeeded", "failed", "cancelled"];
const X_LABELS = { iteration: "iteration", tokens: "tokens seen", time: "seconds" };

/** A value of a config field, short. */
function configText(v) {
  if (v === null || v === undefined) return "–";
  return typeof v === "string" ? v : JSON.stringify(v);
}

/** A link that downloads a job's metrics as CSV (through fetch when a token is needed). */
export function csvLink(id) {
  const href = `/jobs/${encodeURIComponent(id)}/metrics?format=csv`;
  return h("a", {
    href,
    download: `${id}_metrics.csv`,
    onclick: async (e) => {
      if (!getToken()) return;
      e.preventDefault();
      const url = URL.createObjectURL(await (await apiFetch(href)).blob());
      const a = h("a", { href: url, download: `${id}_metrics.csv` });
      document.body.append(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(url), 60_000);
    },
  }, "CSV");
}

/** Renders the comparison of the jobs in `ctx.query`'s `ids` into `ctx.root`. */
export async function compareView(ctx) {
  const ids = (ctx.query.get("ids") ?? "").split(",").filter((s) => s !== "");
  const axis = h(
    "select",
    { id: "compare-x", "aria-label": "x axis" },
    COMPARE_AXES.map((a) => h("option", { value: a }, `by ${X_LABELS[a]}`)),
  );
  const charts = h("div", { class: "charts", id: "compare-charts" });
  const finals = h("div", { id: "compare-final" });
  const config = h("div", { id: "compare-config" });
  setChildren(
    ctx.root,
    h("div", { class: "heading" }, h("h1", {}, "Compare"), h("span", { class: "spacer" }), axis),
    h("p", { class: "muted" }, ids.map((id, i) => [i ? " · " : "", h("a", { href: `#/jobs/${id}` }, id)])),
    charts,
    h("h2", {}, "Final figures"),
    finals,
    h("h2", {}, "Config differences"),
    config,
  );
  let data = null, drawn = [];
  const destroy = () => {
    for (const d of drawn) d.chart.destroy();
    drawn = [];
    setChildren(charts);
  };
  ctx.signal.addEventListener("abort", destroy);
  const colors = ids.map((_, i) => COLORS[i % COLORS.length]);
  const draw = () => {
    destroy();
    const x = axis.value;
    const chart = (name, title, key) => {
      const c = lineChart(charts, {
        name,
        title,
        xLabel: X_LABELS[x],
        series: data.ids.map((id, i) => ({
          label: id,
          key: id,
          color: colors[i],
          points: key !== "train_loss",
        })),
      });
      drawn.push({ chart: c, key });
    };
    chart("compare-train", "Training loss", "train_loss");
    chart("compare-val", "Validation loss", "val_loss");
    for (const name of compareEvalNames(data)) {
      chart(`compare-eval-${name}`, `${name}: accuracy`, `eval:${name}:accuracy`);
    }
    for (const d of drawn) d.chart.update(overlayColumns(data, d.key, x));
  };
  const renderTables = () => {
    const names = compareEvalNames(data);
    setChildren(
      finals,
      h(
        "div",
        { class: "table-wrap" },
        h(
          "table",
          {},
          h(
            "thead",
            {},
            h(
              "tr",
              {},
              ["Job", "Status", "Iteration", "Tokens", "Loss", "Val loss", "Time", ...names, ""].map((c) =>
                h("th", {}, c)
              ),
            ),
          ),
          h(
            "tbody",
            {},
            data.jobs.map((j, i) =>
              h(
                "tr",
                { "data-job": j.id },
                h("td", {}, h("i", { class: "swatch", style: `background:${colors[i]}` }), " ", j.id),
                h("td", {}, badge(j.status)),
                h("td", { class: "num" }, fmtInt(j.iteration)),
                h("td", { class: "num" }, fmtInt(j.final.tokens)),
                h("td", { class: "num" }, fmtNum(j.final.loss)),
                h("td", { class: "num" }, fmtNum(j.final.val_loss)),
                h(
                  "td",
                  { class: "num" },
                  j.final.elapsed_s === null ? "–" : `${fmtNum(j.final.elapsed_s, 1)} s`,
                ),
                names.map((n) => {
                  const e = j.evaluations[n];
                  return h(
                    "td",
                    { class: "num" },
                    e?.accuracy !== undefined ? `${fmtNum(100 * e.accuracy, 1)}%` : "–",
                  );
                }),
                h("td", {}, csvLink(j.id)),
              )
            ),
          ),
        ),
      ),
    );
    setChildren(
      config,
      data.config_differences.length === 0 ? h("p", { class: "muted" }, "The configs are the same") : h(
        "div",
        { class: "table-wrap" },
        h(
          "table",
          {},
          h("thead", {}, h("tr", {}, h("th", {}, "Field"), data.ids.map((id) => h("th", {}, id)))),
          h(
            "tbody",
            {},
            data.config_differences.map((d) =>
              h(
                "tr",
                { "data-field": d.field },
                h("td", {}, d.field),
                d.values.map((v) => h("td", {}, configText(v))),
              )
            ),
          ),
        ),
      ),
    );
  };
  const refresh = async () => {
    data = await getJson(`/jobs/compare?ids=${encodeURIComponent(ids.join(","))}`, { signal: ctx.signal });
    if (ctx.signal.aborted) return;
    draw();
    renderTables();
  };
  axis.addEventListener("change", () => data && draw());
  await refresh();
  // Follow running jobs until all have finished.
  const timer = setInterval(() => {
    if (!data || data.jobs.every((j) => FINISHED.includes(j.status))) return clearInterval(timer);
    refresh().catch(() => {});
  }, 5000);
  ctx.signal.addEventListener("abort", () => clearInterval(timer));
}
