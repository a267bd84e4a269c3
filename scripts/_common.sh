# Shared by the curl scripts: the server URL, the optional bearer token, and a curl wrapper
# that prints the server's error body and exits non-zero on any HTTP error.
# GPT2_URL (default http://127.0.0.1:8080), GPT2_API_TOKEN (optional).

GPT2_URL="${GPT2_URL:-http://127.0.0.1:8080}"
AUTH=()
if [ -n "${GPT2_API_TOKEN:-}" ]; then AUTH=(-H "Authorization: Bearer ${GPT2_API_TOKEN}"); fi

# api METHOD PATH [curl args...]: prints the body; on an HTTP error prints it to stderr and exits 1.
api() {
  local method="$1" path="$2"
  shift 2
  local out status
  out="$(curl -sS -X "$method" "${AUTH[@]}" -w '\n%{http_code}' "$@" "${GPT2_URL}${path}")" || {
    echo "Cannot reach ${GPT2_URL}: is the server running (deno task serve)?" >&2
    exit 2
  }
  status="${out##*$'\n'}"
  out="${out%$'\n'*}"
  if [ "$status" -ge 400 ]; then
    echo "HTTP ${status}: ${out}" >&2
    exit 1
  fi
  printf '%s\n' "$out"
}

# pretty: formats JSON with jq when it is installed.
pretty() {
  if command -v jq >/dev/null 2>&1; then jq "${@:-.}"; else cat; fi
}
