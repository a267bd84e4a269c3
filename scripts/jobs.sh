#!/usr/bin/env bash
# Lists jobs, or shows one job with its checkpoints. Usage:
#   scripts/jobs.sh            # the newest 100 jobs, one line each: id, status, iteration, loss, val loss, tokens/s
#   scripts/jobs.sh JOB_ID     # the job as JSON, then its checkpoints
# Exits non-zero on an HTTP error (404 for an unknown job).
set -euo pipefail
. "$(dirname "$0")/_common.sh"

if [ $# -ge 1 ]; then
  api GET "/jobs/$1" | pretty
  api GET "/jobs/$1/checkpoints" | pretty '.checkpoints[] | "\(.name)  \(.path)"' -r
  exit 0
fi
out="$(api GET /jobs)"
if command -v jq >/dev/null 2>&1; then
  printf '%s' "$out" | jq -r '["ID","STATUS","ITER","LOSS","VAL","TOK/S"],
    (.jobs[] | [.id, .status, "\(.iteration)/\(.config.train_iters)",
      (.metrics.loss // "-" | tostring | .[0:6]), (.metrics.val_loss // "-" | tostring | .[0:6]),
      (.metrics.tokens_per_s // 0 | floor)]) | @tsv' | column -t
else
  printf '%s\n' "$out"
fi
