// exp(x) on GCC generic vectors, lane-wise, for x already within [-87.3, 88] (so 2^n below stays a
// normal float): Cephes' expf polynomial after x = n ln2 + r, n rounded by adding and subtracting
// 1.5 * 2^23, 2^n built from its exponent bits. Shared by the attention kernel's portable/AVX2
// path (its softmax) and the layer operations (SiLU); `static`, so each translation unit keeps its
// own copy, compiled with its own ISA flags.
#pragma once

template <class VF, class VI>
static inline __attribute__((always_inline)) VF cephes_exp(VF x) {
    const VF n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    VF r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    VF p = VF{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + (r + 1.0f);
    return p * (VF)((__builtin_convertvector(n, VI) + 127) << 23);
}
