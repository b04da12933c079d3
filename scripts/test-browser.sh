#!/usr/bin/env bash
# Browser tests' tooling: Debian's Chromium (system package) and the Python Playwright driver.
# Playwright never downloads a browser here: tests/browser points it at the installed chromium.
#   scripts/test-browser.sh          install what the browser tests need (scripts/test.sh calls this)
#   scripts/test-browser.sh --run    ... and run only the browser tests
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get install -y chromium >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get install -y chromium >/dev/null; }
  else
    sudo apt-get install -y chromium >/dev/null
  fi
fi
command -v chromium >/dev/null || { echo "chromium is not installed" >&2; exit 1; }

python3 -m pip install --quiet --disable-pip-version-check -e ".[browser]" 2>&1 | grep -v "Location .* is ignored" || true

if [ "${1:-}" = "--run" ]; then
  shift
  python3 -m pytest tests/browser "$@"
fi
