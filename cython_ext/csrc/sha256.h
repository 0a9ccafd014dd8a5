/* SHA-256 (FIPS 180-4, "Secure Hash Standard", NIST 2015, sections 4.1.2, 4.2.2, 5.1.1, 6.2),
 * written for planserve from the standard's text: the prefix cache's block hash
 * (cython_ext/block_pool.pyx). Portable C99, no dependencies, header-only (static functions) so
 * the block pool's extension compiles it in and step_core reaches it through block_pool's cdef API.
 *
 * Checked against the standard's examples ("abc", the 448-bit message, the empty message) in
 * tests/scheduler/test_block_hash.py, and against Python's hashlib on random inputs.
 *
 * Streaming use: ps_sha256_init, ps_sha256_update (any number of times), ps_sha256_final.
 */
#ifndef PLANSERVE_SHA256_H
#define PLANSERVE_SHA256_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint32_t h[8];        /* working hash value H(i) */
    uint64_t num_bytes;   /* message length so far */
    uint8_t buf[64];      /* the partial 512-bit block */
    size_t buf_len;
} ps_sha256_ctx;

/* K: the first 32 bits of the fractional parts of the cube roots of the first 64 primes (4.2.2). */
static const uint32_t PS_SHA256_K[64] = {
    0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u, 0xab1c5ed5u,
    0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu, 0x9bdc06a7u, 0xc19bf174u,
    0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu, 0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau,
    0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u, 0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u,
    0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu, 0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u,
    0xa2bfe8a1u, 0xa81a664bu, 0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u,
    0x19a4c116u, 0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,
    0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u, 0xc67178f2u,
};

static inline uint32_t ps_rotr32(uint32_t x, unsigned n) { return (x >> n) | (x << (32 - n)); }

static inline uint32_t ps_load_be32(const uint8_t* p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}

static inline void ps_store_be32(uint8_t* p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24); p[1] = (uint8_t)(v >> 16); p[2] = (uint8_t)(v >> 8); p[3] = (uint8_t)v;
}

/* One 512-bit block (6.2.2 steps 1-4). */
static void ps_sha256_compress(uint32_t h[8], const uint8_t block[64]) {
    uint32_t w[64];
    uint32_t a, b, c, d, e, f, g, hh, t1, t2, s0, s1;
    int t;
    for (t = 0; t < 16; t++) w[t] = ps_load_be32(block + 4 * t);
    for (t = 16; t < 64; t++) {
        s0 = ps_rotr32(w[t - 15], 7) ^ ps_rotr32(w[t - 15], 18) ^ (w[t - 15] >> 3);
        s1 = ps_rotr32(w[t - 2], 17) ^ ps_rotr32(w[t - 2], 19) ^ (w[t - 2] >> 10);
        w[t] = w[t - 16] + s0 + w[t - 7] + s1;
    }
    a = h[0]; b = h[1]; c = h[2]; d = h[3]; e = h[4]; f = h[5]; g = h[6]; hh = h[7];
    for (t = 0; t < 64; t++) {
        t1 = hh + (ps_rotr32(e, 6) ^ ps_rotr32(e, 11) ^ ps_rotr32(e, 25)) + ((e & f) ^ (~e & g))
             + PS_SHA256_K[t] + w[t];
        t2 = (ps_rotr32(a, 2) ^ ps_rotr32(a, 13) ^ ps_rotr32(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        hh = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
    }
    h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += hh;
}

static inline void ps_sha256_init(ps_sha256_ctx* ctx) {
    /* H(0): the first 32 bits of the fractional parts of the square roots of the first 8 primes. */
    ctx->h[0] = 0x6a09e667u; ctx->h[1] = 0xbb67ae85u; ctx->h[2] = 0x3c6ef372u; ctx->h[3] = 0xa54ff53au;
    ctx->h[4] = 0x510e527fu; ctx->h[5] = 0x9b05688cu; ctx->h[6] = 0x1f83d9abu; ctx->h[7] = 0x5be0cd19u;
    ctx->num_bytes = 0;
    ctx->buf_len = 0;
}

static void ps_sha256_update(ps_sha256_ctx* ctx, const void* data, size_t len) {
    const uint8_t* p = (const uint8_t*)data;
    size_t take;
    ctx->num_bytes += len;
    if (ctx->buf_len) {
        take = 64 - ctx->buf_len < len ? 64 - ctx->buf_len : len;
        memcpy(ctx->buf + ctx->buf_len, p, take);
        ctx->buf_len += take; p += take; len -= take;
        if (ctx->buf_len < 64) return;
        ps_sha256_compress(ctx->h, ctx->buf);
        ctx->buf_len = 0;
    }
    while (len >= 64) {          /* whole blocks straight from the input */
        ps_sha256_compress(ctx->h, p);
        p += 64; len -= 64;
    }
    memcpy(ctx->buf, p, len);
    ctx->buf_len = len;
}

/* Padding (5.1.1): a 1 bit, zeros, then the message length in bits as a 64-bit big-endian integer. */
static void ps_sha256_final(ps_sha256_ctx* ctx, uint8_t out[32]) {
    uint64_t bits = ctx->num_bytes * 8;
    int i;
    ctx->buf[ctx->buf_len++] = 0x80;
    if (ctx->buf_len > 56) {
        memset(ctx->buf + ctx->buf_len, 0, 64 - ctx->buf_len);
        ps_sha256_compress(ctx->h, ctx->buf);
        ctx->buf_len = 0;
    }
    memset(ctx->buf + ctx->buf_len, 0, 56 - ctx->buf_len);
    for (i = 0; i < 8; i++) ctx->buf[56 + i] = (uint8_t)(bits >> (56 - 8 * i));
    ps_sha256_compress(ctx->h, ctx->buf);
    for (i = 0; i < 8; i++) ps_store_be32(out + 4 * i, ctx->h[i]);
}

#endif /* PLANSERVE_SHA256_H */
