#!/usr/bin/env bash
# Submits a training job. Usage:
#   scripts/train.sh                                  # gpt2-tiny on sotu with defaults (1000 iterations)
#   scripts/train.sh '{"model":"gpt2-small-test","train_iters":500}'
#   scripts/train.sh @config.json
# Prints the job id and how to follow it; exits non-zero on an HTTP error (e.g. 400 with zod's issues).
set -euo pipefail
. "$(dirname "$0")/_common.sh"

body="${1:-{\}}"
if [ "${body:0:1}" = "@" ]; then body="$(cat "${body:1}")"; fi
out="$(api POST /train -H 'Content-Type: application/json' --data-binary "$body")"
id="$(printf '%s' "$out" | sed -n 's/^{"id":"\([^"]*\)".*/\1/p')"
echo "Queued job ${id}"
echo "  follow:  scripts/follow.sh ${id}"
echo "  status:  scripts/jobs.sh ${id}"
echo "  cancel:  scripts/cancel.sh ${id}"
