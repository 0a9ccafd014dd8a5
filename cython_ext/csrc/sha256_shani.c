/* SHA-256 compression (FIPS 180-4 6.2.2) on the x86 SHA extensions (SHA-NI), written for planserve
 * from Intel's description of the instructions (Intel 64 and IA-32 Architectures Software
 * Developer's Manual, vol. 2: SHA256RNDS2, SHA256MSG1, SHA256MSG2).
 *
 * Its own translation unit, built with -msha -msse4.1 (setup.py, ISA_SOURCES_OF) and never
 * called unless CPUID reports SHA, SSSE3 and SSE4.1 (ps_sha256_cpu_has_shani in sha256.h): the
 * rest of the block pool is built for baseline x86-64, so one wheel runs on every CPU. The
 * portable ps_sha256_compress in sha256.h stays the reference; tests/scheduler/test_block_hash.py
 * holds both to FIPS 180-4's examples and to hashlib, byte for byte.
 *
 * What the instructions do (32-bit lanes, lane 0 the lowest):
 *   _mm_sha256rnds2_epu32(cdgh, abef, wk)  two rounds. abef holds (lane 3..0) A B E F, cdgh holds
 *       C D G H, wk lanes 0 and 1 hold W[t] + PS_SHA256_K[t] and W[t+1] + PS_SHA256_K[t+1]. Returns the new A B E F;
 *       after two rounds the new C D G H is the old A B E F, so the caller swaps the roles.
 *   _mm_sha256msg1_epu32(w0_3, w4_7)       lanes i: W[i] + sigma0(W[i+1]), i = 0..3.
 *   _mm_sha256msg2_epu32(x, w12_15)        finishes W[16..19] from x = W[t-16] + sigma0(W[t-15])
 *       + W[t-7] (lanes t = 16..19), adding sigma1(W[t-2]), W[14], W[15] taken from w12_15.
 */
#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "sha256_k.h"

/* num_blocks consecutive 64-byte blocks into h (A..H in h[0..7]), the state kept in registers. */
void ps_sha256_blocks_shani(uint32_t h[8], const uint8_t* data, size_t num_blocks) {
    /* The message words are big-endian: reverse the bytes of each 32-bit lane. */
    const __m128i bswap = _mm_set_epi8(12, 13, 14, 15, 8, 9, 10, 11, 4, 5, 6, 7, 0, 1, 2, 3);
    __m128i abef = _mm_set_epi32((int)h[0], (int)h[1], (int)h[4], (int)h[5]);
    __m128i cdgh = _mm_set_epi32((int)h[2], (int)h[3], (int)h[6], (int)h[7]);
    uint32_t out[8];
    size_t blk;
    for (blk = 0; blk < num_blocks; blk++, data += 64) {
        const __m128i abef_in = abef, cdgh_in = cdgh;
        __m128i w[4];  /* W[4g .. 4g+3] for the last four groups: w[g % 4] */
        int g;
        for (g = 0; g < 4; g++)
            w[g] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i*)(data + 16 * g)), bswap);
        for (g = 0; g < 16; g++) {   /* rounds 4g .. 4g+3 */
            __m128i wk;
            if (g >= 4) {
                /* W[t] = sigma1(W[t-2]) + W[t-7] + sigma0(W[t-15]) + W[t-16], t = 4g .. 4g+3:
                 * msg1 gives W[t-16] + sigma0(W[t-15]); alignr picks W[t-7] (W[4g-7 .. 4g-4],
                 * from the two previous groups); msg2 adds the sigma1 terms. */
                __m128i x = _mm_sha256msg1_epu32(w[g % 4], w[(g + 1) % 4]);
                x = _mm_add_epi32(x, _mm_alignr_epi8(w[(g + 3) % 4], w[(g + 2) % 4], 4));
                w[g % 4] = _mm_sha256msg2_epu32(x, w[(g + 3) % 4]);
            }
            wk = _mm_add_epi32(w[g % 4], _mm_load_si128((const __m128i*)(PS_SHA256_K + 4 * g)));
            cdgh = _mm_sha256rnds2_epu32(cdgh, abef, wk);          /* rounds 4g, 4g+1 */
            wk = _mm_shuffle_epi32(wk, 0x0E);                       /* lanes 2, 3 down to 0, 1 */
            abef = _mm_sha256rnds2_epu32(abef, cdgh, wk);          /* rounds 4g+2, 4g+3 */
            /* Four rounds: the roles are back (abef holds A B E F, cdgh C D G H). */
        }
        abef = _mm_add_epi32(abef, abef_in);  /* H(i) = H(i-1) + working variables (6.2.2 step 4) */
        cdgh = _mm_add_epi32(cdgh, cdgh_in);
    }
    _mm_storeu_si128((__m128i*)out, abef);      /* lanes 0..3: F E B A */
    _mm_storeu_si128((__m128i*)(out + 4), cdgh); /* lanes 0..3: H G D C */
    h[0] = out[3]; h[1] = out[2]; h[4] = out[1]; h[5] = out[0];
    h[2] = out[7]; h[3] = out[6]; h[6] = out[5]; h[7] = out[4];
}

#endif
