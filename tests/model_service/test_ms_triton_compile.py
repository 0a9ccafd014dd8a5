"""The Triton kernels (model_service/kernels/triton_ops.py) compiled for a Hopper GPU (sm_90)
without one: Triton's own compiler and ptxas, as a GPU's first call runs them.

The interpreter's tests check the arithmetic but not what only the compiler sees (types of the
constants, constexpr branches, the lowering of div_rn); and two numerics claims live in the
machine code: fp fusion is off (no fma: each product rounds before the sum, as torch's eager ops
do, so RoPE gives the torch path's bits) and SiLU's division is the exactly rounded one.
"""

from __future__ import annotations

import pytest

from model_service.kernels import triton_ops

triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)


def compile_ptx(kernel, signature: dict, constexprs: dict, num_warps: int = 4) -> str:
    source = ASTSource(
        fn=kernel, signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
        constexprs=constexprs,
    )  # fmt: skip
    compiled = triton.compile(
        source, target=HOPPER, options=dict(num_warps=num_warps, **triton_ops.COMPILE_OPTIONS)
    )
    assert compiled.asm["cubin"], "ptxas made no binary"
    return compiled.asm["ptx"]


def kernels(dtype: str):
    """(name, PTX) of each kernel and variant, activations in `dtype`."""
    act = f"*{dtype}"
    for has_delta in (True, False):
        yield f"norm delta={has_delta}", compile_ptx(
            triton_ops._add_rms_norm_kernel,
            dict(residual_ptr=act, delta_ptr=act, weight_ptr=act, out_ptr=act, residual_stride="i32",
                 delta_stride="i32", hidden="i32", inv_hidden="fp32", eps="fp32"),
            dict(HAS_DELTA=has_delta, BLOCK=1024),
        )  # fmt: skip
    yield "silu_mul", compile_ptx(
        triton_ops._silu_mul_kernel,
        dict(gate_up_ptr=act, out_ptr=act, row_stride="i32", width="i32"), dict(BLOCK=1024),
    )  # fmt: skip
    for write_kv in (True, False):
        yield f"rope write_kv={write_kv}", compile_ptx(
            triton_ops._rope_kernel,
            dict(x_ptr=act, positions_ptr="*i64", table_ptr="*fp32", k_cache_ptr=act, v_cache_ptr=act,
                 slot_ptr="*i64", row_stride="i32", table_stride="i32", num_heads="i32",
                 num_kv_heads="i32", block_size="i32"),
            dict(HALF=32, HALF_PAD=32, HEADS=32, WRITE_KV=write_kv),
        )  # fmt: skip


@pytest.mark.parametrize("dtype", ["bf16", "fp32", "fp16"])
def test_the_kernels_compile_for_hopper_without_fused_multiply_adds(dtype):
    for name, ptx in kernels(dtype):
        assert "fma." not in ptx, f"{name}: a fused multiply-add (fp fusion should be off)"
        if name == "silu_mul":
            assert "div.rn.f32" in ptx, "SiLU's division is not the exactly rounded one"
