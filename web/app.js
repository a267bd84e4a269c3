/**
 * The dashboard's entry: a hash router over the views (jobs, one job, jobs compared, train form,
 * datasets, playground, GPUs, admin), the token bar (sign-in), who is signed in with their quotas,
 * and the clean-up of a view's timers and streams when the user leaves it. Navigation a token may
 * not use is hidden (`GET /auth/me`'s scopes; web/shapes.js NAV_SCOPES).
 */

import { fetchMe, getToken, onUnauthorized, setToken } from "./api.js";
import { mayUse, NAV_SCOPES, whoAmI } from "./shapes.js";
import { adminView } from "./view_admin.js";
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
  [/^\/admin$/, "admin", (_m, ctx) => adminView(ctx)],
];

const view = document.getElementById("view");
let current = null;

/**
 * What a view gets: its root element, the query of its hash, and clean-up hooks. The root is the
 * view's own element: a view still loading when the user (or a sign-in) moves on renders into a
 * detached element, never over the view that replaced it.
 */
function context(query) {
  const controller = new AbortController();
  const timers = [];
  return {
    root: h("div", { class: "view-root" }),
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
    setChildren(view, ctx.root);
    Promise.resolve(make(m, ctx)).catch((e) => {
      if (!ctx.signal.aborted) setChildren(ctx.root, h("p", { class: "error" }, e.message));
    });
    return;
  }
  setChildren(view, h("p", { class: "error" }, `No page "${path}"`), h("a", { href: "#/jobs" }, "Jobs"));
}

/** Shows who is signed in and hides what their token may not do. */
async function signedIn() {
  const me = await fetchMe();
  document.getElementById("whoami").textContent = whoAmI(me);
  for (const a of document.querySelectorAll("[data-nav]")) {
    const scope = NAV_SCOPES[a.dataset.nav] ?? "any";
    // The admin page appears only for a known admin; the rest hide only when the scopes say so.
    a.hidden = scope === "admin" ? !(me && mayUse(me, "admin")) : !mayUse(me, scope);
  }
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
    signedIn();
  });
  document.getElementById("token-clear").addEventListener("click", () => {
    setToken("");
    label();
    signedIn();
  });
  onUnauthorized(() => {
    bar.hidden = false;
    bar.classList.add("alert");
    note.textContent = getToken()
      ? "The server refused this token (wrong, revoked or expired): sign in with another"
      : "This server needs a token: sign in with yours (or its GPT2_API_TOKEN)";
    input.focus();
  });
}

tokenBar();
addEventListener("hashchange", route);
route();
signedIn();
