/**
 * The jobs list: status, model, iteration, loss, validation loss and tokens/s of every job,
 * refreshed every two seconds; a row opens the job's page.
 */

import { getJson } from "./api.js";
import { badge, h, setChildren } from "./dom.js";
import { fmtInt, fmtNum } from "./shapes.js";

/** The name of a job's model: its preset, or its dimensions. */
export function modelName(model) {
  if (typeof model === "string") return model;
  return `${model.n_layer}L×${model.n_embd} (${model.n_head} heads)`;
}

/** Renders the jobs list into `ctx.root`. */
export function jobsView(ctx) {
  const body = h("tbody");
  const empty = h(
    "p",
    { class: "muted", hidden: true },
    "No jobs yet: ",
    h("a", { href: "#/train" }, "start one"),
  );
  setChildren(
    ctx.root,
    h(
      "div",
      { class: "heading" },
      h("h1", {}, "Jobs"),
      h("a", { class: "button", href: "#/train" }, "New job"),
    ),
    h(
      "div",
      { class: "table-wrap" },
      h(
        "table",
        { id: "jobs-table" },
        h(
          "thead",
          {},
          h(
            "tr",
            {},
            ["Job", "Status", "Model", "Iteration", "Loss", "Val loss", "Tokens/s", "GPU", "Created"].map((
              c,
            ) => h("th", {}, c)),
          ),
        ),
        body,
      ),
    ),
    empty,
  );
  ctx.every(2000, async () => {
    const { jobs } = await getJson("/jobs", { signal: ctx.signal });
    empty.hidden = jobs.length > 0;
    setChildren(
      body,
      jobs.map((j) =>
        h(
          "tr",
          { "data-job": j.id },
          h("td", {}, h("a", { href: `#/jobs/${j.id}` }, j.id)),
          h("td", {}, badge(j.status)),
          h("td", {}, modelName(j.config.model)),
          h("td", { class: "num" }, `${fmtInt(j.iteration)} / ${fmtInt(j.config.train_iters)}`),
          h("td", { class: "num" }, fmtNum(j.metrics.loss)),
          h("td", { class: "num" }, fmtNum(j.metrics.val_loss)),
          h("td", { class: "num" }, fmtInt(j.metrics.tokens_per_s)),
          h("td", { class: "num" }, j.gpu),
          h("td", {}, new Date(j.created_at).toLocaleString()),
        )
      ),
    );
  });
}
