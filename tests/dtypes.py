"""Which dtypes a test serves a model in, by CPU class (issue 29): what users get there by default
(`--dtype auto`: bfloat16 where the CPU multiplies bf16 natively, float32 elsewhere) and float32,
where parity with transformers is checked. On a CPU without native bf16 (AVX2 only, AVX-512
without BF16) torch's bf16 GEMM runs at a few hundredths of float32's rate, so SmolLM2 is not
served in bfloat16 there: bfloat16 stays on the tiny model, where it is cheap."""

from __future__ import annotations

from model_service.config import cpu_has_native_bf16

NATIVE_BF16 = cpu_has_native_bf16()


def served_dtypes(model: str) -> tuple[str, ...]:
    """The dtypes to serve `model` in on this CPU."""
    if NATIVE_BF16 or model == "tiny":
        return ("bfloat16", "float32")
    return ("float32",)


def header() -> str:
    """One line for the test report: which dtypes run on this CPU, and why."""
    if NATIVE_BF16:
        return "dtypes: this CPU multiplies bf16 natively: every model in bfloat16 (the default) and float32"
    return (
        "dtypes: no native bf16 on this CPU: SmolLM2 in float32 (the default here) only, "
        "the tiny model in bfloat16 and float32"
    )
