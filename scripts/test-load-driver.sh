#!/usr/bin/env bash
# The load suite's Go turn-loop driver (bench/load/turndriver): gofmt, go vet, build.
# Its behaviour against a real server is tested by tests/e2e/test_load_turn_driver.py (pytest).
set -euo pipefail
cd "$(dirname "$0")/../bench/load/turndriver"
printf '\n== %s\n' "load: go turn driver (gofmt, go vet, go build)"
unformatted=$(gofmt -l .)
[[ -z $unformatted ]] || { echo "gofmt: $unformatted" >&2; exit 1; }
GOFLAGS=-mod=mod go vet ./...
GOFLAGS=-mod=mod go build -o /dev/null .
