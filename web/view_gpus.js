/**
 * GPUs: each one's adapter, state, role, current job, queue and memory in use, from
 * `GET /health` (refreshed every two seconds). Memory is the GPU's figure when the server
 * reports one, else what the running job allocated. Below them, the hosts sharing the job store
 * (several hosts on one PostgreSQL database): each one's GPUs, free Workers, state, the age of its
 * last heartbeat and the jobs it holds a lease on.
 */

import { getJson } from "./api.js";
import { badge, h, setChildren, stat } from "./dom.js";
import { fmtBytes, fmtInt } from "./shapes.js";

/** Renders the GPU cards into `ctx.root`. */
export function gpusView(ctx) {
  const cards = h("div", { class: "cards", id: "gpu-cards" });
  const hosts = h("div", { id: "hosts" });
  setChildren(ctx.root, h("h1", {}, "GPUs"), cards, hosts);
  ctx.every(2000, async () => {
    const health = await getJson("/health", { signal: ctx.signal });
    const jobs = new Map();
    for (const g of health.gpus) {
      if (g.job && !jobs.has(g.job)) {
        jobs.set(g.job, await getJson(`/jobs/${g.job}`, { signal: ctx.signal }).catch(() => null));
      }
    }
    setChildren(
      cards,
      health.gpus.map((g) => {
        const job = g.job ? jobs.get(g.job) : null;
        const own = g.memory_used_bytes ?? g.memory_bytes ?? g.memory?.used_bytes;
        const mem = typeof own === "number"
          ? fmtBytes(own)
          : job
          ? `${fmtBytes(job.metrics.gpu_memory_bytes)} (job)`
          : "–";
        const role = Array.isArray(g.roles) ? g.roles.join(", ") : g.role ?? "train, generate";
        return h(
          "section",
          { class: "card", "data-gpu": g.index },
          h("h2", {}, `GPU ${g.index} `, badge(g.state)),
          h("p", { class: "adapter" }, g.adapter ?? g.error ?? "starting"),
          h(
            "div",
            { class: "stats" },
            stat("role", role),
            stat("job", g.job ? h("a", { href: `#/jobs/${g.job}` }, g.job) : "idle"),
            stat("queued", fmtInt(g.queued)),
            stat("memory in use", mem),
            g.max_buffer_bytes ? stat("max buffer", fmtBytes(g.max_buffer_bytes)) : null,
          ),
        );
      }),
    );
    setChildren(hosts, ...hostsTable(health.hosts ?? []));
  });
}

/** The hosts sharing the job store, as a heading and a table (nothing for a lone host). */
export function hostsTable(list) {
  if (list.length < 2) return [];
  const row = (cells, tag = "td") => h("tr", {}, ...cells.map((c) => h(tag, {}, c)));
  return [
    h("h2", {}, "Hosts"),
    h(
      "div",
      { class: "table-wrap" },
      h(
        "table",
        { "data-hosts": String(list.length) },
        h("thead", {}, row(["host", "state", "GPUs", "free", "heartbeat", "jobs"], "th")),
        h(
          "tbody",
          {},
          ...list.map((host) =>
            row([
              host.id,
              badge(host.state),
              fmtInt(host.gpus),
              fmtInt(host.free),
              `${Number(host.lease_age_s ?? 0).toFixed(1)} s ago`,
              host.jobs?.length
                ? h("span", {}, ...host.jobs.map((j) => h("a", { href: `#/jobs/${j}` }, `${j} `)))
                : "none",
            ])
          ),
        ),
      ),
    ),
  ];
}
