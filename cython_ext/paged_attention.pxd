"""Paged attention kernel: the C contract (csrc/paged_attention.h) as Cython sees it.

paged_attention.pyx wraps it for Python (paged_attention.pyi is the Python view); the tensor
layouts are drawn in csrc/paged_attention.h and in model_service/attention/paged.py.
"""
from libc.stdint cimport int64_t


cdef extern from "csrc/paged_attention.h" nogil:
    ctypedef struct pa_args:
        const void* q
        const void* k_new
        const void* v_new
        void* k_cache
        void* v_cache
        void* out
        const int64_t* slot_mapping
        const int64_t* query_start
        const int64_t* num_scheduled
        const int64_t* context_lens
        const int64_t* block_tables
        int64_t q_row_stride
        int64_t k_new_row_stride
        int64_t v_new_row_stride
        int64_t num_tokens
        int64_t num_seqs
        int64_t num_heads
        int64_t num_kv_heads
        int64_t head_dim
        int64_t block_size
        int64_t num_blocks
        int64_t max_blocks_per_seq
        int64_t split_positions
        float scale
        int dtype
        int num_threads

    int pa_paged_attention(const pa_args* a, int isa)
    int pa_check_indices(const pa_args* a)
    const char* pa_error_message(int code)
    int pa_isa_supported(int isa)


cdef class AttentionStep:
    cdef pa_args args
    cdef int64_t checked_blocks      # the cache shape the indices were checked against (-1: none)
    cdef int64_t checked_block_size
    cdef object _keep  # the index arrays whose memory args points into
