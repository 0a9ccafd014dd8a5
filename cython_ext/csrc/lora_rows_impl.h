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

// Every cache line of `count` bfloat16 values from `from`, toward L1.
static inline void prefetch_chunk(const uint16_t* from, int64_t count) {
    for (int64_t e = 0; e < count; e += 32) __builtin_prefetch(from + e);
}

// The block of `target` that adapter lora_id owns, or NULL where it does not adapt the target;
// *at: where its chunks start in the target's B regrouped by block (by_block, lora_rows.h).
static inline const lr_block* block_of(const lr_target* target, int64_t lora_id, int64_t* at = nullptr) {
    const int64_t panels = (target->end - target->start + GM_PANEL - 1) / GM_PANEL;
    int64_t offset = 0;
    for (int64_t b = 0; b < target->num_blocks; ++b) {
        const lr_block* block = &target->blocks[b];
        if (block->lora_id == lora_id) {
            if (at != nullptr) *at = offset;
            return block;
        }
        offset += (block->k1 - block->k0) * GM_PANEL * panels;
    }
    return nullptr;
}

// An item: rows [a, b) of group g (offsets into its run of `order`), through the module's
// shrink and then its expand. Items share nothing (each writes its own rows of u and y), so a
// module needs no barrier between its shrink and its expand: one parallel region, one join.
struct Item {
    int64_t g, a, b;
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

// The item's rows through their adapter's panels of A: u of those panels' columns.
static void shrink(const Call& c, const int64_t* group, const Item& item) {
    const int64_t panels = panels_of(c.mod, group[0], 0, 0, nullptr);
    for (int64_t first = 0; first < panels; first += NR) {
        int64_t index[NR];
        panels_of(c.mod, group[0], first, NR, index);
        const int np = (int)lesser(NR, panels - first);
        const uint16_t* w[NR];
        for (int j = 0; j < np; ++j) w[j] = c.mod->packed_a + index[j] * c.pairs_in * LINE;
        for (int64_t r = item.a; r < item.b; r += MR) {
            const int m = (int)lesser(MR, item.b - r);
            const uint16_t* rows[MR];
            for (int i = 0; i < m; ++i) rows[i] = c.x + c.step->order[group[1] + r + i] * c.ldx;
            Out out[MR];
            tile_for<MR, NR>(m, np)(rows, w, c.pairs_in, SHRINK_AHEAD * LINE, c.pairs_in - SHRINK_AHEAD, out);
            for (int i = 0; i < m; ++i) {
                uint16_t* u = c.step->u + c.step->order[group[1] + r + i] * c.step->ldu;
                for (int j = 0; j < np; ++j) {
                    const int64_t col = index[j] * GM_PANEL;
                    round_u(out[i] + j * GM_PANEL, u + col, (int)lesser(GM_PANEL, c.mod->rank - col));
                }
            }
        }
    }
}

// The item's rows through target t's B: y += d * scale, NR output panels at a time (the B
// chunk of those panels stays in L1 across the item's rows).
static void expand(const Call& c, const int64_t* group, const lr_target* target, const Item& item) {
    int64_t at;
    const lr_block* block = block_of(target, group[0], &at);
    if (block == nullptr) return;
    const int64_t width = target->end - target->start, pairs = (block->k1 - block->k0) / 2;
    const int64_t stride = pairs * LINE;  // regrouped: the block's chunks one after another
    const uint16_t* first = target->by_block + at;
    const int64_t panels = (width + GM_PANEL - 1) / GM_PANEL;
    // Prefetched EXPAND_AHEAD panels on (a block's B is a few KB: the hardware's stream starts late).
    const int64_t chunk = pairs * LINE;
    for (int64_t q = 0; q < lesser(EXPAND_AHEAD, panels); ++q) prefetch_chunk(first + q * stride, chunk);
    for (int64_t p0 = 0; p0 < panels; p0 += NR) {
        const int np = (int)lesser(NR, panels - p0);
        const uint16_t* w[NR];
        for (int j = 0; j < np; ++j) w[j] = first + (p0 + j) * stride;
        for (int64_t q = p0 + EXPAND_AHEAD; q < lesser(p0 + EXPAND_AHEAD + np, panels); ++q)
            prefetch_chunk(first + q * stride, chunk);
        for (int64_t r = item.a; r < item.b; r += MR) {
            const int m = (int)lesser(MR, item.b - r);
            const uint16_t* rows[MR];
            for (int i = 0; i < m; ++i)
                rows[i] = c.step->u + c.step->order[group[1] + r + i] * c.step->ldu + block->k0;
            Out out[MR];
            tile_for<MR, NR>(m, np)(rows, w, pairs, 0, 0, out);
            for (int i = 0; i < m; ++i) {
                const int64_t row = c.step->order[group[1] + r + i];
                const float scale = c.step->row_scale[row];
                uint16_t* y = c.y + row * c.ldy + target->start;
                for (int j = 0; j < np; ++j) {
                    const int64_t col = (p0 + j) * GM_PANEL;
                    add_scaled(out[i] + j * GM_PANEL, scale, y + col, (int)lesser(GM_PANEL, width - col));
                }
            }
        }
    }
}

static void run_item(const Call& c, const Item& item) {
    const int64_t* group = c.step->groups + 3 * item.g;
    shrink(c, group, item);
    for (int64_t t = 0; t < c.mod->num_targets; ++t) expand(c, group, &c.mod->targets[t], item);
}

// The step's rows per item: enough items for the threads to share (a group of a few rows is one
// item; a lone group's rows are split), at most ITEM_ROWS (an item re-reads its adapter's factors
// of the module, from cache: prefill's long groups). A multiple of MR, so tiles stay full.
constexpr int64_t ITEM_ROWS = 16 * LR_MR;

static int64_t rows_per_item(const lr_step* s, int num_threads) {
    int64_t rows = 0;
    for (int64_t g = 0; g < s->num_groups; ++g) rows += s->groups[3 * g + 2] - s->groups[3 * g + 1];
    const int64_t share = (rows + num_threads - 1) / num_threads;
    return lesser(ITEM_ROWS, (share + MR - 1) / MR * MR);
}

// The module's items; *macs: their multiply-adds (whether to fork).
static int64_t plan(const Call& c, int64_t chunk, Item* items, int64_t* macs) {
    const lr_step* s = c.step;
    int64_t count = 0;
    *macs = 0;
    for (int64_t g = 0; g < s->num_groups; ++g) {
        const int64_t rows = s->groups[3 * g + 2] - s->groups[3 * g + 1];
        for (int64_t r = 0; r < rows; r += chunk) items[count++] = {g, r, lesser(rows, r + chunk)};
        for (int64_t t = 0; t < c.mod->num_targets; ++t) {
            const lr_target* target = &c.mod->targets[t];
            const lr_block* block = block_of(target, s->groups[3 * g]);
            if (block != nullptr)
                *macs += rows * (block->k1 - block->k0) * (c.pairs_in * 2 + target->end - target->start);
        }
    }
    return count;
}

static int add(const Call& c, int num_threads) {
    const lr_step* s = c.step;
    if (s->num_groups == 0) return GM_OK;
    const int64_t chunk = rows_per_item(s, num_threads);
    int64_t bound = 0;
    for (int64_t g = 0; g < s->num_groups; ++g) bound += (s->groups[3 * g + 2] - s->groups[3 * g + 1] + chunk - 1) / chunk;
    Item* items = (Item*)malloc(sizeof(Item) * (bound > 0 ? bound : 1));
    if (items == nullptr) return GM_BAD_SHAPE;
    int64_t macs;
    const int64_t count = plan(c, chunk, items, &macs);
    // A small module's products run on the calling thread: a parallel region costs microseconds.
    // Dynamic: a thread that starts late (its core held by another process) takes fewer items.
    const bool parallel = num_threads > 1 && count > 1 && macs >= ((int64_t)1 << 16);
#pragma omp parallel for num_threads(num_threads) schedule(dynamic) if (parallel)
    for (int64_t i = 0; i < count; ++i) run_item(c, items[i]);
    free(items);
    return GM_OK;
}

}  // namespace LR_NS

extern "C" int LR_ENTRY(const lr_module* mod, const lr_step* step, const uint16_t* x, int64_t ldx, int64_t in_features,
                        uint16_t* y, int64_t ldy, int num_threads) {
    const LR_NS::Call call = {mod, step, x, ldx, in_features / 2, y, ldy};
    return LR_NS::add(call, num_threads);
}
