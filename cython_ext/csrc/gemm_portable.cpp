// The GEMMs' portable path: the same packed layout and loop nest in plain C++, for CPUs without
// AVX512-BF16 (where torch's GEMM is the default: this path is for checks and other architectures).
// Each pair adds its odd product, then its even one, as VDPBF16PS is specified to.
#include <string.h>

#include <vector>

#include "gemm.h"

#define GM_NS planserve_gm_portable
#define GM_ENTRY(name) gm_##name##_portable

namespace GM_NS {

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

template <int MR, int NR>
void tile(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t panel_stride, int64_t pairs, const uint16_t* bias,
          uint16_t* c, int64_t ldc, int cols) {
    float acc[MR][NR * GM_PANEL] = {};
    for (int64_t p = 0; p < pairs; ++p) {
        for (int i = 0; i < MR; ++i) {
            const float x0 = bf16_to_f32(a[i * lda + 2 * p]), x1 = bf16_to_f32(a[i * lda + 2 * p + 1]);
            for (int j = 0; j < NR; ++j) {
                const uint16_t* w = b + j * panel_stride + p * 2 * GM_PANEL;
                for (int col = 0; col < GM_PANEL; ++col) {
                    float& sum = acc[i][j * GM_PANEL + col];
                    sum += x1 * bf16_to_f32(w[2 * col + 1]);
                    sum += x0 * bf16_to_f32(w[2 * col]);
                }
            }
        }
    }
    for (int i = 0; i < MR; ++i)
        for (int col = 0; col < cols; ++col)
            c[i * ldc + col] = f32_to_bf16(bias ? acc[i][col] + bf16_to_f32(bias[col]) : acc[i][col]);
}

void dequant_panel(const uint8_t* src, int64_t blocks, uint16_t* dst) {
    for (int64_t blk = 0; blk < blocks; ++blk) {
        const float* scales = (const float*)src;
        const int8_t* q = (const int8_t*)(src + 32 * sizeof(float));
        for (int p = 0; p < GM_INT8_BLOCK / 2; ++p) {
            for (int lane = 0; lane < 2 * GM_PANEL; ++lane) dst[lane] = f32_to_bf16((float)q[lane] * scales[lane]);
            q += 2 * GM_PANEL;
            dst += 2 * GM_PANEL;
        }
        src += 32 * sizeof(float) + GM_INT8_BLOCK * GM_PANEL;
    }
}

template <int MR, int NR>
void tile_int8(const uint16_t* a, int64_t lda, const uint8_t* b, int64_t panel_bytes, int64_t blocks, const uint16_t* bias,
               uint16_t* c, int64_t ldc, int cols) {
    const int64_t pairs = blocks * GM_INT8_BLOCK / 2;
    std::vector<uint16_t> panels(NR * pairs * 2 * GM_PANEL);
    for (int j = 0; j < NR; ++j) dequant_panel(b + j * panel_bytes, blocks, panels.data() + j * pairs * 2 * GM_PANEL);
    tile<MR, NR>(a, lda, panels.data(), pairs * 2 * GM_PANEL, pairs, bias, c, ldc, cols);
}

}  // namespace GM_NS

#include "gemm_driver.h"
