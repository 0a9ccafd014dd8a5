// The AVX-512 path with VDPBF16PS dot products (built with -mavx512bf16; see paged_attention_avx512.cpp).
#define PA_AVX512_BF16 1
#include "paged_attention_avx512.cpp"
