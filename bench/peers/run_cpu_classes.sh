#!/usr/bin/env bash
# The peer workload on one CPU with planserve's default paths and its AVX2 paths forced, beside
# vLLM's CPU build in bf16 and float32 and transformers, one engine after the other (issue 33).
# Results go to bench/results/peers-cpu-classes/RUN/ (docs/benchmarks.md is not regenerated).
#
#   bench/peers/setup.sh                      # once (the vLLM venv, the HF folder, tcmalloc)
#   bench/peers/run_cpu_classes.sh run1 [ENGINE ...]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
RUN="${1:?name of the run}"
shift
ENGINES=("$@")
if [ ${#ENGINES[@]} -eq 0 ]; then
  ENGINES=(planserve planserve-avx2 vllm vllm-fp32 transformers-bf16 transformers-fp32)
fi
cd "$ROOT"
uptime
PYTHONPATH="$ROOT:$ROOT/protos" "$ROOT/.venv/bin/python" -m bench.peers.compare \
  --engines "${ENGINES[@]}" --skip-online --no-doc --results "bench/results/peers-cpu-classes/$RUN"
uptime
