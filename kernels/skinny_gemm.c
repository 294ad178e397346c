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
    const QRows qx = qrows_at(mem, rows, K);  /* the padding rows stay zero */
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < M; r++) quantize_rows(x, r, r + 1, K, &qx);
#pragma omp parallel for schedule(static)
    for (int64_t pp = 0; pp < pairs; pp++)
        matmul_pairs_dots(&qx, M, K, &w, N, bias, out, N, 0, pp, pp + 1);
    free(mem);
    return 0;
}

/* Where panel row k's value of column col starts in a record's values: its byte, and
 * the shift to its nibble (bits 4). dots: the dot-product layout (dot_block.h). */
static inline int64_t q_value_at(int64_t k, int64_t col, int64_t bits, int64_t dots, int *shift) {
    *shift = 0;
    if (dots) {
        const int64_t per_tile = bits == 4 ? 8 : 4;
        if (bits == 4) *shift = k % 8 >= 4 ? 4 : 0;
        return k / per_tile * DOT_TILE + col * 4 + k % 4;
    }
    if (bits == 4) {
        *shift = k % 2 ? 4 : 0;
        return k / 2 * PANEL + col;
    }
    return (k * PANEL + col) * q_column_bytes(bits);
}

/* Columns ids[0..n) of quantized panels as rows of out [n, K]: an embedding lookup in
 * a tied LM head's records. Each value is scale * q, then + offset, rounded after each
 * (volatile: no FMA), as numpy and QuantRows.dequantize compute them, so a row equals
 * the dequantized weight's bit for bit. Returns 0, or -1 for an id outside [0, N). */
int q_gather_columns(const uint8_t *records, int64_t bk, int64_t bits, int64_t offsets,
                     int64_t scale_bytes, int64_t dots, int64_t K, int64_t N, const int64_t *ids,
                     int64_t n, float *out) {
    const QPanels w = {records, bk, bits, offsets, scale_bytes};
    const int64_t rec = q_record_bytes(&w), hdr = q_header_bytes(offsets, scale_bytes);
    const int64_t blocks = K / bk;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= N) return -1;
    for (int64_t i = 0; i < n; i++) {
        const int64_t pair = ids[i] / PAIR_COLS, panel = ids[i] % PAIR_COLS / PANEL;
        const int64_t col = ids[i] % PANEL;
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *r = records + ((pair * blocks + b) * 2 + panel) * rec;
            float scale, offset = 0.0f;
            if (scale_bytes == 4) {
                memcpy(&scale, r + col * 4, 4);
                if (offsets) memcpy(&offset, r + (PANEL + col) * 4, 4);
            } else {
                uint16_t h;
                memcpy(&h, r + col * 2, 2);
                scale = half_to_float(h);
                if (offsets) {
                    memcpy(&h, r + (PANEL + col) * 2, 2);
                    offset = half_to_float(h);
                }
            }
            for (int64_t k = 0; k < bk; k++) {
                float q;
                int shift;
                const uint8_t *at = r + hdr + q_value_at(k, col, bits, dots, &shift);
                if (bits == 16) {
                    uint16_t half;
                    memcpy(&half, at, 2);
                    const uint32_t u = (uint32_t)half << 16;
                    memcpy(&q, &u, 4);
                } else {
                    q = bits == 4 ? (float)((*at >> shift) & 15) : (float)(int8_t)*at;
                }
                volatile float scaled = scale * q;
                out[i * K + b * bk + k] = offsets ? scaled + offset : scaled;
            }
        }
    }
    return 0;
}
