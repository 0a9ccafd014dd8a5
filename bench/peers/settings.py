"""Where the peer comparison keeps things and what it runs (bench/peers/compare.py)."""

from __future__ import annotations

import os

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))
WORK = os.path.join(ROOT, "bench", "peers", ".work")
RESULTS = os.path.join(ROOT, "bench", "results", "peers")
DOC = os.path.join(ROOT, "docs", "benchmarks.md")
ENGINES = (
    "planserve",
    "planserve-fp32",
    "transformers-bf16",
    "transformers-fp32",
    "vllm",
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
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
ONLINE_RATES = (0.5, 1.0, 2.0, 4.0)
ONLINE_REQUESTS = 48
ONLINE_TIMEOUT_S = 240.0
PORT = 18411
