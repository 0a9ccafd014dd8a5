#!/usr/bin/env bash
# The one stub generator: regenerates protos/planserve/v1/*_pb2.py, *_pb2.pyi and *_pb2_grpc.py.
# The proto path equals the import path (planserve.v1), so the stubs import each other as
# `from planserve.v1 import common_pb2`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
"$PYTHON" -m grpc_tools.protoc -Iprotos \
  --python_out=protos --pyi_out=protos --grpc_python_out=protos \
  protos/planserve/v1/*.proto
