/* This thread's floating-point environment around a GEMM: the float decodes of FP8 make (or
 * widen) subnormal floats that MXCSR.DAZ, which a caller may have set (torch.set_flush_denormal),
 * would read as zeros.  The kernels that need it clear DAZ for their duration and give the
 * caller's control bits back, with every exception flag the call raised. */
#ifndef KTCY_FP_ENV_H
#define KTCY_FP_ENV_H

#include <xmmintrin.h>

#define KTCY_MXCSR_DAZ 0x40u

/* Clears DAZ; returns the caller's MXCSR for ktcy_restore_daz. */
static inline unsigned int ktcy_clear_daz(void) {
    const unsigned int csr = _mm_getcsr();
    if (csr & KTCY_MXCSR_DAZ) _mm_setcsr(csr & ~KTCY_MXCSR_DAZ);
    return csr;
}

static inline void ktcy_restore_daz(unsigned int csr) {
    if (csr & KTCY_MXCSR_DAZ) _mm_setcsr(csr | (_mm_getcsr() & 0x3Fu));
}

#endif
