// The GEMMs' AVX512-BF16 path (Intel Cooper Lake / Sapphire Rapids and later, AMD Zen 4 and later):
// one VDPBF16PS per pair of input columns and 16 output columns, built with -mavx512bf16 (setup.py).
#include <immintrin.h>
#include <string.h>

#include "gemm.h"

#define GM_NS planserve_gm_avx512_bf16
#define GM_ENTRY(name) gm_##name##_avx512_bf16

namespace GM_NS {

static inline __m512bh broadcast_pair(const uint16_t* a) {
    int32_t pair;
    memcpy(&pair, a, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(pair);
}

static inline __m512 bf16_to_f32(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// Prefetch distance in pairs: 16 pairs = 1 KiB ahead in each panel's stream.
constexpr int64_t kAhead = 16;

template <int MR, int NR>
static inline void store(__m512 (&acc)[MR][NR], const uint16_t* bias, uint16_t* c, int64_t ldc, int cols) {
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
        const int valid = cols - j * GM_PANEL;
        if (valid <= 0) break;
        const __mmask16 mask = valid >= GM_PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
        const __m512 add = bias ? bf16_to_f32(_mm256_maskz_loadu_epi16(mask, bias + j * GM_PANEL)) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
            const __m512 v = bias ? _mm512_add_ps(acc[i][j], add) : acc[i][j];
            _mm256_mask_storeu_epi16(c + i * ldc + j * GM_PANEL, mask, (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

template <int MR, int NR>
void tile(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t panel_stride, int64_t pairs, const uint16_t* bias,
          uint16_t* c, int64_t ldc, int cols) {
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
            _mm_prefetch((const char*)(line + kAhead * 2 * GM_PANEL), _MM_HINT_T0);
            w[j] = (__m512bh)_mm512_loadu_si512(line);
        }
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
            const __m512bh x = broadcast_pair(a + i * lda + 2 * p);
#pragma GCC unroll 4
            for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], x, w[j]);
        }
    }
    store<MR, NR>(acc, bias, c, ldc, cols);
}

// One pair of one int8 panel block (gemm.h) as bfloat16: q * scale, exact in float32, rounded once.
static inline __m512bh dequant_pair(const float* scales, const int8_t* q) {
    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q))),
                                    _mm512_loadu_ps(scales));
    const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 16)))),
                                    _mm512_loadu_ps(scales + 16));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

constexpr int64_t kInt8BlockBytes = 2 * GM_PANEL * sizeof(float) + GM_INT8_BLOCK * GM_PANEL;

// tile() over int8 panels (panel_bytes apart), each pair dequantized in registers as it is used:
// the same bfloat16 weights as dequant_panel(), so the same sums.
template <int MR, int NR>
void tile_int8(const uint16_t* a, int64_t lda, const uint8_t* b, int64_t panel_bytes, int64_t blocks, const uint16_t* bias,
               uint16_t* c, int64_t ldc, int cols) {
    __m512 acc[MR][NR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < blocks; ++blk) {
        const uint8_t* block = b + blk * kInt8BlockBytes;
        for (int p = 0; p < GM_INT8_BLOCK / 2; ++p) {
            __m512bh w[NR];
#pragma GCC unroll 4
            for (int j = 0; j < NR; ++j) {
                const uint8_t* panel = block + j * panel_bytes;
                const int8_t* q = (const int8_t*)(panel + 2 * GM_PANEL * sizeof(float)) + p * 2 * GM_PANEL;
                if (p % 2 == 0) _mm_prefetch((const char*)(q + 16 * 2 * GM_PANEL), _MM_HINT_T0);
                w[j] = dequant_pair((const float*)panel, q);
            }
            const int64_t pair = blk * (GM_INT8_BLOCK / 2) + p;
#pragma GCC unroll 8
            for (int i = 0; i < MR; ++i) {
                const __m512bh x = broadcast_pair(a + i * lda + 2 * pair);
#pragma GCC unroll 4
                for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], x, w[j]);
            }
        }
    }
    store<MR, NR>(acc, bias, c, ldc, cols);
}

// One int8 panel: per block of 32 input columns, 32 float32 scales (each column's, twice) then
// 16 pairs x 16 columns x 2 values; q * scale is exact in float32, then rounded once to bfloat16.
void dequant_panel(const uint8_t* src, int64_t blocks, uint16_t* dst) {
    for (int64_t blk = 0; blk < blocks; ++blk) {
        const int8_t* q = (const int8_t*)(src + 2 * GM_PANEL * sizeof(float));
        for (int p = 0; p < GM_INT8_BLOCK / 2; ++p) {
            _mm512_storeu_si512(dst, (__m512i)dequant_pair((const float*)src, q));
            q += 2 * GM_PANEL;
            dst += 2 * GM_PANEL;
        }
        src += kInt8BlockBytes;
    }
}

}  // namespace GM_NS

#include "gemm_driver.h"
