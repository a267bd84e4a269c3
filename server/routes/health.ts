/**
 * Probes and metrics, as vLLM and llama.cpp split them:
 * - `GET /health`: liveness. 200 whenever the server answers, with each GPU's state, job counts and
 *   the hosts sharing the job store (several hosts: GPUs, state, heartbeat age, jobs held).
 * - `GET /ready`: readiness. 200 once at least one GPU's device is open and the job store takes a
 *   write; until then, and while the GPU host is "failed" (it could not start; `/health` has
 *   `gpu_host.reason`), 503 with the reasons in the error message (a load balancer sends it no work).
 * - `GET /metrics`: the app's Prometheus registry (server/routes/metrics.ts).
 */

import { Hono } from "hono";
import type { JobRunner } from "../jobs/mod.ts";
import { ApiError } from "./api_errors.ts";
import type { AppMetrics } from "./metrics.ts";

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
    const storeError = await runner.store.writeError();
    if (storeError) reasons.push(`Job store is not writable: ${storeError}`);
    return { gpus, reasons };
  };

  app.get("/health", async (c) => {
    const { gpus, reasons } = await readiness();
    return c.json({
      status: "ok",
      ready: reasons.length === 0,
      uptime_s: Math.round((Date.now() - startedAt) / 1000),
      gpus,
      gpu_host: runner.hostStatus(),
      jobs: await runner.store.countByStatus(),
      // Hosts sharing the job store (several hosts, GPT2_DATABASE_URL): GPUs, state, lease age, jobs.
      hosts: await runner.store.hosts(),
    });
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
