"""Row-wise layer operations: the C contract (csrc/layer_ops.h) as Cython sees it."""
from libc.stdint cimport int64_t


cdef extern from "csrc/layer_ops.h" nogil:
    int lo_add_rms_norm(void* residual, const void* delta, const void* weight, void* out, int64_t rows, int64_t hidden,
                        float eps, int dtype, int isa, int num_threads)
    int lo_rope(void* x, int64_t rows, int64_t row_stride, int64_t num_heads, int64_t head_dim, const int64_t* positions,
                const float* table, int64_t table_rows, int dtype, int isa, int num_threads)
    int lo_silu_mul(const void* gate_up, void* out, int64_t rows, int64_t width, int dtype, int isa, int num_threads)
    int lo_isa_supported(int isa)
    const char* lo_error_message(int code)
