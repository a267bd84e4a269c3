/**
 * Datasets: each prepared one with its documents, tokens, split sizes and the pipeline's counts
 * (URLs dropped, near-duplicates removed, short documents dropped), preparations in progress,
 * and a form that prepares a new one (`POST /datasets`), the API's messages beside its fields.
 */

import { ApiError, getJson, knownMe, postJson } from "./api.js";
import { badge, h, setChildren } from "./dom.js";
import { datasetCounts, fmtInt, mayUse } from "./shapes.js";

const SOURCES = {
  builtin: "built-in name (sotu, moby-dick)",
  path: "folder or file under the data directory",
  urls: "URLs, one per line",
  url_list: "file of URLs under the data directory",
  texts: "documents, separated by a line holding only ---",
};

function row(d) {
  if (d.status !== "ready") {
    const p = d.progress;
    const rate = p?.rate
      ? ` · ${(p.rate / 1e6).toFixed(1)} MB/s${p.eta_s !== undefined ? ` · ETA ${p.eta_s} s` : ""}`
      : "";
    const saved = p?.shards ? ` · ${p.shards} shards saved${p.resumed_bytes ? " (resumed)" : ""}` : "";
    const what = d.error ??
      (p ? `${p.stage} ${fmtInt(p.done)}${p.total ? ` / ${fmtInt(p.total)}` : ""}${rate}${saved}` : "");
    return h(
      "tr",
      { "data-dataset": d.id },
      h("td", {}, d.id),
      h("td", {}, badge(d.status)),
      h("td", { colspan: 8, class: d.error ? "error" : "muted" }, what),
    );
  }
  const c = datasetCounts(d);
  return h(
    "tr",
    { "data-dataset": d.id },
    h("td", {}, d.id),
    h(
      "td",
      d.partial ? { title: `cut: ${(d.cut ?? []).map((x) => `${x.file}: ${x.reason}`).join("; ")}` } : {},
      badge(d.partial ? "partial" : "ready"),
    ),
    h("td", { class: "num" }, fmtInt(d.documents)),
    h("td", { class: "num" }, fmtInt(d.tokens)),
    h("td", { class: "num" }, fmtInt(d.splits?.train)),
    h("td", { class: "num" }, fmtInt(d.splits?.valid)),
    h("td", { class: "num" }, fmtInt(d.splits?.test)),
    h("td", { class: "num" }, fmtInt(c.urls_dropped)),
    h("td", { class: "num" }, fmtInt(c.near_duplicates)),
    h("td", { class: "num" }, fmtInt(c.short_dropped)),
  );
}

/** Renders the datasets page into `ctx.root`. */
export function datasetsView(ctx) {
  const body = h("tbody");
  const heads = [
    "Dataset",
    "Status",
    "Documents",
    "Tokens",
    "Train",
    "Valid",
    "Test",
    "URLs dropped",
    "Near-dups",
    "Short",
  ];
  const kind = h(
    "select",
    { id: "ds-kind", name: "kind" },
    Object.keys(SOURCES).map((k) => h("option", { value: k }, k)),
  );
  const source = h("textarea", { id: "ds-source", rows: 3, placeholder: SOURCES.builtin });
  kind.addEventListener("change", () => (source.placeholder = SOURCES[kind.value]));
  const opts = {
    id: h("input", { id: "ds-id", placeholder: "derived from the source" }),
    min_tokens: h("input", { id: "ds-min_tokens", inputmode: "numeric", placeholder: "default 128" }),
    dedup_threshold: h("input", {
      id: "ds-dedup_threshold",
      inputmode: "decimal",
      placeholder: "default 0.8",
    }),
    split: h("input", { id: "ds-split", placeholder: "default 949,50,1" }),
    seq_len: h("input", { id: "ds-seq_len", inputmode: "numeric", placeholder: "default 1024" }),
    max_documents: h("input", { id: "ds-max_documents", inputmode: "numeric", placeholder: "all" }),
    // Chat datasets: a path to a JSONL file of {"messages": [...]} conversations (README, chat fine-tuning).
    format: h(
      "select",
      { id: "ds-format" },
      h("option", { value: "" }, "text"),
      h("option", { value: "chat" }, "chat (JSONL conversations)"),
    ),
    on_error: h(
      "select",
      { id: "ds-on_error" },
      h("option", { value: "" }, "refuse bad lines"),
      h("option", { value: "skip" }, "skip bad lines"),
    ),
  };
  const errors = new Map();
  const field = (name, input, wide = false) => {
    const err = h("small", { class: "field-error", "data-error-for": name });
    errors.set(name, err);
    return h("label", { class: wide ? "field wide" : "field" }, h("span", {}, name), input, err);
  };
  const formError = h("p", { class: "error", hidden: true });
  const result = h("p", { class: "muted", id: "ds-result" });
  const form = h(
    "form",
    { id: "dataset-form", novalidate: true },
    h("div", { class: "grid" }, field("source", kind), field("value", source, true)),
    h("div", { class: "grid" }, Object.entries(opts).map(([n, i]) => field(n, i))),
    formError,
    h("div", { class: "actions" }, h("button", { type: "submit" }, "Prepare"), result),
  );
  setChildren(
    ctx.root,
    h("h1", {}, "Datasets"),
    h(
      "div",
      { class: "table-wrap" },
      h(
        "table",
        { id: "datasets-table" },
        h("thead", {}, h("tr", {}, heads.map((c) => h("th", {}, c)))),
        body,
      ),
    ),
    // Preparing one needs the train scope: hidden from a token without it.
    mayUse(knownMe(), "train") ? [h("h2", {}, "Prepare a dataset"), form] : null,
  );
  const refresh = async () => {
    const { datasets } = await getJson("/datasets", { signal: ctx.signal });
    setChildren(
      body,
      datasets.length ? datasets.map(row) : h("tr", {}, h("td", { colspan: 10, class: "muted" }, "None yet")),
    );
  };
  ctx.every(3000, refresh);

  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    for (const [, el] of errors) el.textContent = "";
    formError.hidden = true;
    const raw = source.value.trim();
    const value = kind.value === "urls"
      ? raw.split(/\s+/).filter(Boolean)
      : kind.value === "texts"
      ? raw.split(/^---$/m).map((t) => t.trim()).filter(Boolean)
      : raw;
    const req = { [kind.value]: value };
    for (const [n, input] of Object.entries(opts)) {
      const v = input.value.trim();
      if (v !== "") req[n] = n === "id" || n === "split" ? v : Number.isFinite(Number(v)) ? Number(v) : v;
    }
    result.textContent = "Preparing…";
    try {
      const { status, body: res } = await postJson("/datasets", req);
      result.textContent = status === 201
        ? `Ready: ${res.id}, ${fmtInt(res.documents)} documents, ${fmtInt(res.tokens)} tokens`
        : `Preparing ${res.id} (see the table)`;
      refresh();
    } catch (err) {
      if (!(err instanceof ApiError)) throw err;
      result.textContent = "";
      const fields = { ...err.fields };
      if (err.body?.path) fields.value = err.message;
      for (const [name, msg] of Object.entries(fields)) {
        (errors.get(name === kind.value ? "value" : name) ?? { textContent: "" }).textContent = msg;
      }
      formError.textContent = err.message;
      formError.hidden = false;
    }
  });
}
