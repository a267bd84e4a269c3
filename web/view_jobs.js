/**
 * The jobs list: status, model, iteration, loss, validation loss and tokens/s of every job,
 * refreshed every two seconds; a row opens the job's page, and up to 8 training jobs picked with
 * their boxes open side by side in the compare view.
 */

import { getJson } from "./api.js";
import { badge, h, setChildren } from "./dom.js";
import { fmtInt, fmtNum } from "./shapes.js";

/** The name of a job's model: its preset, or its dimensions. */
export function modelName(model) {
  if (typeof model === "string") return model;
  return `${model.n_layer}L×${model.n_embd} (${model.n_head} heads)`;
}

/** Jobs the compare view takes at most (as `GET /jobs/compare`). */
const MAX_COMPARED = 8;

/** Renders the jobs list into `ctx.root`. */
export function jobsView(ctx) {
  const body = h("tbody");
  const picked = new Set();
  const compare = h(
    "a",
    { class: "button secondary", id: "compare-selected", "aria-disabled": "true" },
    "Compare",
  );
  const syncCompare = () => {
    const ok = picked.size >= 2;
    compare.setAttribute("aria-disabled", ok ? "false" : "true");
    compare.textContent = `Compare${picked.size ? ` (${picked.size})` : ""}`;
    if (ok) compare.setAttribute("href", `#/compare?ids=${[...picked].map(encodeURIComponent).join(",")}`);
    else compare.removeAttribute("href");
  };
  const pick = (id) =>
    h("input", {
      type: "checkbox",
      class: "compare-pick",
      "data-job": id,
      "aria-label": `Compare ${id}`,
      checked: picked.has(id),
      disabled: !picked.has(id) && picked.size >= MAX_COMPARED,
      onchange: (e) => {
        if (e.target.checked) picked.add(id);
        else picked.delete(id);
        syncCompare();
        for (const box of body.querySelectorAll(".compare-pick")) {
          box.disabled = !box.checked && picked.size >= MAX_COMPARED;
        }
      },
    });
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
      h("span", { class: "spacer" }),
      compare,
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
            ["", "Job", "Status", "Model", "Iteration", "Loss", "Val loss", "Tokens/s", "GPU", "Created"].map(
              (
                c,
              ) => h("th", {}, c),
            ),
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
          h("td", {}, j.config.evaluate ? null : pick(j.id)),
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
