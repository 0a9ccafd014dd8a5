"""The Triton paged attention kernel (model_service/attention/cuda_attention.py) compiled for a
Hopper GPU (sm_90) without one, as a GPU's first call compiles it: what the interpreter does not
see (the multi-block walk's reshape, the 16-bit P.V split's dots, the tile map's loads) must lower
and pass ptxas in every dtype and head grouping the models use."""

from __future__ import annotations

import pytest

from model_service.attention import cuda_attention

triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)


def compile_kernel(
    dtype: str, group: int, head_dim: int, window: bool, pv_split: bool, stages: int = 3
) -> str:
    act = f"*{dtype}"
    pointers = dict(q_ptr=act, k_cache_ptr=act, v_cache_ptr=act, out_ptr=act,
                    query_start_ptr="*i64", num_scheduled_ptr="*i64", context_lens_ptr="*i64",
                    block_tables_ptr="*i64", tile_seq_ptr="*i64", tile_row_ptr="*i64")  # fmt: skip
    scalars = dict(q_row_stride="i32", table_stride="i32", scale="fp32", window="i32")
    group_pad = 1 << (group - 1).bit_length()
    constexprs = dict(
        NUM_KV_HEADS=8, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, 1 << (head_dim - 1).bit_length()), BLOCK_SIZE=16,
        ROWS=cuda_attention.rows_per_tile(group), KV_BLOCKS=cuda_attention.KV_TILE_KEYS // 16,
        USE_WINDOW=window, QK_PRECISION="ieee" if dtype == "fp32" else "tf32",
        PV_SPLIT=pv_split, WALK_STAGES=stages,
    )  # fmt: skip
    # As a launch specializes them: torch's allocations (and the cache's layers) start 16-byte
    # aligned, and so does each row of q (its stride, hidden + 2 KV widths, a multiple of 16).
    aligned = [*pointers][:4] + ["q_row_stride"]
    names = [*pointers, *scalars]
    source = ASTSource(
        fn=cuda_attention._paged_attention_kernel,
        signature={**pointers, **scalars, **dict.fromkeys(constexprs, "constexpr")},
        constexprs=constexprs,
        attrs={(names.index(name),): [["tt.divisibility", 16]] for name in aligned},
    )
    compiled = triton.compile(source, target=HOPPER, options=dict(num_warps=4))
    assert compiled.asm["cubin"], "ptxas made no binary"
    return compiled.asm["ptx"]


@pytest.mark.parametrize("dtype, pv_split", [("bf16", True), ("fp16", True), ("fp32", False)])
@pytest.mark.parametrize("group, head_dim", [(3, 64), (4, 64), (4, 128), (1, 80)])
def test_the_kernel_compiles_for_hopper(dtype, pv_split, group, head_dim):
    ptx = compile_kernel(dtype, group, head_dim, window=False, pv_split=pv_split)
    if pv_split:  # P.V on the tensor cores: mma instructions in 16-bit operands
        assert "mma" in ptx
    # The walk over the keys is software-pipelined: the next steps' K and V are copied to shared
    # memory asynchronously while this one computes (Triton pipelines a counted loop, not a while).
    assert "cp.async" in ptx


def test_the_sliding_window_variant_compiles_for_hopper():
    assert "cp.async" in compile_kernel("bf16", 4, 128, window=True, pv_split=True)


def test_one_walk_stage_is_the_walk_unpipelined():
    """WALK_STAGES 1, which bench_cuda_forward times beside the default: each step's K and V are
    loaded when the walk gets there, as the while loop the walk was did."""
    assert "cp.async" not in compile_kernel("bf16", 4, 64, False, True, stages=1)
