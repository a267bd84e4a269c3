/**
 * The Prometheus registry of one app (prom-client), with Prometheus naming: counters end in
 * `_total`, times are in seconds, a job is the label `job_id` (never `job`, which Prometheus
 * sets to the scrape target). Gauges are read from the runner, its store and the generation
 * manager when scraped; the step-time histogram observes each training progress event as it is
 * stored. Other code adds its own collectors through {@link AppMetrics.register}.
 */

import { Counter, Gauge, Histogram, Registry } from "prom-client";
import type { GenerationManager } from "../generate/mod.ts";
import type { JobRunner, JobStore } from "../jobs/mod.ts";
import type { QuotaBook } from "../auth/quotas.ts";

/** Adds collectors to an app's registry (e.g. `new Gauge({ ..., registers: [registry] })`). */
export type MetricsHook = (registry: Registry) => void;

/** An app's metrics. */
export interface AppMetrics {
  /** The registry `GET /metrics` renders. */
  readonly registry: Registry;
  /** Runs `hook` on the registry: the way to add metrics from outside this module. */
  register(hook: MetricsHook): void;
  /** Counts an answered request. */
  countRequest(method: string, status: number): void;
  /** Counts a request of user `user` (none: the bootstrap token or no token) to a route of class `cls`. */
  countUse(user: string | null, cls: string): void;
}

/** Upper bounds of the step-time histogram, in seconds. */
export const STEP_SECONDS_BUCKETS = [
  0.001,
  0.0025,
  0.005,
  0.01,
  0.025,
  0.05,
  0.1,
  0.25,
  0.5,
  1,
  2.5,
  5,
  10,
  30,
  60,
];

const PHASES = [
  "forward_ms",
  "backward_ms",
  "allreduce_ms",
  "optimizer_ms",
  "batch_generator_ms",
  "step_ms",
] as const;

/** Builds the registry of one app over `runner` (and `generation`, when served). */
export function createMetrics(
  runner: JobRunner,
  startedAt: number,
  generation?: GenerationManager,
): AppMetrics {
  const registry = new Registry();
  const registers = [registry];
  serverMetrics(registry, runner, startedAt);
  jobMetrics(registry, runner);
  const requests = new Counter({
    name: "gpt2_http_requests_total",
    help: "HTTP requests answered, by method and status code",
    labelNames: ["method", "code"],
    registers,
  });

  if (generation) generationMetrics(registry, generation);

  const uses = new Counter({
    name: "gpt2_user_requests_total",
    help:
      "Requests that passed the token check, by user (empty: the bootstrap token or none) and route class",
    labelNames: ["user", "class"],
    registers,
  });

  return {
    registry,
    register: (hook) => hook(registry),
    countRequest: (method, status) => requests.inc({ method, code: String(status) }),
    countUse: (user, cls) => uses.inc({ user: user ?? "", class: cls }),
  };
}

/** The process, the jobs by status, the hosts' heartbeats and each GPU's state. */
function serverMetrics(registry: Registry, runner: JobRunner, startedAt: number): void {
  const registers = [registry];
  new Gauge({
    name: "process_start_time_seconds",
    help: "Start time of the server since the Unix epoch in seconds",
    registers,
    collect() {
      this.set(startedAt / 1000);
    },
  });
  new Gauge({
    name: "gpt2_uptime_seconds",
    help: "Seconds since the server started",
    registers,
    collect() {
      this.set((Date.now() - startedAt) / 1000);
    },
  });
  new Gauge({
    name: "gpt2_jobs",
    help: "Jobs by status",
    labelNames: ["status"],
    registers,
    async collect() {
      for (const [status, n] of Object.entries(await runner.store.countByStatus())) this.set({ status }, n);
    },
  });
  new Gauge({
    name: "gpt2_host_heartbeat_age_seconds",
    help: "Seconds since each host sharing the job store last renewed its leases (several hosts only)",
    labelNames: ["host", "state"],
    registers,
    async collect() {
      this.reset();
      for (const h of await runner.store.hosts()) this.set({ host: h.id, state: h.state }, h.lease_age_s);
    },
  });
  const perGpu = (name: string, help: string, pick: (g: ReturnType<JobRunner["gpus"]>[number]) => number) =>
    new Gauge({
      name,
      help,
      labelNames: ["gpu"],
      registers,
      collect() {
        this.reset();
        for (const g of runner.gpus()) this.set({ gpu: g.index }, pick(g));
      },
    });
  perGpu("gpt2_gpu_busy", "Whether the GPU runs a job", (g) => (g.state === "busy" ? 1 : 0));
  perGpu(
    "gpt2_gpu_available",
    "Whether the GPU's device is open (idle or busy)",
    (g) => g.state === "idle" || g.state === "busy" ? 1 : 0,
  );
  perGpu("gpt2_gpu_queue_length", "Jobs waiting per GPU", (g) => g.queued);
}

/** Each running or interrupted job's progress gauges, phase times and step-time histogram. */
function jobMetrics(registry: Registry, runner: JobRunner): void {
  const registers = [registry];
  // Any engine: SQLite answers at once, PostgreSQL (several hosts) with a promise; prom-client awaits collect().
  const live = async () => [
    ...await runner.store.listJobs({ status: "running" }),
    ...await runner.store.listJobs({ status: "interrupted" }),
  ];

  type LiveJob = Awaited<ReturnType<typeof live>>[number];
  const perJob = (name: string, help: string, pick: (j: LiveJob) => number | null | undefined) =>
    new Gauge({
      name,
      help,
      labelNames: ["job_id", "gpu"],
      registers,
      async collect() {
        this.reset();
        for (const j of await live()) {
          const v = pick(j);
          if (typeof v === "number") this.set({ job_id: j.id, gpu: j.gpu }, v);
        }
      },
    });
  perJob("gpt2_job_iteration", "Iterations done", (j) => j.iteration);
  perJob("gpt2_job_loss", "Latest training loss", (j) => j.metrics.loss);
  perJob("gpt2_job_val_loss", "Latest validation loss", (j) => j.metrics.val_loss);
  perJob("gpt2_job_learning_rate", "Current learning rate", (j) => j.metrics.lr);
  perJob(
    "gpt2_job_tokens_per_second",
    "Training throughput (last log interval)",
    (j) => j.metrics.tokens_per_s,
  );
  perJob("gpt2_job_gpu_memory_bytes", "GPU memory allocated by the job", (j) => j.metrics.gpu_memory_bytes);
  perJob(
    "gpt2_job_gpu_memory_estimate_bytes",
    "GPU memory the plan estimated for the job",
    (j) => j.metrics.gpu_memory_estimate_bytes,
  );
  perJob("gpt2_job_loss_scale", "Dynamic loss scale (1 in fp32)", (j) => j.metrics.loss_scale);
  perJob(
    "gpt2_job_skipped_steps",
    "Steps skipped for a non-finite loss or gradient",
    (j) => j.metrics.skipped_steps,
  );
  new Gauge({
    name: "gpt2_job_phase_seconds",
    help: "Seconds per step in each phase, averaged over the last log interval",
    labelNames: ["job_id", "phase"],
    registers,
    async collect() {
      this.reset();
      for (const j of await live()) {
        for (const p of PHASES) {
          const v = j.metrics.timings?.[p];
          if (typeof v === "number") this.set({ job_id: j.id, phase: p.slice(0, -3) }, v / 1000);
        }
      }
    },
  });
  const steps = new Histogram({
    name: "gpt2_job_step_seconds",
    help: "Training step time: one observation per log interval, that interval's mean step time",
    labelNames: ["job_id"],
    buckets: STEP_SECONDS_BUCKETS,
    registers,
  });
  runner.store.onEvent((e) => {
    const timings = e.type === "progress" && e.data.kind === "train"
      ? e.data.timings as { step_ms?: unknown } | null
      : null;
    if (typeof timings?.step_ms === "number") steps.observe({ job_id: e.job_id }, timings.step_ms / 1000);
  });
}

/** Generation's counters and latency histograms, ours and the names vLLM's users already scrape. */
function generationMetrics(registry: Registry, generation: GenerationManager): void {
  const registers = [registry];
  new Counter({
    name: "gpt2_generation_requests_total",
    help: "Generation requests started",
    registers,
    collect() {
      this.reset();
      this.inc(generation.stats.started);
    },
  });
  new Counter({
    name: "gpt2_generation_finished_total",
    help: "Generation requests finished, by reason",
    labelNames: ["reason"],
    registers,
    collect() {
      this.reset();
      for (const [reason, n] of Object.entries(generation.stats.finished)) this.inc({ reason }, n);
    },
  });
  new Counter({
    name: "gpt2_generation_tokens_total",
    help: "Tokens generated",
    registers,
    collect() {
      this.reset();
      this.inc(generation.stats.tokens);
    },
  });
  // The names vLLM's users already scrape.
  const gauge = (name: string, help: string, read: () => number) =>
    new Gauge({
      name,
      help,
      registers,
      collect() {
        this.set(read());
      },
    });
  gauge("vllm:num_requests_running", "Requests decoding on a GPU", () => generation.stats.running);
  gauge("vllm:num_requests_waiting", "Requests waiting for a stream slot", () => generation.stats.waiting);
  const counter = (name: string, help: string, read: () => number) =>
    new Counter({
      name,
      help,
      registers,
      collect() {
        this.reset();
        this.inc(read());
      },
    });
  counter("vllm:prompt_tokens_total", "Prompt tokens processed", () => generation.stats.prompt_tokens);
  counter("vllm:generation_tokens_total", "Tokens generated", () => generation.stats.tokens);
  new Counter({
    name: "vllm:request_success_total",
    help: "Requests finished, by reason",
    labelNames: ["finished_reason"],
    registers,
    collect() {
      this.reset();
      for (const [reason, n] of Object.entries(generation.stats.finished)) {
        this.inc({ finished_reason: reason }, n);
      }
    },
  });
  registry.registerMetric(bucketed(
    "vllm:time_to_first_token_seconds",
    "Seconds from request to first token",
    () => generation.stats.ttft,
  ));
  registry.registerMetric(bucketed(
    "vllm:inter_token_latency_seconds",
    "Seconds between tokens",
    () => generation.stats.itl,
  ));
  registry.registerMetric(bucketed(
    "vllm:request_queue_time_seconds",
    "Seconds a request waited in its GPU Worker before its prefill (a stream slot, the model's load)",
    () => generation.stats.stages.queue,
  ));
  registry.registerMetric(bucketed(
    "vllm:request_prefill_time_seconds",
    "Seconds from a request's admission to its first token, read back, in its GPU Worker",
    () => generation.stats.stages.prefill,
  ));
  registry.registerMetric(bucketed(
    "gpt2_generation_stage_seconds",
    "Seconds of each stage on a request's way to its first token: http (this process), to_host, " +
      "to_worker, queue, prefill, back (from the Worker to this process)",
    () => generation.stats.stages,
    "stage",
  ));
}

/**
 * Per-user gauges, read from the store at each scrape: what each user holds against each quota
 * (`gpt2_user_usage{user, quota}`: queued_jobs, running_gpus, streams, gpu_seconds_per_day) and
 * the quota (`gpt2_user_quota{user, quota}`). A store that is away leaves them empty.
 */
export function userMetrics(store: JobStore, quotas: QuotaBook): MetricsHook {
  return (registry) => {
    const read = (pick: (user: string) => Record<string, number>) =>
      function (this: Gauge) {
        this.reset();
        try {
          for (const u of store.users()) {
            for (const [quota, v] of Object.entries(pick(u.name))) this.set({ user: u.name, quota }, v);
          }
        } catch { /* the store is away: /health says so */ }
      };
    new Gauge({
      name: "gpt2_user_usage",
      help: "What each user holds now against each quota (GPU-seconds: today, UTC)",
      labelNames: ["user", "quota"],
      registers: [registry],
      collect: read((user) => ({ ...quotas.usage(user) })),
    });
    new Gauge({
      name: "gpt2_user_quota",
      help: "Each user's quotas",
      labelNames: ["user", "quota"],
      registers: [registry],
      collect: read((user) => ({ ...quotas.of(user) })),
    });
  };
}

/**
 * A histogram whose buckets are counted elsewhere (the generation manager), exposed as prom-client
 * expects; `read` gives one histogram, or one per value of `label`.
 */
function bucketed(
  name: string,
  help: string,
  read: () => BucketCounts | Record<string, BucketCounts>,
  label?: string,
) {
  return {
    name,
    help,
    type: "histogram",
    aggregator: "sum",
    get() {
      const got = read();
      const series: [Record<string, string>, BucketCounts][] = label
        ? Object.entries(got as Record<string, BucketCounts>).map(([v, h]) => [{ [label]: v }, h])
        : [[{}, got as BucketCounts]];
      const values: { metricName: string; labels: Record<string, string | number>; value: number }[] = [];
      for (const [labels, h] of series) {
        // counts are cumulative already, the last bucket +Inf
        h.buckets.forEach((le, i) =>
          values.push({
            metricName: `${name}_bucket`,
            labels: { ...labels, le: le === Infinity ? "+Inf" : le },
            value: h.counts[i],
          })
        );
        values.push({ metricName: `${name}_sum`, labels, value: h.sum });
        values.push({ metricName: `${name}_count`, labels, value: h.count });
      }
      return { name, help, type: "histogram", aggregator: "sum", values };
    },
  } as unknown as Parameters<Registry["registerMetric"]>[0];
}

/** Cumulative bucket counts as the generation manager keeps them (server/generate/generation_manager.ts). */
interface BucketCounts {
  buckets: number[];
  counts: number[];
  sum: number;
  count: number;
}
