#!/usr/bin/env bash
# Follows a job's event stream (server-sent events) until it finishes. Usage:
#   scripts/follow.sh JOB_ID [LAST_EVENT_ID]
# Prints one line per event; pass the last id seen to continue after a disconnect.
# Exits non-zero on an HTTP error, and with 3 if the job failed or was cancelled.
set -euo pipefail
. "$(dirname "$0")/_common.sh"

id="${1:?usage: scripts/follow.sh JOB_ID [LAST_EVENT_ID]}"
api GET "/jobs/${id}" >/dev/null # 404 before streaming
headers=()
if [ -n "${2:-}" ]; then headers=(-H "Last-Event-ID: $2"); fi
final=""
event="" eid="" data=""
while IFS= read -r line; do
  case "$line" in
    id:*) eid="${line#id: }" ;;
    event:*) event="${line#event: }" ;;
    data:*) data="${line#data: }" ;;
    "") # a blank line ends an event
      if [ -n "$data" ]; then printf '[%s] %-10s %s\n' "$eid" "$event" "$data"; fi
      if [ "$event" = "done" ]; then final="$data"; fi
      event="" data=""
      ;;
  esac
done < <(curl -sS -N --fail-with-body "${AUTH[@]}" "${headers[@]}" "${GPT2_URL}/jobs/${id}/events")
case "$final" in
  *'"status":"succeeded"'*) exit 0 ;;
  "") echo "Stream ended before the job finished: rerun with the last id to continue" >&2; exit 4 ;;
  *) exit 3 ;;
esac
