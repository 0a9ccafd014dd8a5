// The GEMMs' AVX512-BF16 path (Intel Cooper Lake / Sapphire Rapids and later, AMD Zen 4 and later):
// bf16, one VDPBF16PS per pair of input columns and 16 output columns; int8, one VPDPWSSD per pair
// of input columns and 16 output columns. Built with -mavx512bf16 -mavx512vnni (setup.py).
#include <immintrin.h>
#include <string.h>

#include "gemm.h"

#define GM_NS planserve_gm_avx512_bf16
#define GM_ENTRY(name) gm_##name##_avx512_bf16

namespace GM_NS {

using XT = uint16_t;  // the tiles read x as given: VDPBF16PS takes bfloat16 pairs

static inline __m512bh broadcast_pair(const uint16_t* a) {
    int32_t pair;
    memcpy(&pair, a, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(pair);
}

static inline __m512 bf16_to_f32(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// Prefetch distance in pairs, in each panel's stream: 16 pairs = 1 KiB ahead. A tile of 4 rows or
// more spends long enough on a pair that 16 pairs ahead is too close for memory to answer, so it
// asks 48 ahead (decode at 16 rows: ~4% less GEMM time); for fewer rows the hardware prefetcher
// keeps up and farther software prefetches only cost (one row: ~6% more at 48).
template <int MR>
constexpr int64_t kAhead = MR >= 4 ? 48 : 16;

template <int MR, int NR>
static inline void store(__m512 (&acc)[MR][NR], const uint16_t* bias, void* c, int64_t ldc, int cols, int f32) {
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
        const int valid = cols - j * GM_PANEL;
        if (valid <= 0) break;
        const __mmask16 mask = valid >= GM_PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
        const __m512 add = bias ? bf16_to_f32(_mm256_maskz_loadu_epi16(mask, bias + j * GM_PANEL)) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
            const __m512 v = bias ? _mm512_add_ps(acc[i][j], add) : acc[i][j];
            if (f32)
                _mm512_mask_storeu_ps((float*)c + i * ldc + j * GM_PANEL, mask, v);
            else
                _mm256_mask_storeu_epi16((uint16_t*)c + i * ldc + j * GM_PANEL, mask, (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

template <int MR, int NR>
void tile(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t panel_stride, int64_t pairs, const uint16_t* bias,
          void* c, int64_t ldc, int cols, int f32) {
    __m512 acc[MR][NR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
        __m512bh w[NR];
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) {
            const uint16_t* line = b + j * panel_stride + p * 2 * GM_PANEL;
            _mm_prefetch((const char*)(line + kAhead<MR> * 2 * GM_PANEL), _MM_HINT_T0);
            w[j] = (__m512bh)_mm512_loadu_si512(line);
        }
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
            const __m512bh x = broadcast_pair(a + i * lda + 2 * p);
#pragma GCC unroll 4
            for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], x, w[j]);
        }
    }
    store<MR, NR>(acc, bias, c, ldc, cols, f32);
}

// One row of x -> per block of 32: d = max|x| / 32767 and int16 q = rne(x * (32767 / max|x|)).
void quantize_row(const uint16_t* x, int64_t k, int16_t* xq, float* xd) {
    const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    for (int64_t blk = 0; blk < k / GM_INT8_BLOCK; ++blk) {
        const __m512 lo = bf16_to_f32(_mm256_loadu_si256((const __m256i*)(x + blk * GM_INT8_BLOCK)));
        const __m512 hi = bf16_to_f32(_mm256_loadu_si256((const __m256i*)(x + blk * GM_INT8_BLOCK + 16)));
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(lo, magnitude), _mm512_and_ps(hi, magnitude)));
        xd[blk] = amax / 32767.0f;
        const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
        // MXCSR rounding: nearest even. |q| <= 32767 by construction.
        _mm256_storeu_si256((__m256i*)(xq + blk * GM_INT8_BLOCK), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse))));
        _mm256_storeu_si256((__m256i*)(xq + blk * GM_INT8_BLOCK + 16),
                            _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse))));
    }
}

// MR quantized rows x NR int8 panels (gemm.h): per block, each (row, panel) dot product exact in
// int32 (int8 weights widened to int16, one VPDPWSSD per pair of input columns), then folded into
// the float32 sum with the two scales.
template <int MR, int NR>
void tile_q8(const int16_t* xq, int64_t ldq, const float* xd, int64_t ldd, const uint8_t* b, int64_t panel_bytes,
             int64_t blocks, const uint16_t* bias, void* c, int64_t ldc, int cols, int f32) {
    __m512 acc[MR][NR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < blocks; ++blk) {
        const uint8_t* block = b + blk * GM_INT8_PANEL_BLOCK_BYTES;
        __m512i dot[MR][NR];
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
            for (int j = 0; j < NR; ++j) dot[i][j] = _mm512_setzero_si512();
#pragma GCC unroll 16
        for (int p = 0; p < GM_INT8_BLOCK / 2; ++p) {
            __m512i w[NR];
#pragma GCC unroll 4
            for (int j = 0; j < NR; ++j) {
                if (p % 2 == 0) {  // the block two ahead, a line every other pair (its 9 lines over 16 pairs)
                    const char* ahead = (const char*)(block + j * panel_bytes + 2 * GM_INT8_PANEL_BLOCK_BYTES);
                    _mm_prefetch(ahead + p * 32, _MM_HINT_T0);
                    if (p == 0) _mm_prefetch(ahead + 512, _MM_HINT_T0);
                }
                w[j] = _mm512_cvtepi8_epi16(
                    _mm256_loadu_si256((const __m256i*)(block + j * panel_bytes + GM_PANEL * 4 + p * 2 * GM_PANEL)));
            }
#pragma GCC unroll 8
            for (int i = 0; i < MR; ++i) {
                int32_t two;
                memcpy(&two, xq + i * ldq + blk * GM_INT8_BLOCK + 2 * p, sizeof two);
                const __m512i x = _mm512_set1_epi32(two);
#pragma GCC unroll 4
                for (int j = 0; j < NR; ++j) dot[i][j] = _mm512_dpwssd_epi32(dot[i][j], x, w[j]);
            }
        }
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) {
            const __m512 dw = _mm512_loadu_ps((const float*)(block + j * panel_bytes));
#pragma GCC unroll 8
            for (int i = 0; i < MR; ++i) {
                const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(xd[i * ldd + blk]), dw);
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][j]), scale, acc[i][j]);
            }
        }
    }
    store<MR, NR>(acc, bias, c, ldc, cols, f32);
}

}  // namespace GM_NS

#include "gemm_driver.h"
