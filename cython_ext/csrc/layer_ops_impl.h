// The arithmetic of the layer operations (contract: layer_ops.h), in GCC generic vectors of
// LO_VEC_BYTES bytes. Each ISA translation unit defines LO_VEC_BYTES and LO_NS, then includes
// this file: layer_ops_portable.cpp (16 bytes, no ISA flags), layer_ops_avx2.cpp (32),
// layer_ops_avx512.cpp (64). Every vector operation is lane-wise; a row is split into whole
// vectors and a scalar tail by its width alone, so a row computes the same in any batch.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "layer_ops.h"
#include "vector_exp.h"

namespace LO_NS {

#define LO_INLINE inline __attribute__((always_inline))
typedef float vf __attribute__((vector_size(LO_VEC_BYTES)));
typedef int32_t vi __attribute__((vector_size(LO_VEC_BYTES)));
typedef uint32_t vu __attribute__((vector_size(LO_VEC_BYTES)));
typedef uint16_t vh __attribute__((vector_size(LO_VEC_BYTES / 2)));
constexpr int kW = LO_VEC_BYTES / 4;  // float lanes per vector

// Loads and stores of kW elements as float32 lanes; bfloat16 widened exactly, rounded to
// nearest even on the way back (NaN stays a quiet NaN), as torch rounds.
static LO_INLINE vf load(const float* p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static LO_INLINE vf load(const uint16_t* p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}
static LO_INLINE void store(float* p, vf v) { memcpy(p, &v, sizeof v); }
static LO_INLINE void store(uint16_t* p, vf v) {
    const vu u = (vu)v;
    const vu rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    const vh h = __builtin_convertvector(v != v ? (vu){} + 0x7FC0u : rounded, vh);
    memcpy(p, &h, sizeof h);
}
static LO_INLINE float load1(const float* p) { return *p; }
static LO_INLINE float load1(const uint16_t* p) { return __builtin_bit_cast(float, (uint32_t)*p << 16); }
static LO_INLINE void store1(float* p, float x) { *p = x; }
static LO_INLINE void store1(uint16_t* p, float x) {
    const uint32_t u = __builtin_bit_cast(uint32_t, x);
    *p = x != x ? 0x7FC0 : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
// x as the dtype would hold it (identity for float32).
static LO_INLINE vf round_to(const float*, vf x) { return x; }
static LO_INLINE vf round_to(const uint16_t*, vf x) {
    uint16_t h[kW];
    store(h, x);
    return load(h);
}
static LO_INLINE float round1(const float*, float x) { return x; }
static LO_INLINE float round1(const uint16_t*, float x) {
    uint16_t h;
    store1(&h, x);
    return load1(&h);
}

// exp(x) with x clamped to [-87.3, 88] (vector_exp.h).
static LO_INLINE vf exp_clamped(vf x) {
    x = x < -87.3f ? vf{} - 87.3f : x;
    x = x > 88.0f ? vf{} + 88.0f : x;
    return cephes_exp<vf, vi>(x);
}
static LO_INLINE float exp1(float x) { return exp_clamped(vf{} + x)[0]; }

template <class T>
static void add_rms_norm_row(T* residual, const T* delta, const T* weight, T* out, int64_t n, float eps) {
    const int64_t nv = n / kW * kW;
    vf acc = {};
    for (int64_t i = 0; i < nv; i += kW) {
        vf x = load(residual + i);
        if (delta) {
            x = round_to(residual, x + load(delta + i));
            store(residual + i, x);
        }
        acc += x * x;
    }
    float tail = 0.0f;
    for (int64_t i = nv; i < n; ++i) {
        float x = load1(residual + i);
        if (delta) {
            x = round1(residual, x + load1(delta + i));
            store1(residual + i, x);
        }
        tail += x * x;
    }
    float sum = 0.0f;
    for (int lane = 0; lane < kW; ++lane) sum += acc[lane];
    const float inv = 1.0f / sqrtf((sum + tail) / (float)n + eps);
    for (int64_t i = 0; i < nv; i += kW) store(out + i, load(weight + i) * round_to(out, load(residual + i) * inv));
    for (int64_t i = nv; i < n; ++i) store1(out + i, load1(weight + i) * round1(out, load1(residual + i) * inv));
}

template <class T>
static void add_rms_norm(T* residual, const T* delta, const T* weight, T* out, int64_t rows, int64_t n, float eps,
                         int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * n > 262144)
    for (int64_t r = 0; r < rows; ++r)
        add_rms_norm_row(residual + r * n, delta ? delta + r * n : nullptr, weight, out + r * n, n, eps);
}

template <class T>
static void rope(T* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t d, const int64_t* positions,
                 const float* table, int num_threads) {
    const int64_t half = d / 2, nv = half / kW * kW;
#pragma omp parallel for num_threads(num_threads) if (rows * heads * d > 262144)
    for (int64_t r = 0; r < rows; ++r) {
        const float* cos_row = table + positions[r] * d;
        const float* sin_row = cos_row + half;
        for (int64_t h = 0; h < heads; ++h) {
            T* x1 = x + r * row_stride + h * d;
            T* x2 = x1 + half;
            for (int64_t i = 0; i < nv; i += kW) {
                const vf a = load(x1 + i), b = load(x2 + i), c = load(cos_row + i), s = load(sin_row + i);
                store(x1 + i, a * c - b * s);
                store(x2 + i, b * c + a * s);
            }
            for (int64_t i = nv; i < half; ++i) {
                const float a = load1(x1 + i), b = load1(x2 + i), c = cos_row[i], s = sin_row[i];
                store1(x1 + i, a * c - b * s);
                store1(x2 + i, b * c + a * s);
            }
        }
    }
}

template <class T>
static void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t width, int num_threads) {
    const int64_t nv = width / kW * kW;
#pragma omp parallel for num_threads(num_threads) if (rows * width > 65536)
    for (int64_t r = 0; r < rows; ++r) {
        const T* gate = gate_up + r * 2 * width;
        const T* up = gate + width;
        T* o = out + r * width;
        for (int64_t i = 0; i < nv; i += kW) {
            const vf g = load(gate + i);
            store(o + i, g / (1.0f + exp_clamped(-g)) * load(up + i));
        }
        for (int64_t i = nv; i < width; ++i) {
            const float g = load1(gate + i);
            store1(o + i, g / (1.0f + exp1(-g)) * load1(up + i));
        }
    }
}

}  // namespace LO_NS

extern "C" {

int LO_ENTRY(add_rms_norm)(void* residual, const void* delta, const void* weight, void* out, int64_t rows, int64_t hidden,
                           float eps, int dtype, int num_threads) {
    if (dtype == LO_BFLOAT16)
        LO_NS::add_rms_norm((uint16_t*)residual, (const uint16_t*)delta, (const uint16_t*)weight, (uint16_t*)out, rows, hidden,
                            eps, num_threads);
    else
        LO_NS::add_rms_norm((float*)residual, (const float*)delta, (const float*)weight, (float*)out, rows, hidden, eps,
                            num_threads);
    return LO_OK;
}

int LO_ENTRY(rope)(void* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t d, const int64_t* positions,
                   const float* table, int dtype, int num_threads) {
    if (dtype == LO_BFLOAT16)
        LO_NS::rope((uint16_t*)x, rows, row_stride, heads, d, positions, table, num_threads);
    else
        LO_NS::rope((float*)x, rows, row_stride, heads, d, positions, table, num_threads);
    return LO_OK;
}

int LO_ENTRY(silu_mul)(const void* gate_up, void* out, int64_t rows, int64_t width, int dtype, int num_threads) {
    if (dtype == LO_BFLOAT16)
        LO_NS::silu_mul((const uint16_t*)gate_up, (uint16_t*)out, rows, width, num_threads);
    else
        LO_NS::silu_mul((const float*)gate_up, (float*)out, rows, width, num_threads);
    return LO_OK;
}

}  // extern "C"
