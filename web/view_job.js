/**
 * One job's page: its figures, live curves (train, validation and test loss and perplexity, lr,
 * gradient norm, tokens/s, and fp16's loss scale and skipped steps when reported), the step's
 * timing breakdown, GPU memory beside the estimate, checkpoints with downloads, its log and a
 * cancel button. The curves come from the job's event stream, replayed from the store on every
 * load (so they survive a reload) and followed live, resumed with Last-Event-ID after a break.
 * An evaluation job (`POST /evaluate`) shows its progress and result figures instead; a training
 * job lists the evaluations of its checkpoints beside them, with a button to start one, and draws
 * its evaluations during training (`eval_tasks`: accuracy, or loss for perplexity) as a curve.
 */

import {
  ApiError,
  apiFetch,
  fetchEstimate,
  followEvents,
  getJson,
  getToken,
  knownMe,
  postJson,
} from "./api.js";
import { lineChart, timingBar } from "./charts.js";
import { badge, h, setChildren, stat } from "./dom.js";
import { evalTaskKey, fmtBytes, fmtInt, fmtNum, JobSeries, mayUse } from "./shapes.js";
import { modelName } from "./view_jobs.js";
import { csvLink } from "./view_compare.js";

const FINISHED = ["succeeded", "failed", "cancelled"];

/** Downloads through fetch when a token is needed (a plain link cannot send it). */
function downloadLink(href, label) {
  return h("a", {
    href,
    download: "",
    onclick: async (e) => {
      if (!getToken()) return;
      e.preventDefault();
      const blob = await (await apiFetch(href)).blob();
      const url = URL.createObjectURL(blob);
      const a = h("a", { href: url, download: href.split("/").slice(-3).join("_") });
      document.body.append(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(url), 60_000);
    },
  }, label);
}

/** The figures of an evaluation result, as [label, text] pairs. */
export function evaluationFigures(r) {
  if (!r) return [];
  const out = [["loss", fmtNum(r.loss, 4)], ["perplexity", fmtNum(r.perplexity, 2)]];
  if (r.task === "cloze") {
    out.push(["accuracy", `${fmtNum(100 * r.accuracy, 2)}% (${fmtInt(r.correct)} / ${fmtInt(r.examples)})`]);
  } else if (r.task === "multiple_choice") {
    out.unshift(
      ["accuracy", `${fmtNum(100 * r.accuracy, 2)}% (${fmtInt(r.correct)} / ${fmtInt(r.examples)})`],
      ["accuracy_norm", `${fmtNum(100 * r.accuracy_norm, 2)}% (${fmtInt(r.correct_norm)})`],
    );
    out.push(["endings/s", fmtInt(r.endings_per_s)]);
  } else {
    out.push(
      ["word perplexity", fmtNum(r.word_perplexity, 2)],
      ["byte perplexity", fmtNum(r.byte_perplexity, 4)],
      ["bits per byte", fmtNum(r.bits_per_byte, 4)],
    );
  }
  out.push(["tokens scored", fmtInt(r.tokens)], ["tokens/s", fmtInt(r.tokens_per_s)]);
  return out;
}

/** What an evaluation job reads, in a few words. */
function evalSource(e) {
  if (e.texts) return `${fmtInt(e.texts.length)} text${e.texts.length === 1 ? "" : "s"}`;
  if (e.examples) return `${fmtInt(e.examples.length)} multiple-choice examples (${e.scoring ?? "sum"})`;
  if (e.examples_file) return `task file "${e.examples_file}" (${e.scoring ?? "sum"})`;
  return `${e.dataset} (${e.split})`;
}

/** Renders job `id` into `ctx.root` and follows it until the view is left. */
export async function jobView(ctx, id) {
  let job = await getJson(`/jobs/${encodeURIComponent(id)}`, { signal: ctx.signal });
  const series = new JobSeries();
  const title = h("h1", {}, id);
  const status = h("span", { id: "job-status" });
  const conn = h("span", { class: "muted", id: "stream-state" }, "connecting");
  const cancel = h("button", {
    type: "button",
    class: "danger",
    id: "cancel-job",
    onclick: async () => {
      cancel.disabled = true;
      try {
        await postJson(`/jobs/${id}/cancel`, {});
      } catch (e) {
        alert(e.message);
        cancel.disabled = false;
      }
    },
  }, "Cancel");
  const stats = h("div", { class: "stats", id: "job-stats" });
  const timing = h("div", { id: "job-timing" });
  const charts = h("div", { class: "charts", id: "job-charts" });
  const ckpts = h("div", { id: "job-checkpoints" });
  const log = h("ol", { class: "log", id: "job-log" });
  const error = h("p", { class: "error", hidden: true });
  const evals = h("div", { id: "job-evaluations" });
  const isEval = Boolean(job.config.evaluate);
  let evalProgress = null;
  setChildren(
    ctx.root,
    h("div", { class: "heading" }, title, status, h("span", { class: "spacer" }), conn, cancel),
    h("p", { class: "muted", id: "job-config" }),
    error,
    stats,
    isEval ? null : [
      h("h2", {}, "Step time"),
      timing,
      h("h2", {}, "Curves ", h("small", {}, csvLink(id))),
      charts,
      h("h2", {}, "Checkpoints"),
      ckpts,
      h("h2", {}, "Evaluations"),
      evals,
    ],
    h("h2", {}, "Log"),
    log,
  );

  // Each chart with the series keys it draws, in its series order.
  const drawn = [];
  const chart = (opts) => {
    drawn.push({ chart: lineChart(charts, opts), keys: opts.series.map((s) => s.key) });
  };
  chart({
    name: "loss",
    title: "Loss",
    series: [
      { label: "train", key: "loss" },
      { label: "validation", key: "val_loss", points: true },
      { label: "test", key: "test_loss", points: true },
    ],
  });
  chart({
    name: "perplexity",
    title: "Perplexity",
    scales: { y: { distr: 3 } },
    series: [
      { label: "train", key: "train_ppl" },
      { label: "validation", key: "val_ppl", points: true },
      { label: "test", key: "test_ppl", points: true },
    ],
  });
  chart({ name: "lr", title: "Learning rate", series: [{ label: "lr", key: "lr", color: "#9333ea" }] });
  chart({
    name: "grad_norm",
    title: "Gradient norm",
    series: [{ label: "grad norm", key: "grad_norm", color: "#db2777" }],
  });
  chart({
    name: "tokens_per_s",
    title: "Tokens/s",
    series: [{ label: "tokens/s", key: "tokens_per_s", color: "#0891b2" }],
  });
  const tasks = job.config.eval_tasks ?? [];
  if (tasks.length > 0) {
    chart({
      name: "eval_tasks",
      title: "Evaluations during training (accuracy; perplexity tasks: loss)",
      series: tasks.map((t) => ({ label: t.name, key: evalTaskKey(t.name), points: true })),
    });
  }
  ctx.signal.addEventListener("abort", () => drawn.forEach((d) => d.chart.destroy()));

  let estimate = null;
  const renderHead = () => {
    setChildren(status, badge(job.status));
    cancel.hidden = FINISHED.includes(job.status) || !mayUse(knownMe(), "train");
    const c = job.config, e = c.evaluate;
    setChildren(
      document.getElementById("job-config"),
      e
        ? `${e.task}${e.strict ? " (strict)" : ""} of "${e.model}" (${modelName(c.model)}) · ${
          evalSource(e)
        } · ` +
          `windows of ${c.seq_len}${e.task === "perplexity" ? `, stride ${e.stride}` : ""} · batch ` +
          `${c.batch_size} · GPU ${job.gpu}`
        : `${modelName(c.model)}${
          c.init_from ? ` fine-tuned from "${c.init_from}"` : ""
        } · ${c.dataset} · batch ${c.batch_size} × ` +
          `${c.seq_len} · lr ${c.lr} (${c.lr_decay_style})` +
          `${c.precision ? ` · ${c.precision}` : ""} · seed ${c.seed} · GPU ${job.gpu}`,
    );
    error.hidden = !job.error;
    error.textContent = job.error ?? "";
  };
  const renderEvalStats = () => {
    const p = evalProgress;
    setChildren(
      stats,
      p ? stat("progress", `${fmtInt(p.done)} / ${fmtInt(p.total)}`, { id: "stat-progress" }) : null,
      p && !job.metrics.evaluation ? stat("tokens scored", fmtInt(p.tokens)) : null,
      evaluationFigures(job.metrics.evaluation).map(([label, text]) => stat(label, text)),
      stat("GPU memory", fmtBytes(job.metrics.gpu_memory_bytes), { id: "stat-memory" }),
    );
  };
  const renderStats = () => {
    if (isEval) return renderEvalStats();
    const m = job.metrics;
    const p = series.latest ?? {};
    const mem = p.gpu_memory_bytes ?? m.gpu_memory_bytes;
    setChildren(
      stats,
      stat(
        "iteration",
        `${fmtInt(Math.max(job.iteration, p.iteration ?? 0))} / ${fmtInt(job.config.train_iters)}`,
        {
          id: "stat-iteration",
        },
      ),
      stat("loss", fmtNum(p.loss ?? m.loss), { id: "stat-loss" }),
      stat("val loss (ppl)", `${fmtNum(m.val_loss)} (${fmtNum(m.val_perplexity, 1)})`),
      stat("test loss (ppl)", `${fmtNum(m.test_loss)} (${fmtNum(m.test_perplexity, 1)})`),
      stat("lr", fmtNum(p.lr ?? m.lr, 6)),
      stat("grad norm", fmtNum(p.grad_norm ?? m.grad_norm)),
      stat("tokens/s", fmtInt(p.tokens_per_s ?? m.tokens_per_s)),
      stat("GPU memory", fmtBytes(mem), { id: "stat-memory" }),
      estimate !== null ? stat("estimate", fmtBytes(estimate), { id: "stat-estimate" }) : null,
      series.hasFp16 ? stat("loss scale", fmtNum(p.loss_scale, 0)) : null,
      series.hasFp16 ? stat("skipped steps", fmtInt(p.skipped_steps)) : null,
    );
    setChildren(timing, timingBar(p.timings ?? m.timings));
  };
  let fp16Shown = false;
  let pending = false;
  const redraw = () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      if (ctx.signal.aborted) return;
      if (series.hasFp16 && !fp16Shown) {
        fp16Shown = true;
        chart({
          name: "fp16",
          title: "Loss scale and skipped steps",
          scales: { ls: { distr: 3 }, sk: {} },
          series: [
            { label: "loss scale", key: "loss_scale", scale: "ls", color: "#ea580c" },
            { label: "skipped steps", key: "skipped_steps", scale: "sk", color: "#64748b" },
          ],
        });
      }
      for (const d of drawn) d.chart.update(series.columns(d.keys));
      renderStats();
    });
  };
  const refreshJob = async () => {
    job = await getJson(`/jobs/${encodeURIComponent(id)}`, { signal: ctx.signal });
    renderHead();
    renderStats();
  };
  const refreshCheckpoints = async () => {
    const { checkpoints } = await getJson(`/jobs/${encodeURIComponent(id)}/checkpoints`, {
      signal: ctx.signal,
    });
    if (checkpoints.length === 0) {
      setChildren(ckpts, h("p", { class: "muted" }, "None yet"));
      return;
    }
    const base = `/jobs/${encodeURIComponent(id)}/checkpoints`;
    setChildren(
      ckpts,
      h(
        "div",
        { class: "table-wrap" },
        h(
          "table",
          {},
          h(
            "thead",
            {},
            h("tr", {}, ["Checkpoint", "Iteration", "Size", "Saved", "Files", ""].map((c) => h("th", {}, c))),
          ),
          h(
            "tbody",
            {},
            checkpoints.map((k) =>
              h(
                "tr",
                {},
                h("td", {}, k.name),
                h("td", { class: "num" }, fmtInt(k.iteration)),
                h("td", { class: "num" }, fmtBytes(k.bytes)),
                h("td", {}, new Date(k.created_at).toLocaleString()),
                h(
                  "td",
                  { class: "files" },
                  ["model.safetensors", "config.json", "manifest.json"].map((f) =>
                    downloadLink(`${base}/${k.name}/${f}`, f)
                  ),
                ),
                h(
                  "td",
                  {},
                  h("a", { href: `#/playground?model=${encodeURIComponent(`${id}/${k.name}`)}` }, "Try it"),
                  " ",
                  h("button", {
                    type: "button",
                    title: `Perplexity of ${id}/${k.name} on the test split of ${job.config.dataset}, ` +
                      "windows of seq_len with stride seq_len / 2",
                    onclick: (e) => evaluateCheckpoint(e.target, `${id}/${k.name}`),
                  }, "Evaluate"),
                ),
              )
            ),
          ),
        ),
      ),
    );
  };
  const evaluateCheckpoint = async (button, model) => {
    button.disabled = true;
    const c = job.config;
    try {
      const { body } = await postJson("/evaluate", {
        model,
        task: "perplexity",
        dataset: c.dataset,
        split: "test",
        seq_len: c.seq_len,
        stride: Math.max(1, Math.floor(c.seq_len / 2)),
        batch_size: c.batch_size,
      });
      location.hash = `#/jobs/${body.id}`;
    } catch (e) {
      alert(e.message);
      button.disabled = false;
    }
  };
  // Evaluation jobs of this job's checkpoints, beside them.
  const refreshEvaluations = async () => {
    const { jobs } = await getJson("/jobs?limit=1000", { signal: ctx.signal });
    const mine = jobs.filter((j) => {
      const m = j.config.evaluate?.model;
      return m === id || m?.startsWith(`${id}/`);
    });
    if (mine.length === 0) {
      setChildren(evals, h("p", { class: "muted" }, "None yet: evaluate a checkpoint above"));
      return;
    }
    setChildren(
      evals,
      h(
        "div",
        { class: "table-wrap" },
        h(
          "table",
          {},
          h(
            "thead",
            {},
            h("tr", {}, ["Job", "Model", "Task", "Status", "Figures"].map((c) => h("th", {}, c))),
          ),
          h(
            "tbody",
            {},
            mine.map((j) =>
              h(
                "tr",
                {},
                h("td", {}, h("a", { href: `#/jobs/${j.id}` }, j.id)),
                h("td", {}, j.config.evaluate.model),
                h("td", {}, `${j.config.evaluate.task} · ${evalSource(j.config.evaluate)}`),
                h("td", {}, badge(j.status)),
                h(
                  "td",
                  {},
                  evaluationFigures(j.metrics.evaluation).slice(0, 3).map(([l, t]) => `${l} ${t}`).join(
                    " · ",
                  ) ||
                    "–",
                ),
              )
            ),
          ),
        ),
      ),
    );
  };
  const addLog = (text, level = "info") => {
    log.append(h("li", { class: `log-${level}` }, text));
    while (log.children.length > 200) log.firstChild.remove();
  };

  renderHead();
  renderStats();
  if (!isEval) {
    refreshCheckpoints().catch(() => {});
    refreshEvaluations().catch(() => {});
  }
  fetchEstimate(job.config, ctx.signal).then((bytes) => {
    estimate = bytes;
    renderStats();
  });

  try {
    await followEvents(`/jobs/${encodeURIComponent(id)}/events`, {
      signal: ctx.signal,
      onState: (s) => (conn.textContent = s),
      onEvent: (type, data) => {
        if (series.add(type, data)) redraw();
        if (type === "progress" && data.kind === "evaluate") {
          evalProgress = data;
          renderStats();
        } else if (type === "evaluation") {
          job.metrics.evaluation = data;
          addLog(evaluationFigures(data).map(([l, t]) => `${l} ${t}`).join(" · "));
          renderStats();
        }
        if (type === "progress" && data.kind === "eval") {
          const p = data.split === "test" ? "test" : "val";
          job.metrics[`${p}_loss`] = data.loss;
          job.metrics[`${p}_perplexity`] = data.perplexity;
        }
        if (type === "compile" && (data.done === 1 || data.done >= data.total)) {
          const cache = data.cache_disabled
            ? " (the driver's shader cache is disabled)"
            : data.first_run
            ? " (first run on this adapter; cached afterwards)"
            : "";
          addLog(
            data.done >= data.total
              ? `Compiled ${data.total} kernels on ${data.adapter} in ${(data.ms / 1000).toFixed(1)} s`
              : `Compiling ${data.total} kernels on ${data.adapter}${cache}`,
          );
        } else if (type === "eval_task") {
          addLog(
            data.error
              ? `${data.name} at iteration ${data.iteration} failed: ${data.error}`
              : `${data.name} at iteration ${data.iteration}: ` +
                (typeof data.accuracy === "number"
                  ? `accuracy ${fmtNum(100 * data.accuracy, 2)}%` +
                    (typeof data.accuracy_norm === "number"
                      ? `, accuracy_norm ${fmtNum(100 * data.accuracy_norm, 2)}%`
                      : "")
                  : `loss ${fmtNum(data.loss, 4)}, perplexity ${fmtNum(data.perplexity, 2)}`),
            data.error ? "warn" : "info",
          );
        } else if (type === "log") {
          addLog(data.message, data.level);
          if (data.status) refreshJob().catch(() => {});
        } else if (type === "checkpoint") {
          addLog(`Checkpoint ${data.name}`);
          refreshCheckpoints().catch(() => {});
        } else if (type === "done") {
          addLog(
            `Done: ${data.status}${data.error ? `: ${data.error}` : ""}`,
            data.status === "failed" ? "warn" : "info",
          );
          conn.textContent = "finished";
          refreshJob().catch(() => {});
          if (!isEval) {
            refreshCheckpoints().catch(() => {});
            refreshEvaluations().catch(() => {});
          }
          return true;
        }
        return false;
      },
    });
  } catch (e) {
    if (e instanceof ApiError) conn.textContent = e.message;
    else throw e;
  }
}
