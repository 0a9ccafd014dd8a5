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

struct Ops {
#ifdef PA_AVX512_BF16
    static constexpr bool kScoresFromRawK = true;
#else
    static constexpr bool kScoresFromRawK = false;
#endif

    static inline void to_float(const uint16_t* src, float* dst, int64_t n) {
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 mask = tail_mask(n - i);
            _mm512_mask_storeu_ps(dst + i, mask, load_bf16_as_f32(src + i, mask));
        }
    }
    // s[j] = (q . k_j) * scale: 16 lanes of FMAs over the head dimension, then one lane sum.
    static inline void scores(const float* q, const float* k, int64_t n, int64_t d, float scale, float* s) {
        for (int64_t j = 0; j < n; ++j) {
            const float* kj = k + j * d;
            __m512 acc = _mm512_setzero_ps();
            for (int64_t i = 0; i < d; i += 16) {
                const __mmask16 mask = tail_mask(d - i);
                acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, q + i), _mm512_maskz_loadu_ps(mask, kj + i), acc);
            }
            s[j] = _mm512_reduce_add_ps(acc) * scale;
        }
    }
#ifdef PA_AVX512_BF16
    // The same on bf16 rows: VDPBF16PS takes 32 bf16 pairs per instruction into 16 float lanes.
    static inline void scores_bf16(const uint16_t* q, const uint16_t* k, int64_t n, int64_t d, float scale, float* s) {
        for (int64_t j = 0; j < n; ++j) {
            const uint16_t* kj = k + j * d;
            __m512 acc = _mm512_setzero_ps();
            for (int64_t i = 0; i < d; i += 32) {
                const int64_t left = d - i;
                const __mmask32 mask = left >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << left) - 1u);
                const __m512i qv = _mm512_maskz_loadu_epi16(mask, q + i);
                const __m512i kv = _mm512_maskz_loadu_epi16(mask, kj + i);
                acc = _mm512_dpbf16_ps(acc, (__m512bh)qv, (__m512bh)kv);
            }
            s[j] = _mm512_reduce_add_ps(acc) * scale;
        }
    }
#else
    static inline void scores_bf16(const uint16_t*, const uint16_t*, int64_t, int64_t, float, float*) {}
#endif
    static inline float exp1(float x) {
        return _mm512_cvtss_f32(exp_nonpositive(_mm512_set1_ps(x)));
    }
    static inline float exp_shifted(float* s, int64_t n, float m) {
        const __m512 mv = _mm512_set1_ps(m);
        float sum = 0.0f;
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 mask = tail_mask(n - j);
            const __m512 p = _mm512_maskz_mov_ps(mask, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + j), mv)));
            _mm512_mask_storeu_ps(s + j, mask, p);
            sum += _mm512_reduce_add_ps(p);
        }
        return sum;
    }
    static inline void scale_axpy(float* acc, float alpha, const float* p, const float* v, int64_t n, int64_t d) {
        const __m512 av = _mm512_set1_ps(alpha);
        for (int64_t i = 0; i < d; i += 16) {
            const __mmask16 mask = tail_mask(d - i);
            __m512 a = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, acc + i), av);
            for (int64_t j = 0; j < n; ++j)
                a = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_maskz_loadu_ps(mask, v + j * d + i), a);
            _mm512_mask_storeu_ps(acc + i, mask, a);
        }
    }
};

#include "paged_attention_impl.h"

}  // namespace PA_NS

extern "C" void PA_ENTRY(const pa_args* a, const pa_item* items, int64_t num_items, float* partials) {
    PA_NS::pa_run_items_dispatch_dtype(a, items, num_items, partials);
}
