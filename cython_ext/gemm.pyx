"""Small-batch GEMMs over prepacked weights (contract: gemm.pxd, csrc/gemm.h).

Tensors cross as raw addresses, as in layer_ops.pyx (torch stays out of this module);
model_service/kernels/gemm.py checks dtypes, shapes and contiguity before handing addresses over.
Each call releases the GIL. Errors come back as ValueError with the C side's message.
"""
from libc.stdint cimport int8_t, int64_t, uint8_t, uint16_t, uintptr_t

ISAS = ("portable", "avx512_bf16", "avx2", "avx512")  # gm_isa order
TORCH_PATH = "torch"


def isa_supported(str name) -> bool:
    """Whether this build has ISA path `name` (one of ISAS) and this CPU runs it."""
    return gm_isa_supported(ISAS.index(name)) == 1


FASTEST_FIRST = ("avx512_bf16", "avx512", "avx2")


def best_isa() -> str:
    """The fastest path here (docs/benchmarks.md): AVX512-BF16, else AVX-512F, else AVX2+FMA, else
    torch's own GEMM (the portable loop is for checks: slower than torch's)."""
    for name in FASTEST_FIRST:
        if isa_supported(name):
            return name
    return TORCH_PATH


cdef _check(int code, str op):
    if code != 0:
        raise ValueError(f"{op}: {gm_error_message(code).decode()}")


def kernel_addresses() -> dict:
    """The GEMM entry points' addresses, for the native decoder loop (cython_ext/decoder.pyx):
    one compiled copy of each kernel, whichever loop calls it."""
    return {"linear_bf16": <uintptr_t>&gm_linear_bf16, "linear_int8": <uintptr_t>&gm_linear_int8}


def error_message(int code) -> str:
    return gm_error_message(code).decode()


def packed_bf16_elems(int64_t n, int64_t k) -> int:
    return gm_packed_bf16_elems(n, k)


def packed_int8_bytes(int64_t n, int64_t k) -> int:
    return gm_packed_int8_bytes(n, k)


def pack_bf16(uintptr_t w, int64_t n, int64_t k, int64_t ldw, uintptr_t packed) -> None:
    """bfloat16 w [n, k] (row stride ldw) -> packed (packed_bf16_elems(n, k) elements)."""
    cdef int code
    with nogil:
        code = gm_pack_bf16(<const uint16_t*>w, n, k, ldw, <uint16_t*>packed)
    _check(code, "pack_bf16")


def unpack_bf16(uintptr_t packed, int64_t n, int64_t k, uintptr_t w) -> None:
    """packed -> dense bfloat16 w [n, k]."""
    cdef int code
    with nogil:
        code = gm_unpack_bf16(<const uint16_t*>packed, n, k, <uint16_t*>w)
    _check(code, "unpack_bf16")


def gather_rows_bf16(uintptr_t packed, int64_t n, int64_t k, uintptr_t ids, int64_t count, uintptr_t out) -> None:
    """Rows ids (int64 [count]) of a packed bfloat16 [n, k] weight -> dense out [count, k]."""
    cdef int code
    with nogil:
        code = gm_gather_rows_bf16(<const uint16_t*>packed, n, k, <const int64_t*>ids, count, <uint16_t*>out)
    _check(code, "gather_rows_bf16")


def pack_int8(uintptr_t q, uintptr_t scales, int64_t n, int64_t k, uintptr_t packed) -> None:
    """int8 q [n, k] and float32 scales [n, k / 32] -> packed (packed_int8_bytes(n, k) bytes)."""
    cdef int code
    with nogil:
        code = gm_pack_int8(<const int8_t*>q, <const float*>scales, n, k, <uint8_t*>packed)
    _check(code, "pack_int8")


def linear_bf16(uintptr_t x, int64_t rows, int64_t ldx, uintptr_t packed, int64_t n, int64_t k, uintptr_t bias,
                uintptr_t out, int64_t ldo, bint out_f32, int isa, int num_threads) -> None:
    """out [rows, n] = x [rows, k] @ W^T (+ bias [n]; 0: none), W packed by pack_bf16; out bfloat16, or
    float32 (the sums unrounded) with out_f32."""
    cdef int code
    with nogil:
        code = gm_linear_bf16(<const uint16_t*>x, rows, ldx, <const uint16_t*>packed, n, k,
                              <const uint16_t*>bias if bias else NULL, <void*>out, ldo, out_f32, isa, num_threads)
    _check(code, "linear_bf16")


def linear_int8(uintptr_t x, int64_t rows, int64_t ldx, uintptr_t packed, int64_t n, int64_t k, uintptr_t bias,
                uintptr_t out, int64_t ldo, bint out_f32, int isa, int num_threads) -> None:
    """As linear_bf16 with W packed by pack_int8."""
    cdef int code
    with nogil:
        code = gm_linear_int8(<const uint16_t*>x, rows, ldx, <const uint8_t*>packed, n, k,
                              <const uint16_t*>bias if bias else NULL, <void*>out, ldo, out_f32, isa, num_threads)
    _check(code, "linear_int8")
