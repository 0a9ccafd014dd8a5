// The AVX-512 path (AVX512F/BW/VL/DQ + FMA), built with those flags only for this file; with
// PA_AVX512_BF16 defined (paged_attention_avx512_bf16.cpp, built with -mavx512bf16 too) the bf16
// query-key dot products run as VDPBF16PS on the raw bf16 rows instead of float32 FMAs.
// Chosen at run time by pa_isa_supported (paged_attention_dispatch.cpp).
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "paged_attention.h"

#ifdef PA_AVX512_BF16
#define PA_NS planserve_pa_avx512_bf16
#define PA_ENTRY pa_run_items_avx512_bf16
#else
#define PA_NS planserve_pa_avx512
#define PA_ENTRY pa_run_items_avx512
#endif

namespace PA_NS {

static inline __mmask16 tail_mask(int64_t remaining) {
    return remaining >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << remaining) - 1u);
}

// exp(x) for x <= 0 (every argument here is a score minus a running max): Cephes' expf
// polynomial after x = n ln2 + r, |r| <= ln2 / 2, scaled by 2^n; below -87.3 the result is 0.
static inline __m512 exp_nonpositive(__m512 x) {
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
    const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
    r = _mm512_fnmadd_ps(n, ln2_lo, r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_scalef_ps((__mmask16)~underflow, p, n);
}

static inline __m512 load_bf16_as_f32(const uint16_t* src, __mmask16 mask) {
    const __m256i raw = _mm256_maskz_loadu_epi16(mask, src);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// In-register transpose of a 16 x 16 tile of 32-bit elements (rows r[0..15] become columns).
static inline void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // per 128-bit lane: elements k of rows 4i .. 4i+3 in u[4i + k]
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
        u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    for (int k = 0; k < 4; ++k) {  // gather lane L of the four row groups: column 4L + k
        const __m512 v1 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88), v2 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xDD);
        const __m512 w1 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88), w2 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xDD);
        r[k] = _mm512_shuffle_f32x4(v1, w1, 0x88);
        r[8 + k] = _mm512_shuffle_f32x4(v1, w1, 0xDD);
        r[4 + k] = _mm512_shuffle_f32x4(v2, w2, 0x88);
        r[12 + k] = _mm512_shuffle_f32x4(v2, w2, 0xDD);
    }
}

// K of a block, key-minor: for each group of 16 keys, [columns][16 keys] (float32 values, or
// bf16 pairs as 32-bit columns). Rows past n are zero. `load(j, c, mask)` reads row j's 16
// 32-bit columns from c.
template <class Load>
static inline void transpose_keys(int64_t n, int64_t columns, float* out, Load load) {
    for (int64_t g = 0; g * 16 < n; ++g) {
        const int64_t keys = n - g * 16 < 16 ? n - g * 16 : 16;
        for (int64_t c = 0; c < columns; c += 16) {
            const __mmask16 mask = tail_mask(columns - c);
            __m512 r[16];
            for (int64_t i = 0; i < 16; ++i) r[i] = i < keys ? load(g * 16 + i, c, mask) : _mm512_setzero_ps();
            transpose16(r);
            const int64_t width = columns - c < 16 ? columns - c : 16;
            // A whole 16 with constant indices: a loop to a run-time bound makes GCC spill r[] and
            // copy it with `rep movs`, which cost ~6% of decode attention.
            if (width == 16)
                for (int i = 0; i < 16; ++i) _mm512_storeu_ps(out + (g * columns + c + i) * 16, r[i]);
            else
                for (int64_t i = 0; i < width; ++i) _mm512_storeu_ps(out + (g * columns + c + i) * 16, r[i]);
        }
    }
}

// acc[0 .. 16 NV) = acc * alpha + sum_j p_j v_j[0 .. 16 NV), j ascending, in registers.
#define PA_INLINE inline __attribute__((always_inline))

// acc_r[0 .. 16 NV) = acc_r * alpha_r + sum_j p_r[j] v_j[0 .. 16 NV) for R rows, j ascending:
// each V vector is loaded once for the R rows (bf16 rows widened in registers: exact); every
// (row, vector) is one FMA chain.
static inline __m512 load_v(const float* v) { return _mm512_loadu_ps(v); }
static inline __m512 load_v(const uint16_t* v) { return load_bf16_as_f32(v, (__mmask16)0xffff); }

template <int NV, int R, class V>
static PA_INLINE void axpy_block(float* acc, int64_t acc_stride, const float* alpha, const float* p, int64_t p_stride,
                                 const V* v, int64_t n, int64_t d) {
    __m512 a[R][NV];
    for (int r = 0; r < R; ++r)
        for (int k = 0; k < NV; ++k) {
            a[r][k] = _mm512_loadu_ps(acc + r * acc_stride + 16 * k);
            if (alpha[r] != 1.0f) a[r][k] = _mm512_mul_ps(a[r][k], _mm512_set1_ps(alpha[r]));
        }
    for (int64_t j = 0; j < n; ++j) {
        __m512 vj[NV];
        for (int k = 0; k < NV; ++k) vj[k] = load_v(v + j * d + 16 * k);
        for (int r = 0; r < R; ++r) {
            const __m512 pj = _mm512_set1_ps(p[r * p_stride + j]);
            for (int k = 0; k < NV; ++k) a[r][k] = _mm512_fmadd_ps(pj, vj[k], a[r][k]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int k = 0; k < NV; ++k) _mm512_storeu_ps(acc + r * acc_stride + 16 * k, a[r][k]);
}

// R rows at a time (a GQA group of 3 heads is one block), then the rest together.
template <int NV, class V>
static PA_INLINE void axpy_rows_nv(float* acc, const float* alpha, const float* p, int64_t p_stride, int64_t rows,
                                   const V* v, int64_t n, int64_t d) {
    constexpr int R = NV <= 4 ? 4 : 2;  // R * NV accumulators + NV V vectors within 32 registers
    int64_t r = 0;
    for (; r + R <= rows; r += R) axpy_block<NV, R>(acc + r * d, d, alpha + r, p + r * p_stride, p_stride, v, n, d);
    switch (rows - r) {
        case 3: axpy_block<NV, 3>(acc + r * d, d, alpha + r, p + r * p_stride, p_stride, v, n, d); break;
        case 2: axpy_block<NV, 2>(acc + r * d, d, alpha + r, p + r * p_stride, p_stride, v, n, d); break;
        case 1: axpy_block<NV, 1>(acc + r * d, d, alpha + r, p + r * p_stride, p_stride, v, n, d); break;
        default: break;
    }
}

// s_r[16 g .. 16 g + 16) = (q_r . k_j) * scale for R rows against key group g (key-minor K of
// `columns` columns). Each row keeps kScoreChains FMA (or VDPBF16PS) chains, chain i over the
// columns c = i mod kScoreChains in order, added pairwise at the end: a decode row's three heads
// with one chain each waited on the instruction's latency (~20% of decode attention). The K column
// is loaded once for the R rows. Every row count uses the same chains, so a row's bits do not
// depend on how many rows share the pass.
constexpr int kScoreChains = 4;

template <int R, bool BF16>
static PA_INLINE void scores_block(const float* q, int64_t q_stride, const float* kg, int64_t columns, float scale, float* s,
                                   int64_t s_stride) {
    __m512 acc[R][kScoreChains];
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < kScoreChains; ++i) acc[r][i] = _mm512_setzero_ps();
    auto step = [&](int r, int i, int64_t c, __m512 kc) {
#ifdef PA_AVX512_BF16
        if (BF16) {
            const int32_t pair = ((const int32_t*)(q + r * q_stride))[c];
            acc[r][i] = _mm512_dpbf16_ps(acc[r][i], (__m512bh)_mm512_set1_epi32(pair), (__m512bh)_mm512_castps_si512(kc));
            return;
        }
#endif
        acc[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * q_stride + c]), kc, acc[r][i]);
    };
    int64_t c = 0;
    for (; c + kScoreChains <= columns; c += kScoreChains)
        for (int i = 0; i < kScoreChains; ++i) {
            const __m512 kc = _mm512_loadu_ps(kg + (c + i) * 16);
            for (int r = 0; r < R; ++r) step(r, i, c + i, kc);
        }
    for (int i = 0; c < columns; ++c, ++i) {
        const __m512 kc = _mm512_loadu_ps(kg + c * 16);
        for (int r = 0; r < R; ++r) step(r, i, c, kc);
    }
    const __m512 sv = _mm512_set1_ps(scale);
    static_assert(kScoreChains == 4, "the sum below adds four chains");
    for (int r = 0; r < R; ++r) {
        const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3]));
        _mm512_storeu_ps(s + r * s_stride, _mm512_mul_ps(sum, sv));
    }
}

template <bool BF16>
static PA_INLINE void scores_rows_impl(const float* q, int64_t q_stride, int64_t rows, const float* k, int64_t n, int64_t columns,
                                       float scale, float* s, int64_t s_stride) {
    for (int64_t g = 0; g * 16 < n; ++g) {
        const float* kg = k + g * columns * 16;
        int64_t r = 0;
        for (; r + 4 <= rows; r += 4) scores_block<4, BF16>(q + r * q_stride, q_stride, kg, columns, scale, s + r * s_stride + g * 16, s_stride);
        switch (rows - r) {
            case 3: scores_block<3, BF16>(q + r * q_stride, q_stride, kg, columns, scale, s + r * s_stride + g * 16, s_stride); break;
            case 2: scores_block<2, BF16>(q + r * q_stride, q_stride, kg, columns, scale, s + r * s_stride + g * 16, s_stride); break;
            case 1: scores_block<1, BF16>(q + r * q_stride, q_stride, kg, columns, scale, s + r * s_stride + g * 16, s_stride); break;
            default: break;
        }
    }
}

struct Ops {
    // Query rows: float32 [D], or with VDPBF16PS the raw bf16 row (D / 2 pairs).
    static inline void prepare_query(const float* q, float* out, int64_t d) {
        for (int64_t i = 0; i < d; i += 16) {
            const __mmask16 mask = tail_mask(d - i);
            _mm512_mask_storeu_ps(out + i, mask, _mm512_maskz_loadu_ps(mask, q + i));
        }
    }
    static inline void prepare_query(const uint16_t* q, float* out, int64_t d) {
#ifdef PA_AVX512_BF16
        for (int64_t i = 0; i < d; i += 32) {
            const int64_t left = d - i;
            const __mmask32 mask = left >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << left) - 1u);
            _mm512_mask_storeu_epi16((uint16_t*)out + i, mask, _mm512_maskz_loadu_epi16(mask, q + i));
        }
#else
        to_float(q, out, d);
#endif
    }
    // K transposed key-minor into kbuf; V rows in place (float32) or converted into vbuf.
    static inline const void* prepare_block(const float* kb, const float* vb, int64_t n, int64_t d, float* kbuf, float*,
                                            const float** k) {
        transpose_keys(n, d, kbuf, [&](int64_t j, int64_t c, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, kb + j * d + c); });
        *k = kbuf;
        return vb;
    }
    static inline const void* prepare_block(const uint16_t* kb, const uint16_t* vb, int64_t n, int64_t d, float* kbuf, float* vbuf,
                                            const float** k) {
#ifdef PA_AVX512_BF16
        // bf16 pairs (dims 2i, 2i+1) as 32-bit columns: d / 2 of them.
        const uint32_t* pairs = (const uint32_t*)kb;
        transpose_keys(n, d / 2, kbuf, [&](int64_t j, int64_t c, __mmask16 mask) {
            return _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(mask, pairs + j * (d / 2) + c));
        });
#else
        transpose_keys(n, d, kbuf, [&](int64_t j, int64_t c, __mmask16 mask) { return load_bf16_as_f32(kb + j * d + c, mask); });
#endif
        *k = kbuf;
        if (d % 16) {  // a head dim with a masked tail: V as float32 rows (axpy_rows' tail reads floats)
            to_float(vb, vbuf, n * d);
            return vbuf;
        }
        return vb;  // V read in place, widened in registers by axpy_rows<uint16_t>
    }
    static inline void to_float(const uint16_t* src, float* dst, int64_t n) {
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 mask = tail_mask(n - i);
            _mm512_mask_storeu_ps(dst + i, mask, load_bf16_as_f32(src + i, mask));
        }
    }
    // Scores of `rows` query rows (stride d floats) against a block's n keys, every lane of
    // each 16-key group (lanes past n see zero keys).
    template <class T>
    static PA_INLINE void scores_rows(const float* q, int64_t rows, const float* k, int64_t n, int64_t d, float scale, float* s,
                                      int64_t s_stride) {
#ifdef PA_AVX512_BF16
        if (sizeof(T) == 2) return scores_rows_impl<true>(q, d, rows, k, n, d / 2, scale, s, s_stride);
#endif
        scores_rows_impl<false>(q, d, rows, k, n, d, scale, s, s_stride);
    }
    // The softmax update of `pairs` (row, head) pairs, pair i seeing keys[i] keys of the block:
    //     m' = max(m, max_j s_j), alpha = exp(m - m'), p_j = exp(s_j - m'), l = fma(l, alpha, sum)
    // with sum = p_0 + p_1 + ... in key order. Runs of 8 or more pairs are done 16 at a time with
    // pairs in the lanes (one transpose in, one out); the rest one pair at a time with keys in
    // the lanes. Every lane sees the same operations in the same order either way.
    static PA_INLINE void softmax_rows(float* s, int64_t s_stride, int64_t pairs, const int32_t* keys, float* m, float* l, float* alpha) {
        int64_t i = 0;
        for (; i + 8 <= pairs; i += 16) softmax_lanes(s + i * s_stride, s_stride, pairs - i < 16 ? pairs - i : 16, keys + i, m + i, l + i, alpha + i);
        if (i < pairs) softmax_few(s + i * s_stride, s_stride, pairs - i, keys + i, m + i, l + i, alpha + i);
    }
    // Fewer than 8 pairs (a decode row's GQA group), each with keys in the lanes: the probabilities
    // first, then every pair's sum in key order, the pairs' sums interleaved so their serial
    // chains of additions overlap.
    static PA_INLINE void softmax_few(float* s, int64_t s_stride, int64_t pairs, const int32_t* keys, float* m, float* l, float* alpha) {
        float sum[8];
        int64_t most = 0;
        for (int64_t i = 0; i < pairs; ++i) {
            float* si = s + i * s_stride;
            const int64_t n = keys[i];
            most = n > most ? n : most;
            __m512 mx = _mm512_set1_ps(-__builtin_inff());
            for (int64_t j = 0; j < n; j += 16) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, tail_mask(n - j), si + j));
            const __m512 m_old = _mm512_set1_ps(m[i]);
            const __m512 m_new = _mm512_max_ps(m_old, _mm512_set1_ps(_mm512_reduce_max_ps(mx)));
            for (int64_t j = 0; j < n; j += 16) {
                const __mmask16 mask = tail_mask(n - j);
                _mm512_mask_storeu_ps(si + j, mask, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, si + j), m_new)));
            }
            m[i] = _mm512_cvtss_f32(m_new);
            alpha[i] = _mm512_cvtss_f32(exp_nonpositive(_mm512_sub_ps(m_old, m_new)));
            sum[i] = 0.0f;
        }
        for (int64_t t = 0; t < most; ++t)
            for (int64_t i = 0; i < pairs; ++i)
                if (t < keys[i]) sum[i] += s[i * s_stride + t];
        for (int64_t i = 0; i < pairs; ++i)
            l[i] = _mm512_cvtss_f32(_mm512_fmadd_ps(_mm512_set1_ps(l[i]), _mm512_set1_ps(alpha[i]), _mm512_set1_ps(sum[i])));
    }
    static PA_INLINE void softmax_lanes(float* s, int64_t s_stride, int64_t pairs, const int32_t* keys, float* m, float* l, float* alpha) {
        const __mmask16 lanes = tail_mask(pairs);
        const __m512i n = _mm512_maskz_loadu_epi32(lanes, keys);
        const int64_t max_keys = _mm512_reduce_max_epi32(n);
        __m512 r[16];
        __m512 mx = _mm512_set1_ps(-__builtin_inff());
        for (int64_t g = 0; g < max_keys; g += 16) {
            for (int64_t i = 0; i < 16; ++i) r[i] = i < pairs ? _mm512_loadu_ps(s + i * s_stride + g) : _mm512_setzero_ps();
            transpose16(r);
            for (int64_t j = 0; j < 16 && g + j < max_keys; ++j)
                mx = _mm512_mask_max_ps(mx, _mm512_cmpgt_epi32_mask(n, _mm512_set1_epi32((int)(g + j))), mx, r[j]);
        }
        const __m512 m_old = _mm512_maskz_loadu_ps(lanes, m);
        const __m512 m_new = _mm512_max_ps(m_old, mx);
        const __m512 a = exp_nonpositive(_mm512_sub_ps(m_old, m_new));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t g = 0; g < max_keys; g += 16) {
            for (int64_t i = 0; i < 16; ++i) r[i] = i < pairs ? _mm512_loadu_ps(s + i * s_stride + g) : _mm512_setzero_ps();
            transpose16(r);
            for (int64_t j = 0; j < 16; ++j) {
                const __mmask16 valid = _mm512_cmpgt_epi32_mask(n, _mm512_set1_epi32((int)(g + j)));
                r[j] = _mm512_maskz_mov_ps(valid, exp_nonpositive(_mm512_sub_ps(r[j], m_new)));
                sum = _mm512_mask_add_ps(sum, valid, sum, r[j]);
            }
            transpose16(r);
            for (int64_t i = 0; i < pairs; ++i) _mm512_storeu_ps(s + i * s_stride + g, r[i]);
        }
        _mm512_mask_storeu_ps(m, lanes, m_new);
        _mm512_mask_storeu_ps(alpha, lanes, a);
        _mm512_mask_storeu_ps(l, lanes, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, l), a, sum));
    }
    // The whole 16-lane vectors of the head dim; returns how many columns that covered.
    template <class V>
    static PA_INLINE int64_t axpy_vectors(float* acc, const float* alpha, const float* p, int64_t p_stride, int64_t rows, const V* v,
                                          int64_t n, int64_t d) {
        int64_t i = 0;
        for (; i + 64 <= d; i += 64) axpy_rows_nv<4>(acc + i, alpha, p, p_stride, rows, v + i, n, d);
        switch ((d - i) / 16) {
            case 3: axpy_rows_nv<3>(acc + i, alpha, p, p_stride, rows, v + i, n, d); break;
            case 2: axpy_rows_nv<2>(acc + i, alpha, p, p_stride, rows, v + i, n, d); break;
            case 1: axpy_rows_nv<1>(acc + i, alpha, p, p_stride, rows, v + i, n, d); break;
            default: break;
        }
        return i + (d - i) / 16 * 16;
    }
    // V: the cache's bf16 rows when T is bf16 and d a multiple of 16 (prepare_block), else float32.
    template <class T>
    static PA_INLINE void axpy_rows(float* acc, const float* alpha, const float* p, int64_t p_stride, int64_t rows, const void* v_rows,
                                    int64_t n, int64_t d) {
        if (sizeof(T) == 2 && d % 16 == 0) {
            axpy_vectors(acc, alpha, p, p_stride, rows, static_cast<const uint16_t*>(v_rows), n, d);
            return;
        }
        const float* v = static_cast<const float*>(v_rows);
        const int64_t i = axpy_vectors(acc, alpha, p, p_stride, rows, v, n, d);
        if (i < d) {  // a head dim that is not a multiple of 16: the last lanes, masked
            const __mmask16 mask = tail_mask(d - i);
            for (int64_t r = 0; r < rows; ++r) {
                __m512 a = _mm512_maskz_loadu_ps(mask, acc + r * d + i);
                if (alpha[r] != 1.0f) a = _mm512_mul_ps(a, _mm512_set1_ps(alpha[r]));
                for (int64_t j = 0; j < n; ++j)
                    a = _mm512_fmadd_ps(_mm512_set1_ps(p[r * p_stride + j]), _mm512_maskz_loadu_ps(mask, v + j * d + i), a);
                _mm512_mask_storeu_ps(acc + r * d + i, mask, a);
            }
        }
    }
};

#include "paged_attention_impl.h"

}  // namespace PA_NS

extern "C" int PA_ENTRY(const pa_args* a, const pa_item* items, int64_t num_items, float* partials) {
    return PA_NS::pa_run_items_dispatch_dtype(a, items, num_items, partials);
}
