#!/usr/bin/env bash
# Regenerates every client from protos/ with pinned, repo-local generators, and the shipped protoset:
#   Python      contextsvc/_gen/v1            (scripts/gen_protos.py, grpcio-tools)
#   TypeScript  clients/typescript/src/gen    (protoc-gen-es, tools/package.json)
#   Go          clients/go/gen                (protoc-gen-go + protoc-gen-go-grpc, tools/go-bin)
#   protoset    clients/contextsvc.protoset   (buf build: for ghz, grpcurl and other tools)
#
#   scripts/gen_clients.sh            regenerate everything
#   scripts/gen_clients.sh --check    fail when any generated client or the protoset drifts (CI)
#   scripts/gen_clients.sh --skip-python   regenerate all but Python (what gen_protos.py calls)
#   scripts/gen_clients.sh --release  also snapshot the contract as the released one (protos/released.binpb),
#                                     the baseline `buf breaking` compares against
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

PROTOC_GEN_GO_VERSION=v1.36.12
PROTOC_GEN_GO_GRPC_VERSION=v1.6.2
PROTOSET=clients/contextsvc.protoset
RELEASED=protos/released.binpb
GEN_DIRS=(clients/typescript/src/gen clients/go/gen)

mode=${1:-}

# Pinned Go plugins in a repo-local bin (reinstalled when the recorded version differs).
gobin="$root/tools/go-bin"
install_go_plugin() { # module-path version binary
  local stamp="$gobin/.$3.version"
  if [ ! -x "$gobin/$3" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$2" ]; then
    mkdir -p "$gobin"
    GOBIN="$gobin" GOFLAGS=-mod=mod go install "$1@$2"
    echo "$2" >"$stamp"
  fi
}
install_go_plugin google.golang.org/protobuf/cmd/protoc-gen-go "$PROTOC_GEN_GO_VERSION" protoc-gen-go
install_go_plugin google.golang.org/grpc/cmd/protoc-gen-go-grpc "$PROTOC_GEN_GO_GRPC_VERSION" protoc-gen-go-grpc
if [ ! -x tools/node_modules/.bin/protoc-gen-es ] || [ ! -x tools/node_modules/.bin/buf ]; then
  (cd tools && npm ci --no-audit --no-fund --silent >/dev/null)
fi

build_protoset() { scripts/buf.sh build -o "$1" --exclude-source-info; }

if [ "$mode" = "--check" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  status=0
  python3 scripts/gen_protos.py --check || status=1
  scripts/buf.sh generate --output "$tmp"
  for d in "${GEN_DIRS[@]}"; do
    if ! diff -r "$tmp/$d" "$d" >/dev/null 2>&1; then
      echo "$d is out of date: run scripts/gen_clients.sh" >&2
      status=1
    fi
  done
  build_protoset "$tmp/contextsvc.protoset"
  if ! cmp -s "$tmp/contextsvc.protoset" "$PROTOSET"; then
    echo "$PROTOSET is out of date: run scripts/gen_clients.sh" >&2
    status=1
  fi
  [ "$status" = 0 ] && echo "generated clients and protoset are up to date"
  exit "$status"
fi

[ "$mode" = "--skip-python" ] || python3 scripts/gen_protos.py --python-only
scripts/buf.sh generate
build_protoset "$PROTOSET"
echo "generated ${GEN_DIRS[*]} $PROTOSET"
if [ "$mode" = "--release" ]; then
  build_protoset "$RELEASED"
  echo "snapshot of the released contract: $RELEASED"
fi
