/* Decode-shaped matmuls: out[M, N] = x[M, K] @ W^T (+ bias) for a few rows M and a large
 * weight W, which is packed as column panels [P][K][16] (P even; columns past N are
 * zero). See skinny_gemm.py for why and how it is built, skinny_block.h for the block. */
#include <stdlib.h>
#include <string.h>

#include "dot_block.h"

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

/* skinny_gemm_q8 with int8 activations: panels in the dots layout (dot_block.h); x's
 * rows quantized once, then every thread's pairs take them from there. */
int skinny_gemm_dots(const float *x, int64_t M, int64_t K, const uint8_t *records, int64_t bk,
                     int64_t bits, int64_t offsets, int64_t scale_bytes, int64_t N,
                     const float *bias, float *out) {
    int64_t pairs = (N + PAIR_COLS - 1) / PAIR_COLS;
    const int64_t rows = (M + DOT_ROWS - 1) / DOT_ROWS * DOT_ROWS;
    const QPanels w = {records, bk, bits, offsets, scale_bytes};
    void *mem = calloc((size_t)qrows_bytes(rows, K), 1);
    if (!mem) return -1;
    const QRows qx = qrows_at(mem, rows, K, tile_k(bits));  /* the padding rows stay zero */
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < M; r++) quantize_rows(x, r, r + 1, K, &qx);
#pragma omp parallel for schedule(static)
    for (int64_t pp = 0; pp < pairs; pp++)
        matmul_pairs_dots(&qx, M, K, &w, N, bias, out, N, 0, pp, pp + 1);
    free(mem);
    return 0;
}

/* Columns ids[0..n) of quantized panels as rows of out [n, K] (dot_block.h's q_column
 * each). Returns 0, or -1 for an id outside [0, N). */
int q_gather_columns(const uint8_t *records, int64_t bk, int64_t bits, int64_t offsets,
                     int64_t scale_bytes, int64_t dots, int64_t K, int64_t N, const int64_t *ids,
                     int64_t n, float *out) {
    const QPanels w = {records, bk, bits, offsets, scale_bytes};
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= N) return -1;
    for (int64_t i = 0; i < n; i++) q_column(&w, dots, K, ids[i], out + i * K);
    return 0;
}
