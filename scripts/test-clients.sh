#!/usr/bin/env bash
# Contract and client checks (scripts/test.sh calls this; it runs on its own too):
#   buf lint and buf breaking against the released contract (protos/released.binpb),
#   drift of every generated client and of the shipped protoset (scripts/gen_clients.sh --check),
#   TypeScript: npm ci, tsc --noEmit, build, node's test runner against a real server,
#   Go: go vet, go test against a real server,
#   the cross-language scenario (clients/scenario): the three transcripts must match.
# The Python client's tests run with the rest of pytest (tests/e2e/test_python_client.py).
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s\n' "$*"; }

step "clients: buf lint, buf breaking against the released contract"
scripts/buf.sh lint
scripts/buf.sh breaking protos --against protos/released.binpb

step "clients: generated clients and protoset match protos/"
scripts/gen_clients.sh --check

step "clients: typescript (npm ci, tsc --noEmit, node --test)"
(
  cd clients/typescript
  npm ci --no-audit --no-fund --silent
  npx tsc -p tsconfig.json --noEmit
  npm test --silent
)

step "clients: go (go vet, go test)"
(
  cd clients/go
  go mod download
  go vet ./...
  go test -count=1 ./...
)

if [ -d clients/scenario ]; then
  step "clients: cross-language scenario"
  python3 -m pytest -q -p no:cacheprovider clients/scenario
fi
