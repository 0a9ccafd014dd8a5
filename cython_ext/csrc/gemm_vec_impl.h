// The GEMMs' vector tiles for CPUs without a bfloat16 dot product (AVX2+FMA, AVX-512F), written
// once in GCC generic vectors of GM_VEC_BYTES and compiled once per ISA: each gemm_<isa>.cpp
// defines GM_VEC_BYTES, GM_NS, GM_ENTRY, its tile shapes, and in namespace GM_NS the operations
// generic vectors cannot spell, or GCC compiles badly (a fused multiply-add, vpmaddwd, int8 -> int16
// widening, a broadcast: a lane-by-lane loop went through the stack, 50x slower), then includes
// this file. An aarch64 translation unit would define them with NEON.
//
// bf16: the packed line of one pair (gemm.h) is 16 columns x (even, odd) bfloat16, i.e. one uint32
// lane per column holding the even input column's weight in its low half and the odd one's in its
// high half. A bfloat16 is the top half of a float32, so `lane << 16` is the even weight and
// `lane & 0xFFFF0000` the odd one, exactly: half the bytes of float32 weights read, widened in
// registers. x is widened to float32 once per call (GM_WIDEN_X). Each output element is
//     acc = fma(x[2p], w[2p], acc); acc = fma(x[2p + 1], w[2p + 1], acc)   for p = 0, 1, ... in order
// from zero, rounded to bfloat16 once: one order for every row count and tile shape.
//
// int8: as the AVX512-BF16 path (gemm.h), with vpmaddwd (int16 pairs -> int32) and an int32 add in
// place of VPDPWSSD: the block dot products are exact, so every path gives the same bits.
//
// No C++ standard library here (gemm_driver.h says why); compiled with -ffp-contract=off (setup.py)
// so the only fused operations are the fmadd calls written below.
#include <stdint.h>
#include <string.h>

#include "bf16_scalar.h"
#include "gemm.h"

#define GM_WIDEN_X 1

namespace GM_NS {

using XT = float;
constexpr int kW = GM_VEC_BYTES / 4;    // float32 lanes per vector: columns per vector
constexpr int kV = GM_PANEL / kW;       // vectors per panel
constexpr int64_t kLine = 2 * GM_PANEL; // bfloat16 values per pair of one panel

// Prefetch distance in pairs (as the AVX512-BF16 path): tiles of 4 rows or more spend long enough
// per pair that memory needs asking farther ahead.
template <int MR>
constexpr int64_t kAhead = MR >= 4 ? 48 : 16;

void widen_row(const uint16_t* x, int64_t k, float* out) {
    for (int64_t kk = 0; kk < k; ++kk) out[kk] = bf16_to_f32(x[kk]);
}

// acc[i][j][v] (+ bias) -> out, bfloat16 or float32, the first `cols` columns.
template <int MR, int NR>
static inline void store(const vf (&acc)[MR][NR][kV], const uint16_t* bias, void* c, int64_t ldc, int cols, int f32) {
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j)
            for (int v = 0; v < kV; ++v) {
                float lanes[kW];
                memcpy(lanes, &acc[i][j][v], sizeof lanes);
                for (int l = 0; l < kW && j * GM_PANEL + v * kW + l < cols; ++l) {
                    const int col = j * GM_PANEL + v * kW + l;
                    const float s = bias ? lanes[l] + bf16_to_f32(bias[col]) : lanes[l];
                    if (f32)
                        ((float*)c)[i * ldc + col] = s;
                    else
                        ((uint16_t*)c)[i * ldc + col] = f32_to_bf16(s);
                }
            }
}

template <int MR, int NR>
void tile(const float* a, int64_t lda, const uint16_t* b, int64_t panel_stride, int64_t pairs, const uint16_t* bias, void* c,
          int64_t ldc, int cols, int f32) {
    vf acc[MR][NR][kV];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j)
            for (int v = 0; v < kV; ++v) acc[i][j][v] = splat(0.0f);
    for (int64_t p = 0; p < pairs; ++p) {
        vf even[NR][kV], odd[NR][kV];
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) {
            const uint16_t* line = b + j * panel_stride + p * kLine;
            __builtin_prefetch(line + kAhead<MR> * kLine);
#pragma GCC unroll 4
            for (int v = 0; v < kV; ++v) {
                vu w;
                memcpy(&w, line + v * 2 * kW, sizeof w);
                even[j][v] = (vf)(w << 16);
                odd[j][v] = (vf)(w & 0xFFFF0000u);
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
            const vf xe = splat(a[i * lda + 2 * p]), xo = splat(a[i * lda + 2 * p + 1]);
#pragma GCC unroll 4
            for (int j = 0; j < NR; ++j)
#pragma GCC unroll 4
                for (int v = 0; v < kV; ++v) acc[i][j][v] = fmadd(xo, odd[j][v], fmadd(xe, even[j][v], acc[i][j][v]));
        }
    }
    store<MR, NR>(acc, bias, c, ldc, cols, f32);
}

// One row of x -> per block of 32: d = max|x| / 32767 and int16 q = rne(x * (32767 / max|x|)), the
// same IEEE operations as the other paths' (so the same bits).
void quantize_row(const uint16_t* x, int64_t k, int16_t* xq, float* xd) {
    for (int64_t blk = 0; blk < k / GM_INT8_BLOCK; ++blk) {
        const uint16_t* xb = x + blk * GM_INT8_BLOCK;
        float amax = 0.0f;
        for (int i = 0; i < GM_INT8_BLOCK; ++i) {
            const float m = __builtin_fabsf(bf16_to_f32(xb[i]));
            amax = m > amax ? m : amax;
        }
        xd[blk] = amax / 32767.0f;
        const float inverse = amax > 0.0f ? 32767.0f / amax : 0.0f;
        for (int i = 0; i < GM_INT8_BLOCK; ++i)  // the current rounding mode: nearest even
            xq[blk * GM_INT8_BLOCK + i] = (int16_t)__builtin_nearbyintf(bf16_to_f32(xb[i]) * inverse);
    }
}

// MR quantized rows x NR int8 panels (gemm.h): per block, each (row, column) dot product exact in
// int32 (the pair of int8 weights widened to int16, one vpmaddwd per pair of input columns), then
// folded into the float32 sum with the two scales.
template <int MR, int NR>
void tile_q8(const int16_t* xq, int64_t ldq, const float* xd, int64_t ldd, const uint8_t* b, int64_t panel_bytes,
             int64_t blocks, const uint16_t* bias, void* c, int64_t ldc, int cols, int f32) {
    vf acc[MR][NR][kV];
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j)
            for (int v = 0; v < kV; ++v) acc[i][j][v] = splat(0.0f);
    for (int64_t blk = 0; blk < blocks; ++blk) {
        const uint8_t* block = b + blk * GM_INT8_PANEL_BLOCK_BYTES;
        vi dot[MR][NR][kV];
        for (int i = 0; i < MR; ++i)
            for (int j = 0; j < NR; ++j)
                for (int v = 0; v < kV; ++v) dot[i][j][v] = splat_i(0);
#pragma GCC unroll 16
        for (int p = 0; p < GM_INT8_BLOCK / 2; ++p) {
            vi w[NR][kV];
#pragma GCC unroll 4
            for (int j = 0; j < NR; ++j) {
                const uint8_t* line = block + j * panel_bytes + GM_PANEL * 4 + p * 2 * GM_PANEL;
                if (p % 2 == 0) __builtin_prefetch(line + 2 * GM_INT8_PANEL_BLOCK_BYTES);  // two blocks ahead
#pragma GCC unroll 4
                for (int v = 0; v < kV; ++v) w[j][v] = widen_i8(line + v * 2 * kW);
            }
#pragma GCC unroll 8
            for (int i = 0; i < MR; ++i) {
                int32_t two;
                memcpy(&two, xq + i * ldq + blk * GM_INT8_BLOCK + 2 * p, sizeof two);
                const vi x = splat_i(two);
#pragma GCC unroll 4
                for (int j = 0; j < NR; ++j)
#pragma GCC unroll 4
                    for (int v = 0; v < kV; ++v) dot[i][j][v] += madd_pairs(x, w[j][v]);
            }
        }
        for (int j = 0; j < NR; ++j)
            for (int v = 0; v < kV; ++v) {
                vf dw;
                memcpy(&dw, block + j * panel_bytes + v * kW * 4, sizeof dw);
                for (int i = 0; i < MR; ++i) {
                    const vf scale = splat(xd[i * ldd + blk]) * dw;
                    acc[i][j][v] = fmadd(__builtin_convertvector(dot[i][j][v], vf), scale, acc[i][j][v]);
                }
            }
    }
    store<MR, NR>(acc, bias, c, ldc, cols, f32);
}

}  // namespace GM_NS

#include "gemm_driver.h"
