/**
 * The job layer: SQLite store, per-GPU queues, the runner owning one Worker per GPU, the
 * messages between them, and checkpoints on disk. Re-exports only.
 */

export * from "./types.ts";
export * from "./errors.ts";
export * from "./messages.ts";
export { isFinished, type JobPatch, JobStore, MIGRATIONS, SCHEMA_VERSION } from "./store.ts";
export * from "./settings.ts";
export {
  type GenerationReport,
  type GpuState,
  JobRunner,
  type RunnerOptions,
  spawnGpuWorker,
  type SpawnWorker,
  type WorkerPort,
} from "./runner.ts";
export * from "./checkpoint.ts";
export * from "./safetensors.ts";
export * from "./model.ts";
export { lockDataDir } from "./lock.ts";
export { GpuHostClient, type HostStatus } from "./host_client.ts";
export * from "./model_source.ts";
export * from "./text_stream.ts";
export * from "./generation.ts";
