/**
 * Errors the job layer raises for caller mistakes, so the HTTP layer can map each to one status
 * code in its single error handler (404, 409, 400) without knowing the job layer's internals.
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
      `Model "${id}" not found: expected a job id, "<job id>/iter_N" or a directory under models/ (see GET /v1/models)`,
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
