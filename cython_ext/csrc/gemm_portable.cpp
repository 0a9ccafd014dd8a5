// The GEMMs' portable path: the same packed layout and loop nest in plain scalar C++, built without
// ISA flags: the checking path on every CPU (the vector paths, gemm_vec_impl.h, are the fast ones).
// Each pair adds its odd product, then its even one, as VDPBF16PS is specified to; int8 computes
// what the AVX-512 path computes, in the same order.
#include <string.h>

#include <algorithm>
#include <cmath>

#include "bf16_scalar.h"
#include "gemm.h"

// GCC 12's loop vectorizer miscompiles these scalar tiles at -O3 (a 1-row tile added x[0] * w
// twice: caught by test_ms_gemm's 1-row and float32-out checks); they are the checking path, so
// they are simply not loop-vectorized.
#if defined(__GNUC__) && !defined(__clang__)
#define GM_PORTABLE_TILE __attribute__((optimize("no-tree-loop-vectorize")))
#else
#define GM_PORTABLE_TILE
#endif

#define GM_NS planserve_gm_portable
#define GM_ENTRY(name) gm_##name##_portable

namespace GM_NS {

using XT = uint16_t;  // the tiles read x as given

template <int MR, size_t W>
static void store(const float (&acc)[MR][W], const uint16_t* bias, void* c, int64_t ldc, int cols, int f32) {
    for (int i = 0; i < MR; ++i)
        for (int col = 0; col < cols; ++col) {
            const float v = bias ? acc[i][col] + bf16_to_f32(bias[col]) : acc[i][col];
            if (f32)
                ((float*)c)[i * ldc + col] = v;
            else
                ((uint16_t*)c)[i * ldc + col] = f32_to_bf16(v);
        }
}

template <int MR, int NR>
GM_PORTABLE_TILE void tile(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t panel_stride, int64_t pairs, const uint16_t* bias,
          void* c, int64_t ldc, int cols, int f32) {
    float acc[MR][NR * GM_PANEL];
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j)
            for (int col = 0; col < GM_PANEL; ++col) {
                const uint16_t* x = a + i * lda;
                const uint16_t* w = b + j * panel_stride + 2 * col;
                float sum = 0.0f;
                for (int64_t p = 0; p < pairs; ++p) {
                    sum += bf16_to_f32(x[2 * p + 1]) * bf16_to_f32(w[p * 2 * GM_PANEL + 1]);
                    sum += bf16_to_f32(x[2 * p]) * bf16_to_f32(w[p * 2 * GM_PANEL]);
                }
                acc[i][j * GM_PANEL + col] = sum;
            }
    store<MR>(acc, bias, c, ldc, cols, f32);
}

void quantize_row(const uint16_t* x, int64_t k, int16_t* xq, float* xd) {
    for (int64_t blk = 0; blk < k / GM_INT8_BLOCK; ++blk) {
        const uint16_t* xb = x + blk * GM_INT8_BLOCK;
        float amax = 0.0f;
        for (int64_t i = 0; i < GM_INT8_BLOCK; ++i) amax = std::max(amax, std::fabs(bf16_to_f32(xb[i])));
        xd[blk] = amax / 32767.0f;
        const float inverse = amax > 0.0f ? 32767.0f / amax : 0.0f;
        for (int64_t i = 0; i < GM_INT8_BLOCK; ++i)  // nearbyint: nearest even, as the vector path's conversion
            xq[blk * GM_INT8_BLOCK + i] = (int16_t)std::nearbyint(bf16_to_f32(xb[i]) * inverse);
    }
}

template <int MR, int NR>
GM_PORTABLE_TILE void tile_q8(const int16_t* xq, int64_t ldq, const float* xd, int64_t ldd, const uint8_t* b, int64_t panel_bytes,
             int64_t blocks, const uint16_t* bias, void* c, int64_t ldc, int cols, int f32) {
    float acc[MR][NR * GM_PANEL] = {};
    for (int64_t blk = 0; blk < blocks; ++blk)
        for (int j = 0; j < NR; ++j) {
            const uint8_t* panel = b + j * panel_bytes + blk * GM_INT8_PANEL_BLOCK_BYTES;
            const float* dw = (const float*)panel;
            const int8_t* w = (const int8_t*)(panel + GM_PANEL * sizeof(float));
            for (int i = 0; i < MR; ++i)
                for (int col = 0; col < GM_PANEL; ++col) {
                    int32_t dot = 0;
                    for (int kk = 0; kk < GM_INT8_BLOCK; ++kk)
                        dot += (int32_t)xq[i * ldq + blk * GM_INT8_BLOCK + kk] * w[((kk / 2) * GM_PANEL + col) * 2 + kk % 2];
                    const float scale = xd[i * ldd + blk] * dw[col];
                    float& sum = acc[i][j * GM_PANEL + col];
                    sum = std::fma((float)dot, scale, sum);
                }
        }
    store<MR>(acc, bias, c, ldc, cols, f32);
}

}  // namespace GM_NS

#include "gemm_driver.h"
