/**
 * Probes and metrics, as vLLM and llama.cpp split them:
 * - `GET /health`: liveness. 200 whenever the server answers, with each GPU's state, job counts and
 *   the hosts sharing the job store (several hosts: GPUs, state, heartbeat age, jobs held); 503
 *   while the job store is unreachable (`store`: since when, why, records waiting), when training
 *   goes on but nothing new starts. Never a 500 for a store that is away.
 * - `GET /ready`: readiness. 200 once at least one GPU's device is open and the job store takes a
 *   write; until then, and while the GPU host is "failed" (it could not start; `/health` has
 *   `gpu_host.reason`), 503 with the reasons in the error message (a load balancer sends it no work).
 * - `GET /metrics`: the app's Prometheus registry (server/routes/metrics.ts).
 * A caller who is not an admin sees the ids of their own jobs only (a GPU's or a host's job).
 */

import { Hono } from "hono";
import type { JobRunner } from "../jobs/mod.ts";
import { StoreUnavailableError } from "../jobs/job_store.ts";
import { ApiError } from "./api_errors.ts";
import type { AppMetrics } from "./metrics.ts";
import { principalOf } from "./auth.ts";

/** Health, readiness and Prometheus routes. `startedAt` is the server's start time (ms). */
export function healthRoutes(runner: JobRunner, startedAt: number, metrics: AppMetrics): Hono {
  const app = new Hono();

  const readiness = async () => {
    const gpus = runner.gpus();
    const reasons: string[] = [];
    if (!gpus.some((g) => g.state === "idle" || g.state === "busy")) {
      const why = gpus.map((g) => `GPU ${g.index} ${g.state}${g.error ? `: ${g.error}` : ""}`).join("; ");
      reasons.push(`No GPU is open (${why || "no GPUs configured"})`);
    }
    const host = runner.hostStatus();
    if (host?.state === "failed") reasons.push(host.reason ?? "GPU host failed");
    const known = runner.storeState();
    if (known.state === "unreachable") {
      reasons.push(`Job store is unreachable since ${known.since}: ${known.error}`);
    } else {
      const storeError = await runner.store.writeError();
      if (storeError) {
        runner.storeFailed(new StoreUnavailableError(storeError));
        reasons.push(`Job store is not writable: ${storeError}`);
      }
    }
    return { gpus, reasons };
  };

  app.get("/health", async (c) => {
    const { gpus, reasons } = await readiness();
    let jobs = null, hosts = null;
    if (runner.storeState().state === "ok") {
      try {
        jobs = await runner.store.countByStatus();
        // Hosts sharing the job store (several hosts, GPT2_DATABASE_URL): GPUs, state, lease age, jobs.
        hosts = await runner.store.hosts();
      } catch (e) {
        if (!runner.storeFailed(e)) throw e;
      }
    }
    const store = { engine: runner.store.engine, ...runner.storeState() };
    const up = store.state === "ok";
    const p = principalOf(c);
    let shown = gpus;
    if (!p.admin) {
      const mine = (id: string) => {
        try {
          return runner.store.getJob(id)?.owner === p.user;
        } catch {
          return false;
        }
      };
      shown = gpus.map((g) => ({ ...g, job: g.job !== null && mine(g.job) ? g.job : null }));
      hosts = hosts?.map((h) => ({ ...h, jobs: h.jobs.filter(mine) })) ?? null;
    }
    return c.json({
      status: up ? "ok" : "degraded",
      ready: reasons.length === 0 && up,
      uptime_s: Math.round((Date.now() - startedAt) / 1000),
      gpus: shown,
      gpu_host: runner.hostStatus(),
      store,
      jobs,
      hosts,
    }, up ? 200 : 503);
  });

  app.get("/ready", async (c) => {
    const { gpus, reasons } = await readiness();
    if (reasons.length > 0) {
      throw new ApiError(503, `Not ready: ${reasons.join("; ")}`, { code: "not_ready" });
    }
    return c.json({ status: "ready", gpus: gpus.map((g) => ({ index: g.index, state: g.state })) });
  });

  app.get(
    "/metrics",
    async (c) =>
      c.text(await metrics.registry.metrics(), 200, { "Content-Type": metrics.registry.contentType }),
  );

  return app;
}
