/**
 * The HTTP layer: zod schemas, routes, guards, the one error shape, metrics and server-sent
 * events over the job layer. Re-exports only.
 */

export { type AppOptions, createApp, parseHost } from "./app.ts";
export { allowed, authGuard, FailureLimiter, principalOf, type RouteClass, routeClass } from "./auth.ts";
export { adminRoutes, audit, type Auth } from "./admin.ts";
export { jobRoutes } from "./jobs.ts";
export { checkpointRoutes, ReshardRequestSchema } from "./checkpoints.ts";
export { generateRoutes } from "./generate.ts";
export { chatRoutes } from "./chat_completions.ts";
export { healthRoutes } from "./health.ts";
export {
  ApiError,
  type ApiErrorOptions,
  type ErrorBody,
  errorHandler,
  errorType,
  issueParam,
  jsonBody,
  onError,
  queryParams,
  zodError,
} from "./api_errors.ts";
export { type AppMetrics, createMetrics, type MetricsHook } from "./metrics.ts";
export { clientKey, REPLAY_PAGE, streamJobEvents, streamLimit } from "./sse.ts";
export { type TrainRequestBody, TrainRequestSchema } from "./schemas.ts";
