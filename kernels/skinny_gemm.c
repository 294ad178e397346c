/* Decode-shaped matmuls on AVX-512 CPUs: out[M, N] = x[M, K] @ W^T (+ bias) for a few
 * rows M and a large weight W, which is packed as column panels [P][K][16] (P even;
 * columns past N are zero). See skinny_gemm.py for why and how it is built. */
#include <stdlib.h>
#include <string.h>

#include "skinny_block.h"

/* Returns 0, or -1 when the scratch rows could not be allocated. */
int skinny_gemm(const float *x, int64_t M, int64_t K, const float *panels, int64_t N,
                const float *bias, float *out) {
    int64_t full = M / 8 * 8, tail = M - full, pairs = (N + 31) / 32;
    float *padded = NULL; /* the last M % 8 rows, zero-padded to 8 */
    if (tail) {
        padded = (float *)calloc((size_t)(8 * K), sizeof(float));
        if (!padded) return -1;
        memcpy(padded, x + full * K, (size_t)(tail * K) * sizeof(float));
    }
#pragma omp parallel for schedule(static)
    for (int64_t pp = 0; pp < pairs; pp++) {
        const float *w0 = panels + 2 * pp * K * 16, *w1 = w0 + K * 16;
        int64_t col = pp * 32;
        __mmask16 m0 = mask_for(N - col), m1 = mask_for(N - col - 16);
        __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias + col) : _mm512_setzero_ps();
        __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + col + 16) : _mm512_setzero_ps();
        __m512 acc[16];
        for (int64_t r = 0; r < M; r += 8) {
            block8x32(r < full ? x + r * K : padded, K, w0, w1, acc);
            int64_t rows = M - r < 8 ? M - r : 8;
            for (int64_t i = 0; i < rows; i++) {
                float *o = out + (r + i) * N + col;
                _mm512_mask_storeu_ps(o, m0, _mm512_add_ps(acc[2 * i], b0));
                _mm512_mask_storeu_ps(o + 16, m1, _mm512_add_ps(acc[2 * i + 1], b1));
            }
        }
    }
    free(padded);
    return 0;
}
