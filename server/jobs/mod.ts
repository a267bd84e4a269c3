/**
 * The job layer: the jobs and their configs, the store, the runner that schedules them onto the
 * GPU pool, and comparing them. Re-exports only; the GPU pool is server/gpus/mod.ts, generation
 * server/generate/mod.ts.
 */

export * from "../../job/job.ts";
export * from "../../job/errors.ts";
export * from "../../job/job_config.ts";
export { isFinished, type JobPatch, JobStore, MIGRATIONS, SCHEMA_VERSION } from "./job_store.ts";
export { JobRunner, type RunnerOptions } from "./runner.ts";
export { datasetLookups } from "./job_checks.ts";
export { compareJobs, type Comparison, evalTaskPoints, metricsCsv } from "./compare.ts";
/** The start-up clean-up of what a dead writer left in the jobs' checkpoint folders (main.ts). */
export { removeStaleCheckpointTemporaries, removeStaleTemporaries } from "../../checkpoint/checkpoint.ts";
