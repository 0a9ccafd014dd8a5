// The per-row LoRA products' C entry points (lora_rows.h): argument checks, then the ISA path, by
// the GEMM's ISA index (gemm.h), whose bits each path reproduces.
#include <string.h>

#include "cpu_features.h"
#include "gemm.h"
#include "lora_rows.h"

extern "C" {

typedef int (*lr_path_fn)(const lr_module*, const lr_step*, const uint16_t*, int64_t, int64_t, uint16_t*, int64_t, int);

int lr_add_portable(const lr_module*, const lr_step*, const uint16_t*, int64_t, int64_t, uint16_t*, int64_t, int);
#if defined(PLANSERVE_PA_X86)
int lr_add_avx512_bf16(const lr_module*, const lr_step*, const uint16_t*, int64_t, int64_t, uint16_t*, int64_t, int);
int lr_add_avx512(const lr_module*, const lr_step*, const uint16_t*, int64_t, int64_t, uint16_t*, int64_t, int);
int lr_add_avx2(const lr_module*, const lr_step*, const uint16_t*, int64_t, int64_t, uint16_t*, int64_t, int);
#endif

int lr_isa_supported(int isa) {
    switch (isa) {
        case GM_ISA_PORTABLE: return 1;
#if defined(PLANSERVE_PA_X86)
        case GM_ISA_AVX512_BF16: return planserve_cpu_avx512_bf16() ? 1 : 0;
        case GM_ISA_AVX2: return planserve_cpu_avx2() ? 1 : 0;
        case GM_ISA_AVX512: return planserve_cpu_avx512() ? 1 : 0;
#endif
    }
    return 0;
}

static lr_path_fn path(int isa) {
    switch (isa) {
#if defined(PLANSERVE_PA_X86)
        case GM_ISA_AVX512_BF16: return lr_add_avx512_bf16;
        case GM_ISA_AVX2: return lr_add_avx2;
        case GM_ISA_AVX512: return lr_add_avx512;
#endif
    }
    return lr_add_portable;
}

// A block inside its target's K, at an even offset from the target's first column, of even size.
static bool bad_block(const lr_target* target, const lr_block* block) {
    return block->k0 < target->k0 || block->k1 > target->k1 || block->k0 >= block->k1 ||
           (block->k0 - target->k0) % 2 || (block->k1 - block->k0) % 2;
}

static int64_t panels_of(const lr_target* target) { return (target->end - target->start + GM_PANEL - 1) / GM_PANEL; }

int64_t lr_by_block_size(const lr_target* target) {
    if (target->k0 < 0 || target->k0 >= target->k1 || target->start >= target->end || target->num_blocks < 0) return 0;
    int64_t size = 0;
    for (int64_t b = 0; b < target->num_blocks; ++b) {
        if (bad_block(target, &target->blocks[b])) return 0;
        size += (target->blocks[b].k1 - target->blocks[b].k0) * GM_PANEL * panels_of(target);
    }
    return size;
}

int lr_regroup_b(const lr_target* target, uint16_t* out) {
    if (target->packed_b == nullptr || lr_by_block_size(target) == 0) return GM_BAD_SHAPE;
    const int64_t line = 2 * GM_PANEL, stride = (target->k1 - target->k0) / 2 * line;
    for (int64_t b = 0; b < target->num_blocks; ++b) {
        const lr_block* block = &target->blocks[b];
        const int64_t chunk = (block->k1 - block->k0) / 2 * line;
        const uint16_t* from = target->packed_b + (block->k0 - target->k0) / 2 * line;
        for (int64_t q = 0; q < panels_of(target); ++q, out += chunk) memcpy(out, from + q * stride, chunk * 2);
    }
    return GM_OK;
}

// Every block inside its target's K at even offsets, every target's columns inside y's row, the
// regrouped B in place.
static bool bad_module(const lr_module* mod, int64_t ldy) {
    if (mod->packed_a == nullptr || mod->rank <= 0 || mod->num_targets < 0) return true;
    for (int64_t t = 0; t < mod->num_targets; ++t) {
        const lr_target* target = &mod->targets[t];
        if (target->k0 < 0 || target->k1 > mod->rank || target->k0 >= target->k1 || (target->k1 - target->k0) % 2 ||
            target->start < 0 || target->end > ldy || target->start >= target->end || target->num_blocks < 0 ||
            (target->num_blocks > 0 && target->by_block == nullptr))
            return true;
        for (int64_t b = 0; b < target->num_blocks; ++b)
            if (bad_block(target, &target->blocks[b])) return true;
    }
    return false;
}

int lr_add(const lr_module* mod, const lr_step* step, const uint16_t* x, int64_t ldx, int64_t in_features, uint16_t* y,
           int64_t ldy, int isa, int num_threads) {
    if (!lr_isa_supported(isa)) return GM_ISA_UNAVAILABLE;
    if (in_features <= 0 || in_features % 2 || ldx < in_features || step->ldu < mod->rank || num_threads <= 0 ||
        step->num_groups < 0 || bad_module(mod, ldy))
        return GM_BAD_SHAPE;
    return path(isa)(mod, step, x, ldx, in_features, y, ldy, num_threads);
}

}  // extern "C"
