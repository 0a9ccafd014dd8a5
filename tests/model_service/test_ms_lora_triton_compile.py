"""The grouped LoRA kernels (model_service/lora/triton_lora.py) compiled for a Hopper GPU (sm_90)
without one, as test_ms_triton_compile.py does for the layer kernels: Triton's compiler and
ptxas, as the first call on a GPU (or a graph capture's warm-up) runs them. The interpreter's
tests check the arithmetic; this checks what only the compiler sees (the row's slot branch, the
int64 slot arithmetic, the strided xa of a target's columns) in each activation dtype, and that
fp fusion stays off (no fma: the scaled add rounds its product before the sum)."""

from __future__ import annotations

import pytest

from model_service.lora import triton_lora

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")
from test_ms_triton_compile import compile_ptx  # noqa: E402


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_the_lora_kernels_compile_for_hopper(dtype):
    act = f"*{dtype}"
    shrink = compile_ptx(
        triton_lora._shrink_kernel,
        dict(x=act, a=act, row_slot="*i64", out="*fp32", x_stride="i32", K="i32", R="i32"),
        dict(BLOCK_K=128, BLOCK_R=64),
    )  # fmt: skip
    expand = compile_ptx(
        triton_lora._expand_kernel,
        dict(y=act, xa="*fp32", b=act, scale="*fp32", row_slot="*i64", y_stride="i32",
             xa_stride="i32", start="i32", N="i32", R="i32"),
        dict(BLOCK_N=64, BLOCK_R=16),
    )  # fmt: skip
    for name, ptx in (("shrink", shrink), ("expand", expand)):
        assert "fma." not in ptx, f"{name}: a fused multiply-add (fp fusion should be off)"
