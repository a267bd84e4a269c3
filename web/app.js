/**
 * The dashboard's entry: a hash router over the views (jobs, one job, jobs compared, train form,
 * datasets, playground, GPUs), the token bar, and the clean-up of a view's timers and streams when the
 * user leaves it.
 */

import { getToken, onUnauthorized, setToken } from "./api.js";
import { h, setChildren } from "./dom.js";
import { jobsView } from "./view_jobs.js";
import { jobView } from "./view_job.js";
import { compareView } from "./view_compare.js";
import { trainView } from "./view_train.js";
import { datasetsView } from "./view_datasets.js";
import { playgroundView } from "./view_playground.js";
import { gpusView } from "./view_gpus.js";

const routes = [
  [/^\/jobs\/([^/]+)$/, "jobs", (m, ctx) => jobView(ctx, decodeURIComponent(m[1]))],
  [/^\/(jobs)?$/, "jobs", (_m, ctx) => jobsView(ctx)],
  [/^\/compare$/, "jobs", (_m, ctx) => compareView(ctx)],
  [/^\/train$/, "train", (_m, ctx) => trainView(ctx)],
  [/^\/datasets$/, "datasets", (_m, ctx) => datasetsView(ctx)],
  [/^\/playground$/, "playground", (_m, ctx) => playgroundView(ctx)],
  [/^\/gpus$/, "gpus", (_m, ctx) => gpusView(ctx)],
];

const view = document.getElementById("view");
let current = null;

/** What a view gets: its root element, the query of its hash, and clean-up hooks. */
function context(query) {
  const controller = new AbortController();
  const timers = [];
  return {
    root: view,
    query,
    signal: controller.signal,
    /** Runs `fn` now and every `ms` until the view is left. */
    every(ms, fn) {
      const tick = () => fn().catch((e) => console.warn(e));
      tick();
      timers.push(setInterval(tick, ms));
    },
    close() {
      controller.abort();
      for (const t of timers) clearInterval(t);
    },
  };
}

function route() {
  current?.close();
  const [path, qs] = (location.hash.slice(1) || "/jobs").split("?");
  const ctx = context(new URLSearchParams(qs ?? ""));
  current = ctx;
  for (const a of document.querySelectorAll("[data-nav]")) a.classList.remove("active");
  for (const [re, nav, make] of routes) {
    const m = path.match(re);
    if (!m) continue;
    document.querySelector(`[data-nav="${nav}"]`)?.classList.add("active");
    setChildren(view);
    Promise.resolve(make(m, ctx)).catch((e) => {
      if (!ctx.signal.aborted) setChildren(view, h("p", { class: "error" }, e.message));
    });
    return;
  }
  setChildren(view, h("p", { class: "error" }, `No page "${path}"`), h("a", { href: "#/jobs" }, "Jobs"));
}

function tokenBar() {
  const bar = document.getElementById("token-bar");
  const input = document.getElementById("token-input");
  const note = document.getElementById("token-note");
  const toggle = document.getElementById("token-toggle");
  const label = () => (toggle.textContent = getToken() ? "Token ✓" : "Token");
  label();
  toggle.addEventListener("click", () => (bar.hidden = !bar.hidden));
  bar.addEventListener("submit", (e) => {
    e.preventDefault();
    setToken(input.value.trim());
    input.value = "";
    bar.hidden = true;
    bar.classList.remove("alert");
    label();
    route();
  });
  document.getElementById("token-clear").addEventListener("click", () => {
    setToken("");
    label();
  });
  onUnauthorized(() => {
    bar.hidden = false;
    bar.classList.add("alert");
    note.textContent = getToken()
      ? "The server refused this token: enter the server's GPT2_API_TOKEN"
      : "This server needs a bearer token: enter its GPT2_API_TOKEN";
    input.focus();
  });
}

tokenBar();
addEventListener("hashchange", route);
route();
