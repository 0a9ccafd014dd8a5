// A step's decoder layers in one native call (the contract with cython_ext/decoder.pyx).
//
// The Python loop over the layers (model_service/models/llama.py) makes nine native calls a layer
// (add + RMSNorm, the QKV GEMM, RoPE, paged attention, the output GEMM, add + RMSNorm, the
// gate/up GEMM, SiLU x up, the down GEMM), each behind a Python wrapper that checks its tensors
// and allocates its output: a visible share of a decode step on two cores (docs/benchmarks.md,
// "Figures behind the code's comments"). dl_run_layers
// makes the same calls, in the same order, on the same kernels, into buffers allocated once per
// step: the same bits as the Python loop by construction (it computes nothing itself).
//
// The kernels are reached through function pointers that their own extensions hand out
// (cython_ext/gemm.pyx, layer_ops.pyx, paged_attention.pyx: `kernel_addresses()`), so there is one
// compiled copy of each kernel and one ISA choice per kernel, whichever loop calls it.
//
// Buffers (T token rows, bfloat16, dense rows):
//   residual [T, hidden]  the residual stream, updated in place layer by layer
//   delta    [T, hidden]  the last layer's MLP output on return (not yet added to residual)
//   x        [T, hidden]  a normed row, the GEMMs' input
//   qkv      [T, (H + 2 KVH) D], attn [T, H D], gate_up [T, 2 I], act [T, I]
//
// LoRA adapters (optional, dl_buffers.lora): after each fused linear (before RoPE for qkv), each
// row's own adapter's products added into its output (csrc/lora_rows.h: rows grouped by adapter,
// base rows skipped), in the bits of the packed GEMM over the stack of model_service/lora/stacked.py
// that the Python loop calls: the same bits as the Python loop.
#pragma once
#include <stdint.h>

#include "gemm.h"
#include "layer_ops.h"
#include "lora_rows.h"
#include "paged_attention.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef int (*dl_linear_bf16_fn)(const uint16_t* x, int64_t rows, int64_t ldx, const uint16_t* packed, int64_t n,
                                 int64_t k, const uint16_t* bias, void* out, int64_t ldo, int out_f32, int isa,
                                 int num_threads);
typedef int (*dl_linear_int8_fn)(const uint16_t* x, int64_t rows, int64_t ldx, const uint8_t* packed, int64_t n,
                                 int64_t k, const uint16_t* bias, void* out, int64_t ldo, int out_f32, int isa,
                                 int num_threads);
typedef int (*dl_add_rms_norm_fn)(void* residual, const void* delta, const void* weight, void* out, int64_t rows,
                                  int64_t hidden, float eps, int dtype, int isa, int num_threads);
typedef int (*dl_rope_fn)(void* x, int64_t rows, int64_t row_stride, int64_t num_heads, int64_t head_dim,
                          const int64_t* positions, const float* table, int64_t table_rows, int dtype, int isa,
                          int num_threads);
typedef int (*dl_silu_mul_fn)(const void* gate_up, void* out, int64_t rows, int64_t width, int dtype, int isa,
                              int num_threads);
typedef int (*dl_attention_fn)(const pa_args* a, int isa);
typedef int (*dl_check_indices_fn)(const pa_args* a);

typedef struct dl_kernels {
    dl_linear_bf16_fn linear_bf16;
    dl_linear_int8_fn linear_int8;
    dl_add_rms_norm_fn add_rms_norm;
    dl_rope_fn rope;
    dl_silu_mul_fn silu_mul;
    dl_attention_fn attention;
    dl_check_indices_fn check_indices;
} dl_kernels;

// A packed linear layer (model_service/kernels/gemm.py's PackedLinear): out [T, n] = x [T, k] @ W^T + bias.
typedef struct dl_linear {
    const void* packed;
    const uint16_t* bias;  // NULL: none
    int64_t n, k;
    int int8;  // packed by gm_pack_int8 (else gm_pack_bf16)
} dl_linear;

// A step's adapters: the modules of every layer ([num_layers][4]: qkv, o, gate_up, down) and the
// step's rows by adapter (with the u scratch buffer).
typedef struct dl_lora {
    const lr_module* modules;
    lr_step step;
} dl_lora;

typedef struct dl_layer {
    const uint16_t* input_norm;           // [hidden]
    const uint16_t* post_attention_norm;  // [hidden]
    dl_linear qkv, o, gate_up, down;
    void* k_cache;  // [NB, KVH, BS, D] of this layer
    void* v_cache;
} dl_layer;

typedef struct dl_model {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps;          // RMSNorm's
    float scale;        // attention's, head_dim ** -0.5
    const float* rope;  // [rope_rows, head_dim] float32 cos | sin
    int64_t rope_rows;
    int gemm_isa, layer_ops_isa, attention_isa;  // each kernel's own ISA index
    const dl_layer* layers;
} dl_model;

typedef struct dl_buffers {
    int64_t rows;  // T
    const int64_t* positions;  // [T]
    void* residual;
    void* delta;
    void* x;
    void* qkv;
    void* attn;
    void* gate_up;
    void* act;
    const dl_lora* lora;  // NULL: no adapter in this step
} dl_buffers;

// Which call failed (dl_run_layers' *failed_op), for the error message.
enum dl_op {
    DL_OP_NONE = 0, DL_OP_CHECK_INDICES, DL_OP_INPUT_NORM, DL_OP_QKV, DL_OP_ROPE, DL_OP_ATTENTION, DL_OP_O,
    DL_OP_POST_NORM, DL_OP_GATE_UP, DL_OP_SILU_MUL, DL_OP_DOWN, DL_OP_LORA
};

// Runs every layer; `step` holds the step's attention indices (slot_mapping .. block_tables,
// num_tokens, num_seqs, max_blocks_per_seq, block_size, num_blocks, split_positions); the rest of
// its fields are filled per layer. 0 on success, else the failing kernel's own error code, with
// *failed_op and *failed_layer saying where.
int dl_run_layers(const dl_kernels* kernels, const dl_model* model, const pa_args* step, const dl_buffers* buffers,
                  int num_threads, int* failed_op, int64_t* failed_layer);

#ifdef __cplusplus
}
#endif
