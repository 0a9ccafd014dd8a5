"""The CPU class the suite runs as (issue 29): which kernel paths and dtypes are fast here decides
what the tests serve (tests/dtypes.py), so a CPU is one of three classes:

  native-bf16  AMX or AVX512-BF16: bf16 matmul beats float32; `--dtype auto` is bfloat16
  avx512       AVX-512 without BF16: oneDNN emulates bf16, the packed GEMM widens bf16 weights to
               float32 (its avx512 path); auto is bfloat16 on that path
  avx2         AVX2 (+FMA) only: the same on the avx2 paths, and no AVX-512 kernel paths

PLANSERVE_TEST_CPU_CLASS=avx2 (or avx512) runs the suite as that class on a newer CPU, to see what
such a CPU runs and how long it takes (docs/benchmarks.md): before torch's first matmul it caps
oneDNN (ONEDNN_MAX_CPU_ISA) and ATen's kernels (ATEN_CPU_CAPABILITY) for this process and the
model services it starts, it caps what the native kernel modules of this process report
(`isa_supported`, `best_isa`) to that class's paths, and it sets the kernel paths' environment
aliases (PLANSERVE_GEMM_ISA, ...) to the class's best, which model services started as processes
read at start (a test's own setting wins).
"""

from __future__ import annotations

import os
from types import ModuleType

from model_service.cpu_bf16 import cpu_has_native_bf16

CLASSES = ("avx2", "avx512", "native-bf16")
ENV = "PLANSERVE_TEST_CPU_CLASS"
# Per emulated class: the oneDNN and ATen caps, and per kernel module its best path, the ISAs that
# class runs (the modules' ISAS names) and the environment alias of its config field.
_CAPS: dict[str, dict[str, str]] = {
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "ATEN_CPU_CAPABILITY": "avx512"},
}
_KERNEL_PATHS: dict[str, dict[str, tuple[str, tuple[str, ...]]]] = {
    "avx2": {
        "gemm": ("avx2", ("portable", "avx2")),
        "layer_ops": ("avx2", ("portable", "avx2")),
        "paged_attention": ("avx2", ("portable", "avx2")),
    },
    "avx512": {
        "gemm": ("avx512", ("portable", "avx2", "avx512")),
        "layer_ops": ("avx512", ("portable", "avx2", "avx512")),
        "paged_attention": ("avx512", ("portable", "avx2", "avx512")),
    },
}
_ALIASES = {
    "gemm": "PLANSERVE_GEMM_ISA",
    "layer_ops": "PLANSERVE_LAYER_OPS_ISA",
    "paged_attention": "PLANSERVE_ATTENTION_ISA",
}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


def detected() -> str:
    """This CPU's class (and oneDNN's cap, where one is set)."""
    if cpu_has_native_bf16():
        return "native-bf16"
    return "avx512" if "avx512f" in _cpu_flags() else "avx2"


def forced() -> str | None:
    """The class PLANSERVE_TEST_CPU_CLASS names, if any; a name outside CLASSES is refused."""
    name = os.environ.get(ENV, "").strip()
    if not name:
        return None
    if name not in CLASSES:
        raise ValueError(f"{ENV}: {name!r} is not one of {', '.join(CLASSES)}")
    return name


def _cap_kernel(module: ModuleType, best: str, isas: tuple[str, ...]) -> None:
    supported = module.isa_supported
    module.isa_supported = lambda name: name in isas and supported(name)  # type: ignore[attr-defined]
    module.best_isa = lambda: best  # type: ignore[attr-defined]


def emulate() -> str:
    """Runs this process (and the services it starts) as the forced class, if one is; returns the
    class the suite runs as. Called once, before any test imports torch's kernels."""
    name = forced()
    if name is None or name == "native-bf16":
        return name or detected()
    for key, value in _CAPS[name].items():
        os.environ.setdefault(key, value)
    import importlib

    for module_name, (best, isas) in _KERNEL_PATHS[name].items():
        _cap_kernel(importlib.import_module(f"cython_ext.{module_name}"), best, isas)
        os.environ.setdefault(_ALIASES[module_name], best)
    return name
