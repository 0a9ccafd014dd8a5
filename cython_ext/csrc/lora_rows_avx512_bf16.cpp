// The per-row LoRA products' AVX512-BF16 path: the tiles of the GEMM's AVX512-BF16 path
// (gemm_avx512_bf16.cpp), one VDPBF16PS per pair of inputs and 16 columns, u rounded by
// VCVTNEPS2BF16 as that GEMM rounds its bfloat16 out. Built with -mavx512bf16 (setup.py).
#include <immintrin.h>
#include <string.h>

#include "gemm.h"

#define LR_NS planserve_lr_avx512_bf16
#define LR_ENTRY lr_add_avx512_bf16
#define LR_MR 4
#define LR_NR 4

namespace LR_NS {

template <int M, int N>
void tile(const uint16_t* const* x, const uint16_t* const* w, int64_t pairs, int64_t ahead, int64_t until,
          float (*out)[LR_NR * GM_PANEL]) {
    __m512 acc[M][N];
#pragma GCC unroll 4
    for (int i = 0; i < M; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < N; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
        __m512bh line[N];
#pragma GCC unroll 4
        for (int j = 0; j < N; ++j) {
            if (p < until) _mm_prefetch((const char*)(w[j] + p * 2 * GM_PANEL + ahead), _MM_HINT_T0);
            line[j] = (__m512bh)_mm512_loadu_si512(w[j] + p * 2 * GM_PANEL);
        }
#pragma GCC unroll 4
        for (int i = 0; i < M; ++i) {
            int32_t two;
            memcpy(&two, x[i] + 2 * p, sizeof two);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(two);
#pragma GCC unroll 4
            for (int j = 0; j < N; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, line[j]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < M; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < N; ++j) _mm512_storeu_ps(out[i] + j * GM_PANEL, acc[i][j]);
}

static inline void round_u(const float* in, uint16_t* out, int n) {
    const __mmask16 mask = n >= GM_PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
    _mm256_mask_storeu_epi16(out, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(in)));
}

}  // namespace LR_NS

#include "lora_rows_avx512_add.h"
#include "lora_rows_impl.h"
