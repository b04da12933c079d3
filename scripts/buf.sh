#!/usr/bin/env bash
# Runs buf from the npm package pinned in tools/package.json, installing it on first use.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin="$root/tools/node_modules/.bin/buf"
if [ ! -x "$bin" ]; then
  (cd "$root/tools" && npm install --no-audit --no-fund --silent >/dev/null)
fi
export BUF_CACHE_DIR="${BUF_CACHE_DIR:-$root/tools/.buf-cache}"
cd "$root"
exec "$bin" "$@"
