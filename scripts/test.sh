#!/usr/bin/env bash
# Runs the whole test suite on a fresh machine: installs the Vulkan CPU driver (lavapipe),
# Chromium and PostgreSQL when they are missing, so the GPU tests run on the CPU adapter, the
# dashboard test in a real browser and the job store's tests on both engines, then runs
# `deno task test` with Deno from npm.
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
if ! ldconfig -p 2>/dev/null | grep -q libvulkan.so.1 || [ ! -e /usr/share/vulkan/icd.d/lvp_icd.x86_64.json ]; then
  missing+=(libvulkan1 mesa-vulkan-drivers)
fi
# tests/web/browser_test.ts drives Debian's Chromium headless (puppeteer-core).
if ! command -v chromium >/dev/null 2>&1 && [ -z "${CHROMIUM_PATH:-}" ]; then
  missing+=(chromium)
fi
# tests/_postgres.ts starts a throwaway PostgreSQL cluster (initdb, pg_ctl) for the store's tests.
if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  missing+=(postgresql)
fi
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq >/dev/null
  $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi
export DENO_WEBGPU_BACKEND=${DENO_WEBGPU_BACKEND:-vulkan}
# Mesa warns on every adapter request without it.
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-$(mktemp -d)}
deno_cmd=(npx --yes deno@2.9.6)
command -v deno >/dev/null 2>&1 && [ "$(deno --version | head -1 | cut -d' ' -f2)" = "2.9.6" ] && deno_cmd=(deno)
exec "${deno_cmd[@]}" task test "$@"
