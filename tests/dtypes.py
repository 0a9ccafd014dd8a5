"""Which dtypes a test serves a model in, by CPU class (issue 29; the classes: tests/cpu_class.py).

Every test checks the dtype users get by default (`--dtype auto`: bfloat16 where the CPU multiplies
bf16 natively or the packed GEMM takes bf16 linears on a vector path, AVX2 included; float32
elsewhere) and float32 where parity with transformers is checked. Where bf16 would run torch's
GEMM without native bf16 (a few hundredths of float32's rate), a test serves SmolLM2 in bfloat16
only when bf16 is its point (the bf16 kernels, int8 in bf16); the tiny model, where bf16 is cheap,
keeps both dtypes everywhere. The end-to-end batch-invariance grid serves SmolLM2 in the default
dtype only (`invariance_dtypes`): float32's paths there (torch's GEMM, the Python loop, the float32
attention) are the ones the tiny model's float32 cases run, and parity with transformers, which
does need SmolLM2 in float32, has tests of its own.
"""

from __future__ import annotations

import cpu_class

CLASS = cpu_class.emulate()  # before any test module loads a model
CHEAP = ("tiny",)  # small enough for emulated bf16 on any CPU (so are the random family models)


def _default_dtype() -> str:
    from model_service.config import ModelServiceConfig

    return ModelServiceConfig(dtype="auto", device="cpu").resolved_dtype()


DEFAULT = _default_dtype()  # what `--dtype auto` serves on this class


def served_dtypes(model: str) -> tuple[str, ...]:
    """The dtypes to serve `model` in on this CPU: bfloat16 where it is the default or cheap, and
    float32 (parity's dtype, and the default where bf16 would run torch's GEMM)."""
    if DEFAULT == "bfloat16" or model in CHEAP:
        return ("bfloat16", "float32")
    return ("float32",)


def invariance_dtypes(model: str) -> tuple[str, ...]:
    """The dtypes the batch-invariance cases serve `model` in: every served dtype of a cheap model,
    the default dtype alone of a larger one (the module docstring says why)."""
    return served_dtypes(model) if model in CHEAP else (DEFAULT,)


def header() -> list[str]:
    """The report header's lines: the CPU class, the dtypes served, and why."""
    forced = cpu_class.forced()
    source = f"forced by {cpu_class.ENV}" if forced else "detected"
    if DEFAULT == "bfloat16":
        served = (
            "every model in bfloat16 (the default here) and float32 (batch invariance: SmolLM2 in "
            "bfloat16 only)"
        )
    else:
        served = (
            "bf16 runs torch's GEMM here: SmolLM2 in float32 (the default here), in bfloat16 only "
            "where bf16 is the point of the test; the tiny model in bfloat16 and float32"
        )
    return [f"CPU class: {CLASS} ({source}); dtypes: {served}", f"kernel paths (auto): {_paths()}"]


def _paths() -> str:
    """What each native kernel's "auto" runs in this process; tests that name a path run every
    path this class has (the paths it lacks are refused, as on such a CPU)."""
    from model_service.attention import paged
    from model_service.kernels import gemm, layer_ops

    paths = {"gemm (bf16 linears)": gemm, "layer ops": layer_ops, "attention": paged}
    return ", ".join(f"{name} {module.resolve_isa()}" for name, module in paths.items())
