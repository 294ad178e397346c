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

/* Columns ids[0..n) of quantized panels as rows of out [n, K]: an embedding lookup in
 * a tied LM head's records. Each value is scale * q, then + offset, rounded after each
 * (volatile: no FMA), as numpy and QuantRows.dequantize compute them, so a row equals
 * the dequantized weight's bit for bit. Returns 0, or -1 for an id outside [0, N). */
int q_gather_columns(const uint8_t *records, int64_t bk, int64_t bits, int64_t offsets,
                     int64_t scale_bytes, int64_t K, int64_t N, const int64_t *ids, int64_t n,
                     float *out) {
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
                if (bits == 16) {
                    uint16_t half;
                    memcpy(&half, r + hdr + (k * PANEL + col) * 2, 2);
                    const uint32_t u = (uint32_t)half << 16;
                    memcpy(&q, &u, 4);
                } else {
                    const uint8_t byte = bits == 4 ? r[hdr + (k / 2) * PANEL + col]
                                                   : r[hdr + k * PANEL + col];
                    q = bits == 4 ? (float)(k % 2 ? byte >> 4 : byte & 15) : (float)(int8_t)byte;
                }
                volatile float scaled = scale * q;
                out[i * K + b * bk + k] = offsets ? scaled + offset : scaled;
            }
        }
    }
    return 0;
}
