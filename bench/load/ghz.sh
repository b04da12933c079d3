#!/usr/bin/env bash
# Installs the pinned ghz into bench/load/.gobin (once) and prints its path.
# v0.120.0: the first release whose proto parser accepts proto3 `optional` (older ones reject the contract).
set -euo pipefail
GHZ_VERSION=v0.120.0
here=$(cd "$(dirname "$0")" && pwd)
bin="$here/.gobin/ghz"
if [[ -x $bin ]] && "$bin" --version 2>/dev/null | grep -q "${GHZ_VERSION#v}"; then
  echo "$bin"
  exit 0
fi
command -v go >/dev/null || { echo "ghz.sh: Go is needed to install ghz" >&2; exit 1; }
mkdir -p "$here/.gobin"
GOBIN="$here/.gobin" GOFLAGS=-mod=mod go install "github.com/bojand/ghz/cmd/ghz@${GHZ_VERSION}" >&2
echo "$bin"
