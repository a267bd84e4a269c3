/**
 * Errors the job layer raises for caller mistakes, so the HTTP layer can map each to one status
 * code in its single error handler (404, 409, 400, 429/507) without knowing the job layer's internals.
 */

/** No job has this id (HTTP 404). */
export class JobNotFoundError extends Error {
  constructor(id: string) {
    super(`Job "${id}" not found`);
    this.name = "JobNotFoundError";
  }
}

/** The job's state does not allow the operation (HTTP 409). */
export class JobConflictError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "JobConflictError";
  }
}

/** The request names something that does not exist or cannot work (HTTP 400). `field` names the culprit. */
export class InvalidJobError extends Error {
  constructor(readonly field: string, message: string) {
    super(message);
    this.name = "InvalidJobError";
  }
}

/** No checkpoint or model directory has this id (HTTP 404). */
export class ModelNotFoundError extends Error {
  constructor(readonly id: string) {
    super(
      `Model "${id}" not found: expected a job id, "<job id>/iter_0001000" (a checkpoint as GET /jobs/:id/checkpoints names it) or a directory under models/ (see GET /v1/models)`,
    );
    this.name = "ModelNotFoundError";
  }
}

/** No GPU can serve the request now (HTTP 503). */
export class GpuUnavailableError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "GpuUnavailableError";
  }
}

/**
 * A resource limit would be exceeded (HTTP 429 when it frees up with time, 507 for disk). The
 * message names the limit and the setting that raises it; `param` names the request field, if any.
 */
export class LimitError extends Error {
  constructor(readonly status: 429 | 507, message: string, readonly param: string | null = null) {
    super(message);
    this.name = "LimitError";
  }
}

/**
 * A user's quota would be exceeded (HTTP 429): the message names the quota, the user and when it
 * frees; `retryAfter` is seconds until it frees, when known.
 */
export class QuotaError extends Error {
  constructor(readonly quota: string, message: string, readonly retryAfter: number | null = null) {
    super(message);
    this.name = "QuotaError";
  }
}
