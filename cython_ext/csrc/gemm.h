// Small-batch GEMMs over prepacked weights (the contract; gemm_driver.h holds the loop nest).
//
// out[r, :] = x[r, :] @ W^T (+ bias), x and out bfloat16, W prepacked once at load. Every output
// element is one float32 sum over the input columns in a fixed order (pairs of columns, first to
// last), started from zero and rounded to bfloat16 once at the end: whatever the row count, the
// tile shape or the thread split, a row's bits are the same (the batch-invariance rule), so one
// path serves a decode row alone and 2,048 prompt rows.
//
// Packed layout: the output columns in panels of GM_PANEL (16), each panel the input columns in
// pairs: packed[panel][pair][column][2], zero-filled past N and K. One 64-byte line is one pair of
// one panel: the operand of one AVX512-BF16 dot-product instruction.
//
// int8 (quant.py's blocks of 32 input columns, one scale per block and output row): each row of
// x is quantized per block of 32 to int16 (d = max|x| / 32767, q = x * (32767 / max|x|) rounded to
// nearest even: 15 bits, finer than bf16's 8, so the weights' rounding is all int8 adds), the
// block's dot product is exact in int32 (VPDPWSSD on int8 weights widened to int16), and
// out = sum over blocks in order of fma(dot, d_x * d_w, out) in float32, rounded to bfloat16 once.
// Row-local again: batch-invariant. Packed per panel and block: the 16 columns' scales (float32),
// then 16 pairs of input columns x 16 columns x 2 int8 values.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GM_PANEL 16
#define GM_INT8_BLOCK 32
// One panel's block of int8: 16 float32 scales, then 32 x 16 int8 values.
#define GM_INT8_PANEL_BLOCK_BYTES (GM_PANEL * 4 + GM_INT8_BLOCK * GM_PANEL)

// The ISA paths (cython_ext/gemm.pyx's ISAS in this order). AVX2 and AVX512 widen bf16 weights to
// float32 in registers and multiply with FMA (gemm_vec_impl.h); each path has its own summation
// order, the same for every row count.
enum gm_isa { GM_ISA_PORTABLE = 0, GM_ISA_AVX512_BF16 = 1, GM_ISA_AVX2 = 2, GM_ISA_AVX512 = 3 };
enum gm_error { GM_OK = 0, GM_BAD_SHAPE = 1, GM_ISA_UNAVAILABLE = 2, GM_BAD_ROW = 3 };

// Elements of the packed bfloat16 weight (uint16) for an [n, k] matrix.
int64_t gm_packed_bf16_elems(int64_t n, int64_t k);
// Bytes of the packed int8 weight for an [n, k] matrix (k a multiple of GM_INT8_BLOCK).
int64_t gm_packed_int8_bytes(int64_t n, int64_t k);

// w [n, k] bfloat16 (row stride ldw) -> packed; and back (unpack: w dense [n, k]).
int gm_pack_bf16(const uint16_t* w, int64_t n, int64_t k, int64_t ldw, uint16_t* packed);
int gm_unpack_bf16(const uint16_t* packed, int64_t n, int64_t k, uint16_t* w);
// Rows ids[0..count) of the packed bf16 weight, dense, into out [count, k]: the embedding lookup of
// a tied lm_head, so the model keeps one copy of the matrix.
int gm_gather_rows_bf16(const uint16_t* packed, int64_t n, int64_t k, const int64_t* ids, int64_t count, uint16_t* out);
// q [n, k] int8 and scales [n, k / GM_INT8_BLOCK] float32 -> packed.
int gm_pack_int8(const int8_t* q, const float* scales, int64_t n, int64_t k, uint8_t* packed);

// out [rows, n] (row stride ldo) = x [rows, k] (row stride ldx) @ W^T + bias [n] (NULL: none); out is
// bfloat16, or float32 with out_f32 (the float32 sums unrounded: lm_head's logits).
int gm_linear_bf16(const uint16_t* x, int64_t rows, int64_t ldx, const uint16_t* packed, int64_t n, int64_t k,
                   const uint16_t* bias, void* out, int64_t ldo, int out_f32, int isa, int num_threads);
int gm_linear_int8(const uint16_t* x, int64_t rows, int64_t ldx, const uint8_t* packed, int64_t n, int64_t k,
                   const uint16_t* bias, void* out, int64_t ldo, int out_f32, int isa, int num_threads);

int gm_isa_supported(int isa);
const char* gm_error_message(int code);

#ifdef __cplusplus
}
#endif
