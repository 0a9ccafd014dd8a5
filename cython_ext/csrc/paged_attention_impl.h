// The paged attention algorithm, written once and compiled once per ISA: each
// paged_attention_<isa>.cpp defines `struct Ops` (its vector primitives) inside its own namespace
// and then includes this file there. Ops prepares a query row (prepare_query: into D floats of
// scratch, in whatever form its scores() reads), a K/V block (prepare_block: K in the form its
// scores() reads, V rows [n, D] in the form its axpy_rows<T>() reads: float32 in the scratch
// given, or the cache's own rows in place) and computes
// scores, exp and the weighted sum of V rows. No C++ standard library here: an inline std::
// template compiled with AVX-512 flags could be merged by the linker into the portable path.
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

// Per-thread scratch, allocated once per call. Pairs (row r of the tile, head g) are indexed
// rg = r * G + g.
struct Scratch {
    int64_t keys_padded;  // block_size rounded up to whole 16-key groups
    float* qf;            // [rows * G, D]   the tile's queries, as Ops::prepare_query left them
    float* kbuf;          // one block's K as Ops::prepare_block left it
    float* vbuf;          // one block's V as float32 rows (when not read in place)
    float* s;             // [rows * G, keys_padded]  scores, then probabilities
    float* alpha;         // [rows * G]  this block's rescale of the running state
    float* m;             // [rows * G]  running max of the current split
    float* l;             // [rows * G]  running sum of exp of the current split
    float* acc;           // [rows * G, D]  running weighted V sum of the current split
    float* fm;            // [rows * G]  the splits folded so far (a tile running its splits)
    float* fl;
    float* facc;
    char* folded;         // [rows * G]  whether any split was folded yet
    int32_t* keys;        // [rows * G]  keys of the current block each pair attends

    Scratch(const pa_args* a) {
        const int64_t D = a->head_dim, pairs = PA_MAX_TILE_ROWS * (a->num_heads / a->num_kv_heads);
        keys_padded = (a->block_size + 15) / 16 * 16;
        qf = alloc(pairs * D);
        kbuf = alloc(keys_padded * (D + 1));
        vbuf = alloc(a->block_size * D);
        s = alloc(pairs * keys_padded);
        alpha = alloc(pairs);
        m = alloc(pairs);
        l = alloc(pairs);
        acc = alloc(pairs * D);
        fm = alloc(pairs);
        fl = alloc(pairs);
        facc = alloc(pairs * D);
        folded = (char*)malloc(pairs);
        keys = (int32_t*)malloc(sizeof(int32_t) * pairs);
    }
    ~Scratch() {
        free(qf); free(kbuf); free(vbuf); free(s); free(alpha); free(m); free(l); free(acc);
        free(fm); free(fl); free(facc); free(folded); free(keys);
    }
    // Whether every buffer was allocated (free(nullptr) is a no-op, so a partial one still frees).
    bool ok() const {
        return qf && kbuf && vbuf && s && alpha && m && l && acc && fm && fl && facc && folded && keys;
    }
    static float* alloc(int64_t n) { return (float*)malloc(sizeof(float) * n); }
};

// The rows of one work item: query rows [r0, r1) of sequence b, KV head h.
struct Tile {
    int64_t b, h, r0, nrows;
    int64_t first_pos;  // position of the sequence's first query row this step
    int64_t row0;       // packed row of the sequence's first query row
    int64_t ctx;        // context length of the sequence
    int64_t position(int64_t r) const { return first_pos + r0 + r; }  // of tile row r
};

template <class T>
static inline const T* pa_cache_block(const void* cache, int64_t block_id, int64_t kv_head, const pa_args* a) {
    return static_cast<const T*>(cache) + ((block_id * a->num_kv_heads + kv_head) * a->block_size) * a->head_dim;
}

// Asks for a line of K or V ahead of use. Blocks are scattered over the cache (no stride for the
// hardware prefetcher to follow) and a step's KV is larger than the caches, so without it every
// block's first lines wait for memory and decode attention reads KV at a fraction of the memory's
// bandwidth (docs/benchmarks.md, "Figures behind the code's comments").
static inline __attribute__((always_inline)) void pa_prefetch(const char* p) {
#if defined(__x86_64__)
    asm volatile("prefetcht0 %0" : : "m"(*p));  // GCC 12 drops __builtin_prefetch in this loop
#else
    __builtin_prefetch(p);
#endif
}

// Walks one block's K and V lines of one KV head. pa_attend_block takes four steps of a quarter
// each, so the prefetches of the block ahead are spread over the current block's work: one burst of
// 64 lines at the start of each block stalled on the core's miss buffers and then left them idle
// while the block computed (the gain: docs/benchmarks.md, "Figures behind the code's comments").
// An idle cursor (never started) steps over nothing.
struct PrefetchCursor {
    const char* k = nullptr;
    const char* v = nullptr;
    int64_t off = 0, bytes = 0;
    template <class T>
    void start(const pa_args* a, int64_t seq, int64_t kv_head, int64_t blk) {
        const int64_t block_id = a->block_tables[seq * a->max_blocks_per_seq + blk];
        k = reinterpret_cast<const char*>(pa_cache_block<T>(a->k_cache, block_id, kv_head, a));
        v = reinterpret_cast<const char*>(pa_cache_block<T>(a->v_cache, block_id, kv_head, a));
        off = 0;
        bytes = a->block_size * a->head_dim * (int64_t)sizeof(T);
    }
    inline __attribute__((always_inline)) void step() {  // a quarter of the block, in whole lines
        const int64_t quarter = (bytes + 255) / 256 * 64;
        to(off + quarter < bytes ? off + quarter : bytes);
    }
    inline __attribute__((always_inline)) void finish() { to(bytes); }

  private:
    inline __attribute__((always_inline)) void to(int64_t end) {
        for (; off < end; off += 64) {
            pa_prefetch(k + off);
            pa_prefetch(v + off);
        }
    }
};

// All of block `blk`'s K and V lines of one KV head at once (an item's first blocks).
template <class T>
static inline void pa_prefetch_block(const pa_args* a, int64_t seq, int64_t kv_head, int64_t blk) {
    PrefetchCursor block;
    block.start<T>(a, seq, kv_head, blk);
    block.finish();
}

// The first PA_PREFETCH_BLOCKS blocks an item reads.
template <class T>
static inline void pa_prefetch_item(const pa_args* a, const pa_item& item) {
    const int64_t first = item.split_begin * (a->split_positions / a->block_size);
    const int64_t end = (a->context_lens[item.seq] + a->block_size - 1) / a->block_size;
    for (int64_t blk = first; blk < first + PA_PREFETCH_BLOCKS && blk < end; ++blk) pa_prefetch_block<T>(a, item.seq, item.kv_head, blk);
}

// Keys of block `blk` that the row at `position` attends (it starts at or before the position).
static inline int64_t keys_of_row(int64_t position, int64_t blk, int64_t block_size, int64_t in_block) {
    const int64_t n = position - blk * block_size + 1;
    return n < in_block ? n : in_block;
}

// One KV block into the running state of every (row, head) pair that reaches it, in three passes
// (scores; softmax update: m' = max(m, block max), alpha = exp(m - m'), p_j = exp(s_j - m'),
// l = l * alpha + sum_j p_j with the sum in key order; weighted V sum). Ops may compute several pairs at once, sharing each
// K/V load; a pair's own arithmetic is the same whichever pairs share the pass.
template <class T>
static inline __attribute__((always_inline)) void pa_attend_block(const pa_args* a, const Tile& t, int64_t blk, Scratch& w,
                                                                  PrefetchCursor& ahead) {
    const int64_t D = a->head_dim, BS = a->block_size, G = a->num_heads / a->num_kv_heads, KP = w.keys_padded;
    // Local copies: stores through the float buffers could otherwise alias the Scratch fields.
    float* const s = w.s;
    float* const m = w.m;
    float* const l = w.l;
    float* const alpha = w.alpha;
    const int64_t block_id = a->block_tables[t.b * a->max_blocks_per_seq + blk];
    const int64_t in_block = t.ctx - blk * BS < BS ? t.ctx - blk * BS : BS;
    ahead.step();
    const float* k;
    const void* v = Ops::prepare_block(pa_cache_block<T>(a->k_cache, block_id, t.h, a), pa_cache_block<T>(a->v_cache, block_id, t.h, a),
                                       in_block, D, w.kbuf, w.vbuf, &k);
    int64_t first = 0;  // tile rows before it end before this block
    while (first < t.nrows && blk * BS > t.position(first)) ++first;
    ahead.step();
    Ops::template scores_rows<T>(w.qf + first * G * D, (t.nrows - first) * G, k, in_block, D, a->scale, s + first * G * KP, KP);
    ahead.step();
    int32_t* const keys = w.keys;
    for (int64_t r = first; r < t.nrows; ++r)
        for (int64_t rg = r * G; rg < (r + 1) * G; ++rg) keys[rg] = (int32_t)keys_of_row(t.position(r), blk, BS, in_block);
    Ops::softmax_rows(s + first * G * KP, KP, (t.nrows - first) * G, keys + first * G, m + first * G, l + first * G, alpha + first * G);
    ahead.step();
    float* const acc = w.acc;
    for (int64_t r = first; r < t.nrows;) {  // runs of rows that see the same keys
        const int64_t n = keys_of_row(t.position(r), blk, BS, in_block);
        int64_t end = r + 1;
        while (end < t.nrows && keys_of_row(t.position(end), blk, BS, in_block) == n) ++end;
        Ops::template axpy_rows<T>(acc + r * G * D, alpha + r * G, s + r * G * KP, KP, (end - r) * G, v, n, D);
        r = end;
    }
}

// A split is done: its state goes to the partials (the split is its own item) or is folded into
// the tile's running fold (the tile runs all its splits). Rows that end before the split skip it.
static void pa_finish_split(const pa_args* a, const Tile& t, const pa_item& item, int64_t split_first, Scratch& w, float* partials) {
    const int64_t D = a->head_dim, G = a->num_heads / a->num_kv_heads;
    for (int64_t r = 0; r < t.nrows; ++r) {
        if (split_first > t.position(r)) continue;
        for (int64_t rg = r * G; rg < (r + 1) * G; ++rg) {
            if (item.partial_offset >= 0) {
                float* p = partials + item.partial_offset + rg * PA_PARTIAL_FLOATS(D);
                p[0] = w.m[rg];
                p[1] = w.l[rg];
                for (int64_t d = 0; d < D; ++d) p[2 + d] = w.acc[rg * D + d];
            } else if (!w.folded[rg]) {
                w.fm[rg] = w.m[rg];
                w.fl[rg] = w.l[rg];
                for (int64_t d = 0; d < D; ++d) w.facc[rg * D + d] = w.acc[rg * D + d];
                w.folded[rg] = 1;
            } else {
                pa_fold_split(w.fm + rg, w.fl + rg, w.facc + rg * D, w.m[rg], w.l[rg], w.acc + rg * D, D);
            }
        }
    }
}

template <class T>
static void pa_run_item(const pa_args* a, const pa_item& item, Scratch& w, float* partials) {
    const int64_t D = a->head_dim, BS = a->block_size, H = a->num_heads, G = H / a->num_kv_heads;
    const int64_t ctx = a->context_lens[item.seq];
    const Tile t{item.seq, item.kv_head, item.row_begin, item.row_end - item.row_begin, ctx - a->num_scheduled[item.seq],
                 a->query_start[item.seq], ctx};
    const int64_t last_pos = t.position(t.nrows - 1), blocks_per_split = a->split_positions / BS;
    const T* q = static_cast<const T*>(a->q);
    for (int64_t r = 0; r < t.nrows; ++r)
        for (int64_t g = 0; g < G; ++g)
            Ops::prepare_query(q + (t.row0 + t.r0 + r) * a->q_row_stride + (t.h * G + g) * D, w.qf + (r * G + g) * D, D);
    for (int64_t rg = 0; rg < t.nrows * G; ++rg) w.folded[rg] = 0;

    for (int64_t split = item.split_begin; split < item.split_end; ++split) {
        const int64_t split_first = split * a->split_positions;
        if (split_first > last_pos) break;
        for (int64_t rg = 0; rg < t.nrows * G; ++rg) {
            w.m[rg] = -__builtin_inff();
            w.l[rg] = 0.0f;
        }
        for (int64_t i = 0; i < t.nrows * G * D; ++i) w.acc[i] = 0.0f;
        const int64_t blk_end = (split + 1) * blocks_per_split < last_pos / BS + 1 ? (split + 1) * blocks_per_split : last_pos / BS + 1;
        for (int64_t blk = split * blocks_per_split; blk < blk_end; ++blk) {
            PrefetchCursor ahead;
            if (blk == split * blocks_per_split)
                for (int64_t b = blk + 1; b < blk + PA_PREFETCH_BLOCKS && b < blk_end; ++b) pa_prefetch_block<T>(a, t.b, t.h, b);
            if (blk + PA_PREFETCH_BLOCKS < blk_end) ahead.start<T>(a, t.b, t.h, blk + PA_PREFETCH_BLOCKS);
            pa_attend_block<T>(a, t, blk, w, ahead);
        }
        pa_finish_split(a, t, item, split_first, w, partials);
    }
    if (item.partial_offset >= 0) return;
    for (int64_t r = 0; r < t.nrows; ++r)
        for (int64_t g = 0; g < G; ++g) {
            const int64_t rg = r * G + g;
            T* out = static_cast<T*>(a->out) + ((t.row0 + t.r0 + r) * H + t.h * G + g) * D;
            if constexpr (sizeof(T) == 2)
                pa_store_row_bf16(w.facc + rg * D, w.fl[rg], (uint16_t*)out, D);
            else
                pa_store_row_f32(w.facc + rg * D, w.fl[rg], (float*)out, D);
        }
}

// 0, or PA_SCRATCH_OUT_OF_MEMORY when a thread could not allocate its scratch: then the call
// fails as a whole (the other threads still run the loop, every thread must reach it).
template <class T>
static int pa_run_items_impl(const pa_args* a, const pa_item* items, int64_t num_items, float* partials) {
    static_assert(sizeof(T) == 2 || sizeof(T) == 4, "float32 or bfloat16 (as uint16_t)");
    int failed = 0;
#pragma omp parallel num_threads(a->num_threads)
    {
        Scratch w(a);
        if (!w.ok()) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < num_items; ++it) {
            if (!w.ok()) continue;
            // This thread's next item is likely num_threads further: its first blocks are on their way.
            if (it + a->num_threads < num_items) pa_prefetch_item<T>(a, items[it + a->num_threads]);
            pa_run_item<T>(a, items[it], w, partials);
        }
    }
    return failed ? PA_SCRATCH_OUT_OF_MEMORY : 0;
}

static int pa_run_items_dispatch_dtype(const pa_args* a, const pa_item* items, int64_t num_items, float* partials) {
    if (a->dtype == PA_BFLOAT16)
        return pa_run_items_impl<uint16_t>(a, items, num_items, partials);
    return pa_run_items_impl<float>(a, items, num_items, partials);
}
