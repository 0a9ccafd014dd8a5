// The GEMMs' loop nest, shared by every ISA path (gemm.h has the contract). Included by one
// translation unit per path after it defines, in namespace GM_NS:
//   template <int MR, int NR> void tile(a, lda, b, panel_stride, pairs, bias, c, ldc, cols):
//       MR rows x NR panels of out, each element a sum over all `pairs` from zero, in order;
//   void quantize_row(x, k, xq, xd): one bfloat16 row -> per block of 32, d = max|x| / 32767 and
//       int16 q = x * (32767 / max|x|) rounded to nearest even, as gemm.h says;
//   template <int MR, int NR> void tile_q8(xq, ldq, xd, ldd, b, panel_bytes, blocks, bias, c, ldc, cols):
//       MR quantized rows x NR int8 panels, out = sum over blocks in order of fma(dot, d_x * d_w, out).
// The nest only decides which tiles run where: tile shapes, row blocks and the thread split change
// no element's arithmetic.
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "gemm.h"

namespace GM_NS {

constexpr int MR = 6;           // rows per tile: 6 x 4 accumulators + 4 weight vectors fit 32 registers
constexpr int NR = 4;           // panels per tile (64 output columns)
constexpr int64_t MB = 120;     // rows per block: a block of x (<= 120 x 1,536 bf16) stays in L2
constexpr int64_t PAIR = 2 * GM_PANEL;  // elements of one pair of one panel

// Tiles write out through c (ldc elements a row): bfloat16, or float32 where f32 is set.
using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, const uint16_t*, void*, int64_t, int,
                        int);

template <int M>
struct TileRow {
    static constexpr TileFn fns[NR] = {tile<M, 1>, tile<M, 2>, tile<M, 3>, tile<M, 4>};
};
static const TileFn* const kTiles[MR] = {TileRow<1>::fns, TileRow<2>::fns, TileRow<3>::fns,
                                         TileRow<4>::fns, TileRow<5>::fns, TileRow<6>::fns};

// int8 tiles: 6 rows x 2 panels (12 float32 sums + 12 integer dots + 2 weight vectors in 32
// registers): each widened weight vector serves 6 rows.
constexpr int MR_Q8 = 6, NR_Q8 = 2;
using Q8TileFn = void (*)(const int16_t*, int64_t, const float*, int64_t, const uint8_t*, int64_t, int64_t, const uint16_t*,
                          void*, int64_t, int, int);
template <int M>
struct Q8TileRow {
    static constexpr Q8TileFn fns[NR_Q8] = {tile_q8<M, 1>, tile_q8<M, 2>};
};
static const Q8TileFn* const kQ8Tiles[MR_Q8] = {Q8TileRow<1>::fns, Q8TileRow<2>::fns, Q8TileRow<3>::fns,
                                                Q8TileRow<4>::fns, Q8TileRow<5>::fns, Q8TileRow<6>::fns};

// Element (r, col) of out, bfloat16 or float32.
static inline void* at(void* out, int64_t ldo, int f32, int64_t r, int64_t col) {
    return (char*)out + (r * ldo + col) * (f32 ? 4 : 2);
}

// Rows [r0, r1) of out for panels [p0, p0 + nr), from panels b (panel_stride apart).
static inline void block(const uint16_t* x, int64_t ldx, int64_t r0, int64_t r1, const uint16_t* b, int64_t panel_stride,
                         int64_t pairs, int64_t p0, int nr, int64_t n, const uint16_t* bias, void* out, int64_t ldo,
                         int f32) {
    const int cols = (int)std::min<int64_t>(nr * GM_PANEL, n - p0 * GM_PANEL);
    const uint16_t* panel_bias = bias ? bias + p0 * GM_PANEL : nullptr;
    for (int64_t r = r0; r < r1; r += MR) {
        const int mr = (int)std::min<int64_t>(MR, r1 - r);
        kTiles[mr - 1][nr - 1](x + r * ldx, ldx, b, panel_stride, pairs, panel_bias, at(out, ldo, f32, r, p0 * GM_PANEL), ldo,
                               cols, f32);
    }
}

// Work items: (slice of at most NR panels, block of MB rows), slice-major, so a thread's static
// share is a run of whole slices: it reads its share of the weight once and keeps it in L2 across
// row blocks. The panels are cut into a multiple of the thread count of near-equal slices: in
// groups of NR, SmolLM2's 576-column projections were 9 groups, 5 on one thread and 4 on the other.
// Few items' worth of work runs on the calling thread (a parallel region costs microseconds).
struct Plan {
    int64_t pairs, panels, slices, row_blocks, items;
    bool parallel;
    Plan(int64_t rows, int64_t n, int64_t k, int num_threads) {
        pairs = (k + 1) / 2;
        panels = (n + GM_PANEL - 1) / GM_PANEL;
        const int64_t groups = (panels + NR - 1) / NR;
        row_blocks = (rows + MB - 1) / MB;
        parallel = num_threads > 1 && groups * row_blocks > 1 && (n * k >= 32768 || rows * n * k >= (int64_t)1 << 20);
        slices = parallel ? (groups + num_threads - 1) / num_threads * num_threads : groups;
        items = slices * row_blocks;
    }
    // Panels [first, first + count) of slice `slice` (count <= NR; 0 for an empty slice of a
    // weight with fewer panels than threads).
    void slice_panels(int64_t slice, int64_t* first, int* count) const {
        *first = slice * panels / slices;
        *count = (int)((slice + 1) * panels / slices - *first);
    }
};

static void linear_bf16(const uint16_t* x, int64_t rows, int64_t ldx, const uint16_t* packed, int64_t n, int64_t k,
                        const uint16_t* bias, void* out, int64_t ldo, int f32, int num_threads) {
    if (rows == 0) return;
    const Plan plan(rows, n, k, num_threads);
    const int64_t panel_stride = plan.pairs * PAIR;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (plan.parallel)
    for (int64_t item = 0; item < plan.items; ++item) {
        const int64_t r0 = (item % plan.row_blocks) * MB;
        int64_t p0;
        int nr;
        plan.slice_panels(item / plan.row_blocks, &p0, &nr);
        if (nr == 0) continue;
        block(x, ldx, r0, std::min(rows, r0 + MB), packed + p0 * panel_stride, panel_stride, plan.pairs, p0, nr, n, bias,
              out, ldo, f32);
    }
}

static void linear_int8(const uint16_t* x, int64_t rows, int64_t ldx, const uint8_t* packed, int64_t n, int64_t k,
                        const uint16_t* bias, void* out, int64_t ldo, int f32, int num_threads) {
    if (rows == 0) return;
    const Plan plan(rows, n, k, num_threads);
    const int64_t blocks = k / GM_INT8_BLOCK, panel_bytes = blocks * GM_INT8_PANEL_BLOCK_BYTES;
    std::vector<int16_t> xq(rows * k);
    std::vector<float> xd(rows * blocks);
#pragma omp parallel num_threads(num_threads) if (plan.parallel)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) quantize_row(x + r * ldx, k, xq.data() + r * k, xd.data() + r * blocks);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < plan.items; ++item) {
            const int64_t r0 = (item % plan.row_blocks) * MB, r1 = std::min(rows, r0 + MB);
            int64_t p0;
            int nr;
            plan.slice_panels(item / plan.row_blocks, &p0, &nr);
            for (int64_t r = r0; r < r1; r += MR_Q8) {
                const int mr = (int)std::min<int64_t>(MR_Q8, r1 - r);
                for (int64_t p = p0; p < p0 + nr; p += NR_Q8) {
                    const int np = (int)std::min<int64_t>(NR_Q8, p0 + nr - p);
                    const int cols = (int)std::min<int64_t>(np * GM_PANEL, n - p * GM_PANEL);
                    kQ8Tiles[mr - 1][np - 1](xq.data() + r * k, k, xd.data() + r * blocks, blocks, packed + p * panel_bytes,
                                             panel_bytes, blocks, bias ? bias + p * GM_PANEL : nullptr,
                                             at(out, ldo, f32, r, p * GM_PANEL), ldo, cols, f32);
                }
            }
        }
    }
}

}  // namespace GM_NS

extern "C" {
void GM_ENTRY(linear_bf16)(const uint16_t* x, int64_t rows, int64_t ldx, const uint16_t* packed, int64_t n, int64_t k,
                           const uint16_t* bias, void* out, int64_t ldo, int out_f32, int num_threads) {
    GM_NS::linear_bf16(x, rows, ldx, packed, n, k, bias, out, ldo, out_f32, num_threads);
}
void GM_ENTRY(linear_int8)(const uint16_t* x, int64_t rows, int64_t ldx, const uint8_t* packed, int64_t n, int64_t k,
                           const uint16_t* bias, void* out, int64_t ldo, int out_f32, int num_threads) {
    GM_NS::linear_int8(x, rows, ldx, packed, n, k, bias, out, ldo, out_f32, num_threads);
}
}
