/**
 * `GET /health` (liveness plus each GPU's state) and `GET /metrics` (Prometheus text format:
 * job counts, per-job progress, GPU slots, generation counts), read from the runner, its store and
 * the generation manager.
 */

import { Hono } from "hono";
import type { GenerationManager, JobRunner } from "../jobs/mod.ts";

/** Health and Prometheus routes. `startedAt` is the server's start time (ms). */
export function healthRoutes(runner: JobRunner, startedAt: number, generation?: GenerationManager): Hono {
  const app = new Hono();

  app.get("/health", (c) =>
    c.json({
      status: "ok",
      uptime_s: Math.round((Date.now() - startedAt) / 1000),
      gpus: runner.gpus(),
      gpu_host: runner.hostStatus(),
      jobs: runner.store.countByStatus(),
    }));

  app.get("/metrics", (c) => {
    const lines: string[] = [];
    const metric = (
      name: string,
      help: string,
      samples: Array<[Record<string, string | number>, number]>,
    ) => {
      lines.push(`# HELP ${name} ${help}`, `# TYPE ${name} gauge`);
      for (const [labels, value] of samples) {
        const l = Object.entries(labels).map(([k, v]) => `${k}="${String(v).replace(/["\\\n]/g, "_")}"`).join(
          ",",
        );
        lines.push(`${name}${l ? `{${l}}` : ""} ${Number.isFinite(value) ? value : "NaN"}`);
      }
    };
    metric("gpt2_uptime_seconds", "Seconds since the server started", [[
      {},
      (Date.now() - startedAt) / 1000,
    ]]);
    metric(
      "gpt2_jobs",
      "Jobs by status",
      Object.entries(runner.store.countByStatus()).map(([s, n]) => [{ status: s }, n]),
    );
    const gpus = runner.gpus();
    metric(
      "gpt2_gpu_busy",
      "Whether the GPU runs a job",
      gpus.map((g) => [{ gpu: g.index }, g.state === "busy" ? 1 : 0]),
    );
    metric("gpt2_gpu_queue_length", "Jobs waiting per GPU", gpus.map((g) => [{ gpu: g.index }, g.queued]));
    const live = [
      ...runner.store.listJobs({ status: "running" }),
      ...runner.store.listJobs({ status: "interrupted" }),
    ];
    const per = (pick: (m: (typeof live)[number]) => number | null) =>
      live.flatMap((j) => {
        const v = pick(j);
        return v === null
          ? []
          : [[{ job: j.id, gpu: j.gpu }, v] as [Record<string, string | number>, number]];
      });
    metric("gpt2_job_iteration", "Iterations done", per((j) => j.iteration));
    metric("gpt2_job_loss", "Latest training loss", per((j) => j.metrics.loss));
    metric("gpt2_job_val_loss", "Latest validation loss", per((j) => j.metrics.val_loss));
    metric("gpt2_job_lr", "Current learning rate", per((j) => j.metrics.lr));
    metric("gpt2_job_tokens_per_second", "Training throughput", per((j) => j.metrics.tokens_per_s));
    metric(
      "gpt2_job_gpu_memory_bytes",
      "GPU memory allocated by the job",
      per((j) => j.metrics.gpu_memory_bytes),
    );
    metric(
      "gpt2_job_gpu_memory_estimate_bytes",
      "GPU memory the plan estimated for the job",
      per((j) => j.metrics.gpu_memory_estimate_bytes),
    );
    metric("gpt2_job_loss_scale", "Dynamic loss scale (1 in fp32)", per((j) => j.metrics.loss_scale));
    metric(
      "gpt2_job_skipped_steps",
      "Steps skipped for a non-finite loss or gradient",
      per((j) => j.metrics.skipped_steps),
    );
    const phases = [
      "forward_ms",
      "backward_ms",
      "allreduce_ms",
      "optimizer_ms",
      "batch_generator_ms",
      "step_ms",
    ] as const;
    metric(
      "gpt2_job_phase_milliseconds",
      "Milliseconds per step in each phase (last log interval)",
      live.flatMap((j) =>
        phases.flatMap((p) => {
          const v = j.metrics.timings?.[p];
          return typeof v === "number"
            ? [[{ job: j.id, phase: p.slice(0, -3) }, v] as [Record<string, string>, number]]
            : [];
        })
      ),
    );
    if (generation) {
      const g = generation.stats;
      metric("gpt2_generations_started", "Generation requests started", [[{}, g.started]]);
      metric(
        "gpt2_generations_finished",
        "Generation requests finished, by reason",
        Object.entries(g.finished).map(([reason, n]) => [{ reason }, n]),
      );
      metric("gpt2_generated_tokens", "Tokens generated", [[{}, g.tokens]]);
    }
    return c.text(lines.join("\n") + "\n", 200, {
      "Content-Type": "text/plain; version=0.0.4; charset=utf-8",
    });
  });

  return app;
}
