#!/usr/bin/env bash
# Streams generated text to the terminal (GET /generate, server-sent events). Usage:
#   scripts/generate.sh MODEL "PROMPT" [NAME=VALUE ...]
#   scripts/generate.sh job_0123456789ab "The state of the union is" max_tokens=40 temperature=0.8 top_k=40
# MODEL is a job id (its newest checkpoint), "<job id>/iter_0000060" (a checkpoint's full name), or a
# directory under $GPT2_HOME/models/ (see GET /v1/models). Other parameters: top_p, seed, stop (repeatable),
# ignore_eos=true.
# Prints the text as it arrives, then a line with the finish reason, token counts and timings
# (without jq, deno prints the same). GPT2_URL (default http://127.0.0.1:8080) names the server.
# Exits non-zero on an HTTP error (404 unknown model, 400 naming bad parameters).
set -euo pipefail
. "$(dirname "$0")/_common.sh"

model="${1:?usage: scripts/generate.sh MODEL \"PROMPT\" [NAME=VALUE ...]}"
prompt="${2:-}"
shift $(($# < 2 ? $# : 2))
args=(--data-urlencode "model=${model}" --data-urlencode "prompt=${prompt}")
for kv in "$@"; do args+=(--data-urlencode "$kv"); done

# Each SSE data line is JSON: token events {id, text}, then the final {finish_reason, ...}.
render() {
  if command -v jq >/dev/null 2>&1; then
    jq --unbuffered -j 'if has("text") then .text
      else "\n[\(.finish_reason)\(if .error then ": " + .error else "" end)] \(.prompt_tokens) prompt + \(.completion_tokens) new tokens" +
        "\(if .truncated_tokens > 0 then " (prompt cut by \(.truncated_tokens))" else "" end)" +
        ", first token \(.timings.ttft_ms // 0 | floor) ms, \(.timings.tokens_per_s // 0 | . * 10 | floor / 10) tokens/s\n" end'
  else
    deno eval 'let buf = "";
      for await (const chunk of Deno.stdin.readable.pipeThrough(new TextDecoderStream()).values()) {
        const lines = (buf + chunk).split("\n");
        buf = lines.pop() ?? "";
        for (const line of lines.filter(Boolean)) {
          const d = JSON.parse(line);
          const t = d.timings ?? {};
          const s = "text" in d ? d.text : `\n[${d.finish_reason}${d.error ? ": " + d.error : ""}] ` +
            `${d.prompt_tokens} prompt + ${d.completion_tokens} new tokens` +
            (d.truncated_tokens > 0 ? ` (prompt cut by ${d.truncated_tokens})` : "") +
            `, first token ${Math.floor(t.ttft_ms ?? 0)} ms, ${Math.floor((t.tokens_per_s ?? 0) * 10) / 10} tokens/s\n`;
          Deno.stdout.writeSync(new TextEncoder().encode(s));
        }
      }'
  fi
}

# An HTTP error answers with a JSON body instead of events: it goes to stderr, curl exits 22.
curl -sS -N -G --fail-with-body "${AUTH[@]}" "${args[@]}" "${GPT2_URL}/generate" |
  sed -u -n -e 's/^data: //p' -e '/^{"error"/w /dev/stderr' | render
