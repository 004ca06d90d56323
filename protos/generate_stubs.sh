#!/usr/bin/env bash
# Regenerates the committed Python stubs in strata/v1/ from protos/strata/v1/*.proto.
# Use grpcio-tools 1.84.x: newer generated code refuses the grpcio 1.84 runtime.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root}"
cd "$root/protos"
python -m grpc_tools.protoc -I. --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" strata/v1/*.proto
