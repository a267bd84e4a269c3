/**
 * The GPUs as the HTTP process sees them: the pool of slots and their Workers, the GPU host that
 * runs the Workers, and each GPU's roles. Re-exports only.
 */

export { type GenerationReport, GpuPool, type GpuSlot, type GpuState, type JobClient } from "./gpu_pool.ts";
export { GpuHostClient, type HostStatus } from "./host_client.ts";
export * from "./roles.ts";
