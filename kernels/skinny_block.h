/* The register block shared by skinny_gemm.c and decode_step.c: BLOCK_ROWS rows of x
 * against BLOCK_COLS columns of 16-column weight panels (see skinny_gemm.py for the
 * layout and why), every accumulator in a register. Its shape per ISA was measured
 * (in-cache GFLOPS, 24 rows, 1 and 2 threads, against the other shapes that fit):
 *   AVX-512 (32 registers): 8 rows x 32 columns (two panels) = 16 accumulators
 *                           (148-150 / 176-200 GFLOPS; 6 rows 97 / 162, 12 rows 61-66 / 102-105)
 *   AVX2 (16 registers):    6 rows x 16 columns (one panel)  = 12 accumulators
 *                           (78-80 / 111-137; 4 rows 69-70 / 77-87, 8 rows 51 / 78-79)
 *   other (16 registers):   4 rows x  8 columns (half panel) =  8 accumulators
 * Callers pad x to padded_rows(M) rows (zeros; their results are dropped). */
#ifndef PDSERVE_SKINNY_BLOCK_H
#define PDSERVE_SKINNY_BLOCK_H
#include "simd.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define PANEL 16
#define PAIR_COLS 32  /* the unit threads take: two panels */
#define PREFETCH_K 32 /* panel rows (2 KiB) ahead: keeps the weight streams' loads in flight */

#ifndef BLOCK_ROWS
#if VW == 16
#define BLOCK_ROWS 8
#elif VW == 8
#define BLOCK_ROWS 6
#else
#define BLOCK_ROWS 4
#endif
#endif
#ifndef BLOCK_VECS
#define BLOCK_VECS 2
#endif
#define BLOCK_COLS (BLOCK_VECS * VW)
#define BLOCK_ACCS (BLOCK_ROWS * BLOCK_VECS)

/* Rows whose accumulators are kept together (on the stack) while the weights stream,
 * and panel rows per pass: a chunk of K_CHUNK panel rows (8 KiB a panel) is read from
 * memory once, by the first row block, and from L1 by the others; so the memory stream
 * overlaps the row blocks' arithmetic instead of one pass waiting on memory and the
 * others on the FMA units. */
#define ROW_GROUP (24 * BLOCK_ROWS)
#define K_CHUNK 128

/* Rows of x a caller provides for M rows: whole blocks. */
static inline int64_t padded_rows(int64_t M) {
    return (M + BLOCK_ROWS - 1) / BLOCK_ROWS * BLOCK_ROWS;
}

/* Where column `col`'s panel row 0 starts in panels [P][K][16]. */
static inline const float *panel_column(const float *panels, int64_t K, int64_t col) {
    return panels + (col / PANEL) * K * PANEL + col % PANEL;
}

/* acc[r * BLOCK_VECS + j] += x row r times column vector j (panel pointers w[j]), over
 * panel rows [k0, k1). x holds BLOCK_ROWS rows of K floats (row stride K). With
 * `prefetch` (a constant at each call), the panels are prefetched PREFETCH_K rows ahead. */
static inline __attribute__((always_inline)) void block_rows_cols(
    const float *x, int64_t K, const float *const w[BLOCK_VECS], int64_t k0, int64_t k1,
    vf acc[BLOCK_ACCS], const int prefetch) {
    vf a[BLOCK_ACCS];
    for (int i = 0; i < BLOCK_ACCS; i++) a[i] = acc[i];
    for (int64_t k = k0; k < k1; k++) {
        if (prefetch) {
#pragma GCC unroll 2
            for (int j = 0; j < BLOCK_VECS; j++)
                if ((j * VW) % PANEL == 0) PREFETCH_L1(w[j] + (k + PREFETCH_K) * PANEL);
        }
        vf v[BLOCK_VECS];
#pragma GCC unroll 2
        for (int j = 0; j < BLOCK_VECS; j++) v[j] = vload(w[j] + k * PANEL);
#pragma GCC unroll 8
        for (int r = 0; r < BLOCK_ROWS; r++) {
            vf b = vset1(x[r * K + k]);
#pragma GCC unroll 2
            for (int j = 0; j < BLOCK_VECS; j++)
                a[r * BLOCK_VECS + j] = vfma(b, v[j], a[r * BLOCK_VECS + j]);
        }
    }
    for (int i = 0; i < BLOCK_ACCS; i++) acc[i] = a[i];
}

/* ---- quantized weights: small integers dequantized in registers ---------------------
 * A weight [N, K] kept as integer values q in column panels [P][K][16] with, per panel
 * column and block of `bk` consecutive k, a scale s and an offset m (fp32, [P][K / bk]
 * [16]): w = s * q + m, what GGUF's Q8_0 (m = 0), Q4_0 (m = -8 s) and Q4_1 (m its
 * block's min) dequantize to. Values are int8 (16 bytes a panel row) or, where they fit
 * in 0..15, nibbles: 16 bytes hold two panel rows, byte j column j of the even row in
 * its low half and of the odd row in its high half (one load, two masks: two rows). Each panel row is converted and scaled once in
 * registers (one FMA per vector, shared by every row of x), then used like an fp32 panel
 * row: the memory stream is a quarter (int8) or an eighth (nibbles) of fp32's. */
typedef int8_t vq __attribute__((vector_size(VW)));
/* accumulators per column vector when a block computes one row (at most BLOCK_ROWS) */
#define SPLIT (BLOCK_ROWS < 4 ? BLOCK_ROWS : 4) /* even: rows are taken in pairs */
typedef int8_t vq_unaligned __attribute__((vector_size(VW), aligned(1)));

typedef struct {
    const uint8_t *values; /* [P][K][16] int8, or [P][K / 2][16] nibble pairs */
    const float *scales;   /* [P][K / bk][16] */
    const float *offsets;  /* [P][K / bk][16], or NULL: all zero */
    int64_t bk;            /* k per scale; divides K and K_CHUNK */
    int64_t bits;          /* 8 or 4 */
} QPanels;

/* VW int8 values at p as floats. GCC lowers __builtin_convertvector from int8 to a
 * byte-by-byte loop, so the two x86 widths say it with their one sign-extending load
 * (vpmovsxbd) and conversion; the portable form serves the rest. */
static inline vf vq8_load(const uint8_t *p) {
#if VW == 16 && defined(__AVX512F__)
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif VW == 8 && defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    return __builtin_convertvector(*(const vq_unaligned *)p, vf);
#endif
}

/* Columns [c0, c0 + VW) of the two panel rows a nibble pair row holds (c0 a multiple of
 * VW within the panel): the even row's in *lo, the odd row's in *hi. */
static inline __attribute__((always_inline)) void vq4_load2(const uint8_t *pair, int64_t c0,
                                                            vf *lo, vf *hi) {
#if VW == 16 && defined(__AVX512F__)
    (void)c0;
    __m128i b = _mm_loadu_si128((const __m128i *)pair), m = _mm_set1_epi8(15);
    *lo = (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, m)));
    *hi = (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), m)));
#elif VW == 8 && defined(__AVX2__)
    __m128i b = _mm_loadl_epi64((const __m128i *)(pair + c0)), m = _mm_set1_epi8(15);
    *lo = (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(b, m)));
    *hi = (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), m)));
#else
    for (int i = 0; i < VW; i++) {
        (*lo)[i] = (float)(pair[c0 + i] & 15);
        (*hi)[i] = (float)(pair[c0 + i] >> 4);
    }
#endif
}

/* Panel rows k and k + 1 (k even), columns [c0, c0 + VW) of column vector j, dequantized
 * (q * s + m) into v0[j] and v1[j]. q[j]: the vector's values (int8: at its column;
 * nibbles: the panel's pair rows). */
static inline __attribute__((always_inline)) void vq_rows2(
    const uint8_t *q, int64_t k, int64_t c0, vf s, vf m, const int bits, vf *v0, vf *v1) {
    if (bits == 4) {
        vf lo, hi;
        vq4_load2(q + (k / 2) * PANEL, c0, &lo, &hi);
        *v0 = vfma(lo, s, m);
        *v1 = vfma(hi, s, m);
    } else {
        *v0 = vfma(vq8_load(q + k * PANEL), s, m);
        *v1 = vfma(vq8_load(q + (k + 1) * PANEL), s, m);
    }
}

/* block_rows_cols on quantized panels, for the first `rows` rows of the block (the rest
 * of acc untouched): column vector j starts at column c + j * VW. `bits` and `rows` are
 * constants at each call site, so each gets its own loop: one row (a single stream's
 * decode) does 2 FMAs a panel row, not the whole block's 16, and the values' conversion
 * is then what bounds it. */
static inline __attribute__((always_inline)) void block_rows_cols_q(
    const float *x, int64_t K, const QPanels *w, int64_t c, int64_t k0, int64_t k1,
    vf acc[BLOCK_ACCS], const int prefetch, const int bits, const int rows) {
    const int64_t row_bytes = bits == 4 ? PANEL / 2 : PANEL;  /* on average, per k */
    vf a[BLOCK_ACCS];
    const uint8_t *q[BLOCK_VECS];
    const float *sc[BLOCK_VECS], *of[BLOCK_VECS];
    int64_t c0[BLOCK_VECS];
    for (int j = 0; j < BLOCK_VECS; j++) {
        const int64_t col = c + j * VW, panel = col / PANEL;
        c0[j] = col % PANEL;
        q[j] = w->values + panel * K * row_bytes + (bits == 4 ? 0 : c0[j]);  /* nibbles: +c0 on load */
        sc[j] = w->scales + panel * (K / w->bk) * PANEL + c0[j];
        of[j] = w->offsets ? w->offsets + panel * (K / w->bk) * PANEL + c0[j] : NULL;
    }
    for (int i = 0; i < BLOCK_ACCS; i++) a[i] = acc[i];
    for (int64_t kb = k0; kb < k1; kb += w->bk) {
        vf s[BLOCK_VECS], m[BLOCK_VECS];
        for (int j = 0; j < BLOCK_VECS; j++) {
            s[j] = vload(sc[j] + (kb / w->bk) * PANEL);
            m[j] = of[j] ? vload(of[j] + (kb / w->bk) * PANEL) : vzero();
        }
        if (prefetch) {  /* the values of a block a few blocks ahead, line by line */
            for (int j = 0; j < BLOCK_VECS; j++)
                if ((j * VW) % PANEL == 0)
                    for (int64_t l = 0; l < w->bk * row_bytes; l += 64)
                        PREFETCH_L1(q[j] + (kb + 4 * w->bk) * row_bytes + l);
        }
        if (rows == 1) {
            /* One row: its sums split over SPLIT accumulators by k (the free rows'
             * registers), so consecutive FMAs do not wait on each other's latency. */
            for (int64_t k = kb; k < kb + w->bk; k += SPLIT) {
#pragma GCC unroll 2
                for (int u = 0; u < SPLIT; u += 2) {
                    vf b0 = vset1(x[k + u]), b1 = vset1(x[k + u + 1]);
#pragma GCC unroll 2
                    for (int j = 0; j < BLOCK_VECS; j++) {
                        vf v0, v1;
                        vq_rows2(q[j], k + u, c0[j], s[j], m[j], bits, &v0, &v1);
                        a[u * BLOCK_VECS + j] = vfma(b0, v0, a[u * BLOCK_VECS + j]);
                        a[(u + 1) * BLOCK_VECS + j] = vfma(b1, v1, a[(u + 1) * BLOCK_VECS + j]);
                    }
                }
            }
            continue;
        }
        for (int64_t k = kb; k < kb + w->bk; k += 2) {
            vf v0[BLOCK_VECS], v1[BLOCK_VECS];
#pragma GCC unroll 2
            for (int j = 0; j < BLOCK_VECS; j++)
                vq_rows2(q[j], k, c0[j], s[j], m[j], bits, &v0[j], &v1[j]);
#pragma GCC unroll 8
            for (int r = 0; r < rows; r++) {
                vf b0 = vset1(x[r * K + k]), b1 = vset1(x[r * K + k + 1]);
#pragma GCC unroll 2
                for (int j = 0; j < BLOCK_VECS; j++)
                    a[r * BLOCK_VECS + j] = vfma(b1, v1[j], vfma(b0, v0[j], a[r * BLOCK_VECS + j]));
            }
        }
    }
    if (rows == 1)  /* the split sums back into row 0, in a fixed order */
        for (int u = 1; u < SPLIT; u++)
            for (int j = 0; j < BLOCK_VECS; j++) {
                a[j] += a[u * BLOCK_VECS + j];
                a[u * BLOCK_VECS + j] = vzero();
            }
    for (int i = 0; i < BLOCK_ACCS; i++) acc[i] = a[i];
}

/* `one_row`: only the block's first row is wanted (M == 1). */
static inline void block_rows_cols_q8(const float *x, int64_t K, const QPanels *w, int64_t c,
                                      int64_t k0, int64_t k1, vf acc[BLOCK_ACCS],
                                      const int prefetch, int one_row) {
    if (one_row) {
        if (w->bits == 4)
            block_rows_cols_q(x, K, w, c, k0, k1, acc, prefetch, 4, 1);
        else
            block_rows_cols_q(x, K, w, c, k0, k1, acc, prefetch, 8, 1);
    } else if (w->bits == 4) {
        block_rows_cols_q(x, K, w, c, k0, k1, acc, prefetch, 4, BLOCK_ROWS);
    } else {
        block_rows_cols_q(x, K, w, c, k0, k1, acc, prefetch, 8, BLOCK_ROWS);
    }
}

/* One row block against the column vectors from c on, over [k0, k1): fp32 panels
 * (w: their column pointers) or, with q, quantized ones. */
static inline __attribute__((always_inline)) void block_any(
    const float *x, int64_t K, const float *const w[BLOCK_VECS], const QPanels *q, int64_t c,
    int64_t k0, int64_t k1, vf acc[BLOCK_ACCS], const int prefetch, int one_row) {
    if (q)
        block_rows_cols_q8(x, K, q, c, k0, k1, acc, prefetch, one_row);
    else
        block_rows_cols(x, K, w, k0, k1, acc, prefetch);
}

/* Rows [0, M) of x (row stride K; rows up to the next multiple of BLOCK_ROWS are read
 * and their results dropped) times panel pairs [p0, p1) -> out (row stride ldo) + bias;
 * add_to: out += that instead (the residual, added after the bias as in torch). The
 * weight: fp32 `panels`, or quantized panels `q` (then `panels` is unused). Sums run
 * over K in order whatever the chunking: results do not depend on it. */
static inline void matmul_pairs(const float *x, int64_t M, int64_t K, const float *panels,
                                const QPanels *q, int64_t N, const float *bias, float *out,
                                int64_t ldo, int add_to, int64_t p0, int64_t p1) {
    vf acc[ROW_GROUP / BLOCK_ROWS][BLOCK_ACCS];
    for (int64_t c = p0 * PAIR_COLS; c < p1 * PAIR_COLS; c += BLOCK_COLS) {
        const float *w[BLOCK_VECS];
        vf b[BLOCK_VECS];
        for (int j = 0; j < BLOCK_VECS; j++) {
            w[j] = q ? NULL : panel_column(panels, K, c + j * VW);
            b[j] = bias ? vload_n(bias + c + j * VW, N - c - j * VW) : vzero();
        }
        for (int64_t g = 0; g < M; g += ROW_GROUP) {
            const int64_t rows = M - g < ROW_GROUP ? M - g : ROW_GROUP;
            const int64_t blocks = (rows + BLOCK_ROWS - 1) / BLOCK_ROWS;
            for (int64_t rb = 0; rb < blocks; rb++)
                for (int i = 0; i < BLOCK_ACCS; i++) acc[rb][i] = vzero();
            for (int64_t k0 = 0; k0 < K; k0 += K_CHUNK) {
                const int64_t k1 = k0 + K_CHUNK < K ? k0 + K_CHUNK : K;
                block_any(x + g * K, K, w, q, c, k0, k1, acc[0], 1, M == 1);
                for (int64_t rb = 1; rb < blocks; rb++)
                    block_any(x + (g + rb * BLOCK_ROWS) * K, K, w, q, c, k0, k1, acc[rb], 0, 0);
            }
            for (int64_t i = 0; i < rows; i++)
                for (int j = 0; j < BLOCK_VECS; j++) {
                    int64_t col = c + j * VW, n = N - col;
                    float *o = out + (g + i) * ldo + col;
                    vf y = acc[i / BLOCK_ROWS][(i % BLOCK_ROWS) * BLOCK_VECS + j] + b[j];
                    if (add_to) y += vload_n(o, n);
                    vstore_n(o, y, n);
                }
        }
    }
}

#endif
