/**
 * GPUs: each one's adapter, state, role, current job, queue and memory in use, from
 * `GET /health` (refreshed every two seconds). Memory is the GPU's figure when the server
 * reports one, else what the running job allocated.
 */

import { getJson } from "./api.js";
import { badge, h, setChildren, stat } from "./dom.js";
import { fmtBytes, fmtInt } from "./shapes.js";

/** Renders the GPU cards into `ctx.root`. */
export function gpusView(ctx) {
  const cards = h("div", { class: "cards", id: "gpu-cards" });
  setChildren(ctx.root, h("h1", {}, "GPUs"), cards);
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
  });
}
