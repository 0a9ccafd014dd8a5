// The per-row LoRA products' loop nest (lora_rows.h has the contract), shared by every ISA path.
// Included by one translation unit per path after it defines LR_NS, LR_ENTRY, LR_MR / LR_NR (rows
// and panels of a tile) and, in namespace LR_NS:
//   template <int M, int N> void tile(x, w, pairs, ahead, until, out): M rows x N panels,
//       out[i][16 j + lane] = the sum from zero over `pairs` pairs of row x[i] (bfloat16) and panel
//       w[j] (packed lines, gemm.h), in the order the path's GEMM sums a pair: the GEMM's float32
//       sum for that column; while p < until it prefetches w[j]'s line p plus `ahead` elements;
//   void round_u(in, out, n): n <= 16 float32 sums -> bfloat16 as the path's GEMM rounds its out;
//   void add_scaled(d, scale, y, n): y[l] = f32_to_bf16(bf16_to_f32(y[l]) + d[l] * scale), l < n.
// The nest decides which rows and panels a tile covers and which thread runs it: no element's
// arithmetic. No C++ standard library (gemm_driver.h says why); built with -ffp-contract=off, so
// the scaled add rounds its product before the sum, as lora/stacked.py does.
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "gemm.h"
#include "lora_rows.h"

namespace LR_NS {

constexpr int MR = LR_MR, NR = LR_NR;
constexpr int64_t LINE = 2 * GM_PANEL;  // bfloat16 values of one pair of one panel
constexpr int64_t SHRINK_ROWS = 4 * LR_MR;  // rows of a group per shrink item, at most

using Out = float[NR * GM_PANEL];
using TileFn = void (*)(const uint16_t* const*, const uint16_t* const*, int64_t, int64_t, int64_t, Out*);
// Prefetch distances: the shrink's in pairs of a panel's stream, the expand's in panels. A tile
// spends a few cycles on a pair: these ask a few hundred cycles (DRAM's latency) ahead.
constexpr int64_t SHRINK_AHEAD = 64;
constexpr int64_t EXPAND_AHEAD = 4 * LR_NR;

template <int M, int N>
static inline TileFn tile_for(int m, int n) {
    if constexpr (M > 1)
        if (m < M) return tile_for<M - 1, N>(m, n);
    if constexpr (N > 1)
        if (n < N) return tile_for<M, N - 1>(m, n);
    return tile<M, N>;
}

static inline int64_t lesser(int64_t a, int64_t b) { return a < b ? a : b; }

// The block of `target` that adapter lora_id owns, or NULL where it does not adapt the target.
static inline const lr_block* block_of(const lr_target* target, int64_t lora_id) {
    for (int64_t b = 0; b < target->num_blocks; ++b)
        if (target->blocks[b].lora_id == lora_id) return &target->blocks[b];
    return nullptr;
}

// A shrink item: group g, its rows [a, b), the panels of A it reads [t, t + n) (counted in the
// group's own panels, panels_of below). An expand item (g -1): target t's output panels
// [a, a + n), for every group.
struct Item {
    int64_t g, t, a, b, n;
};

struct Call {
    const lr_module* mod;
    const lr_step* step;
    const uint16_t* x;
    int64_t ldx, pairs_in;
    uint16_t* y;
    int64_t ldy;
};

// The panels of A holding adapter lora_id's blocks, in order, each once (a small rank's blocks of
// two targets can share one): the ones numbered [first, first + max) into index; their count.
static int64_t panels_of(const lr_module* mod, int64_t lora_id, int64_t first, int64_t max, int64_t* index) {
    int64_t count = 0, last = -1;
    for (int64_t t = 0; t < mod->num_targets; ++t) {
        const lr_block* block = block_of(&mod->targets[t], lora_id);
        if (block == nullptr) continue;
        for (int64_t p = block->k0 / GM_PANEL; p <= (block->k1 - 1) / GM_PANEL; ++p) {
            if (p <= last) continue;
            if (count >= first && count < first + max) index[count - first] = p;
            ++count;
            last = p;
        }
    }
    return count;
}

// Rows [a, b) of group g through its panels [t, t + n) of A: u of those panels' columns.
static void shrink(const Call& c, const Item& item) {
    const int64_t* group = c.step->groups + 3 * item.g;
    int64_t index[NR];
    panels_of(c.mod, group[0], item.t, item.n, index);
    const uint16_t* panels[NR];
    const int n = (int)item.n;
    for (int j = 0; j < n; ++j) panels[j] = c.mod->packed_a + index[j] * c.pairs_in * LINE;
    for (int64_t r = item.a; r < item.b; r += MR) {
        const int m = (int)lesser(MR, item.b - r);
        const uint16_t* rows[MR];
        for (int i = 0; i < m; ++i) rows[i] = c.x + c.step->order[group[1] + r + i] * c.ldx;
        Out out[MR];
        tile_for<MR, NR>(m, n)(rows, panels, c.pairs_in, SHRINK_AHEAD * LINE, c.pairs_in - SHRINK_AHEAD, out);
        for (int i = 0; i < m; ++i) {
            uint16_t* u = c.step->u + c.step->order[group[1] + r + i] * c.step->ldu;
            for (int j = 0; j < n; ++j) {
                const int64_t col = index[j] * GM_PANEL;
                round_u(out[i] + j * GM_PANEL, u + col, (int)lesser(GM_PANEL, c.mod->rank - col));
            }
        }
    }
}

// Group g's rows through target t's B, output panels [p0, p0 + np): y += d * scale.
static void expand_group(const Call& c, const int64_t* group, const lr_target* target, const Item& item) {
    const lr_block* block = block_of(target, group[0]);
    if (block == nullptr) return;
    const int64_t width = target->end - target->start, pairs = (block->k1 - block->k0) / 2;
    const int64_t stride = (target->k1 - target->k0) / 2 * LINE;
    const uint16_t* first = target->packed_b + (block->k0 - target->k0) / 2 * LINE;
    const int np = (int)item.n;
    const uint16_t* panels[NR];
    for (int j = 0; j < np; ++j) panels[j] = first + (item.a + j) * stride;
    // Prefetched: the block's chunks EXPAND_AHEAD panels on, which the same thread mostly reads
    // next (a static schedule), a stride away each (no hardware prefetcher follows strides
    // across pages).
    const int64_t panels_of_target = (width + GM_PANEL - 1) / GM_PANEL;
    const int64_t until = item.a + EXPAND_AHEAD + np <= panels_of_target ? pairs : 0;
    for (int64_t r = group[1]; r < group[2]; r += MR) {
        const int m = (int)lesser(MR, group[2] - r);
        const uint16_t* rows[MR];
        for (int i = 0; i < m; ++i) rows[i] = c.step->u + c.step->order[r + i] * c.step->ldu + block->k0;
        Out out[MR];
        tile_for<MR, NR>(m, np)(rows, panels, pairs, EXPAND_AHEAD * stride, r == group[1] ? until : 0, out);
        for (int i = 0; i < m; ++i) {
            const int64_t row = c.step->order[r + i];
            const float scale = c.step->row_scale[row];
            uint16_t* y = c.y + row * c.ldy + target->start;
            for (int j = 0; j < np; ++j) {
                const int64_t col = (item.a + j) * GM_PANEL;
                add_scaled(out[i] + j * GM_PANEL, scale, y + col, (int)lesser(GM_PANEL, width - col));
            }
        }
    }
}

// Target t's output panels [a, a + n) for every group: panel by panel, B is read in address
// order (a panel holds every adapter's chunk of those columns side by side: the groups' chunks
// of one panel share its pages), not adapter by adapter at a stride.
static void expand(const Call& c, const Item& item) {
    const lr_target* target = &c.mod->targets[item.t];
    for (int64_t g = 0; g < c.step->num_groups; ++g) expand_group(c, c.step->groups + 3 * g, target, item);
}

// The module's shrink and expand items; *macs: their multiply-adds (whether to fork). A shrink
// item takes NR panels of its group's, or one where there are few groups (a group of 8 rows on
// one adapter: its 3 qkv panels are then 3 items for the threads, not one).
static int64_t plan(const Call& c, int num_threads, Item* items, int64_t* shrinks, int64_t* macs) {
    const lr_step* s = c.step;
    const int64_t batch = s->num_groups >= 2 * num_threads ? NR : 1;
    int64_t count = 0;
    *macs = 0;
    for (int64_t g = 0; g < s->num_groups; ++g) {
        const int64_t rows = s->groups[3 * g + 2] - s->groups[3 * g + 1];
        const int64_t panels = panels_of(c.mod, s->groups[3 * g], 0, 0, nullptr);
        for (int64_t p = 0; p < panels; p += batch)
            for (int64_t r = 0; r < rows; r += SHRINK_ROWS)
                items[count++] = {g, p, r, lesser(rows, r + SHRINK_ROWS), lesser(batch, panels - p)};
    }
    *shrinks = count;
    for (int64_t t = 0; t < c.mod->num_targets; ++t) {
        const lr_target* target = &c.mod->targets[t];
        const int64_t width = target->end - target->start;
        bool used = false;
        for (int64_t g = 0; g < s->num_groups; ++g) {
            const lr_block* block = block_of(target, s->groups[3 * g]);
            if (block == nullptr) continue;
            used = true;
            *macs += (s->groups[3 * g + 2] - s->groups[3 * g + 1]) * (block->k1 - block->k0) * (c.pairs_in * 2 + width);
        }
        const int64_t panels = (width + GM_PANEL - 1) / GM_PANEL;
        for (int64_t p = 0; used && p < panels; p += NR) items[count++] = {-1, t, p, 0, lesser(NR, panels - p)};
    }
    return count;
}

// An upper bound on `plan`'s items.
static int64_t max_items(const Call& c) {
    int64_t total = 0;
    for (int64_t g = 0; g < c.step->num_groups; ++g) {
        const int64_t rows = c.step->groups[3 * g + 2] - c.step->groups[3 * g + 1];
        const int64_t panels = panels_of(c.mod, c.step->groups[3 * g], 0, 0, nullptr);
        total += panels * ((rows + SHRINK_ROWS - 1) / SHRINK_ROWS);
    }
    for (int64_t t = 0; t < c.mod->num_targets; ++t) {
        const lr_target* target = &c.mod->targets[t];
        total += (target->end - target->start + NR * GM_PANEL - 1) / (NR * GM_PANEL);
    }
    return total;
}

static int add(const Call& c, int num_threads) {
    if (c.step->num_groups == 0) return GM_OK;
    Item* items = (Item*)malloc(sizeof(Item) * max_items(c));
    if (items == nullptr) return GM_BAD_SHAPE;
    int64_t shrinks, macs;
    const int64_t count = plan(c, num_threads, items, &shrinks, &macs);
    // A small module's products run on the calling thread: a parallel region costs microseconds.
    const bool parallel = num_threads > 1 && count > 1 && macs >= ((int64_t)1 << 16);
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < shrinks; ++i) shrink(c, items[i]);
#pragma omp for schedule(static)
        for (int64_t i = shrinks; i < count; ++i) expand(c, items[i]);
    }
    free(items);
    return GM_OK;
}

}  // namespace LR_NS

extern "C" int LR_ENTRY(const lr_module* mod, const lr_step* step, const uint16_t* x, int64_t ldx, int64_t in_features,
                        uint16_t* y, int64_t ldy, int num_threads) {
    const LR_NS::Call call = {mod, step, x, ldx, in_features / 2, y, ldy};
    return LR_NS::add(call, num_threads);
}
