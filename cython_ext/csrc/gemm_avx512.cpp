// The GEMMs' AVX-512 path without BF16 (Intel Skylake-SP to Ice Lake, and AVX-512 CPUs run with it
// forced): gemm_vec_impl.h at 64-byte vectors, built with -mavx512f/bw/vl/dq -mfma (setup.py).
// 32 zmm registers, one vector per panel: bf16 tiles of 6 rows x 2 panels (12 sums, 4 widened
// weight vectors, 2 broadcasts), int8 tiles of 6 x 2 (12 sums, 12 integer dots, 2 weights).
#include <immintrin.h>
#include <stdint.h>

#define GM_VEC_BYTES 64
#define GM_NS planserve_gm_avx512
#define GM_ENTRY(name) gm_##name##_avx512
#define GM_TILE_MR 6
#define GM_TILE_NR 2
#define GM_Q8_MR 6
#define GM_Q8_NR 2

namespace GM_NS {
typedef float vf __attribute__((vector_size(GM_VEC_BYTES)));
typedef int32_t vi __attribute__((vector_size(GM_VEC_BYTES)));
typedef uint32_t vu __attribute__((vector_size(GM_VEC_BYTES)));

static inline vf splat(float s) { return (vf)_mm512_set1_ps(s); }
static inline vi splat_i(int32_t s) { return (vi)_mm512_set1_epi32(s); }
static inline vf fmadd(vf a, vf b, vf c) { return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
// int16 pairs: lane l = x[2l] * w[2l] + x[2l + 1] * w[2l + 1], exact in int32 (AVX-512BW).
static inline vi madd_pairs(vi x, vi w) { return (vi)_mm512_madd_epi16((__m512i)x, (__m512i)w); }
// 32 int8 -> 32 int16 (16 columns' pairs).
static inline vi widen_i8(const uint8_t* p) { return (vi)_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p)); }
}  // namespace GM_NS

#include "gemm_vec_impl.h"
