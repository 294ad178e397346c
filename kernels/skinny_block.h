/* The register block shared by skinny_gemm.c and decode_step.c: eight rows of x against
 * two 16-column weight panels (see skinny_gemm.py for the layout and why). */
#ifndef PDSERVE_SKINNY_BLOCK_H
#define PDSERVE_SKINNY_BLOCK_H
#include <immintrin.h>
#include <stdint.h>

#define PREFETCH_K 32 /* panel rows (2 KiB) ahead: keeps the weight streams' loads in flight */

/* 16 accumulators in registers; per k, two 64-byte weight loads, eight broadcasts,
 * sixteen FMAs. x holds 8 rows of K floats (row stride K). */
static inline void block8x32(const float *x, int64_t K, const float *w0, const float *w1,
                             __m512 acc[16]) {
    __m512 a[16];
    for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        _mm_prefetch((const char *)(w0 + (k + PREFETCH_K) * 16), _MM_HINT_T0);
        _mm_prefetch((const char *)(w1 + (k + PREFETCH_K) * 16), _MM_HINT_T0);
        __m512 v0 = _mm512_loadu_ps(w0 + k * 16), v1 = _mm512_loadu_ps(w1 + k * 16);
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) {
            __m512 b = _mm512_set1_ps(x[r * K + k]);
            a[2 * r] = _mm512_fmadd_ps(b, v0, a[2 * r]);
            a[2 * r + 1] = _mm512_fmadd_ps(b, v1, a[2 * r + 1]);
        }
    }
    for (int i = 0; i < 16; i++) acc[i] = a[i];
}

static inline __mmask16 mask_for(int64_t cols) {
    if (cols <= 0) return 0;
    return cols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
}

#endif
