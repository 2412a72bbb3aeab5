/* Machine roofline probes: sustained streaming read and per-instruction multiply-add peaks.
 * Each peak loop keeps 16 (12 for AVX2) independent accumulator chains, enough to cover the
 * latency of one multiply-add pipe pair, and returns a value derived from every chain so the
 * compiler cannot drop work. */
#ifndef KTCY_ROOFLINE_H
#define KTCY_ROOFLINE_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Streaming reads: XOR of every byte in 8/32/64-byte words (cheap enough to stay load bound). */
static inline uint64_t ktcy_read_ref(const uint8_t *p, int64_t n) {
    uint64_t acc = 0;
    for (int64_t i = 0; i + 8 <= n; i += 8) { uint64_t v; memcpy(&v, p + i, 8); acc ^= v; }
    return acc;
}

/* Four streams a quarter of the range apart, as in ktcy_read_avx512: the GEMMs read several
 * weight panels side by side, and one stream alone keeps too few cache-line misses in flight to
 * show what the memory system can deliver (the bench's GB/s then exceeded the "peak"). */
__attribute__((target("avx2"))) static inline uint64_t ktcy_read_avx2(const uint8_t *p, int64_t n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    const int64_t quarter = n / 4 / 64 * 64;
    const uint8_t *s0 = p, *s1 = p + quarter, *s2 = p + 2 * quarter, *s3 = p + 3 * quarter;
    for (int64_t i = 0; i + 64 <= quarter; i += 64) {
        a0 = _mm256_xor_si256(a0, _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(s0 + i)),
                                                   _mm256_loadu_si256((const __m256i *)(s0 + i + 32))));
        a1 = _mm256_xor_si256(a1, _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(s1 + i)),
                                                   _mm256_loadu_si256((const __m256i *)(s1 + i + 32))));
        a2 = _mm256_xor_si256(a2, _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(s2 + i)),
                                                   _mm256_loadu_si256((const __m256i *)(s2 + i + 32))));
        a3 = _mm256_xor_si256(a3, _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(s3 + i)),
                                                   _mm256_loadu_si256((const __m256i *)(s3 + i + 32))));
    }
    __m256i x = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    return (uint64_t)_mm256_extract_epi64(x, 0) ^ (uint64_t)_mm256_extract_epi64(x, 3);
}

/* Bytes a ktcy_read_avx2 / ktcy_read_avx512 call over n bytes actually reads. */
static inline int64_t ktcy_read_avx2_bytes(int64_t n) { return n / 4 / 64 * 64 * 4; }
static inline int64_t ktcy_read_avx512_bytes(int64_t n) { return n / 4 / 128 * 128 * 4; }

/* Four streams at once, a quarter of the range apart: like the GEMMs, which read several weight
 * panels side by side, this keeps more cache-line misses in flight than one stream can. */
__attribute__((target("avx512f"))) static inline uint64_t ktcy_read_avx512(const uint8_t *p, int64_t n) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    const int64_t quarter = n / 4 / 128 * 128;
    const uint8_t *s0 = p, *s1 = p + quarter, *s2 = p + 2 * quarter, *s3 = p + 3 * quarter;
    for (int64_t i = 0; i + 128 <= quarter; i += 128) {
        a0 = _mm512_xor_si512(a0, _mm512_xor_si512(_mm512_loadu_si512(s0 + i), _mm512_loadu_si512(s0 + i + 64)));
        a1 = _mm512_xor_si512(a1, _mm512_xor_si512(_mm512_loadu_si512(s1 + i), _mm512_loadu_si512(s1 + i + 64)));
        a2 = _mm512_xor_si512(a2, _mm512_xor_si512(_mm512_loadu_si512(s2 + i), _mm512_loadu_si512(s2 + i + 64)));
        a3 = _mm512_xor_si512(a3, _mm512_xor_si512(_mm512_loadu_si512(s3 + i), _mm512_loadu_si512(s3 + i + 64)));
    }
    __m512i x = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
    return (uint64_t)_mm512_reduce_or_epi64(x);
}

/* Peaks.  Ops per instruction: vfmadd231ps ymm 16, zmm 32; vdpbf16ps zmm 64; vpdpbusd zmm 128
 * (a multiply and an add per element product); AMX TDPBSSD 32768, TDPBF16PS 16384. */
#define KTCY_CHAINS 16

__attribute__((target("avx2,fma"))) static inline float ktcy_peak_fma256(int64_t iters, float seed) {
    __m256 acc[12], a = _mm256_set1_ps(seed), b = _mm256_set1_ps(1.0f - seed);
    for (int j = 0; j < 12; ++j) acc[j] = _mm256_set1_ps((float)j);
    for (int64_t i = 0; i < iters; ++i)
        for (int j = 0; j < 12; ++j) acc[j] = _mm256_fmadd_ps(a, b, acc[j]);
    __m256 s = acc[0];
    for (int j = 1; j < 12; ++j) s = _mm256_add_ps(s, acc[j]);
    return _mm256_cvtss_f32(s);
}

/* The AVX2 INT8/INT4 kernels' inner step: vpmaddubsw (u8 x s8 pairs -> s16), vpmaddwd by ones
 * (-> s32), vpaddd.  Three dependent instructions per 32 int8 multiply-adds (64 ops). */
__attribute__((target("avx2"))) static inline float ktcy_peak_int8_256(int64_t iters, float seed) {
    __m256i acc[12], a = _mm256_set1_epi8((char)(1 + (int)seed)), b = _mm256_set1_epi8(1);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int j = 0; j < 12; ++j) acc[j] = _mm256_set1_epi32(j);
    for (int64_t i = 0; i < iters; ++i)
        for (int j = 0; j < 12; ++j) {
            /* An empty asm makes `a` look new to the compiler each step, so the loop-invariant
             * products are not hoisted; it emits no instruction. */
            __asm__("" : "+x"(a));
            acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones));
        }
    __m256i s = acc[0];
    for (int j = 1; j < 12; ++j) s = _mm256_add_epi32(s, acc[j]);
    return (float)_mm256_extract_epi32(s, 0);
}

__attribute__((target("avx512f"))) static inline float ktcy_peak_fma512(int64_t iters, float seed) {
    __m512 acc[KTCY_CHAINS], a = _mm512_set1_ps(seed), b = _mm512_set1_ps(1.0f - seed);
    for (int j = 0; j < KTCY_CHAINS; ++j) acc[j] = _mm512_set1_ps((float)j);
    for (int64_t i = 0; i < iters; ++i)
        for (int j = 0; j < KTCY_CHAINS; ++j) acc[j] = _mm512_fmadd_ps(a, b, acc[j]);
    __m512 s = acc[0];
    for (int j = 1; j < KTCY_CHAINS; ++j) s = _mm512_add_ps(s, acc[j]);
    return _mm512_reduce_add_ps(s);
}

#if KTCY_ENABLE_AVX512_BF16
__attribute__((target("avx512f,avx512bf16"))) static inline float ktcy_peak_dpbf16(int64_t iters, float seed) {
    __m512 acc[KTCY_CHAINS];
    __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(seed), _mm512_set1_ps(seed));
    for (int j = 0; j < KTCY_CHAINS; ++j) acc[j] = _mm512_set1_ps((float)j);
    for (int64_t i = 0; i < iters; ++i)
        for (int j = 0; j < KTCY_CHAINS; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], a, a);
    __m512 s = acc[0];
    for (int j = 1; j < KTCY_CHAINS; ++j) s = _mm512_add_ps(s, acc[j]);
    return _mm512_reduce_add_ps(s);
}
#else
static inline float ktcy_peak_dpbf16(int64_t iters, float seed) { (void)iters; (void)seed; return NAN; } /* not built */
#endif

__attribute__((target("avx512f,avx512vnni"))) static inline float ktcy_peak_dpbusd(int64_t iters, float seed) {
    __m512i acc[KTCY_CHAINS], a = _mm512_set1_epi8((char)(1 + (int)seed)), b = _mm512_set1_epi8(1);
    for (int j = 0; j < KTCY_CHAINS; ++j) acc[j] = _mm512_set1_epi32(j);
    for (int64_t i = 0; i < iters; ++i)
        for (int j = 0; j < KTCY_CHAINS; ++j) acc[j] = _mm512_dpbusd_epi32(acc[j], a, b);
    __m512i s = acc[0];
    for (int j = 1; j < KTCY_CHAINS; ++j) s = _mm512_add_epi32(s, acc[j]);
    return (float)_mm512_reduce_add_epi32(s);
}

#if KTCY_ENABLE_AMX
/* Four C tiles fed by two A and two B tiles, as the GEMM kernels block them. */
__attribute__((target("amx-tile,amx-int8,amx-bf16"))) static inline float ktcy_peak_amx(int64_t iters, int bf16) {
    uint8_t cfg[64] __attribute__((aligned(64)));
    uint8_t data[1024] __attribute__((aligned(64)));
    float out[256] __attribute__((aligned(64)));
    memset(cfg, 0, sizeof cfg);
    memset(data, 0, sizeof data);
    cfg[0] = 1;
    for (int t = 0; t < 8; ++t) { cfg[16 + 2 * t] = 64; cfg[48 + t] = 16; }
    _tile_loadconfig(cfg);
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(4, data, 64); _tile_loadd(5, data, 64); _tile_loadd(6, data, 64); _tile_loadd(7, data, 64);
    for (int64_t i = 0; i < iters; ++i) {
        if (bf16) {
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        } else {
            _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 4, 7); _tile_dpbssd(2, 5, 6); _tile_dpbssd(3, 5, 7);
        }
    }
    _tile_stored(0, out, 64);
    _tile_release();
    return out[0];
}
#else
static inline float ktcy_peak_amx(int64_t iters, int bf16) { (void)iters; (void)bf16; return NAN; } /* not built */
#endif

#endif
