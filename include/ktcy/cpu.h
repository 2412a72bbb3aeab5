/* CPU feature probe: cpuid + xgetbv, plus the Linux permission request for AMX tile data.
 * /proc/cpuinfo is not consulted: the instructions themselves are the source of truth. */
#ifndef KTCY_CPU_H
#define KTCY_CPU_H

#include <cpuid.h>
#include <stdint.h>
#include <string.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

typedef struct {
    /* instruction-set flags as cpuid reports them */
    int avx2, fma, f16c, avx512f, avx512bw, avx512vl, avx512dq;
    int avx512_vnni, avx512_bf16, avx512_vbmi;
    int amx_tile, amx_int8, amx_bf16;
    /* operating-system state */
    int os_avx, os_avx512, os_amx, amx_permitted;
    int amd; /* an AMD (or Hygon) core: some tile shapes are chosen by vendor (registry.h) */
    int family; /* cpuid's display family (base + extended): AMD 0x19 is Zen 3 and Zen 4, 0x1A Zen 5 */
    char model_name[49];
} ktcy_cpu;

/* XCR0 bits: 1 SSE, 2 AVX (YMM), 5 opmask, 6 ZMM_Hi256, 7 Hi16_ZMM, 17 XTILECFG, 18 XTILEDATA. */
#define KTCY_XCR0_YMM 0x6ull
#define KTCY_XCR0_ZMM 0xE0ull
#define KTCY_XCR0_AMX 0x60000ull

static inline uint64_t ktcy_xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

/* Linux keeps AMX tile data off until a process asks (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA); without that grant the first tile instruction faults. */
static inline int ktcy_request_amx_permission(void) {
#if defined(__linux__) && defined(SYS_arch_prctl)
    const long ARCH_GET_XCOMP_PERM = 0x1022, ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    unsigned long granted = 0;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &granted) != 0) return 0;
    return (granted >> XFEATURE_XTILEDATA) & 1;
#else
    return 0;
#endif
}

static inline void ktcy_cpu_probe(ktcy_cpu *cpu) {
    unsigned a, b, c, d, max_leaf;
    memset(cpu, 0, sizeof *cpu);
    max_leaf = __get_cpuid_max(0, 0);
    if (max_leaf < 1) return;
    __cpuid(0, a, b, c, d);
    const unsigned amd_b = 0x68747541u, amd_d = 0x69746e65u, amd_c = 0x444d4163u;  /* "AuthenticAMD" */
    const unsigned hygon_b = 0x6f677948u, hygon_d = 0x6e65476eu, hygon_c = 0x656e6975u; /* "HygonGenuine" */
    cpu->amd = (b == amd_b && d == amd_d && c == amd_c) || (b == hygon_b && d == hygon_d && c == hygon_c);
    __cpuid_count(1, 0, a, b, c, d);
    cpu->family = (int)((a >> 8) & 0xF) == 0xF ? (int)(0xF + ((a >> 20) & 0xFF)) : (int)((a >> 8) & 0xF);
    int osxsave = (c >> 27) & 1;
    cpu->fma = (c >> 12) & 1;
    cpu->f16c = (c >> 29) & 1;
    uint64_t xcr0 = osxsave ? ktcy_xgetbv0() : 0;
    cpu->os_avx = osxsave && (xcr0 & KTCY_XCR0_YMM) == KTCY_XCR0_YMM;
    cpu->os_avx512 = cpu->os_avx && (xcr0 & KTCY_XCR0_ZMM) == KTCY_XCR0_ZMM;
    cpu->os_amx = osxsave && (xcr0 & KTCY_XCR0_AMX) == KTCY_XCR0_AMX;
    if (max_leaf >= 7) {
        __cpuid_count(7, 0, a, b, c, d);
        unsigned subleaves = a;
        cpu->avx2 = (b >> 5) & 1;
        cpu->avx512f = (b >> 16) & 1;
        cpu->avx512dq = (b >> 17) & 1;
        cpu->avx512bw = (b >> 30) & 1;
        cpu->avx512vl = (b >> 31) & 1;
        cpu->avx512_vbmi = (c >> 1) & 1;
        cpu->avx512_vnni = (c >> 11) & 1;
        cpu->amx_bf16 = (d >> 22) & 1;
        cpu->amx_tile = (d >> 24) & 1;
        cpu->amx_int8 = (d >> 25) & 1;
        if (subleaves >= 1) {
            __cpuid_count(7, 1, a, b, c, d);
            cpu->avx512_bf16 = (a >> 5) & 1;
        }
    }
    /* Leaf 0xD sub-leaf 0 lists the XSAVE components the CPU supports; tile state must be
     * among them for the OS bits in XCR0 to mean anything. */
    if (max_leaf >= 0xD && cpu->os_amx) {
        __cpuid_count(0xD, 0, a, b, c, d);
        if ((a & KTCY_XCR0_AMX) != KTCY_XCR0_AMX) cpu->os_amx = 0;
    }
    if (cpu->amx_tile && cpu->os_amx) cpu->amx_permitted = ktcy_request_amx_permission();

    unsigned max_ext = __get_cpuid_max(0x80000000, 0);
    if (max_ext >= 0x80000004) {
        unsigned *words = (unsigned *)cpu->model_name;
        for (unsigned leaf = 0; leaf < 3; ++leaf)
            __cpuid(0x80000002 + leaf, words[4 * leaf], words[4 * leaf + 1], words[4 * leaf + 2],
                    words[4 * leaf + 3]);
        cpu->model_name[48] = 0;
    }
}

#endif
