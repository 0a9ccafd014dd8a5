// The per-row LoRA products' AVX2 path: lora_rows_vec_impl.h at 32-byte vectors, the GEMM's AVX2
// arithmetic (gemm_avx2.cpp). 16 ymm registers: tiles of 2 rows x 2 panels (8 sums, 8 widened
// weight vectors). Built with -mavx2 -mfma (setup.py).
#include <immintrin.h>
#include <stdint.h>

#define GM_VEC_BYTES 32
#define LR_NS planserve_lr_avx2
#define LR_ENTRY lr_add_avx2
#define LR_MR 2
#define LR_NR 2

namespace LR_NS {
typedef float vf __attribute__((vector_size(GM_VEC_BYTES)));
typedef uint32_t vu __attribute__((vector_size(GM_VEC_BYTES)));
static inline vf splat(float s) { return (vf)_mm256_set1_ps(s); }
static inline vf fmadd(vf a, vf b, vf c) { return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
}  // namespace LR_NS

#include "lora_rows_vec_impl.h"
