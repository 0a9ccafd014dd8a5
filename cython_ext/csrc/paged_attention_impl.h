// The paged attention algorithm, written once and compiled once per ISA: each
// paged_attention_<isa>.cpp defines `struct Ops` (its vector primitives) inside its own namespace
// and then includes this file there. No C++ standard library here: an inline std:: template
// compiled with AVX-512 flags could be merged by the linker into the portable path.
//
// Per work item (sequence b, KV head h, query rows [r0, r1), KV splits [s0, s1)), G = H / KVH
// query heads share KV head h and are processed together, so each K/V block is read once per
// row tile. For each split, for each block of the split, in position order, for each row and head:
//
//     s_j   = (q . k_j) * scale                  j < valid keys of the row in this block
//     m'    = max(m, max_j s_j)
//     p_j   = exp(s_j - m'),  alpha = exp(m - m')
//     l     = l * alpha + sum_j p_j
//     acc   = acc * alpha + sum_j p_j v_j        (j ascending, float32)
//
// and each split's (m, l, acc) is folded in split order by pa_fold_split. The result of a row
// depends on nothing but its own query, its context and its position.

template <class T>
static inline T* pa_cache_block(void* cache, int64_t block_id, int64_t kv_head, const pa_args* a) {
    return static_cast<T*>(cache) + ((block_id * a->num_kv_heads + kv_head) * a->block_size) * a->head_dim;
}

template <class T>
static void pa_run_items_impl(const pa_args* a, const pa_item* items, int64_t num_items, float* partials) {
    const int64_t D = a->head_dim, BS = a->block_size, H = a->num_heads, KVH = a->num_kv_heads;
    const int64_t G = H / KVH, blocks_per_split = a->split_positions / BS;
    const int64_t max_rows = PA_MAX_TILE_ROWS;
    const float neg_inf = -__builtin_inff();
    constexpr bool is_bf16 = sizeof(T) == 2;

#pragma omp parallel num_threads(a->num_threads)
    {
        // Per-thread scratch, once per call.
        float* qf = (float*)malloc(sizeof(float) * max_rows * G * D);
        float* kf = (float*)malloc(sizeof(float) * BS * D);
        float* vf = (float*)malloc(sizeof(float) * BS * D);
        float* s = (float*)malloc(sizeof(float) * BS);
        float* m = (float*)malloc(sizeof(float) * max_rows * G);
        float* l = (float*)malloc(sizeof(float) * max_rows * G);
        float* acc = (float*)malloc(sizeof(float) * max_rows * G * D);
        float* fm = (float*)malloc(sizeof(float) * max_rows * G);
        float* fl = (float*)malloc(sizeof(float) * max_rows * G);
        float* facc = (float*)malloc(sizeof(float) * max_rows * G * D);
        char* folded = (char*)malloc(max_rows * G);

#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < num_items; ++it) {
            const pa_item item = items[it];
            const int64_t b = item.seq, h = item.kv_head, r0 = item.row_begin, r1 = item.row_end;
            const int64_t nrows = r1 - r0;
            const int64_t ctx = a->context_lens[b];
            const int64_t first_pos = ctx - a->num_scheduled[b];
            const int64_t row0 = a->query_start[b];
            const int64_t last_pos = first_pos + r1 - 1;
            const int64_t* table = a->block_tables + b * a->max_blocks_per_seq;
            const T* q = static_cast<const T*>(a->q);

            if (is_bf16 && !Ops::kScoresFromRawK) {
                for (int64_t r = 0; r < nrows; ++r)
                    for (int64_t g = 0; g < G; ++g)
                        Ops::to_float((const uint16_t*)(q + ((row0 + r0 + r) * H + h * G + g) * D), qf + (r * G + g) * D, D);
            }
            for (int64_t i = 0; i < nrows * G; ++i) folded[i] = 0;

            for (int64_t split = item.split_begin; split < item.split_end; ++split) {
                const int64_t split_first = split * a->split_positions;
                if (split_first > last_pos) break;
                for (int64_t i = 0; i < nrows * G; ++i) { m[i] = neg_inf; l[i] = 0.0f; }
                for (int64_t i = 0; i < nrows * G * D; ++i) acc[i] = 0.0f;
                int64_t blk_end = (split + 1) * blocks_per_split;
                if (blk_end > last_pos / BS + 1) blk_end = last_pos / BS + 1;
                for (int64_t blk = split * blocks_per_split; blk < blk_end; ++blk) {
                    const int64_t block_id = table[blk];
                    const T* kb = pa_cache_block<T>(a->k_cache, block_id, h, a);
                    const T* vb = pa_cache_block<T>(a->v_cache, block_id, h, a);
                    int64_t in_block = ctx - blk * BS;
                    if (in_block > BS) in_block = BS;
                    const float* kblock = (const float*)kb;
                    const float* vblock = (const float*)vb;
                    if constexpr (is_bf16) {
                        if (!Ops::kScoresFromRawK) { Ops::to_float((const uint16_t*)kb, kf, in_block * D); kblock = kf; }
                        Ops::to_float((const uint16_t*)vb, vf, in_block * D);
                        vblock = vf;
                    }
                    for (int64_t r = 0; r < nrows; ++r) {
                        const int64_t limit = first_pos + r0 + r;  // the row's own position
                        if (blk * BS > limit) continue;
                        int64_t n = limit - blk * BS + 1;
                        if (n > in_block) n = in_block;
                        for (int64_t g = 0; g < G; ++g) {
                            const int64_t rg = r * G + g;
                            if constexpr (is_bf16) {
                                if (Ops::kScoresFromRawK)
                                    Ops::scores_bf16((const uint16_t*)(q + ((row0 + r0 + r) * H + h * G + g) * D), (const uint16_t*)kb, n, D, a->scale, s);
                                else
                                    Ops::scores(qf + rg * D, kblock, n, D, a->scale, s);
                            } else {
                                Ops::scores((const float*)(q + ((row0 + r0 + r) * H + h * G + g) * D), kblock, n, D, a->scale, s);
                            }
                            float block_max = s[0];
                            for (int64_t j = 1; j < n; ++j) block_max = s[j] > block_max ? s[j] : block_max;
                            const float m_old = m[rg];
                            const float m_new = block_max > m_old ? block_max : m_old;
                            const float alpha = Ops::exp1(m_old - m_new);
                            const float sum = Ops::exp_shifted(s, n, m_new);
                            m[rg] = m_new;
                            l[rg] = l[rg] * alpha + sum;
                            Ops::scale_axpy(acc + rg * D, alpha, s, vblock, n, D);
                        }
                    }
                }
                // The split is done: hand it on (its own item) or fold it (a tile running its splits).
                for (int64_t r = 0; r < nrows; ++r) {
                    if (split_first > first_pos + r0 + r) continue;  // the row ends before this split
                    for (int64_t g = 0; g < G; ++g) {
                        const int64_t rg = r * G + g;
                        if (item.partial_offset >= 0) {
                            float* p = partials + item.partial_offset + rg * PA_PARTIAL_FLOATS(D);
                            p[0] = m[rg];
                            p[1] = l[rg];
                            for (int64_t d = 0; d < D; ++d) p[2 + d] = acc[rg * D + d];
                        } else {
                            if (!folded[rg]) {
                                fm[rg] = m[rg];
                                fl[rg] = l[rg];
                                for (int64_t d = 0; d < D; ++d) facc[rg * D + d] = acc[rg * D + d];
                                folded[rg] = 1;
                            } else {
                                pa_fold_split(fm + rg, fl + rg, facc + rg * D, m[rg], l[rg], acc + rg * D, D);
                            }
                        }
                    }
                }
            }
            if (item.partial_offset < 0) {
                for (int64_t r = 0; r < nrows; ++r)
                    for (int64_t g = 0; g < G; ++g) {
                        const int64_t rg = r * G + g;
                        T* o = static_cast<T*>(a->out) + ((row0 + r0 + r) * H + h * G + g) * D;
                        if constexpr (is_bf16)
                            pa_store_row_bf16(facc + rg * D, fl[rg], (uint16_t*)o, D);
                        else
                            pa_store_row_f32(facc + rg * D, fl[rg], (float*)o, D);
                    }
            }
        }
        free(qf); free(kf); free(vf); free(s); free(m); free(l); free(acc); free(fm); free(fl); free(facc); free(folded);
    }
}

static void pa_run_items_dispatch_dtype(const pa_args* a, const pa_item* items, int64_t num_items, float* partials) {
    if (a->dtype == PA_BFLOAT16)
        pa_run_items_impl<uint16_t>(a, items, num_items, partials);
    else
        pa_run_items_impl<float>(a, items, num_items, partials);
}
