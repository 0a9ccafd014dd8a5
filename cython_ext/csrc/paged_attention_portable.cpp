// The portable path: plain C++ built without ISA flags (any x86-64 or ARM CPU). The compiler may
// vectorize what the baseline ISA allows; a test checks its object code for AVX-512 registers.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_attention.h"

namespace planserve_pa_portable {

static inline void bf16_to_float(const uint16_t* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        uint32_t bits = (uint32_t)src[i] << 16;
        memcpy(dst + i, &bits, 4);
    }
}

struct Ops {
    // Query rows and K/V blocks as float32 rows ([D] and [n, D]; float32 caches are read in place).
    static inline void prepare_query(const float* q, float* out, int64_t d) { memcpy(out, q, d * sizeof(float)); }
    static inline void prepare_query(const uint16_t* q, float* out, int64_t d) { bf16_to_float(q, out, d); }
    static inline const float* prepare_block(const float* kb, const float* vb, int64_t, int64_t, float*, float*, const float** k) {
        *k = kb;
        return vb;
    }
    static inline const float* prepare_block(const uint16_t* kb, const uint16_t* vb, int64_t n, int64_t d, float* kbuf, float* vbuf,
                                             const float** k) {
        bf16_to_float(kb, kbuf, n * d);
        bf16_to_float(vb, vbuf, n * d);
        *k = kbuf;
        return vbuf;
    }
    // s[r][j] = (q_r . k_j) * scale for rows q_r = q + r * d and keys k_j = k + j * d; one
    // running sum per dot, in index order.
    template <class T>
    static inline void scores_rows(const float* q, int64_t rows, const float* k, int64_t n, int64_t d, float scale, float* s,
                                   int64_t s_stride) {
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = 0; j < n; ++j) {
                const float* qr = q + r * d;
                const float* kj = k + j * d;
                float sum = 0.0f;
                for (int64_t i = 0; i < d; ++i) sum += qr[i] * kj[i];
                s[r * s_stride + j] = sum * scale;
            }
    }
    static inline float max(const float* s, int64_t n) {
        float m = s[0];
        for (int64_t j = 1; j < n; ++j) m = s[j] > m ? s[j] : m;
        return m;
    }
    static inline float exp1(float x) { return expf(x); }
    // s[j] = exp(s[j] - m); returns the sum in index order.
    static inline float exp_shifted(float* s, int64_t n, float m) {
        float sum = 0.0f;
        for (int64_t j = 0; j < n; ++j) {
            s[j] = expf(s[j] - m);
            sum += s[j];
        }
        return sum;
    }
    // acc_r = acc_r * alpha_r + sum_j p_r[j] v_j, j ascending, for rows r (acc stride d, p stride p_stride).
    static inline void axpy_rows(float* acc, const float* alpha, const float* p, int64_t p_stride, int64_t rows, const float* v,
                                 int64_t n, int64_t d) {
        for (int64_t r = 0; r < rows; ++r) {
            float* ar = acc + r * d;
            if (alpha[r] != 1.0f)
                for (int64_t i = 0; i < d; ++i) ar[i] *= alpha[r];
            for (int64_t j = 0; j < n; ++j) {
                const float* vj = v + j * d;
                const float pj = p[r * p_stride + j];
                for (int64_t i = 0; i < d; ++i) ar[i] += pj * vj[i];
            }
        }
    }
};

#include "paged_attention_impl.h"

}  // namespace planserve_pa_portable

extern "C" void pa_run_items_portable(const pa_args* a, const pa_item* items, int64_t num_items, float* partials) {
    planserve_pa_portable::pa_run_items_dispatch_dtype(a, items, num_items, partials);
}
