"""The decoder's layers in one native call: the C contract (csrc/decoder.h) as Cython sees it."""
from libc.stdint cimport int64_t, uint8_t, uint16_t

from cython_ext.paged_attention cimport pa_args


cdef extern from "csrc/lora_rows.h" nogil:
    ctypedef struct lr_block:
        int64_t lora_id
        int64_t k0
        int64_t k1

    ctypedef struct lr_target:
        const uint16_t* packed_b
        int64_t k0
        int64_t k1
        int64_t start
        int64_t end
        int64_t num_blocks
        const lr_block* blocks
        const uint16_t* by_block

    ctypedef struct lr_module:
        const uint16_t* packed_a
        int64_t rank
        int64_t num_targets
        const lr_target* targets

    ctypedef struct lr_step:
        const int64_t* order
        const int64_t* groups
        int64_t num_groups
        const float* row_scale
        uint16_t* u
        int64_t ldu

    int lr_add(const lr_module* mod, const lr_step* step, const uint16_t* x, int64_t ldx, int64_t in_features,
               uint16_t* y, int64_t ldy, int isa, int num_threads)
    int lr_isa_supported(int isa)
    int64_t lr_by_block_size(const lr_target* target)
    int lr_regroup_b(const lr_target* target, uint16_t* out)


cdef extern from "csrc/decoder.h" nogil:
    ctypedef int (*dl_linear_bf16_fn)(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t,
                                      const uint16_t*, void*, int64_t, int, int, int)
    ctypedef int (*dl_linear_int8_fn)(const uint16_t*, int64_t, int64_t, const uint8_t*, int64_t, int64_t,
                                      const uint16_t*, void*, int64_t, int, int, int)
    ctypedef int (*dl_add_rms_norm_fn)(void*, const void*, const void*, void*, int64_t, int64_t, float, int, int, int)
    ctypedef int (*dl_rope_fn)(void*, int64_t, int64_t, int64_t, int64_t, const int64_t*, const float*, int64_t, int,
                               int, int)
    ctypedef int (*dl_silu_mul_fn)(const void*, void*, int64_t, int64_t, int, int, int)
    ctypedef int (*dl_attention_fn)(const pa_args*, int)
    ctypedef int (*dl_check_indices_fn)(const pa_args*)

    ctypedef struct dl_kernels:
        dl_linear_bf16_fn linear_bf16
        dl_linear_int8_fn linear_int8
        dl_add_rms_norm_fn add_rms_norm
        dl_rope_fn rope
        dl_silu_mul_fn silu_mul
        dl_attention_fn attention
        dl_check_indices_fn check_indices

    ctypedef struct dl_linear:
        const void* packed
        const uint16_t* bias
        int64_t n
        int64_t k
        int int8

    ctypedef struct dl_lora:
        const lr_module* modules
        lr_step step

    ctypedef struct dl_layer:
        const uint16_t* input_norm
        const uint16_t* post_attention_norm
        dl_linear qkv
        dl_linear o
        dl_linear gate_up
        dl_linear down
        void* k_cache
        void* v_cache

    ctypedef struct dl_model:
        int64_t num_layers
        int64_t hidden
        int64_t num_heads
        int64_t num_kv_heads
        int64_t head_dim
        int64_t intermediate
        float eps
        float scale
        const float* rope
        int64_t rope_rows
        int gemm_isa
        int layer_ops_isa
        int attention_isa
        const dl_layer* layers

    ctypedef struct dl_buffers:
        int64_t rows
        const int64_t* positions
        void* residual
        void* delta
        void* x
        void* qkv
        void* attn
        void* gate_up
        void* act
        const dl_lora* lora

    int dl_run_layers(const dl_kernels* kernels, const dl_model* model, const pa_args* step,
                      const dl_buffers* buffers, int num_threads, int* failed_op, int64_t* failed_layer)
