// The per-row LoRA products' scaled add in AVX-512 (both AVX-512 paths): y = bf16(y + d * scale)
// for up to 16 columns, the product rounded to float32 before the sum, the sum rounded to nearest
// even as bf16.h's f32_to_bf16 (NaN kept, quiet): the scalar add's bits, 16 at a time.
#include <immintrin.h>
#include <stdint.h>

namespace LR_NS {

static inline void add_scaled(const float* d, float scale, uint16_t* y, int n) {
    const __mmask16 mask = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
    const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, y)), 16);
    const __m512 product = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, d), _mm512_set1_ps(scale));
    const __m512i sum = _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(wide), product));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(sum, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(sum, _mm512_set1_epi32(0x7FFF)), odd), 16);
    const __m512i magnitude = _mm512_and_si512(sum, _mm512_set1_epi32(0x7FFFFFFF));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7F800000));
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(sum, 16), _mm512_set1_epi32(0x40));
    _mm256_mask_storeu_epi16(y, mask, _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet)));
}

}  // namespace LR_NS
