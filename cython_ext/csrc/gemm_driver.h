// The GEMMs' loop nest, shared by every ISA path (gemm.h has the contract). Included by one
// translation unit per path after it defines, in namespace GM_NS:
//   XT: the element type its tiles read x in: uint16_t (bfloat16 as given) or float (GM_WIDEN_X:
//       the rows widened to float32 once per call, so a tile broadcasts a float, not a pair);
//   template <int MR, int NR> void tile(a, lda, b, panel_stride, pairs, bias, c, ldc, cols):
//       MR rows x NR panels of out, each element a sum over all `pairs` from zero, in order;
//   void quantize_row(x, k, xq, xd): one bfloat16 row -> per block of 32, d = max|x| / 32767 and
//       int16 q = x * (32767 / max|x|) rounded to nearest even, as gemm.h says;
//   template <int MR, int NR> void tile_q8(xq, ldq, xd, ldd, b, panel_bytes, blocks, bias, c, ldc, cols):
//       MR quantized rows x NR int8 panels, out = sum over blocks in order of fma(dot, d_x * d_w, out);
// and, where its registers call for other tile shapes, GM_TILE_MR / GM_TILE_NR (bf16) and
// GM_Q8_MR / GM_Q8_NR (int8). The nest only decides which tiles run where: tile shapes, row
// blocks and the thread split change no element's arithmetic.
//
// No C++ standard library templates here: an inline std:: function compiled with one path's ISA
// flags is a weak symbol the linker may keep for every path, and an AVX-512 copy of it would then
// run on a CPU that only has AVX2.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gemm.h"

#ifndef GM_TILE_MR
#define GM_TILE_MR 6  // 6 x 4 accumulators + 4 weight vectors fit AVX-512's 32 registers
#endif
#ifndef GM_TILE_NR
#define GM_TILE_NR 4
#endif
#ifndef GM_Q8_MR
#define GM_Q8_MR 6  // 12 float32 sums + 12 integer dots + 2 weight vectors in 32 registers
#endif
#ifndef GM_Q8_NR
#define GM_Q8_NR 2
#endif

namespace GM_NS {

constexpr int MR = GM_TILE_MR;   // rows per tile
constexpr int NR = GM_TILE_NR;   // panels per tile
constexpr int GROUP = 4;         // panels per slice of the thread split (64 output columns)
constexpr int64_t MB = 120;      // rows per block: a block of x (<= 120 x 1,536 bf16) stays in L2
constexpr int64_t PAIR = 2 * GM_PANEL;  // elements of one pair of one panel
constexpr int MR_Q8 = GM_Q8_MR, NR_Q8 = GM_Q8_NR;

static inline int64_t lesser(int64_t a, int64_t b) { return a < b ? a : b; }

// Tiles write out through c (ldc elements a row): bfloat16, or float32 where f32 is set.
using TileFn = void (*)(const XT*, int64_t, const uint16_t*, int64_t, int64_t, const uint16_t*, void*, int64_t, int, int);
using Q8TileFn = void (*)(const int16_t*, int64_t, const float*, int64_t, const uint8_t*, int64_t, int64_t, const uint16_t*,
                          void*, int64_t, int, int);

// The tile for m rows (1..M) and n panels (1..N): a branch per shape, no table to build.
template <int M, int N>
static inline TileFn tile_for(int m, int n) {
    if constexpr (M > 1)
        if (m < M) return tile_for<M - 1, N>(m, n);
    if constexpr (N > 1)
        if (n < N) return tile_for<M, N - 1>(m, n);
    return tile<M, N>;
}
template <int M, int N>
static inline Q8TileFn q8_tile_for(int m, int n) {
    if constexpr (M > 1)
        if (m < M) return q8_tile_for<M - 1, N>(m, n);
    if constexpr (N > 1)
        if (n < N) return q8_tile_for<M, N - 1>(m, n);
    return tile_q8<M, N>;
}

// Element (r, col) of out, bfloat16 or float32.
static inline void* at(void* out, int64_t ldo, int f32, int64_t r, int64_t col) {
    return (char*)out + (r * ldo + col) * (f32 ? 4 : 2);
}

// Rows [r0, r1) of out for panels [p0, p0 + np), from panels b (panel_stride apart): panels in
// tiles of NR, each across the rows, so a tile's panels stay in cache while the rows pass.
static inline void block(const XT* x, int64_t ldx, int64_t r0, int64_t r1, const uint16_t* b, int64_t panel_stride,
                         int64_t pairs, int64_t p0, int np, int64_t n, const uint16_t* bias, void* out, int64_t ldo,
                         int f32) {
    for (int j = 0; j < np; j += NR) {
        const int nr = (int)lesser(NR, np - j);
        const int64_t col = (p0 + j) * GM_PANEL;
        const int cols = (int)lesser(nr * GM_PANEL, n - col);
        for (int64_t r = r0; r < r1; r += MR) {
            const int mr = (int)lesser(MR, r1 - r);
            tile_for<MR, NR>(mr, nr)(x + r * ldx, ldx, b + j * panel_stride, panel_stride, pairs, bias ? bias + col : nullptr,
                                     at(out, ldo, f32, r, col), ldo, cols, f32);
        }
    }
}

// Work items: (slice of at most GROUP panels, block of MB rows), slice-major, so a thread's static
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
        const int64_t groups = (panels + GROUP - 1) / GROUP;
        row_blocks = (rows + MB - 1) / MB;
        parallel = num_threads > 1 && groups * row_blocks > 1 && (n * k >= 32768 || rows * n * k >= (int64_t)1 << 20);
        slices = parallel ? (groups + num_threads - 1) / num_threads * num_threads : groups;
        items = slices * row_blocks;
    }
    // Panels [first, first + count) of slice `slice` (count <= GROUP; 0 for an empty slice of a
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
#ifdef GM_WIDEN_X
    float* xa = (float*)malloc(sizeof(float) * rows * k);
    const int64_t lda = k;
#else
    const uint16_t* xa = x;
    const int64_t lda = ldx;
#endif
#pragma omp parallel num_threads(num_threads) if (plan.parallel)
    {
#ifdef GM_WIDEN_X
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) widen_row(x + r * ldx, k, xa + r * k);
#endif
#pragma omp for schedule(static)
        for (int64_t item = 0; item < plan.items; ++item) {
            const int64_t r0 = (item % plan.row_blocks) * MB;
            int64_t p0;
            int np;
            plan.slice_panels(item / plan.row_blocks, &p0, &np);
            if (np == 0) continue;
            block(xa, lda, r0, lesser(rows, r0 + MB), packed + p0 * panel_stride, panel_stride, plan.pairs, p0, np, n, bias,
                  out, ldo, f32);
        }
    }
#ifdef GM_WIDEN_X
    free(xa);
#endif
}

static void linear_int8(const uint16_t* x, int64_t rows, int64_t ldx, const uint8_t* packed, int64_t n, int64_t k,
                        const uint16_t* bias, void* out, int64_t ldo, int f32, int num_threads) {
    if (rows == 0) return;
    const Plan plan(rows, n, k, num_threads);
    const int64_t blocks = k / GM_INT8_BLOCK, panel_bytes = blocks * GM_INT8_PANEL_BLOCK_BYTES;
    int16_t* xq = (int16_t*)malloc(sizeof(int16_t) * rows * k);
    float* xd = (float*)malloc(sizeof(float) * rows * blocks);
#pragma omp parallel num_threads(num_threads) if (plan.parallel)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) quantize_row(x + r * ldx, k, xq + r * k, xd + r * blocks);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < plan.items; ++item) {
            const int64_t r0 = (item % plan.row_blocks) * MB, r1 = lesser(rows, r0 + MB);
            int64_t p0;
            int np;
            plan.slice_panels(item / plan.row_blocks, &p0, &np);
            for (int64_t r = r0; r < r1; r += MR_Q8) {
                const int mr = (int)lesser(MR_Q8, r1 - r);
                for (int64_t p = p0; p < p0 + np; p += NR_Q8) {
                    const int nr = (int)lesser(NR_Q8, p0 + np - p);
                    const int cols = (int)lesser(nr * GM_PANEL, n - p * GM_PANEL);
                    q8_tile_for<MR_Q8, NR_Q8>(mr, nr)(xq + r * k, k, xd + r * blocks, blocks, packed + p * panel_bytes,
                                                      panel_bytes, blocks, bias ? bias + p * GM_PANEL : nullptr,
                                                      at(out, ldo, f32, r, p * GM_PANEL), ldo, cols, f32);
                }
            }
        }
    }
    free(xq);
    free(xd);
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
