// One bfloat16 value to float32 and back, in plain C (the upper 16 bits of a float32), for the
// packed GEMM's scalar edges: the portable path's tiles and every path's stores and int8 row
// quantization. `static`, so each translation unit keeps its own copy compiled with its own ISA
// flags (an inline function with external linkage could be merged across the ISA objects).
#pragma once
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
