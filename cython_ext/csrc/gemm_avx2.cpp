// The GEMMs' AVX2 path (x86-64 with AVX2 and FMA, no AVX-512: AMD Zen 2/3, Intel Haswell to Comet
// Lake): gemm_vec_impl.h at 32-byte vectors, built with -mavx2 -mfma (setup.py). 16 ymm registers:
// bf16 tiles of 4 rows x 1 panel (8 sums, 4 widened weight vectors, 2 broadcasts), int8 tiles of
// 3 rows x 1 panel (6 sums, 6 integer dots, 2 weight vectors, a broadcast).
#include <immintrin.h>
#include <stdint.h>

#define GM_VEC_BYTES 32
#define GM_NS planserve_gm_avx2
#define GM_ENTRY(name) gm_##name##_avx2
#define GM_TILE_MR 4
#define GM_TILE_NR 1
#define GM_Q8_MR 3
#define GM_Q8_NR 1

namespace GM_NS {
typedef float vf __attribute__((vector_size(GM_VEC_BYTES)));
typedef int32_t vi __attribute__((vector_size(GM_VEC_BYTES)));
typedef uint32_t vu __attribute__((vector_size(GM_VEC_BYTES)));

static inline vf splat(float s) { return (vf)_mm256_set1_ps(s); }
static inline vi splat_i(int32_t s) { return (vi)_mm256_set1_epi32(s); }
static inline vf fmadd(vf a, vf b, vf c) { return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
// int16 pairs: lane l = x[2l] * w[2l] + x[2l + 1] * w[2l + 1], exact in int32.
static inline vi madd_pairs(vi x, vi w) { return (vi)_mm256_madd_epi16((__m256i)x, (__m256i)w); }
// 16 int8 -> 16 int16 (8 columns' pairs).
static inline vi widen_i8(const uint8_t* p) { return (vi)_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p)); }
}  // namespace GM_NS

#include "gemm_vec_impl.h"
