/* SHA-256 (FIPS 180-4, "Secure Hash Standard", NIST 2015, sections 4.1.2, 4.2.2, 5.1.1, 6.2),
 * written for planserve from the standard's text: the prefix cache's block hash
 * (cython_ext/block_pool.pyx). Portable C99, no dependencies, header-only (static functions) so
 * the block pool's extension compiles it in and step_core reaches it through block_pool's cdef API.
 *
 * Two compression paths, bit-identical: the portable one here (the reference, every CPU) and, on
 * x86-64, csrc/sha256_shani.c on the CPU's SHA instructions, its own translation unit built with
 * -msha -msse4.1. ps_sha256_select picks one at run time by CPUID; block_pool calls it at import.
 *
 * Checked against the standard's examples ("abc", the 448-bit message, the empty message) in
 * tests/scheduler/test_block_hash.py, and against Python's hashlib on random inputs, on each path.
 *
 * Streaming use: ps_sha256_init, ps_sha256_update (any number of times), ps_sha256_final.
 * One-shot use on a buffer with room for the padding: ps_sha256_padded.
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

#include "sha256_k.h"

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

/* The compression paths take num_blocks consecutive 64-byte blocks: one indirect call per message
 * part, and the SHA-NI path keeps the state in registers across them. */
typedef void (*ps_sha256_blocks_fn)(uint32_t h[8], const uint8_t* data, size_t num_blocks);

static void ps_sha256_blocks_portable(uint32_t h[8], const uint8_t* data, size_t num_blocks) {
    for (; num_blocks; num_blocks--, data += 64) ps_sha256_compress(h, data);
}

#if defined(__x86_64__) || defined(_M_X64)
#define PS_SHA256_HAVE_SHANI 1
#include <cpuid.h>
#ifdef __cplusplus
extern "C" {
#endif
void ps_sha256_blocks_shani(uint32_t h[8], const uint8_t* data, size_t num_blocks);  /* sha256_shani.c */
#ifdef __cplusplus
}
#endif

/* CPUID: SHA (leaf 7 EBX bit 29) and the SSSE3 / SSE4.1 the SHA-NI path also uses (leaf 1 ECX
 * bits 9, 19). No OS check needed: it only touches XMM registers, which every x86-64 OS saves. */
static int ps_sha256_cpu_has_shani(void) {
    unsigned a, b, c, d;
    if (__get_cpuid_max(0, 0) < 7) return 0;
    __cpuid(1, a, b, c, d);
    if (!(c & (1u << 9)) || !(c & (1u << 19))) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    return (b >> 29) & 1;
}
#else
#define PS_SHA256_HAVE_SHANI 0
static int ps_sha256_cpu_has_shani(void) { return 0; }
#endif

/* The path in use (per translation unit: only block_pool's includes this header). */
static ps_sha256_blocks_fn ps_sha256_blocks = ps_sha256_blocks_portable;

/* which: 0 portable, 1 SHA-NI, -1 the best this CPU runs. Returns the path now in use (0 or 1),
 * or -2 when SHA-NI was asked for and this build or CPU lacks it (nothing changes). */
static int ps_sha256_select(int which) {
    int shani = PS_SHA256_HAVE_SHANI && ps_sha256_cpu_has_shani();
    if (which == 1 && !shani) return -2;
    if (which == -1) which = shani;
#if PS_SHA256_HAVE_SHANI
    ps_sha256_blocks = which == 1 ? ps_sha256_blocks_shani : ps_sha256_blocks_portable;
#endif
    return which == 1;
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
        ps_sha256_blocks(ctx->h, ctx->buf, 1);
        ctx->buf_len = 0;
    }
    if (len >= 64) {             /* whole blocks straight from the input */
        ps_sha256_blocks(ctx->h, p, len / 64);
        p += len & ~(size_t)63; len &= 63;
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
        ps_sha256_blocks(ctx->h, ctx->buf, 1);
        ctx->buf_len = 0;
    }
    memset(ctx->buf + ctx->buf_len, 0, 56 - ctx->buf_len);
    for (i = 0; i < 8; i++) ctx->buf[56 + i] = (uint8_t)(bits >> (56 - 8 * i));
    ps_sha256_blocks(ctx->h, ctx->buf, 1);
    for (i = 0; i < 8; i++) ps_store_be32(out + 4 * i, ctx->h[i]);
}

/* Bytes a len-byte message takes once padded (5.1.1): a multiple of 64 with room for the 0x80
 * byte and the 64-bit length. */
static inline size_t ps_sha256_padded_len(size_t len) { return (len + 9 + 63) & ~(size_t)63; }

/* SHA-256 of msg[0:len], padding it in place: msg must have ps_sha256_padded_len(len) bytes.
 * The same digest as init/update/final, in one call to the compression path with no copying
 * (a 16-token block's 135-byte message is 3 blocks). */
static void ps_sha256_padded(uint8_t* msg, size_t len, uint8_t out[32]) {
    size_t total = ps_sha256_padded_len(len);
    uint64_t bits = (uint64_t)len * 8;
    ps_sha256_ctx ctx;  /* for H(0) only */
    int i;
    ps_sha256_init(&ctx);
    msg[len] = 0x80;
    memset(msg + len + 1, 0, total - 8 - len - 1);
    for (i = 0; i < 8; i++) msg[total - 8 + i] = (uint8_t)(bits >> (56 - 8 * i));
    ps_sha256_blocks(ctx.h, msg, total / 64);
    for (i = 0; i < 8; i++) ps_store_be32(out + 4 * i, ctx.h[i]);
}

#endif /* PLANSERVE_SHA256_H */
