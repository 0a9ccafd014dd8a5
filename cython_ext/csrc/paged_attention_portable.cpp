// The portable path: plain C++ built without ISA flags (any x86-64 or ARM CPU). The compiler may
// vectorize what the baseline ISA allows; a test checks its object code for AVX-512 registers.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_attention.h"

namespace planserve_pa_portable {

struct Ops {
    static constexpr bool kScoresFromRawK = false;

    static inline void to_float(const uint16_t* src, float* dst, int64_t n) {
        for (int64_t i = 0; i < n; ++i) {
            uint32_t bits = (uint32_t)src[i] << 16;
            memcpy(dst + i, &bits, 4);
        }
    }
    // s[j] = (q . k_j) * scale, k_j = k + j * d; one running sum per dot, in index order.
    static inline void scores(const float* q, const float* k, int64_t n, int64_t d, float scale, float* s) {
        for (int64_t j = 0; j < n; ++j) {
            const float* kj = k + j * d;
            float sum = 0.0f;
            for (int64_t i = 0; i < d; ++i) sum += q[i] * kj[i];
            s[j] = sum * scale;
        }
    }
    static inline void scores_bf16(const uint16_t*, const uint16_t*, int64_t, int64_t, float, float*) {}
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
    // acc = acc * alpha + sum_j p_j v_j, j ascending.
    static inline void scale_axpy(float* acc, float alpha, const float* p, const float* v, int64_t n, int64_t d) {
        for (int64_t i = 0; i < d; ++i) acc[i] *= alpha;
        for (int64_t j = 0; j < n; ++j) {
            const float* vj = v + j * d;
            const float pj = p[j];
            for (int64_t i = 0; i < d; ++i) acc[i] += pj * vj[i];
        }
    }
};

#include "paged_attention_impl.h"

}  // namespace planserve_pa_portable

extern "C" void pa_run_items_portable(const pa_args* a, const pa_item* items, int64_t num_items, float* partials) {
    planserve_pa_portable::pa_run_items_dispatch_dtype(a, items, num_items, partials);
}
