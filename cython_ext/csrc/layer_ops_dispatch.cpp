// The layer operations' C entry points (layer_ops.h): argument checks, then the ISA path.
#include "layer_ops.h"

#include "cpu_features.h"

extern "C" {

#define LO_DECLARE(isa)                                                                                                    \
    int lo_add_rms_norm_##isa(void*, const void*, const void*, void*, int64_t, int64_t, float, int, int);                  \
    int lo_rope_##isa(void*, int64_t, int64_t, int64_t, int64_t, const int64_t*, const float*, int, int);                  \
    int lo_silu_mul_##isa(const void*, void*, int64_t, int64_t, int, int);
LO_DECLARE(portable)
#if defined(PLANSERVE_PA_X86)
LO_DECLARE(avx2)
LO_DECLARE(avx512)
#endif

int lo_isa_supported(int isa) {
    switch (isa) {
        case LO_ISA_PORTABLE: return 1;
#if defined(PLANSERVE_PA_X86)
        case LO_ISA_AVX2: return planserve_cpu_avx2() ? 1 : 0;
        case LO_ISA_AVX512: return planserve_cpu_avx512() ? 1 : 0;
#endif
    }
    return 0;
}

const char* lo_error_message(int code) {
    switch (code) {
        case LO_OK: return "ok";
        case LO_BAD_SHAPE: return "a row count, width, head count, head_dim (even) or row stride out of range";
        case LO_BAD_POSITION: return "a position outside the RoPE table";
        case LO_ISA_UNAVAILABLE: return "the requested ISA path is not available on this CPU or build";
    }
    return "unknown error";
}

// One switch per operation: the ISA path's function of that name, called with the arguments.
#if defined(PLANSERVE_PA_X86)
#define LO_CALL(op, isa, ...)                                                                                              \
    switch (isa) {                                                                                                         \
        case LO_ISA_PORTABLE: return lo_##op##_portable(__VA_ARGS__);                                                      \
        case LO_ISA_AVX2: return lo_##op##_avx2(__VA_ARGS__);                                                              \
        case LO_ISA_AVX512: return lo_##op##_avx512(__VA_ARGS__);                                                          \
    }                                                                                                                      \
    return LO_ISA_UNAVAILABLE
#else
#define LO_CALL(op, isa, ...)                                                                                              \
    if (isa == LO_ISA_PORTABLE) return lo_##op##_portable(__VA_ARGS__);                                                   \
    return LO_ISA_UNAVAILABLE
#endif

static bool bad_common(int64_t rows, int dtype, int num_threads) {
    return rows < 0 || (dtype != LO_FLOAT32 && dtype != LO_BFLOAT16) || num_threads <= 0;
}

int lo_add_rms_norm(void* residual, const void* delta, const void* weight, void* out, int64_t rows, int64_t hidden,
                    float eps, int dtype, int isa, int num_threads) {
    if (!lo_isa_supported(isa)) return LO_ISA_UNAVAILABLE;
    if (bad_common(rows, dtype, num_threads) || hidden <= 0) return LO_BAD_SHAPE;
    LO_CALL(add_rms_norm, isa, residual, delta, weight, out, rows, hidden, eps, dtype, num_threads);
}

int lo_rope(void* x, int64_t rows, int64_t row_stride, int64_t num_heads, int64_t head_dim, const int64_t* positions,
            const float* table, int64_t table_rows, int dtype, int isa, int num_threads) {
    if (!lo_isa_supported(isa)) return LO_ISA_UNAVAILABLE;
    if (bad_common(rows, dtype, num_threads) || num_heads < 0 || head_dim <= 0 || head_dim % 2 ||
        row_stride < num_heads * head_dim)
        return LO_BAD_SHAPE;
    for (int64_t r = 0; r < rows; ++r)
        if (positions[r] < 0 || positions[r] >= table_rows) return LO_BAD_POSITION;
    LO_CALL(rope, isa, x, rows, row_stride, num_heads, head_dim, positions, table, dtype, num_threads);
}

int lo_silu_mul(const void* gate_up, void* out, int64_t rows, int64_t width, int dtype, int isa, int num_threads) {
    if (!lo_isa_supported(isa)) return LO_ISA_UNAVAILABLE;
    if (bad_common(rows, dtype, num_threads) || width <= 0) return LO_BAD_SHAPE;
    LO_CALL(silu_mul, isa, gate_up, out, rows, width, dtype, num_threads);
}

}  // extern "C"
