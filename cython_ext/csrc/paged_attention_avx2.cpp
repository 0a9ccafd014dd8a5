// The AVX2 path (AVX2 + FMA), built with those flags only for this file (setup.py), for x86-64
// CPUs without AVX-512. Chosen at run time by pa_isa_supported (paged_attention_dispatch.cpp).
//
// K and V stay key-major: prepare_block widens a bf16 block to float32 rows (a 16-bit shift, 8
// lanes at a time) and scores take each score as a dot product over the head dim (eight FMA
// lanes of dims c = lane mod 8, summed by a fixed add tree), eight keys per pass, so no block is
// transposed. The weighted V sum keeps up to three rows' accumulators in registers so each V
// vector is loaded once for them. Every row's arithmetic is the same whichever rows share a pass
// (the batch-invariance rule of paged_attention.h).
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_attention.h"
#include "vector_exp.h"

namespace planserve_pa_avx2 {

#define PA_INLINE inline __attribute__((always_inline))
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
constexpr int kWidth = 8;  // float32 lanes of a ymm register

// Lanes [0, n) of a vector (n < 8): the mask of a masked load or store of a head-dim tail.
static PA_INLINE __m256i tail_mask(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static PA_INLINE __m256 widen_bf16(const uint16_t* src) {
    const __m128i raw = _mm_loadu_si128((const __m128i*)src);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

static inline void bf16_to_float(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
    int64_t i = 0;
    for (; i + kWidth <= n; i += kWidth) _mm256_storeu_ps(dst + i, widen_bf16(src + i));
    for (; i < n; ++i) dst[i] = __builtin_bit_cast(float, (uint32_t)src[i] << 16);
}

// exp(x) for x <= 0, as the other paths compute it (vector_exp.h; 0 below -87.3).
static PA_INLINE vf exp_nonpositive(vf x) {
    const vf floor_value = vf{} - 87.3f;
    const vf clamped = x < floor_value ? floor_value : x;
    return x < floor_value ? vf{} : cephes_exp<vf, vi>(clamped);
}
static PA_INLINE vf loadv(const float* p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static PA_INLINE void storev(float* p, vf v) { memcpy(p, &v, sizeof v); }

// The eight dot products acc[0..7] (one key each, lanes = dims mod 8) as one vector of eight
// sums, by a fixed tree: lanes paired within 128-bit halves (hadd), then the halves added.
static PA_INLINE __m256 sum8(const __m256 acc[8]) {
    const __m256 a = _mm256_hadd_ps(acc[0], acc[1]), b = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 c = _mm256_hadd_ps(acc[4], acc[5]), d = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    // ab = [k0 k1 k2 k3 | k0 k1 k2 k3] halves of the sums, cd the same for k4..k7.
    const __m256 lo = _mm256_permute2f128_ps(ab, cd, 0x20), hi = _mm256_permute2f128_ps(ab, cd, 0x31);
    return _mm256_add_ps(lo, hi);
}

// s[j] = (q . k_j) * scale for the eight keys k (rows of d floats), each over the head dim in
// order of its 8-lane vectors, the tail (d mod 8 dims) masked into the last vector.
static PA_INLINE void scores8(const float* q, const float* k, int64_t d, float scale, float* s) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + kWidth <= d; c += kWidth) {
        const __m256 qc = _mm256_loadu_ps(q + c);
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + j * d + c), acc[j]);
    }
    if (c < d) {
        const __m256i mask = tail_mask(d - c);
        const __m256 qc = _mm256_maskload_ps(q + c, mask);
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qc, _mm256_maskload_ps(k + j * d + c, mask), acc[j]);
    }
    _mm256_storeu_ps(s, _mm256_mul_ps(sum8(acc), _mm256_set1_ps(scale)));
}

// acc_r = acc_r * alpha_r + sum_j p_r[j] v_j over the dims [0, NV * 8) of R rows, j ascending, one
// FMA chain per (row, vector); each V vector is loaded once for the R rows.
template <int NV, int R>
static PA_INLINE void axpy_block(float* acc, int64_t d, const float* alpha, const float* p, int64_t p_stride, const float* v,
                                 int64_t n) {
    __m256 a[R][NV];
    for (int r = 0; r < R; ++r)
        for (int k = 0; k < NV; ++k) {
            a[r][k] = _mm256_loadu_ps(acc + r * d + kWidth * k);
            if (alpha[r] != 1.0f) a[r][k] = _mm256_mul_ps(a[r][k], _mm256_set1_ps(alpha[r]));
        }
    for (int64_t j = 0; j < n; ++j)
        for (int k = 0; k < NV; ++k) {
            const __m256 vj = _mm256_loadu_ps(v + j * d + kWidth * k);
            for (int r = 0; r < R; ++r) a[r][k] = _mm256_fmadd_ps(_mm256_set1_ps(p[r * p_stride + j]), vj, a[r][k]);
        }
    for (int r = 0; r < R; ++r)
        for (int k = 0; k < NV; ++k) _mm256_storeu_ps(acc + r * d + kWidth * k, a[r][k]);
}

// The same for one row's dims [0, d) when d is not a multiple of 8: the last vector masked.
static inline void axpy_masked_row(float* acc, float alpha, const float* p, const float* v, int64_t n, int64_t d) {
    for (int64_t c = 0; c < d; c += kWidth) {
        const __m256i mask = tail_mask(d - c < kWidth ? d - c : kWidth);
        __m256 a = _mm256_maskload_ps(acc + c, mask);
        if (alpha != 1.0f) a = _mm256_mul_ps(a, _mm256_set1_ps(alpha));
        for (int64_t j = 0; j < n; ++j) a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_maskload_ps(v + j * d + c, mask), a);
        _mm256_maskstore_ps(acc + c, mask, a);
    }
}

// Rows three at a time (a GQA group of 3 heads in one pass), then the rest, over 32-dim chunks.
template <int NV>
static PA_INLINE void axpy_chunk(float* acc, int64_t d, const float* alpha, const float* p, int64_t p_stride, int64_t rows,
                                 const float* v, int64_t n) {
    int64_t r = 0;
    for (; r + 3 <= rows; r += 3) axpy_block<NV, 3>(acc + r * d, d, alpha + r, p + r * p_stride, p_stride, v, n);
    if (rows - r == 2) axpy_block<NV, 2>(acc + r * d, d, alpha + r, p + r * p_stride, p_stride, v, n);
    if (rows - r == 1) axpy_block<NV, 1>(acc + r * d, d, alpha + r, p + r * p_stride, p_stride, v, n);
}

struct Ops {
    // Query rows as float32 [D].
    static inline void prepare_query(const float* q, float* out, int64_t d) { memcpy(out, q, d * sizeof(float)); }
    static inline void prepare_query(const uint16_t* q, float* out, int64_t d) { bf16_to_float(q, out, d); }

    // K as float32 rows [n rounded up to 8, D] in kbuf (rows past n zero); V as float32 rows,
    // float32 caches read in place.
    static inline void zero_key_tail(float* kbuf, int64_t n, int64_t d) {
        const int64_t padded = (n + 7) / 8 * 8;
        if (padded > n) memset(kbuf + n * d, 0, (padded - n) * d * sizeof(float));
    }
    static inline const float* prepare_block(const float* kb, const float* vb, int64_t n, int64_t d, float* kbuf, float*,
                                             const float** k) {
        memcpy(kbuf, kb, n * d * sizeof(float));
        zero_key_tail(kbuf, n, d);
        *k = kbuf;
        return vb;
    }
    static inline const float* prepare_block(const uint16_t* kb, const uint16_t* vb, int64_t n, int64_t d, float* kbuf, float* vbuf,
                                             const float** k) {
        bf16_to_float(kb, kbuf, n * d);
        zero_key_tail(kbuf, n, d);
        bf16_to_float(vb, vbuf, n * d);
        *k = kbuf;
        return vbuf;
    }
    // Scores of `rows` query rows against the block's keys, eight at a time (lanes past n see
    // zero keys; the lanes up to the next multiple of 16 are left as they are: nothing reads them).
    template <class T>
    static PA_INLINE void scores_rows(const float* q, int64_t rows, const float* k, int64_t n, int64_t d, float scale, float* s,
                                      int64_t s_stride) {
        for (int64_t g = 0; g * 8 < n; ++g)
            for (int64_t r = 0; r < rows; ++r) scores8(q + r * d, k + g * 8 * d, d, scale, s + r * s_stride + g * 8);
    }
    // The softmax update of `pairs` (row, head) pairs, pair i seeing keys[i] keys of the block:
    //     m' = max(m, max_j s_j), alpha = exp(m - m'), p_j = exp(s_j - m'), l = fma(l, alpha, sum)
    // with the block's max and sum over 8-lane vectors of keys, reduced across the lanes by a
    // fixed tree (a max is the same in any order; the sum's order is this one for every pair).
    static inline void softmax_rows(float* s, int64_t s_stride, int64_t pairs, const int32_t* keys, float* m, float* l, float* alpha) {
        for (int64_t i = 0; i < pairs; ++i) softmax_pair(s + i * s_stride, keys[i], m[i], l[i], alpha[i]);
    }
    static PA_INLINE void softmax_pair(float* s, int64_t n, float& m, float& l, float& alpha) {
        const __m256 lowest = _mm256_set1_ps(-__builtin_inff());
        __m256 mx = lowest;
        for (int64_t j = 0; j < n; j += kWidth)  // lanes past n: -inf (the row has KP >= n rounded up to 8 floats)
            mx = _mm256_max_ps(mx, _mm256_blendv_ps(lowest, _mm256_loadu_ps(s + j), _mm256_castsi256_ps(tail_mask(n - j))));
        mx = _mm256_max_ps(mx, _mm256_permute2f128_ps(mx, mx, 1));
        mx = _mm256_max_ps(mx, _mm256_permute_ps(mx, 0x4E));
        mx = _mm256_max_ps(mx, _mm256_permute_ps(mx, 0xB1));
        const float block_max = _mm256_cvtss_f32(mx);
        const float m_new = block_max > m ? block_max : m;
        // exp(0) is exactly 1 in every path's exp, so skipping it changes no bit.
        alpha = m_new == m ? 1.0f : exp_nonpositive(vf{} + (m - m_new))[0];
        __m256 sum = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j += kWidth) {
            const vf p = exp_nonpositive(loadv(s + j) - m_new);
            const __m256 kept = _mm256_and_ps((__m256)p, _mm256_castsi256_ps(tail_mask(n - j)));  // lanes past n: 0
            _mm256_storeu_ps(s + j, kept);
            sum = _mm256_add_ps(sum, kept);
        }
        sum = _mm256_add_ps(sum, _mm256_permute2f128_ps(sum, sum, 1));
        sum = _mm256_add_ps(sum, _mm256_permute_ps(sum, 0x4E));
        sum = _mm256_add_ps(sum, _mm256_permute_ps(sum, 0xB1));
        m = m_new;
        l = __builtin_fmaf(l, alpha, _mm256_cvtss_f32(sum));
    }
    // V is float32 rows here whatever T is (prepare_block widened bf16 ones).
    template <class T>
    static inline void axpy_rows(float* acc, const float* alpha, const float* p, int64_t p_stride, int64_t rows, const void* v_rows,
                                 int64_t n, int64_t d) {
        const float* v = static_cast<const float*>(v_rows);
        if (d % kWidth) {
            for (int64_t r = 0; r < rows; ++r) axpy_masked_row(acc + r * d, alpha[r], p + r * p_stride, v, n, d);
            return;
        }
        int64_t c = 0;
        for (; c + 4 * kWidth <= d; c += 4 * kWidth) axpy_chunk<4>(acc + c, d, alpha, p, p_stride, rows, v + c, n);
        switch ((d - c) / kWidth) {
            case 3: axpy_chunk<3>(acc + c, d, alpha, p, p_stride, rows, v + c, n); break;
            case 2: axpy_chunk<2>(acc + c, d, alpha, p, p_stride, rows, v + c, n); break;
            case 1: axpy_chunk<1>(acc + c, d, alpha, p, p_stride, rows, v + c, n); break;
            default: break;
        }
    }
};

#include "paged_attention_impl.h"

}  // namespace planserve_pa_avx2

extern "C" int pa_run_items_avx2(const pa_args* a, const pa_item* items, int64_t num_items, float* partials) {
    return planserve_pa_avx2::pa_run_items_dispatch_dtype(a, items, num_items, partials);
}
