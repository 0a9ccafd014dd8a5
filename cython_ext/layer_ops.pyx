"""Row-wise layer operations of the decoder (contract: layer_ops.pxd, csrc/layer_ops.h).

Tensors cross as raw addresses, as in paged_attention.pyx (torch stays out of this module);
model_service/kernels/layer_ops.py checks dtypes, shapes and contiguity before handing addresses over.
Each call releases the GIL. Errors come back as ValueError with the C side's message.
"""
from libc.stdint cimport int64_t, uintptr_t

ISAS = ("portable", "avx2", "avx512")  # lo_isa order: by preference
DTYPES = ("float32", "bfloat16")


def isa_supported(str name) -> bool:
    """Whether this build has ISA path `name` (one of ISAS) and this CPU runs it."""
    return lo_isa_supported(ISAS.index(name)) == 1


def best_isa() -> str:
    """The fastest path this build and CPU support."""
    for name in reversed(ISAS):
        if isa_supported(name):
            return name
    return "portable"


cdef _check(int code, str op):
    if code != 0:
        raise ValueError(f"{op}: {lo_error_message(code).decode()}")


def kernel_addresses() -> dict:
    """The operations' entry points' addresses, for the native decoder loop (cython_ext/decoder.pyx)."""
    return {"add_rms_norm": <uintptr_t>&lo_add_rms_norm, "rope": <uintptr_t>&lo_rope,
            "silu_mul": <uintptr_t>&lo_silu_mul}


def error_message(int code) -> str:
    return lo_error_message(code).decode()


def add_rms_norm(uintptr_t residual, uintptr_t delta, uintptr_t weight, uintptr_t out, int64_t rows, int64_t hidden,
                 float eps, int dtype, int isa, int num_threads) -> None:
    """residual [rows, hidden] += delta (0: no add), then out = RMSNorm(residual) * weight."""
    cdef int code
    with nogil:
        code = lo_add_rms_norm(<void*>residual, <const void*>delta if delta else NULL, <const void*>weight, <void*>out,
                               rows, hidden, eps, dtype, isa, num_threads)
    _check(code, "add_rms_norm")


def rope(uintptr_t x, int64_t rows, int64_t row_stride, int64_t num_heads, int64_t head_dim, uintptr_t positions,
         uintptr_t table, int64_t table_rows, int dtype, int isa, int num_threads) -> None:
    """Rotate-half RoPE in place on the first num_heads heads of x's rows (int64 positions [rows],
    float32 table [table_rows, head_dim]: cos then sin of each position's frequencies)."""
    cdef int code
    with nogil:
        code = lo_rope(<void*>x, rows, row_stride, num_heads, head_dim, <const int64_t*>positions, <const float*>table,
                       table_rows, dtype, isa, num_threads)
    _check(code, "rope")


def silu_mul(uintptr_t gate_up, uintptr_t out, int64_t rows, int64_t width, int dtype, int isa, int num_threads) -> None:
    """out [rows, width] = silu(gate_up[:, :width]) * gate_up[:, width:]."""
    cdef int code
    with nogil:
        code = lo_silu_mul(<const void*>gate_up, <void*>out, rows, width, dtype, isa, num_threads)
    _check(code, "silu_mul")
