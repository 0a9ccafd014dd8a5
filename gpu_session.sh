#!/usr/bin/env bash
# One device session: install + build, CUDA tests of the new paths, the forward bench on the 1B
# shape, the served bench, then the other CUDA tests and e2e while time is left.
set -uo pipefail
cd "$(dirname "$0")"
export OUT="${OUT:-/tmp/out}" GPU_KIT=build/gpu-kit
LOGS=/tmp/logs; mkdir -p "$LOGS" "$OUT"
export PYTHONPATH="/tmp/planserve-deps:$PWD:$PWD/protos"
T0=$(date +%s)
left() { echo $(( ${DEADLINE:-540} - ($(date +%s) - T0) )); }
step() {  # name seconds command...
  local name=$1 secs=$2; shift 2
  local l; l=$(left); [ "$secs" -gt "$l" ] && secs=$l
  if [ "$secs" -lt 15 ]; then echo "$name skipped (time)" | tee -a "$OUT/summary.txt"; return; fi
  local s; s=$(date +%s)
  timeout "$secs" "$@" > "$LOGS/$name.log" 2>&1
  echo "$name exit=$? seconds=$(( $(date +%s) - s ))" | tee -a "$OUT/summary.txt"
  tail -n 4 "$LOGS/$name.log"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"
step install 60 env STEPS="install build" OUT=/tmp/runsh bench/gpu/run.sh
step gpu_new 110 python3 -m pytest -q -p no:cacheprovider -m gpu tests/model_service/test_ms_cuda_graphs.py tests/model_service/test_ms_cuda_attention.py tests/model_service/test_ms_triton_ops.py
step forward 100 python3 bench/bench_cuda_forward.py --model llama-1b --load-format dummy --out "$OUT/cuda_forward.json"
step serve 230 python3 bench/bench_gpu_serve.py --shapes llama-1b,smollm2-135m,llama-8b --budget-seconds 220 --max-seconds 75 --out "$OUT/gpu_serve.json" --log-dir "$LOGS/bench"
step gpu_rest 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/model_service --deselect tests/model_service/test_ms_cuda_graphs.py --deselect tests/model_service/test_ms_cuda_attention.py --deselect tests/model_service/test_ms_triton_ops.py
step e2e 100 python3 -m pytest -q -p no:cacheprovider tests/e2e/test_concurrency.py tests/e2e/test_stops_and_cancel.py tests/e2e/test_engine_up.py tests/e2e/test_dummy_weights.py
cp /tmp/runsh/logs/*.log "$LOGS/" 2>/dev/null
tar czf "$OUT/logs.tgz" -C /tmp logs
grep -h -E "passed|failed|error" "$LOGS"/gpu_*.log "$LOGS"/e2e.log | tail -n 6
