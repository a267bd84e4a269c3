/**
 * The job layer: SQLite store, per-GPU queues, the runner owning one Worker per GPU, the
 * messages between them, and checkpoints on disk. Re-exports only.
 */

export * from "../../model/job.ts";
export * from "../../model/errors.ts";
export * from "../../protocol.ts";
export { isFinished, type JobPatch, JobStore, MIGRATIONS, SCHEMA_VERSION } from "./job_store.ts";
export * from "../settings.ts";
export { JobRunner, type RunnerOptions } from "./runner.ts";
export { type GenerationReport, GpuPool, type GpuState } from "../gpus/gpu_pool.ts";
export * from "../../checkpoint/checkpoint.ts";
export * from "../../checkpoint/safetensors.ts";
export * from "../../model/job_config.ts";
export { lockDataDir } from "../lock.ts";
export { GpuHostClient, type HostStatus } from "../gpus/host_client.ts";
export * from "../../checkpoint/model_source.ts";
export * from "../generate/text_stream.ts";
export * from "../generate/generation_manager.ts";
export * from "../gpus/roles.ts";
export { compareJobs, type Comparison, evalTaskPoints, metricsCsv } from "./compare.ts";
