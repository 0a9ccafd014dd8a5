// The per-row LoRA products' tiles for CPUs without a bfloat16 dot product (AVX2+FMA, AVX-512F), in
// GCC generic vectors, as the GEMM's (gemm_vec_impl.h): the weights widened in registers (`lane << 16`
// the even input's, `lane & 0xFFFF0000` the odd one's), each sum acc = fma(x[2p], w[2p], acc) then
// fma(x[2p + 1], w[2p + 1], acc) from zero, u rounded by f32_to_bf16: the GEMM path's bits. Each
// lora_rows_<isa>.cpp defines GM_VEC_BYTES, LR_NS, LR_ENTRY, LR_MR / LR_NR and, in LR_NS, vf, vu,
// splat and fmadd, then includes this file.
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "gemm.h"

namespace LR_NS {

constexpr int kW = GM_VEC_BYTES / 4;  // float32 lanes per vector
constexpr int kV = GM_PANEL / kW;     // vectors per panel

template <int M, int N>
void tile(const uint16_t* const* x, const uint16_t* const* w, int64_t pairs, int64_t ahead, int64_t until,
          float (*out)[LR_NR * GM_PANEL]) {
    vf acc[M][N][kV];
    for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j)
            for (int v = 0; v < kV; ++v) acc[i][j][v] = splat(0.0f);
    for (int64_t p = 0; p < pairs; ++p) {
        vf even[N][kV], odd[N][kV];
#pragma GCC unroll 4
        for (int j = 0; j < N; ++j) {
            if (p < until) __builtin_prefetch(w[j] + p * 2 * GM_PANEL + ahead);
#pragma GCC unroll 4
            for (int v = 0; v < kV; ++v) {
                vu lanes;
                memcpy(&lanes, w[j] + p * 2 * GM_PANEL + v * 2 * kW, sizeof lanes);
                even[j][v] = (vf)(lanes << 16);
                odd[j][v] = (vf)(lanes & 0xFFFF0000u);
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < M; ++i) {
            const vf xe = splat(bf16_to_f32(x[i][2 * p])), xo = splat(bf16_to_f32(x[i][2 * p + 1]));
#pragma GCC unroll 4
            for (int j = 0; j < N; ++j)
#pragma GCC unroll 4
                for (int v = 0; v < kV; ++v) acc[i][j][v] = fmadd(xo, odd[j][v], fmadd(xe, even[j][v], acc[i][j][v]));
        }
    }
    for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j)
            for (int v = 0; v < kV; ++v) memcpy(out[i] + j * GM_PANEL + v * kW, &acc[i][j][v], sizeof acc[i][j][v]);
}

static inline void round_u(const float* in, uint16_t* out, int n) {
    for (int l = 0; l < n; ++l) out[l] = f32_to_bf16(in[l]);
}

#ifndef LR_VECTOR_ADD
static inline void add_scaled(const float* d, float scale, uint16_t* y, int n) {
    for (int l = 0; l < n; ++l) {
        const float product = d[l] * scale;  // rounded: -ffp-contract=off
        y[l] = f32_to_bf16(bf16_to_f32(y[l]) + product);
    }
}
#endif

}  // namespace LR_NS

#include "lora_rows_impl.h"
