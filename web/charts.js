/**
 * Charts of a job: uPlot line charts over iterations (resized with their container, so they fit
 * a narrow screen) and the step's timing breakdown as one stacked bar. `uPlot` is the global
 * from /web/vendor/uPlot.iife.min.js.
 */

import { h } from "./dom.js";
import { fmtNum, fmtTick } from "./shapes.js";

/** Series colours: train, validation, test, then others. */
export const COLORS = [
  "#2563eb",
  "#ea580c",
  "#16a34a",
  "#9333ea",
  "#db2777",
  "#0891b2",
  "#65a30d",
  "#64748b",
];

/** Tick steps of the iteration axis: whole numbers only. */
const ITERATION_STEPS = [1, 2, 5].flatMap((m) => [1, 10, 100, 1e3, 1e4, 1e5, 1e6].map((p) => m * p))
  .sort((a, b) => a - b);

/**
 * A line chart in `parent`: `series` is [{label, key, color?, points?, scale?}]; `scales` adds
 * y scales (e.g. a log scale or a second axis); `xLabel` names the x axis (iteration by default).
 * `update(columns)` redraws with uPlot's data.
 */
export function lineChart(parent, { title, series, scales = {}, axes = null, name, xLabel = "iteration" }) {
  const box = h("div", { class: "chart", "data-chart": name, "data-points": "0" });
  parent.append(box);
  const width = () => Math.max(240, box.clientWidth || parent.clientWidth || 320);
  const yScales = new Set(series.map((s) => s.scale ?? "y"));
  const opts = {
    title,
    width: width(),
    height: 200,
    scales: { x: { time: false }, ...scales },
    legend: { live: true },
    cursor: { drag: { x: true, y: false } },
    series: [
      { label: xLabel },
      ...series.map((s, i) => ({
        label: s.label,
        scale: s.scale ?? "y",
        stroke: s.color ?? COLORS[i % COLORS.length],
        width: 1.5,
        spanGaps: true,
        points: { show: s.points ?? false, size: 5 },
        value: (_u, v) => fmtNum(v, 4),
      })),
    ],
    axes: axes ?? [
      { incrs: ITERATION_STEPS },
      ...[...yScales].map((scale, i) => ({
        scale,
        side: i === 0 ? 3 : 1,
        size: 60,
        grid: { show: i === 0 },
        values: (_u, ticks) => ticks.map(fmtTick),
      })),
    ],
  };
  const empty = [[], ...series.map(() => [])];
  // deno-lint-ignore no-undef
  const plot = new uPlot(opts, empty, box);
  const observer = new ResizeObserver(() => plot.setSize({ width: width(), height: 200 }));
  observer.observe(box);
  return {
    el: box,
    update(columns) {
      plot.setData(columns);
      box.dataset.points = String(columns[0].length);
    },
    destroy() {
      observer.disconnect();
      plot.destroy();
    },
  };
}

const PHASES = [
  ["forward_ms", "forward"],
  ["backward_ms", "backward"],
  ["allreduce_ms", "allreduce"],
  ["optimizer_ms", "optimizer"],
  ["batch_generator_ms", "batch"],
];

/** The step's time split into phases (the rest is "other"), as one stacked bar with a legend. */
export function timingBar(timings) {
  if (!timings || !(timings.step_ms > 0)) return h("p", { class: "muted" }, "No step timings yet");
  const parts = PHASES.map(([k, label]) => [label, typeof timings[k] === "number" ? timings[k] : 0])
    .filter(([, v]) => v > 0);
  const known = parts.reduce((s, [, v]) => s + v, 0);
  if (timings.step_ms > known) parts.push(["other", timings.step_ms - known]);
  const total = Math.max(timings.step_ms, known);
  return h(
    "div",
    { class: "timing" },
    h(
      "div",
      { class: "timing-bar", role: "img", "aria-label": "Step time by phase" },
      parts.map(([label, v], i) =>
        h("span", {
          class: "timing-part",
          style: `flex-basis:${(100 * v / total).toFixed(2)}%;background:${COLORS[i % COLORS.length]}`,
          title: `${label} ${fmtNum(v, 2)} ms`,
        })
      ),
    ),
    h(
      "div",
      { class: "timing-legend" },
      parts.map(([label, v], i) =>
        h(
          "span",
          {},
          h("i", { style: `background:${COLORS[i % COLORS.length]}` }),
          `${label} ${fmtNum(v, 1)} ms`,
        )
      ),
      h("span", { class: "muted" }, `step ${fmtNum(timings.step_ms, 1)} ms`),
    ),
  );
}
