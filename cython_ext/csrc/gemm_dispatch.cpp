// The GEMMs' C entry points (gemm.h): packing, argument checks, then the ISA path.
#include <string.h>

#include "cpu_features.h"
#include "gemm.h"

extern "C" {

#define GM_DECLARE(isa)                                                                                                  \
    void gm_linear_bf16_##isa(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t, const uint16_t*,    \
                              void*, int64_t, int, int);                                                                 \
    void gm_linear_int8_##isa(const uint16_t*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, const uint16_t*,     \
                              void*, int64_t, int, int);
GM_DECLARE(portable)
#if defined(PLANSERVE_PA_X86)
GM_DECLARE(avx512_bf16)
GM_DECLARE(avx2)
GM_DECLARE(avx512)
#endif

int gm_isa_supported(int isa) {
    switch (isa) {
        case GM_ISA_PORTABLE: return 1;
#if defined(PLANSERVE_PA_X86)
        case GM_ISA_AVX512_BF16:  // int8 runs VPDPWSSD: every AVX512-BF16 CPU so far has AVX512-VNNI too
            return planserve_cpu_avx512_bf16() && __builtin_cpu_supports("avx512vnni") ? 1 : 0;
        case GM_ISA_AVX2: return planserve_cpu_avx2() ? 1 : 0;
        case GM_ISA_AVX512: return planserve_cpu_avx512() ? 1 : 0;  // F, BW (vpmaddwd on zmm), VL, DQ
#endif
    }
    return 0;
}

const char* gm_error_message(int code) {
    switch (code) {
        case GM_OK: return "ok";
        case GM_BAD_SHAPE:
            return "a row count, column count or row stride out of range (input columns even; a multiple of 32 for int8)";
        case GM_ISA_UNAVAILABLE: return "the requested ISA path is not available on this CPU or build";
        case GM_BAD_ROW: return "a row id outside the weight's rows";
    }
    return "unknown error";
}

static int64_t panels_of(int64_t n) { return (n + GM_PANEL - 1) / GM_PANEL; }

int64_t gm_packed_bf16_elems(int64_t n, int64_t k) { return panels_of(n) * ((k + 1) / 2) * 2 * GM_PANEL; }

int64_t gm_packed_int8_bytes(int64_t n, int64_t k) { return panels_of(n) * (k / GM_INT8_BLOCK) * GM_INT8_PANEL_BLOCK_BYTES; }

int gm_pack_bf16(const uint16_t* w, int64_t n, int64_t k, int64_t ldw, uint16_t* packed) {
    if (n <= 0 || k <= 0 || ldw < k) return GM_BAD_SHAPE;
    const int64_t pairs = (k + 1) / 2;
    for (int64_t panel = 0; panel < panels_of(n); ++panel)
        for (int64_t p = 0; p < pairs; ++p)
            for (int64_t col = 0; col < GM_PANEL; ++col)
                for (int64_t h = 0; h < 2; ++h) {
                    const int64_t row = panel * GM_PANEL + col, kk = 2 * p + h;
                    *packed++ = row < n && kk < k ? w[row * ldw + kk] : 0;
                }
    return GM_OK;
}

int gm_unpack_bf16(const uint16_t* packed, int64_t n, int64_t k, uint16_t* w) {
    if (n <= 0 || k <= 0) return GM_BAD_SHAPE;
    const int64_t pairs = (k + 1) / 2;
    for (int64_t row = 0; row < n; ++row)
        for (int64_t kk = 0; kk < k; ++kk)
            w[row * k + kk] = packed[((row / GM_PANEL * pairs + kk / 2) * GM_PANEL + row % GM_PANEL) * 2 + kk % 2];
    return GM_OK;
}

int gm_pack_int8(const int8_t* q, const float* scales, int64_t n, int64_t k, uint8_t* packed) {
    if (n <= 0 || k <= 0 || k % GM_INT8_BLOCK) return GM_BAD_SHAPE;
    const int64_t blocks = k / GM_INT8_BLOCK;
    for (int64_t panel = 0; panel < panels_of(n); ++panel)
        for (int64_t blk = 0; blk < blocks; ++blk) {
            float* scale = (float*)packed;
            int8_t* out = (int8_t*)(packed + GM_PANEL * sizeof(float));
            for (int64_t col = 0; col < GM_PANEL; ++col) {
                const int64_t row = panel * GM_PANEL + col;
                const int8_t* w = row < n ? q + row * k + blk * GM_INT8_BLOCK : nullptr;
                scale[col] = w ? scales[row * blocks + blk] : 0.0f;
                for (int64_t kk = 0; kk < GM_INT8_BLOCK; ++kk) out[((kk / 2) * GM_PANEL + col) * 2 + kk % 2] = w ? w[kk] : 0;
            }
            packed += GM_INT8_PANEL_BLOCK_BYTES;
        }
    return GM_OK;
}

int gm_gather_rows_bf16(const uint16_t* packed, int64_t n, int64_t k, const int64_t* ids, int64_t count, uint16_t* out) {
    if (n <= 0 || k <= 0 || count < 0) return GM_BAD_SHAPE;
    for (int64_t i = 0; i < count; ++i)
        if (ids[i] < 0 || ids[i] >= n) return GM_BAD_ROW;
    const int64_t pairs = (k + 1) / 2;
    for (int64_t i = 0; i < count; ++i) {
        // Row r's pairs are GM_PANEL pairs apart within its panel: 2 values at a time.
        const uint16_t* row = packed + (ids[i] / GM_PANEL * pairs * GM_PANEL + ids[i] % GM_PANEL) * 2;
        for (int64_t kk = 0; kk < k; ++kk) out[i * k + kk] = row[(kk / 2) * GM_PANEL * 2 + kk % 2];
    }
    return GM_OK;
}

typedef void (*linear_bf16_fn)(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t, const uint16_t*,
                               void*, int64_t, int, int);
typedef void (*linear_int8_fn)(const uint16_t*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, const uint16_t*,
                               void*, int64_t, int, int);

static linear_bf16_fn linear_bf16_path(int isa) {
    switch (isa) {
#if defined(PLANSERVE_PA_X86)
        case GM_ISA_AVX512_BF16: return gm_linear_bf16_avx512_bf16;
        case GM_ISA_AVX2: return gm_linear_bf16_avx2;
        case GM_ISA_AVX512: return gm_linear_bf16_avx512;
#endif
    }
    return gm_linear_bf16_portable;
}

static linear_int8_fn linear_int8_path(int isa) {
    switch (isa) {
#if defined(PLANSERVE_PA_X86)
        case GM_ISA_AVX512_BF16: return gm_linear_int8_avx512_bf16;
        case GM_ISA_AVX2: return gm_linear_int8_avx2;
        case GM_ISA_AVX512: return gm_linear_int8_avx512;
#endif
    }
    return gm_linear_int8_portable;
}

static bool bad_call(int64_t rows, int64_t ldx, int64_t n, int64_t k, int64_t ldo, int num_threads) {
    return rows < 0 || n <= 0 || k <= 0 || k % 2 || ldx < k || ldo < n || num_threads <= 0;
}

int gm_linear_bf16(const uint16_t* x, int64_t rows, int64_t ldx, const uint16_t* packed, int64_t n, int64_t k,
                   const uint16_t* bias, void* out, int64_t ldo, int out_f32, int isa, int num_threads) {
    if (!gm_isa_supported(isa)) return GM_ISA_UNAVAILABLE;
    if (bad_call(rows, ldx, n, k, ldo, num_threads)) return GM_BAD_SHAPE;
    linear_bf16_path(isa)(x, rows, ldx, packed, n, k, bias, out, ldo, out_f32, num_threads);
    return GM_OK;
}

int gm_linear_int8(const uint16_t* x, int64_t rows, int64_t ldx, const uint8_t* packed, int64_t n, int64_t k,
                   const uint16_t* bias, void* out, int64_t ldo, int out_f32, int isa, int num_threads) {
    if (!gm_isa_supported(isa)) return GM_ISA_UNAVAILABLE;
    if (bad_call(rows, ldx, n, k, ldo, num_threads) || k % GM_INT8_BLOCK) return GM_BAD_SHAPE;
    linear_int8_path(isa)(x, rows, ldx, packed, n, k, bias, out, ldo, out_f32, num_threads);
    return GM_OK;
}

}  // extern "C"
