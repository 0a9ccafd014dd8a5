// Row-wise layer operations of the decoder (the contract; layer_ops_impl.h holds the arithmetic).
//
// Every operation works on packed token rows [T, width] in float32 or bfloat16 and computes each
// row by itself, in a fixed order, with the same code whatever T is: a row's bits never depend on
// the other rows of the step (the batch-invariance rule), and a prompt row computes exactly as a
// decode row. Arithmetic is float32; bfloat16 results are rounded to nearest even once where
// noted. Built once per ISA path (portable, AVX2, AVX-512; same source, different vector widths,
// -ffp-contract=off so no path fuses a multiply-add the others round twice... see setup.py), chosen
// at run time.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum lo_dtype { LO_FLOAT32 = 0, LO_BFLOAT16 = 1 };
enum lo_isa { LO_ISA_PORTABLE = 0, LO_ISA_AVX2 = 1, LO_ISA_AVX512 = 2 };
enum lo_error { LO_OK = 0, LO_BAD_SHAPE = 1, LO_BAD_POSITION = 2, LO_ISA_UNAVAILABLE = 3 };

// residual[r] += delta[r] (rounded to the dtype; skipped when delta is NULL), then
// out[r] = weight * round(residual[r] / sqrt(mean(residual[r]^2) + eps)), rounded: Hugging Face's
// LlamaRMSNorm, with the residual add before it folded in.
int lo_add_rms_norm(void* residual, const void* delta, const void* weight, void* out, int64_t rows, int64_t hidden,
                    float eps, int dtype, int isa, int num_threads);

// Rotate-half RoPE in place on the first num_heads heads of each row of x (rows row_stride
// elements apart, heads head_dim apart): with c, s = table[positions[r], :D/2], table[.., D/2:],
//     x1' = x1 * c - x2 * s,   x2' = x2 * c + x1 * s      (x1, x2 the two halves of a head)
// each product rounded to float32 before the sum, as torch's eager `x*cos + rotate_half(x)*sin`.
int lo_rope(void* x, int64_t rows, int64_t row_stride, int64_t num_heads, int64_t head_dim, const int64_t* positions,
            const float* table, int64_t table_rows, int dtype, int isa, int num_threads);

// out[r, i] = silu(gate_up[r, i]) * gate_up[r, width + i] for i < width, rounded once.
int lo_silu_mul(const void* gate_up, void* out, int64_t rows, int64_t width, int dtype, int isa, int num_threads);

int lo_isa_supported(int isa);
const char* lo_error_message(int code);

#ifdef __cplusplus
}
#endif
