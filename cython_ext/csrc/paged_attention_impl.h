// The paged attention algorithm, written once and compiled once per ISA: each
// paged_attention_<isa>.cpp defines `struct Ops` (its vector primitives) inside its own namespace
// and then includes this file there. Ops prepares a query row (prepare_query: into D floats of
// scratch, in whatever form its scores() reads), a K/V block (prepare_block: K in the form its
// scores() reads, V as float32 rows [n, D]; either in the scratch given or in place) and computes scores, exp and the weighted sum of V rows.
// No C++ standard library here: an inline std:: template
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

// Keys of block `blk` that the row at `position` attends (it starts at or before the position).
static inline int64_t keys_of_row(int64_t position, int64_t blk, int64_t block_size, int64_t in_block) {
    const int64_t n = position - blk * block_size + 1;
    return n < in_block ? n : in_block;
}

template <class T>
static void pa_run_items_impl(const pa_args* a, const pa_item* items, int64_t num_items, float* partials) {
    const int64_t D = a->head_dim, BS = a->block_size, H = a->num_heads, KVH = a->num_kv_heads;
    const int64_t G = H / KVH, blocks_per_split = a->split_positions / BS;
    const int64_t max_rows = PA_MAX_TILE_ROWS;
    const float neg_inf = -__builtin_inff();
    constexpr bool is_bf16 = sizeof(T) == 2;
    static_assert(sizeof(T) == 2 || sizeof(T) == 4, "float32 or bfloat16 (as uint16_t)");

#pragma omp parallel num_threads(a->num_threads)
    {
        // Per-thread scratch, once per call. A block's K/V are prepared once per item and block
        // (converted, transposed or packed as the ISA's Ops likes them) and shared by the rows.
        const int64_t keys_padded = (BS + 15) / 16 * 16;
        float* qf = (float*)malloc(sizeof(float) * max_rows * G * D);
        float* kbuf = (float*)malloc(sizeof(float) * keys_padded * (D + 1));
        float* vbuf = (float*)malloc(sizeof(float) * BS * D);
        float* s = (float*)malloc(sizeof(float) * max_rows * G * keys_padded);
        float* alpha = (float*)malloc(sizeof(float) * max_rows * G);
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

            for (int64_t r = 0; r < nrows; ++r)
                for (int64_t g = 0; g < G; ++g)
                    Ops::prepare_query(q + ((row0 + r0 + r) * H + h * G + g) * D, qf + (r * G + g) * D, D);
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
                    int64_t in_block = ctx - blk * BS;
                    if (in_block > BS) in_block = BS;
                    const float* k;
                    const float* v = Ops::prepare_block(pa_cache_block<T>(a->k_cache, block_id, h, a),
                                                        pa_cache_block<T>(a->v_cache, block_id, h, a), in_block, D, kbuf, vbuf, &k);
                    // Three passes over the tile's (row, head) pairs: scores, softmax update, weighted V
                    // sum. Ops may compute several pairs at once (sharing each K/V load); a pair's own
                    // arithmetic is the same whichever pairs share the pass.
                    int64_t first_row = 0;  // rows before it end before this block
                    while (first_row < nrows && blk * BS > first_pos + r0 + first_row) ++first_row;
                    Ops::template scores_rows<T>(qf + first_row * G * D, (nrows - first_row) * G, k, in_block, D, a->scale,
                                                 s + first_row * G * keys_padded, keys_padded);
                    for (int64_t r = first_row; r < nrows; ++r) {
                        const int64_t n = keys_of_row(first_pos + r0 + r, blk, BS, in_block);
                        for (int64_t g = 0; g < G; ++g) {
                            const int64_t rg = r * G + g;
                            float* sr = s + rg * keys_padded;
                            const float block_max = Ops::max(sr, n);
                            const float m_old = m[rg];
                            const float m_new = block_max > m_old ? block_max : m_old;
                            // exp(0) is exactly 1 in every path's exp, so skipping it changes no bit.
                            alpha[rg] = m_new == m_old ? 1.0f : Ops::exp1(m_old - m_new);
                            const float sum = Ops::exp_shifted(sr, n, m_new);
                            m[rg] = m_new;
                            l[rg] = l[rg] * alpha[rg] + sum;
                        }
                    }
                    for (int64_t r = first_row; r < nrows;) {  // runs of rows that see the same keys
                        const int64_t n = keys_of_row(first_pos + r0 + r, blk, BS, in_block);
                        int64_t run_end = r + 1;
                        while (run_end < nrows && keys_of_row(first_pos + r0 + run_end, blk, BS, in_block) == n) ++run_end;
                        Ops::axpy_rows(acc + r * G * D, alpha + r * G, s + r * G * keys_padded, keys_padded, (run_end - r) * G, v, n, D);
                        r = run_end;
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
        free(qf); free(kbuf); free(vbuf); free(s); free(alpha); free(m); free(l); free(acc); free(fm); free(fl); free(facc); free(folded);
    }
}

static void pa_run_items_dispatch_dtype(const pa_args* a, const pa_item* items, int64_t num_items, float* partials) {
    if (a->dtype == PA_BFLOAT16)
        pa_run_items_impl<uint16_t>(a, items, num_items, partials);
    else
        pa_run_items_impl<float>(a, items, num_items, partials);
}
