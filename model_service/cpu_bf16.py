"""Whether bf16 is the fast dtype on this CPU: the facts `--dtype auto` is resolved from
(model_service/config.py), kept apart from the config so that it imports nothing heavy."""

from __future__ import annotations

import os
from typing import Mapping

# The packed GEMM's paths faster than torch's bf16 GEMM wherever they run (cython_ext.gemm.ISAS).
_GEMM_VECTOR_PATHS = ("avx512_bf16", "avx512", "avx2")


def packs_bf16_linears(gemm_isa: str) -> bool:
    """Whether a bf16 model's linears run the packed GEMM on a vector path here (not torch's,
    which gemm_isa torch and tensor-parallel ranks run, nor the scalar portable one). The native
    module itself, as kernels/gemm.py resolves it (kernels/ import the config)."""
    from cython_ext import gemm as native

    isa = native.best_isa() if gemm_isa == "auto" else gemm_isa
    return isa in _GEMM_VECTOR_PATHS and native.isa_supported(isa)


# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) under AVX512_CORE_BF16: oneDNN then emulates bf16 matmul
# whatever the CPU has, so bf16 is no longer the faster dtype (and tests emulate an AVX2 CPU so).
_ONEDNN_CAPS_WITHOUT_BF16 = frozenset(
    ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")
)


def onednn_capped_below_bf16(environ: Mapping[str, str] = os.environ) -> bool:
    """True when the environment caps oneDNN (which runs torch's bf16 matmul on the CPU) under
    AVX512_CORE_BF16; DNNL_MAX_CPU_ISA is its older name."""
    cap = environ.get("ONEDNN_MAX_CPU_ISA") or environ.get("DNNL_MAX_CPU_ISA") or ""
    return cap.strip().upper() in _ONEDNN_CAPS_WITHOUT_BF16


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AMX tiles or AVX512-BF16) and oneDNN may use
    it, so bf16 matmul beats float32; without it oneDNN emulates bf16 and float32 is faster."""
    if onednn_capped_below_bf16():
        return False
    import torch

    cpu = getattr(torch, "cpu", None)
    for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        check = getattr(cpu, probe, None)
        if check is not None and check():
            return True
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags
