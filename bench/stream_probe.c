/* How many read streams a core needs to reach the memory's bandwidth (not part of CI).
 *
 *     gcc -O2 -mavx2 -fopenmp bench/stream_probe.c -o /tmp/stream_probe && /tmp/stream_probe 2 1024
 *
 * Arguments: threads, KiB each thread reads per pass.  Each thread reads its window as S streams
 * side by side (S parts of the window, a 64-byte line of each in turn), optionally with a software
 * prefetch D bytes ahead on each stream, and does the GEMMs' vpmaddubsw + vpmaddwd + vpaddd work
 * on every 32 bytes.  Windows cycle through a 1 GiB buffer on huge pages (madvise, as ktcy's
 * expert arena), so each pass reads memory.  Prints the median GB/s of 21 passes per pattern; the
 * patterns alternate, so the host's drift falls on all alike.  ktcy's AVX2 decode tiles stream one
 * or two panels (streams) per tile, prefetching 8 packed blocks ahead (8 KiB for INT8, 4 KiB for
 * INT4); the bandwidth probe reads four streams. */
#include <errno.h>
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

enum { PASSES = 21 };

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* STREAMS (a constant: the sums stay in registers) side by side over n bytes, prefetching `ahead`
 * bytes on (0: none); returns a value the compiler cannot drop. */
__attribute__((target("avx2"), always_inline)) static inline int64_t read_streams_n(const uint8_t *p, int64_t n,
                                                                                  const int STREAMS, int64_t ahead) {
    __m256i acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_si256();
    const __m256i act = _mm256_set1_epi32(0x01020304), ones = _mm256_set1_epi16(1);
    const int64_t part = n / STREAMS / 64 * 64;
    for (int64_t i = 0; i < part; i += 64)
        _Pragma("GCC unroll 4")
        for (int s = 0; s < STREAMS; ++s) {
            const uint8_t *line = p + s * part + i;
            if (ahead) _mm_prefetch((const char *)line + ahead, _MM_HINT_T0);
            _Pragma("GCC unroll 2")
            for (int h = 0; h < 2; ++h) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(line + 32 * h));
                const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(act, w));
                acc[2 * s + h] = _mm256_add_epi32(acc[2 * s + h], _mm256_madd_epi16(pairs, ones));
            }
        }
    __m256i x = acc[0];
    for (int i = 1; i < 2 * STREAMS; ++i) x = _mm256_xor_si256(x, acc[i]);
    return _mm256_extract_epi64(x, 0);
}

__attribute__((target("avx2"), noinline)) static int64_t read_streams(const uint8_t *p, int64_t n, int streams,
                                                                     int64_t ahead) {
    switch (streams) {
    case 1: return read_streams_n(p, n, 1, ahead);
    case 2: return read_streams_n(p, n, 2, ahead);
    default: return read_streams_n(p, n, 4, ahead);
    }
}

/* A whole number in [lo, hi], or -1. */
static long parse_count(const char *text, long lo, long hi) {
    char *end;
    errno = 0;
    const long v = strtol(text, &end, 10);
    return errno || end == text || *end || v < lo || v > hi ? -1 : v;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    const long threads = argc == 3 ? parse_count(argv[1], 1, 64) : -1, kib = argc == 3 ? parse_count(argv[2], 64, 65536) : -1;
    if (threads < 0 || kib < 0) {
        fprintf(stderr, "usage: stream_probe THREADS(1-64) KIB_PER_THREAD(64-65536)\n");
        return 2;
    }
    const int64_t window = (int64_t)kib << 10, total = (int64_t)1 << 30;
    if (window * threads * 4 > total) {
        fprintf(stderr, "error: %ld threads x %ld KiB do not fit four times in the 1 GiB buffer\n", threads, kib);
        return 2;
    }
    uint8_t *buf = aligned_alloc(2 << 20, total);
    if (!buf) {
        fprintf(stderr, "error: cannot allocate 1 GiB\n");
        return 1;
    }
    madvise(buf, total, MADV_HUGEPAGE);
    memset(buf, 1, total);
    static const struct { int streams; int64_t ahead; } patterns[] = {
        {1, 0}, {1, 1024}, {1, 8192}, {2, 0}, {2, 8192}, {4, 0}, {4, 4096},
    };
    enum { NP = sizeof patterns / sizeof patterns[0] };
    double gbs[NP][PASSES];
    int64_t sink = 0, at = 0;
    const int64_t span = window * threads;
    int ran = (int)threads;
    for (int pass = 0; pass < PASSES; ++pass)
        for (int c = 0; c < NP; ++c) {
            at = (at + span) % (total / span * span);
            double start = 0;
            /* timed inside the team, from a barrier to the last thread's end: not the fork */
#pragma omp parallel num_threads(threads) reduction(+ : sink)
            {
#pragma omp single
                ran = omp_get_num_threads(); /* its implicit barrier lines the team up */
#pragma omp master
                start = seconds();
#pragma omp barrier
                sink += read_streams(buf + at + omp_get_thread_num() * window, window, patterns[c].streams,
                                     patterns[c].ahead);
            }
            gbs[c][pass] = ran * window / (seconds() - start) / 1e9; /* the bytes the team read */
        }
    printf("%d thread(s), %ld KiB each per pass, median of %d passes:\n", ran, kib, PASSES);
    for (int c = 0; c < NP; ++c) {
        qsort(gbs[c], PASSES, sizeof(double), by_value);
        printf("  %d stream(s), prefetch %5lld bytes ahead: %5.1f GB/s\n", patterns[c].streams,
               (long long)patterns[c].ahead, gbs[c][PASSES / 2]);
    }
    volatile int64_t keep = sink; /* the reads' results are used */
    (void)keep;
    free(buf);
    return 0;
}
