// LoRA products row by row, each row against its own adapter only (the contract; lora_rows_impl.h
// holds the loop nest, one translation unit per ISA path computes it).
//
// The stacks (model_service/lora/stacked.py) hold every loaded adapter of a fused module: A packed
// [K, in features] with K = per target, per adapter, the adapter's rank padded to even; each
// target's B packed [columns, k1 - k0]. A packed GEMM over the whole stack makes every row run
// every loaded adapter's shrink and expand, masked to its own: with 8 adapters, 8x the useful
// multiply-adds. Here a row runs its own adapter's blocks only:
//   shrink  u[r, c] = bf16(sum over input pairs of x[r] . A[c])  for c in its blocks' panels
//   expand  d[col] = sum over the block's pairs of u[r, block] . B[col, block]   (float32)
//           y[r, col] = bf16(y[r, col] + d[col] * scale[r])  (the product rounded, then the sum)
// Rows are grouped by adapter (lr_step: the order and the groups, base rows in none), so a group
// reads its adapter's blocks once for all its rows (a long group, split among the threads, again
// from cache). A group's rows run their shrink and then their expand on one thread, reading B
// regrouped by adapter (lr_target.by_block: one adapter's chunks contiguous): a module is one
// OpenMP parallel region with no barrier inside (on shared cores a barrier waits for the other
// core whenever another process holds it).
//
// Same bits as the packed GEMM over the stack (gemm.h), ISA path for ISA path: each u element is
// the GEMM's sum for that column (from zero, over the input's pairs in order, in the path's order
// within a pair, rounded as the path rounds); each d element is the GEMM's sum over the target's K
// with the masked columns left out, which only added exact zeros to a sum that started from +0
// (a block starts at an even offset from the target's first column, so pairs are the GEMM's pairs).
// So a row's bits do not depend on the other rows of its step, nor on the other adapters loaded.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// One adapter's columns [k0, k1) of the module's K (absolute; k0 - target k0 and k1 - k0 even).
typedef struct lr_block {
    int64_t lora_id, k0, k1;
} lr_block;

// One target of a fused module: its K columns [k0, k1), its B packed [end - start, k1 - k0], the
// output columns [start, end) it adds into, and where each adapter sits in its K. by_block: the
// same B regrouped by block (lr_regroup_b), which the products read: packed_b's panels hold every
// adapter's chunk side by side, so one adapter's chunks lie a panel's stride apart; regrouped,
// each block's chunks of every panel follow one another (block after block, in blocks' order).
typedef struct lr_target {
    const uint16_t* packed_b;
    int64_t k0, k1, start, end;
    int64_t num_blocks;
    const lr_block* blocks;
    const uint16_t* by_block;
} lr_target;

// A fused module's stacked adapters: A packed [rank, in features]. packed_a NULL: no loaded
// adapter adapts this module.
typedef struct lr_module {
    const uint16_t* packed_a;
    int64_t rank;
    int64_t num_targets;
    const lr_target* targets;
} lr_module;

// A step's rows by adapter: groups[g] = (lora_id, begin, end), the group's rows order[begin:end]
// (ascending); base rows belong to no group. row_scale[r]: row r's adapter's scale. u: scratch,
// [rows, ldu] bfloat16 with ldu >= the module's rank.
typedef struct lr_step {
    const int64_t* order;
    const int64_t* groups;  // [num_groups][3]
    int64_t num_groups;
    const float* row_scale;
    uint16_t* u;
    int64_t ldu;
} lr_step;

// y [*, ldy] += the module's LoRA products of x [*, ldx] (in_features columns), rows as `step`
// groups them. isa: gemm.h's gm_isa, so the bits are the GEMM path's. 0 or a gm_error code.
int lr_add(const lr_module* mod, const lr_step* step, const uint16_t* x, int64_t ldx, int64_t in_features, uint16_t* y,
           int64_t ldy, int isa, int num_threads);

int lr_isa_supported(int isa);

// The bfloat16 values of target's B regrouped by block (0 where a block lies outside the target's
// K or at an odd offset), and the copy itself into out (that many values); sets nothing.
int64_t lr_by_block_size(const lr_target* target);
int lr_regroup_b(const lr_target* target, uint16_t* out);

#ifdef __cplusplus
}
#endif
