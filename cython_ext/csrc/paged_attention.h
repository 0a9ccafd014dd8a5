// Paged attention over a packed mixed batch, reading K/V in place through the block table.
//
// The contract between the Cython wrapper (cython_ext/paged_attention.pyx) and the C++ kernel.
// One call per layer: write this step's K/V rows into the cache, then attend every query row.
//
//   q, out        [T, H, D]            packed query rows (T = sum of num_scheduled)
//   k_new, v_new  [T, KVH, D]          this step's K/V rows, written at slot_mapping[t]
//   k/v cache     [NB, KVH, BS, D]     block-major, then KV head, then position in the block
//   slot_mapping  [T]      int64       block_id * BS + offset
//   query_start   [B]      int64       packed row of sequence b's first query
//   num_scheduled [B]      int64       query rows of sequence b (1 for a decode)
//   context_lens  [B]      int64       cached prefix + num_scheduled of sequence b
//   block_tables  [B, MB]  int64       block ids of sequence b's context, in order
//
// Query row r of sequence b sits at position context_lens[b] - num_scheduled[b] + r and attends
// positions 0 .. that position (causal inside the chunk, full over the cached prefix).
//
// Batch invariance by construction: the context of every row is cut into KV splits at fixed
// positions (multiples of split_positions); each split is reduced block by block in position order,
// and the splits are folded in order by pa_fold_split. Whether a split runs as its own work item or
// inside a row tile's loop, whether the row is a decode or inside a chunk, and what else shares the
// call change nothing in that arithmetic.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum pa_dtype { PA_FLOAT32 = 0, PA_BFLOAT16 = 1 };
// In order of preference: the last one a CPU runs is the default.
enum pa_isa { PA_ISA_PORTABLE = 0, PA_ISA_AVX2 = 1, PA_ISA_AVX512 = 2, PA_ISA_AVX512_BF16 = 3 };

typedef struct pa_args {
    const void* q;
    const void* k_new;
    const void* v_new;
    void* k_cache;
    void* v_cache;
    void* out;
    const int64_t* slot_mapping;
    const int64_t* query_start;
    const int64_t* num_scheduled;
    const int64_t* context_lens;
    const int64_t* block_tables;
    int64_t q_row_stride;        // elements between q rows (H * D when contiguous)
    int64_t k_new_row_stride;    // elements between k_new rows (KVH * D when contiguous)
    int64_t v_new_row_stride;    // elements between v_new rows
    int64_t num_tokens;          // T
    int64_t num_seqs;            // B
    int64_t num_heads;           // H
    int64_t num_kv_heads;        // KVH
    int64_t head_dim;            // D
    int64_t block_size;          // BS
    int64_t num_blocks;          // NB
    int64_t max_blocks_per_seq;  // MB (row stride of block_tables)
    int64_t split_positions;     // KV split length, a multiple of BS
    float scale;
    int dtype;                   // pa_dtype
    int num_threads;
} pa_args;

// One unit of work: query rows [row_begin, row_end) of sequence seq, KV head kv_head, over KV
// splits [split_begin, split_end). A row tile with one split per item stores its partial state;
// a tile that runs all its splits folds them itself and writes the output.
typedef struct pa_item {
    int32_t seq;
    int32_t kv_head;
    int32_t row_begin;
    int32_t row_end;
    int32_t split_begin;
    int32_t split_end;
    int64_t partial_offset;      // float offset of this item's partials, -1: write out directly
} pa_item;

// Partial state of one (row, head, split): m (running max), l (sum of exp), acc[D].
#define PA_PARTIAL_FLOATS(d) ((d) + 2)
// Query rows of one work item at most (a tile shares each K/V block read among its rows).
#define PA_MAX_TILE_ROWS 16
// KV blocks requested ahead of the one being attended (the first ones whole by pa_prefetch_block,
// then each one's lines spread over the block PA_PREFETCH_BLOCKS before it by PrefetchCursor).
#ifndef PA_PREFETCH_BLOCKS
#define PA_PREFETCH_BLOCKS 2
#endif

// out[d] = acc[d] / l, rounded to the output dtype (bfloat16: round to nearest even). Division,
// not a multiply by 1/l: IEEE division rounds the same in every ISA, so the split-item path and
// the tile path write the same bits.
static inline void pa_store_row_f32(const float* acc, float l, float* out, int64_t d) {
    for (int64_t i = 0; i < d; ++i) out[i] = acc[i] / l;
}
static inline void pa_store_row_bf16(const float* acc, float l, uint16_t* out, int64_t d) {
    for (int64_t i = 0; i < d; ++i) {
        union { float f; uint32_t u; } x;
        x.f = acc[i] / l;
        uint32_t u = x.u;
        if ((u & 0x7fffffffu) > 0x7f800000u) { out[i] = (uint16_t)((u >> 16) | 0x40); continue; }  // NaN stays NaN
        u += 0x7fffu + ((u >> 16) & 1u);
        out[i] = (uint16_t)(u >> 16);
    }
}

// Folds split state (m_s, l_s, acc_s) into the running (m, l, acc); the first split is taken as
// it is. The one place the splits' combination is defined (paged_attention_dispatch.cpp).
void pa_fold_split(float* m, float* l, float* acc, float m_s, float l_s, const float* acc_s, int64_t d);

// The ISA kernels: process the items (each TU compiled with its own ISA flags); 0, or
// PA_SCRATCH_OUT_OF_MEMORY when a thread's scratch buffers could not be allocated.
#define PA_SCRATCH_OUT_OF_MEMORY (-6)
int pa_run_items_portable(const pa_args* a, const pa_item* items, int64_t num_items, float* partials);
int pa_run_items_avx2(const pa_args* a, const pa_item* items, int64_t num_items, float* partials);
int pa_run_items_avx512(const pa_args* a, const pa_item* items, int64_t num_items, float* partials);
int pa_run_items_avx512_bf16(const pa_args* a, const pa_item* items, int64_t num_items, float* partials);

// The entry point: 0 on success, else a negative code (pa_error_message says which). It trusts
// the indices: pa_check_indices must have passed for them and the same cache shape.
int pa_paged_attention(const pa_args* a, int isa);
// Every slot, block id and sequence range inside the cache and the packed rows: 0, or the code.
int pa_check_indices(const pa_args* a);
const char* pa_error_message(int code);
// 1 when this build has the ISA's code and the CPU runs it.
int pa_isa_supported(int isa);

#ifdef __cplusplus
}
#endif
