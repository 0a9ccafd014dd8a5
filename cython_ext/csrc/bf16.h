// bfloat16 <-> float32 in scalar C++, one copy for every translation unit that needs them (the GEMMs'
// portable and generic-vector paths, the decoder loop's LoRA add). A bfloat16 is the top half of a
// float32: widening is exact; narrowing rounds to nearest even, as torch does. `static`, so each
// translation unit keeps its own copy compiled with its own ISA flags (an inline function with
// external linkage could be merged across the ISA objects).
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
