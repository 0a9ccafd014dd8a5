// The AVX2 path: the portable source built with -mavx2 -mfma (setup.py), so the compiler
// vectorizes its loops 8 lanes wide with FMAs. For x86-64 CPUs without AVX-512.
#define PA_PORTABLE_AVX2 1
#include "paged_attention_portable.cpp"
