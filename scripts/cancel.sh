#!/usr/bin/env bash
# Cancels a job (idempotent). Usage: scripts/cancel.sh JOB_ID
# A queued job is cancelled at once; a running one stops before its next step.
# Exits non-zero on an HTTP error (404 unknown job, 409 already finished).
set -euo pipefail
. "$(dirname "$0")/_common.sh"

id="${1:?usage: scripts/cancel.sh JOB_ID}"
api POST "/jobs/${id}/cancel" -H 'Content-Type: application/json' | pretty
