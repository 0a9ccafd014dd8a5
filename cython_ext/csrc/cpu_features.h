// Which vector paths this CPU runs (x86-64 builds with PLANSERVE_PA_X86; elsewhere none but the
// portable one). Shared by the paged attention kernel and the layer operations.
#pragma once

static inline bool planserve_cpu_avx2(void) {
#if defined(__x86_64__) && defined(PLANSERVE_PA_X86)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return false;
#endif
}

static inline bool planserve_cpu_avx512(void) {
#if defined(__x86_64__) && defined(PLANSERVE_PA_X86)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
#else
    return false;
#endif
}

static inline bool planserve_cpu_avx512_bf16(void) {
#if defined(__x86_64__) && defined(PLANSERVE_PA_X86)
    return planserve_cpu_avx512() && __builtin_cpu_supports("avx512bf16");
#else
    return false;
#endif
}
