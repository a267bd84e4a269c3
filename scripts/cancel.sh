#!/usr/bin/env bash
# Cancels a job (idempotent). Usage: scripts/cancel.sh JOB_ID
# A queued job is cancelled at once; a running one stops before its next step, keeping the checkpoints
# it saved (none is written on cancel). Cancelling a cancelled job again is answered as before.
# Exits non-zero on an HTTP error (404 unknown job, 409 already succeeded or failed).
set -euo pipefail
. "$(dirname "$0")/_common.sh"

id="${1:?usage: scripts/cancel.sh JOB_ID}"
api POST "/jobs/${id}/cancel" -H 'Content-Type: application/json' | pretty
