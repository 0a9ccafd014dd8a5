#!/usr/bin/env bash
# Run HERE (a machine with network and this repo's .venv): fetches what a CUDA machine with torch
# and no network needs to run planserve's GPU tests and bench/bench_gpu_serve.py, into one folder:
#
#   KIT/wheels/*.whl          planserve's dependencies the CUDA torch image lacks, for CPython
#                             3.12 on manylinux x86_64, at the versions this checkout runs with
#                             (the gRPC and protobuf pins are the generated stubs' in protos/)
#   KIT/smollm2-tokenizer.gguf  SmolLM2's tokenizer, no weights (bench/gpu/tokenizer_gguf.py)
#
#   bench/gpu/prepare.sh [KIT]        (default /work/gpu-wheels; prints the kit's size)
#
# Then carry KIT to the CUDA machine (inside the checkout as .gpu-kit, or anywhere) and run
# bench/gpu/run.sh there. PYTHON_VERSION / PLATFORM choose another interpreter or platform.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
KIT="${1:-/work/gpu-wheels}"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
PYTHON_VERSION="${PYTHON_VERSION:-3.12}"
ABI="cp${PYTHON_VERSION/./}"

# The gRPC stack and protobuf at pyproject.toml's exact pins; the rest at the versions the
# project's own environment runs, so the kit is what CI tested. Not here: what the image has
# (torch, triton, numpy, tokenizers, safetensors, transformers, pytest).
PACKAGES=(
  grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 grpcio-status==1.85.1
  protobuf==7.36.2 googleapis-common-protos==1.76.0
  structlog==26.1.0 prometheus-client==0.26.0 jinja2==3.1.6 markupsafe==3.0.4
  fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 uvicorn==0.54.0 h11==0.16.0
  httptools==0.7.1 llguidance==1.9.1
  click==8.5.1 anyio==4.16.0 sniffio==1.3.1 idna==3.20
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 opentelemetry-api==1.45.2
  outlines-core==0.2.14 pyzmq==27.3.0 msgpack==1.2.4
  gguf==0.19.0 pyyaml==6.0.4 tqdm==4.70.1
  pytest-asyncio==1.5.0 pytest-timeout==2.4.0 hypothesis==6.170.17 sortedcontainers==2.4.0
  attrs==26.1.0 cython==3.3.1 setuptools==84.2.1
)

mkdir -p "$KIT/wheels"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest "$KIT/wheels" \
  --python-version "$PYTHON_VERSION" --implementation cp --abi "$ABI" --abi abi3 --abi none \
  --platform "${PLATFORM:-manylinux_2_28_x86_64}" --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 --platform any "${PACKAGES[@]}"

PYTHONPATH="$REPO:$REPO/protos" "$PYTHON" -m bench.gpu.tokenizer_gguf "$KIT/smollm2-tokenizer.gguf"

echo "$(ls "$KIT/wheels" | wc -l) wheels and the tokenizer in $KIT: $(du -sh "$KIT" | cut -f1)"
