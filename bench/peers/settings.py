"""Where the peer comparison keeps things and what it runs (bench/peers/compare.py)."""

from __future__ import annotations

import os

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))
WORK = os.path.join(ROOT, "bench", "peers", ".work")
RESULTS = os.path.join(ROOT, "bench", "results", "peers")
DOC = os.path.join(ROOT, "docs", "benchmarks.md")
ENGINES = (
    "planserve",
    "planserve-avx2",
    "planserve-fp32",
    "transformers-bf16",
    "transformers-fp32",
    "vllm",
    "vllm-fp32",
    "llamacpp",
)
SERVERS = ("planserve", "vllm", "llamacpp")
HF_FOLDER = os.path.join(WORK, "smollm2-hf")
VLLM_VENV = os.path.join(WORK, "vllm-venv")
LLAMA_SERVER = os.path.join(
    WORK,
    "llamacpp",
    "llama_cpp_python-0.3.36",
    "vendor",
    "llama.cpp",
    "build",
    "bin",
    "llama-server",
)
# The AVX2 paths forced on a newer CPU (as tests/cpu_class.py's avx2 class does): planserve's kernel
# paths through their environment aliases, torch's ATen and oneDNN capped to the same ISA.
AVX2_ENV = {
    "PLANSERVE_GEMM_ISA": "avx2",
    "PLANSERVE_ATTENTION_ISA": "avx2",
    "PLANSERVE_LAYER_OPS_ISA": "avx2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
ONLINE_RATES = (0.5, 1.0, 2.0, 4.0)
ONLINE_REQUESTS = 48
ONLINE_TIMEOUT_S = 240.0
PORT = 18411
