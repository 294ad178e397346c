/* Decode-shaped matmuls: out[M, N] = x[M, K] @ W^T (+ bias) for a few rows M and a large
 * weight W, which is packed as column panels [P][K][16] (P even; columns past N are
 * zero). See skinny_gemm.py for why and how it is built, skinny_block.h for the block. */
#include <stdlib.h>
#include <string.h>

#include "skinny_block.h"

/* Returns 0, or -1 when the padded rows could not be allocated. */
int skinny_gemm(const float *x, int64_t M, int64_t K, const float *panels, int64_t N,
                const float *bias, float *out) {
    int64_t pairs = (N + PAIR_COLS - 1) / PAIR_COLS, rows = padded_rows(M);
    /* x zero-padded to whole blocks of rows: the block reads them all */
    float *padded = (float *)calloc((size_t)(rows * K), sizeof(float));
    if (!padded) return -1;
    memcpy(padded, x, (size_t)(M * K) * sizeof(float));
#pragma omp parallel for schedule(static)
    for (int64_t pp = 0; pp < pairs; pp++)
        matmul_pairs(padded, M, K, panels, NULL, N, bias, out, N, 0, pp, pp + 1);
    free(padded);
    return 0;
}

/* skinny_gemm on quantized panels (skinny_block.h's QPanels: records, bk, bits, offsets,
 * scale_bytes). */
int skinny_gemm_q8(const float *x, int64_t M, int64_t K, const uint8_t *records, int64_t bk,
                   int64_t bits, int64_t offsets, int64_t scale_bytes, int64_t N,
                   const float *bias, float *out) {
    int64_t pairs = (N + PAIR_COLS - 1) / PAIR_COLS, rows = padded_rows(M);
    const QPanels w = {records, bk, bits, offsets, scale_bytes};
    float *padded = (float *)calloc((size_t)(rows * K), sizeof(float));
    if (!padded) return -1;
    memcpy(padded, x, (size_t)(M * K) * sizeof(float));
#pragma omp parallel for schedule(static)
    for (int64_t pp = 0; pp < pairs; pp++)
        matmul_pairs(padded, M, K, NULL, &w, N, bias, out, N, 0, pp, pp + 1);
    free(padded);
    return 0;
}
