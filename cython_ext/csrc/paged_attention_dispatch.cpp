// The entry point: checks the arguments, writes this step's K/V rows, cuts the work into items,
// runs them on the chosen ISA's kernel and folds split partials into the output. Built without
// ISA flags, like the portable path.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "cpu_features.h"
#include "paged_attention.h"

namespace {

enum pa_error {
    PA_OK = 0,
    PA_BAD_SHAPE = -1,
    PA_BAD_SLOT = -2,
    PA_BAD_BLOCK = -3,
    PA_BAD_SEQUENCE = -4,
    PA_ISA_UNAVAILABLE = -5,
    PA_OUT_OF_MEMORY = PA_SCRATCH_OUT_OF_MEMORY,
};

// A sequence with at most this many query rows spreads its KV splits over separate items (so a
// batch-1 decode keeps both cores busy); longer chunks run their splits inside row tiles. Either
// way the arithmetic per row is the same (paged_attention.h).
constexpr int64_t kSplitItemsMaxRows = 8;

template <class T>
void write_kv(const pa_args* a) {
    const int64_t D = a->head_dim, KVH = a->num_kv_heads, BS = a->block_size;
    const T* k_new = static_cast<const T*>(a->k_new);
    const T* v_new = static_cast<const T*>(a->v_new);
    T* kc = static_cast<T*>(a->k_cache);
    T* vc = static_cast<T*>(a->v_cache);
#pragma omp parallel for num_threads(a->num_threads) if (a->num_tokens * KVH * D > 65536)
    for (int64_t t = 0; t < a->num_tokens; ++t) {
        const int64_t slot = a->slot_mapping[t], block = slot / BS, offset = slot % BS;
        for (int64_t h = 0; h < KVH; ++h) {
            const int64_t dst = ((block * KVH + h) * BS + offset) * D;
            memcpy(kc + dst, k_new + t * a->k_new_row_stride + h * D, D * sizeof(T));
            memcpy(vc + dst, v_new + t * a->v_new_row_stride + h * D, D * sizeof(T));
        }
    }
}

int check_shape(const pa_args* a) {
    if (a->num_heads <= 0 || a->num_kv_heads <= 0 || a->num_heads % a->num_kv_heads || a->head_dim <= 0 || a->head_dim % 2 ||
        a->block_size <= 0 || a->split_positions <= 0 || a->split_positions % a->block_size || a->num_threads <= 0 ||
        a->q_row_stride < a->num_heads * a->head_dim || a->k_new_row_stride < a->num_kv_heads * a->head_dim ||
        a->v_new_row_stride < a->num_kv_heads * a->head_dim)
        return PA_BAD_SHAPE;
    return PA_OK;
}

}  // namespace

extern "C" int pa_check_indices(const pa_args* a) {
    const int err = check_shape(a);
    if (err) return err;
    const int64_t capacity = a->num_blocks * a->block_size;
    for (int64_t t = 0; t < a->num_tokens; ++t)
        if (a->slot_mapping[t] < 0 || a->slot_mapping[t] >= capacity) return PA_BAD_SLOT;
    int64_t rows = 0;
    for (int64_t b = 0; b < a->num_seqs; ++b) {
        const int64_t n = a->num_scheduled[b], ctx = a->context_lens[b];
        if (n <= 0 || ctx < n || a->query_start[b] < 0 || a->query_start[b] + n > a->num_tokens) return PA_BAD_SEQUENCE;
        const int64_t blocks = (ctx + a->block_size - 1) / a->block_size;
        if (blocks > a->max_blocks_per_seq) return PA_BAD_SEQUENCE;
        for (int64_t i = 0; i < blocks; ++i) {
            const int64_t id = a->block_tables[b * a->max_blocks_per_seq + i];
            if (id < 0 || id >= a->num_blocks) return PA_BAD_BLOCK;
        }
        rows += n;
    }
    return rows <= a->num_tokens ? PA_OK : PA_BAD_SEQUENCE;
}

namespace {

struct SplitSeq {  // a sequence whose splits are separate items, and where its partials start
    int64_t seq;
    int64_t offset;
};

// Folds each split sequence's partials, in split order, into its output rows.
template <class T>
void combine(const pa_args* a, const std::vector<SplitSeq>& split_seqs, const float* partials) {
    const int64_t D = a->head_dim, H = a->num_heads, KVH = a->num_kv_heads, G = H / KVH, PF = PA_PARTIAL_FLOATS(D);
    const int64_t total = (int64_t)split_seqs.size() * H;
#pragma omp parallel num_threads(a->num_threads) if (total > 64)
    {
        std::vector<float> acc(D);
#pragma omp for
        for (int64_t flat = 0; flat < total; ++flat) {
            const SplitSeq& ss = split_seqs[flat / H];
            const int64_t head = flat % H, h = head / G, g = head % G;
            const int64_t b = ss.seq, nq = a->num_scheduled[b];
            for (int64_t r = 0; r < nq; ++r) {
                const int64_t last_split = (a->context_lens[b] - nq + r) / a->split_positions;
                float m = 0, l = 0;
                for (int64_t s = 0; s <= last_split; ++s) {
                    // Item (b, h, s) holds rows [0, nq) x G heads: (r * G + g) inside it.
                    const float* p = partials + ss.offset + ((s * KVH + h) * nq * G + r * G + g) * PF;
                    if (s == 0) {
                        m = p[0];
                        l = p[1];
                        memcpy(acc.data(), p + 2, D * sizeof(float));
                    } else {
                        pa_fold_split(&m, &l, acc.data(), p[0], p[1], p + 2, D);
                    }
                }
                T* out = static_cast<T*>(a->out) + ((a->query_start[b] + r) * H + head) * D;
                if (sizeof(T) == 2)
                    pa_store_row_bf16(acc.data(), l, (uint16_t*)out, D);
                else
                    pa_store_row_f32(acc.data(), l, (float*)out, D);
            }
        }
    }
}

bool cpu_has(int isa) {
    switch (isa) {
        case PA_ISA_PORTABLE: return true;
        case PA_ISA_AVX2: return planserve_cpu_avx2();
        case PA_ISA_AVX512: return planserve_cpu_avx512();
        case PA_ISA_AVX512_BF16: return planserve_cpu_avx512_bf16();
    }
    return false;
}

}  // namespace

extern "C" {

void pa_fold_split(float* m, float* l, float* acc, float m_s, float l_s, const float* acc_s, int64_t d) {
    const float m_new = m_s > *m ? m_s : *m;
    const float a = expf(*m - m_new), b = expf(m_s - m_new);
    *l = *l * a + l_s * b;
    for (int64_t i = 0; i < d; ++i) acc[i] = acc[i] * a + acc_s[i] * b;
    *m = m_new;
}

int pa_isa_supported(int isa) { return cpu_has(isa) ? 1 : 0; }

const char* pa_error_message(int code) {
    switch (code) {
        case PA_OK: return "ok";
        case PA_BAD_SHAPE: return "heads, head_dim (even), block_size, split_positions or a row stride out of range";
        case PA_BAD_SLOT: return "slot_mapping entry outside the cache";
        case PA_BAD_BLOCK: return "block_tables entry outside the cache";
        case PA_BAD_SEQUENCE: return "num_scheduled, context_lens or query_start inconsistent";
        case PA_ISA_UNAVAILABLE: return "the requested ISA path is not available on this CPU or build";
        case PA_OUT_OF_MEMORY: return "out of memory for the kernel's per-thread scratch buffers";
    }
    return "unknown error";
}

int pa_paged_attention(const pa_args* a, int isa) {
    if (!cpu_has(isa)) return PA_ISA_UNAVAILABLE;
    const int err = check_shape(a);  // the indices: pa_check_indices, once per step
    if (err) return err;
    if (a->num_tokens == 0) return PA_OK;
    if (a->k_new != nullptr) {
        if (a->dtype == PA_BFLOAT16) write_kv<uint16_t>(a); else write_kv<float>(a);
    }

    const int64_t G = a->num_heads / a->num_kv_heads, PF = PA_PARTIAL_FLOATS(a->head_dim);
    std::vector<pa_item> items;
    std::vector<SplitSeq> split_seqs;
    int64_t partial_floats = 0;
    for (int64_t b = 0; b < a->num_seqs; ++b) {
        const int64_t nq = a->num_scheduled[b], ctx = a->context_lens[b];
        const int64_t num_splits = (ctx + a->split_positions - 1) / a->split_positions;
        if (nq <= kSplitItemsMaxRows && num_splits > 1) {
            split_seqs.push_back({b, partial_floats});
            for (int64_t s = 0; s < num_splits; ++s)
                for (int64_t h = 0; h < a->num_kv_heads; ++h) {
                    items.push_back({(int32_t)b, (int32_t)h, 0, (int32_t)nq, (int32_t)s, (int32_t)(s + 1), partial_floats});
                    partial_floats += nq * G * PF;
                }
            continue;
        }
        // Row tiles from the end: the longest rows first, so dynamic scheduling balances.
        for (int64_t r1 = nq; r1 > 0; r1 -= PA_MAX_TILE_ROWS) {
            const int64_t r0 = r1 > PA_MAX_TILE_ROWS ? r1 - PA_MAX_TILE_ROWS : 0;
            for (int64_t h = 0; h < a->num_kv_heads; ++h)
                items.push_back({(int32_t)b, (int32_t)h, (int32_t)r0, (int32_t)r1, 0, (int32_t)num_splits, -1});
        }
    }
    std::vector<float> partials(partial_floats);
    const int64_t n = (int64_t)items.size();
    int ran;
    switch (isa) {
        case PA_ISA_PORTABLE: ran = pa_run_items_portable(a, items.data(), n, partials.data()); break;
#if defined(PLANSERVE_PA_X86)
        case PA_ISA_AVX2: ran = pa_run_items_avx2(a, items.data(), n, partials.data()); break;
        case PA_ISA_AVX512: ran = pa_run_items_avx512(a, items.data(), n, partials.data()); break;
        case PA_ISA_AVX512_BF16: ran = pa_run_items_avx512_bf16(a, items.data(), n, partials.data()); break;
#endif
        default: return PA_ISA_UNAVAILABLE;
    }
    if (ran) return ran;
    if (!split_seqs.empty()) {
        if (a->dtype == PA_BFLOAT16) combine<uint16_t>(a, split_seqs, partials.data());
        else combine<float>(a, split_seqs, partials.data());
    }
    return PA_OK;
}

}  // extern "C"
