#!/usr/bin/env bash
# The project's one test command (README "Run the tests"; .ci/run calls it).
# Installs what the tests need, then runs: buf lint, the codegen drift check, ruff, mypy and pytest
# (unit, conformance on memory/files/PostgreSQL, end-to-end against real server processes).
# PostgreSQL is installed if missing and started as a private throwaway cluster by the test fixtures.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: scripts/test.sh [PYTEST-ARGS...]

The project's one test command. It changes the machine: it installs the package with its dev
extras (pip) and the browser tooling (system Chromium with apt, Playwright), and the PostgreSQL
tests install PostgreSQL (apt) when it is missing and start a private throwaway cluster. It runs
buf lint, the codegen drift check, the client checks, ruff, mypy and pytest (unit, conformance,
end-to-end, then the browser tests). Every argument goes to both pytest runs: scripts/test.sh -q -x.
EOF
}

case "${1:-}" in
  -h | --help) usage; exit 0 ;;  # before anything is installed or started
esac

cd "$(dirname "$0")/.."

step() { printf '\n== %s\n' "$*"; }

step "install (python package with dev extras)"
python3 -m pip install --quiet --disable-pip-version-check -e ".[dev]" 2>&1 | grep -v "Location .* is ignored" || true

step "browser tooling (system chromium, playwright)"; scripts/test-browser.sh

step "buf lint (contract)"
scripts/buf.sh lint

step "generated code matches protos/"
python3 scripts/gen_protos.py --check

scripts/test-clients.sh  # contract (buf breaking, client drift), TypeScript and Go clients, scenario
scripts/test-load-driver.sh  # the load suite's Go turn-loop driver (gofmt, go vet)

step "ruff"
python3 -m ruff check .
python3 -m ruff format --check .

step "mypy contextsvc"
python3 -m mypy contextsvc

step "pytest"
# The browser tests drive Chromium through Playwright's sync API, which keeps an event loop running
# in the test process; pytest-asyncio's tests cannot share a process with it, so they run apart.
python3 -m pytest --ignore=tests/browser "$@"

step "pytest: browser (inspector page in Chromium)"
python3 -m pytest tests/browser "$@"
