// The portable path: plain C++ that any x86-64 or ARM CPU runs, built without ISA flags. Its loops
// are written so that the compiler vectorizes them with whatever the target has (element-wise
// over 16 key lanes or over the head dimension; no reductions across lanes). A test checks the
// object code: no AVX or AVX-512 registers in it.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_attention.h"
#include "vector_exp.h"

#define PA_NS planserve_pa_portable
#define PA_ENTRY pa_run_items_portable

namespace PA_NS {

// GCC's generic vectors as wide as the target's registers (16 bytes: SSE2 or NEON); every
// operation is lane-wise, so a lane's result does not depend on the width.
#define PA_VEC_BYTES 16
#define PA_INLINE inline __attribute__((always_inline))
typedef float vf __attribute__((vector_size(PA_VEC_BYTES)));
typedef int32_t vi __attribute__((vector_size(PA_VEC_BYTES)));
constexpr int kWidth = PA_VEC_BYTES / 4;  // lanes of one vector
constexpr int kLanes = 16;                // keys per group: scores are computed for 16 key lanes at a time
constexpr int kGroupVectors = kLanes / kWidth;

static PA_INLINE vf load(const float* p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static PA_INLINE void store(float* p, vf v) { memcpy(p, &v, sizeof v); }

static inline void bf16_to_float(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = __builtin_bit_cast(float, (uint32_t)src[i] << 16);
}

// exp(x) for x <= 0, as the AVX-512 path computes it (vector_exp.h; 0 below -87.3).
static PA_INLINE vf exp_nonpositive(vf x) {
    const vf floor_value = vf{} - 87.3f;
    const vf clamped = x < floor_value ? floor_value : x;
    return x < floor_value ? vf{} : cephes_exp<vf, vi>(clamped);
}

struct Ops {
    // Query rows as float32 [D].
    static inline void prepare_query(const float* q, float* out, int64_t d) { memcpy(out, q, d * sizeof(float)); }
    static inline void prepare_query(const uint16_t* q, float* out, int64_t d) { bf16_to_float(q, out, d); }

    // K key-minor: for each group of 16 keys, [D][16] float32 (keys past n are zero); V as
    // float32 rows [n, D] (float32 caches are read in place).
    static inline float key_value(const float* kb, int64_t i) { return kb[i]; }
    static inline float key_value(const uint16_t* kb, int64_t i) { return __builtin_bit_cast(float, (uint32_t)kb[i] << 16); }
    template <class T>
    static inline void transpose_keys(const T* __restrict kb, int64_t n, int64_t d, float* __restrict kbuf) {
        for (int64_t g = 0; g * kLanes < n; ++g) {
            float* out = kbuf + g * d * kLanes;
            const int64_t keys = n - g * kLanes < kLanes ? n - g * kLanes : kLanes;
            for (int64_t j = 0; j < keys; ++j)
                for (int64_t c = 0; c < d; ++c) out[c * kLanes + j] = key_value(kb, (g * kLanes + j) * d + c);
            for (int64_t j = keys; j < kLanes; ++j)
                for (int64_t c = 0; c < d; ++c) out[c * kLanes + j] = 0.0f;
        }
    }
    static inline const float* prepare_block(const float* kb, const float* vb, int64_t n, int64_t d, float* kbuf, float*,
                                             const float** k) {
        transpose_keys(kb, n, d, kbuf);
        *k = kbuf;
        return vb;
    }
    static inline const float* prepare_block(const uint16_t* kb, const uint16_t* vb, int64_t n, int64_t d, float* kbuf, float* vbuf,
                                             const float** k) {
        transpose_keys(kb, n, d, kbuf);
        bf16_to_float(vb, vbuf, n * d);
        *k = kbuf;
        return vbuf;
    }
    // s[r][16 g + j] = (q_r . k_j) * scale for every lane of each 16-key group: one running sum
    // per score over the head dimension in order; four rows at a time share each K column load.
    template <int R>
    static PA_INLINE void scores_block(const float* q, int64_t d, const float* kg, float scale, float* s, int64_t s_stride) {
        vf acc[R][kGroupVectors] = {};
        for (int64_t c = 0; c < d; ++c)
            for (int u = 0; u < kGroupVectors; ++u) {
                const vf kc = load(kg + c * kLanes + u * kWidth);
                for (int r = 0; r < R; ++r) acc[r][u] += q[r * d + c] * kc;
            }
        for (int r = 0; r < R; ++r)
            for (int u = 0; u < kGroupVectors; ++u) store(s + r * s_stride + u * kWidth, acc[r][u] * scale);
    }
    template <class T>
    static PA_INLINE void scores_rows(const float* q, int64_t rows, const float* k, int64_t n, int64_t d, float scale, float* s,
                                      int64_t s_stride) {
        for (int64_t g = 0; g * kLanes < n; ++g) {
            const float* kg = k + g * d * kLanes;
            int64_t r = 0;
            for (; r + 4 <= rows; r += 4) scores_block<4>(q + r * d, d, kg, scale, s + r * s_stride + g * kLanes, s_stride);
            for (; r < rows; ++r) scores_block<1>(q + r * d, d, kg, scale, s + r * s_stride + g * kLanes, s_stride);
        }
    }
    static inline float max(const float* s, int64_t n) {
        float m = s[0];
        for (int64_t j = 1; j < n; ++j) m = s[j] > m ? s[j] : m;
        return m;
    }
    static inline float exp1(float x) { return exp_nonpositive(vf{} + x)[0]; }
    // s[j] = exp(s[j] - m) over whole 16-lane groups (lanes past n become 0); returns the sum of
    // the first n, in index order.
    static inline float exp_shifted(float* s, int64_t n, float m) {
        for (int64_t j = 0; j < n; j += kWidth) store(s + j, exp_nonpositive(load(s + j) - m));
        const int64_t lanes = (n + kLanes - 1) / kLanes * kLanes;
        for (int64_t j = n; j < lanes; ++j) s[j] = 0.0f;
        float sum = 0.0f;
        for (int64_t j = 0; j < n; ++j) sum += s[j];
        return sum;
    }
    // The softmax update of `pairs` (row, head) pairs, pair i seeing keys[i] keys of the block.
    static inline void softmax_rows(float* s, int64_t s_stride, int64_t pairs, const int32_t* keys, float* m, float* l, float* alpha) {
        for (int64_t i = 0; i < pairs; ++i) {
            float* si = s + i * s_stride;
            const float block_max = max(si, keys[i]);
            const float m_new = block_max > m[i] ? block_max : m[i];
            // exp(0) is exactly 1 in every path's exp, so skipping it changes no bit.
            alpha[i] = m_new == m[i] ? 1.0f : exp1(m[i] - m_new);
            const float sum = exp_shifted(si, keys[i], m_new);
            m[i] = m_new;
            l[i] = l[i] * alpha[i] + sum;
        }
    }
    // acc_r = acc_r * alpha_r + sum_j p_r[j] v_j, j ascending, 8 vectors of the head dim at a time
    // kept in registers across j (then one vector, then single lanes for what is left).
    template <int NV>
    static PA_INLINE void axpy_chunk(float* acc, float alpha, const float* p, const float* v, int64_t n, int64_t d) {
        vf a[NV];
        for (int k = 0; k < NV; ++k) a[k] = alpha != 1.0f ? load(acc + kWidth * k) * alpha : load(acc + kWidth * k);
        for (int64_t j = 0; j < n; ++j)
            for (int k = 0; k < NV; ++k) a[k] += p[j] * load(v + j * d + kWidth * k);
        for (int k = 0; k < NV; ++k) store(acc + kWidth * k, a[k]);
    }
    // V is float32 rows here whatever T is (prepare_block converted bf16 ones).
    template <class T>
    static inline void axpy_rows(float* acc, const float* alpha, const float* p, int64_t p_stride, int64_t rows, const void* v_rows,
                                 int64_t n, int64_t d) {
        const float* v = static_cast<const float*>(v_rows);
        for (int64_t r = 0; r < rows; ++r) {
            float* ar = acc + r * d;
            const float* pr = p + r * p_stride;
            int64_t i = 0;
            constexpr int kChunk = 8 * kWidth;  // 8 vectors of accumulators in registers
            for (; i + kChunk <= d; i += kChunk) axpy_chunk<8>(ar + i, alpha[r], pr, v + i, n, d);
            for (; i + kWidth <= d; i += kWidth) axpy_chunk<1>(ar + i, alpha[r], pr, v + i, n, d);
            for (; i < d; ++i) {
                float a = alpha[r] != 1.0f ? ar[i] * alpha[r] : ar[i];
                for (int64_t j = 0; j < n; ++j) a += pr[j] * v[j * d + i];
                ar[i] = a;
            }
        }
    }
};

#include "paged_attention_impl.h"

}  // namespace PA_NS

extern "C" int PA_ENTRY(const pa_args* a, const pa_item* items, int64_t num_items, float* partials) {
    return PA_NS::pa_run_items_dispatch_dtype(a, items, num_items, partials);
}
