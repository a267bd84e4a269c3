/**
 * The HTTP layer: zod schemas, routes and server-sent events over the job layer. Re-exports only.
 */

export { type AppOptions, createApp, DEFAULT_MAX_BODY_BYTES } from "./app.ts";
export { jobRoutes } from "./jobs.ts";
export { generateRoutes } from "./generate.ts";
export { healthRoutes } from "./health.ts";
export { onError } from "./errors.ts";
export { streamJobEvents } from "./sse.ts";
export { type TrainRequestBody, TrainRequestSchema } from "./schemas.ts";
