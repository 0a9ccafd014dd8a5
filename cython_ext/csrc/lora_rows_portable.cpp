// The per-row LoRA products' portable path: scalar C++ built without ISA flags, the GEMM's portable
// arithmetic (gemm_portable.cpp): each pair adds its odd product, then its even one, as VDPBF16PS
// is specified to; u rounded by f32_to_bf16. The checking path on every CPU.
#include <stdint.h>

#include "bf16.h"
#include "gemm.h"

// As gemm_portable.cpp's tiles: GCC 12's loop vectorizer miscompiled those scalar loops at -O3.
#if defined(__GNUC__) && !defined(__clang__)
#define LR_PORTABLE_TILE __attribute__((optimize("no-tree-loop-vectorize")))
#else
#define LR_PORTABLE_TILE
#endif

#define LR_NS planserve_lr_portable
#define LR_ENTRY lr_add_portable
#define LR_MR 4
#define LR_NR 4

namespace LR_NS {

template <int M, int N>
LR_PORTABLE_TILE void tile(const uint16_t* const* x, const uint16_t* const* w, int64_t pairs, int64_t, int64_t,
                           float (*out)[LR_NR * GM_PANEL]) {
    for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j)
            for (int col = 0; col < GM_PANEL; ++col) {
                float sum = 0.0f;
                for (int64_t p = 0; p < pairs; ++p) {
                    const uint16_t* pair = w[j] + p * 2 * GM_PANEL + 2 * col;
                    sum += bf16_to_f32(x[i][2 * p + 1]) * bf16_to_f32(pair[1]);
                    sum += bf16_to_f32(x[i][2 * p]) * bf16_to_f32(pair[0]);
                }
                out[i][j * GM_PANEL + col] = sum;
            }
}

static inline void round_u(const float* in, uint16_t* out, int n) {
    for (int l = 0; l < n; ++l) out[l] = f32_to_bf16(in[l]);
}

static inline void add_scaled(const float* d, float scale, uint16_t* y, int n) {
    for (int l = 0; l < n; ++l) {
        const float product = d[l] * scale;  // rounded: -ffp-contract=off
        y[l] = f32_to_bf16(bf16_to_f32(y[l]) + product);
    }
}

}  // namespace LR_NS

#include "lora_rows_impl.h"
