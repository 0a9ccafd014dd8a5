// The per-row LoRA products' AVX-512 path without BF16: lora_rows_vec_impl.h at 64-byte vectors,
// the GEMM's AVX-512 arithmetic (gemm_avx512.cpp). Built with -mavx512f/bw/vl/dq -mfma (setup.py).
#include <immintrin.h>
#include <stdint.h>

#define GM_VEC_BYTES 64
#define LR_NS planserve_lr_avx512
#define LR_ENTRY lr_add_avx512
#define LR_MR 4
#define LR_NR 4

namespace LR_NS {
typedef float vf __attribute__((vector_size(GM_VEC_BYTES)));
typedef uint32_t vu __attribute__((vector_size(GM_VEC_BYTES)));
static inline vf splat(float s) { return (vf)_mm512_set1_ps(s); }
static inline vf fmadd(vf a, vf b, vf c) { return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
}  // namespace LR_NS

#define LR_VECTOR_ADD 1
#include "lora_rows_avx512_add.h"
#include "lora_rows_vec_impl.h"
