"""Small-batch GEMMs over prepacked weights: the C contract (csrc/gemm.h) as Cython sees it."""
from libc.stdint cimport int8_t, int64_t, uint8_t, uint16_t


cdef extern from "csrc/gemm.h" nogil:
    int64_t gm_packed_bf16_elems(int64_t n, int64_t k)
    int64_t gm_packed_int8_bytes(int64_t n, int64_t k)
    int gm_pack_bf16(const uint16_t* w, int64_t n, int64_t k, int64_t ldw, uint16_t* packed)
    int gm_unpack_bf16(const uint16_t* packed, int64_t n, int64_t k, uint16_t* w)
    int gm_gather_rows_bf16(const uint16_t* packed, int64_t n, int64_t k, const int64_t* ids, int64_t count, uint16_t* out)
    int gm_pack_int8(const int8_t* q, const float* scales, int64_t n, int64_t k, uint8_t* packed)
    int gm_linear_bf16(const uint16_t* x, int64_t rows, int64_t ldx, const uint16_t* packed, int64_t n, int64_t k,
                       const uint16_t* bias, void* out, int64_t ldo, int out_f32, int isa, int num_threads)
    int gm_linear_int8(const uint16_t* x, int64_t rows, int64_t ldx, const uint8_t* packed, int64_t n, int64_t k,
                       const uint16_t* bias, void* out, int64_t ldo, int out_f32, int isa, int num_threads)
    int gm_isa_supported(int isa)
    const char* gm_error_message(int code)
