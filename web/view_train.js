/**
 * The form that starts a training job. Its fields are built from the JSON Schema of `POST /train`
 * (served at /web/meta.json, generated from the server's zod schema), so new fields appear by
 * themselves; browser validation is off, so the API's own messages show beside each field. The
 * estimator's memory figure (`GET /estimate`, when the server has one) and the GPU it planned for
 * show before submitting. `init_from` (fine-tuning) offers the models the server knows
 * (`GET /v1/models`); with it, `model` may stay empty and comes from that model.
 */

import { ApiError, fetchEstimateAnswer, getJson, postJson } from "./api.js";
import { h, setChildren } from "./dom.js";
import { fmtBytes } from "./shapes.js";

const PRIMARY = ["model", "init_from", "dataset", "train_iters", "batch_size", "seq_len", "lr", "precision"];

/** What the user typed, as the API expects it; untouched fields are left out (server defaults). */
function valueOf(input, prop) {
  const raw = input.value.trim();
  if (raw === "") return undefined;
  if (input.dataset.kind === "json") {
    try {
      return JSON.parse(raw);
    } catch {
      return raw; // the API names the field and says why
    }
  }
  if (input.dataset.kind === "model") {
    if (!raw.startsWith("{")) return raw;
    try {
      return JSON.parse(raw);
    } catch {
      return raw;
    }
  }
  if (prop.type === "boolean") return raw === "true";
  if (prop.type === "integer" || prop.type === "number") {
    const n = Number(raw);
    return Number.isFinite(n) ? n : raw; // the API names the field and says why
  }
  return raw;
}

function control(name, prop, lists) {
  const id = `f-${name}`;
  const hint = prop.default !== undefined ? `default ${JSON.stringify(prop.default)}` : "optional";
  if (prop.enum || prop.type === "boolean") {
    const options = prop.enum ?? [true, false];
    return h(
      "select",
      { id, name },
      h("option", { value: "" }, hint),
      options.map((o) => h("option", { value: String(o) }, String(o))),
    );
  }
  const numeric = prop.type === "integer" || prop.type === "number";
  const isModel = name === "model";
  return h("input", {
    id,
    name,
    placeholder: hint,
    autocomplete: "off",
    inputmode: numeric ? (prop.type === "integer" ? "numeric" : "decimal") : null,
    list: isModel
      ? "presets"
      : name === "dataset"
      ? "dataset-ids"
      : name === "init_from"
      ? "model-ids"
      : null,
    "data-kind": isModel ? "model" : prop.type === "array" ? "json" : null,
    title: isModel
      ? `A preset (${lists.presets.join(", ")}) or {"n_layer":..,"n_head":..,"n_embd":..,"n_positions":..}`
      : name === "eval_tasks"
      ? 'JSON: [{"name": "mc", "task": "multiple_choice", "examples": [{"context": .., "endings": [..], "label": 0}]}]'
      : name === "init_from"
      ? "Fine-tune: start from this model's weights (a job, a job's checkpoint, or a folder under models/)"
      : null,
  });
}

/** The dimensions of a model listed by `GET /v1/models`, as `model` takes them (null when unknown). */
function sourceDims(models, id) {
  const c = models.find((m) => m.id === id)?.config;
  return c ? { n_layer: c.n_layer, n_head: c.n_head, n_embd: c.n_embd, n_positions: c.n_positions } : null;
}

/** Renders the training form into `ctx.root`. */
export async function trainView(ctx) {
  const meta = await getJson("/web/meta.json", { signal: ctx.signal });
  const datasets = await getJson("/datasets", { signal: ctx.signal }).then((b) => b.datasets).catch(() => []);
  const models = await getJson("/v1/models", { signal: ctx.signal }).then((b) => b.data).catch(() => []);
  const ids = [
    ...new Set([...meta.builtin_datasets, ...datasets.filter((d) => d.status === "ready").map((d) => d.id)]),
  ];
  const props = meta.train_schema.properties;
  const names = Object.keys(props);
  const ordered = [...PRIMARY.filter((n) => n in props), ...names.filter((n) => !PRIMARY.includes(n))];
  const inputs = new Map();
  const errors = new Map();
  const field = (name) => {
    const input = control(name, props[name], meta);
    const err = h("small", { class: "field-error", "data-error-for": name });
    inputs.set(name, input);
    errors.set(name, err);
    return h("label", { class: "field", for: `f-${name}` }, h("span", {}, name), input, err);
  };
  const formError = h("p", { class: "error", id: "train-error", hidden: true });
  const estimate = h("p", { class: "estimate", id: "train-estimate", hidden: true });
  const submit = h("button", { type: "submit", id: "train-submit" }, "Start training");
  const form = h(
    "form",
    { id: "train-form", novalidate: true },
    h("div", { class: "grid" }, ordered.filter((n) => PRIMARY.includes(n)).map(field)),
    h(
      "details",
      {},
      h("summary", {}, "More options"),
      h("div", { class: "grid" }, ordered.filter((n) => !PRIMARY.includes(n)).map(field)),
    ),
    formError,
    h("div", { class: "actions" }, submit, estimate),
  );
  setChildren(
    ctx.root,
    h("h1", {}, "Train"),
    h("datalist", { id: "presets" }, meta.presets.map((p) => h("option", { value: p }))),
    h("datalist", { id: "dataset-ids" }, ids.map((d) => h("option", { value: d }))),
    h("datalist", { id: "model-ids" }, models.map((m) => h("option", { value: m.id }))),
    form,
  );

  const body = () => {
    const out = {};
    for (const [name, input] of inputs) {
      const v = valueOf(input, props[name]);
      if (v !== undefined) out[name] = v;
    }
    return out;
  };
  const clearErrors = () => {
    for (const [, el] of errors) el.textContent = "";
    for (const [, input] of inputs) input.removeAttribute("aria-invalid");
    formError.hidden = true;
  };

  let timer;
  let asked = 0;
  const updateEstimate = () => {
    clearTimeout(timer);
    timer = setTimeout(async () => {
      const n = ++asked;
      const b = body();
      const cfg = {
        ...b,
        model: b.model ??
          (b.init_from ? sourceDims(models, b.init_from) : props.model.default ?? "gpt2-tiny"),
        batch_size: b.batch_size ?? props.batch_size.default,
      };
      const answer = await fetchEstimateAnswer(cfg, ctx.signal);
      if (n !== asked) return;
      estimate.hidden = answer === null;
      estimate.textContent = answer === null ? "" : `Estimated GPU memory: ${fmtBytes(answer.bytes)}` +
        (answer.gpu ? `, planned for ${answer.gpu}` : "");
    }, 300);
  };
  form.addEventListener("input", updateEstimate);
  updateEstimate();

  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    clearErrors();
    submit.disabled = true;
    try {
      const { body: res } = await postJson("/train", body());
      location.hash = `#/jobs/${res.id}`;
    } catch (err) {
      if (!(err instanceof ApiError)) throw err;
      for (const [name, msg] of Object.entries(err.fields)) {
        const el = errors.get(name);
        if (!el) continue;
        el.textContent = msg;
        inputs.get(name).setAttribute("aria-invalid", "true");
        if (!PRIMARY.includes(name)) form.querySelector("details").open = true;
      }
      formError.textContent = err.message;
      formError.hidden = false;
    } finally {
      submit.disabled = false;
    }
  });
}
