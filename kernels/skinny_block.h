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
/* Bytes further ahead that a weight stream is also prefetched into L2: from DRAM a core
 * then keeps more lines in flight (real model's decode step, Zen 4, one row: fp32 panels
 * 0.67-0.81x on AVX-512, 0.95x on AVX2; int8 rows, dot_block.h, 0.87-0.89x and 0.95x;
 * 4 to 16 KiB alike). The fp32-row loops on quantized records, bound by their
 * conversions, gained nothing and do without. */
#define PREFETCH_L2_BYTES 8192

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
                if ((j * VW) % PANEL == 0) {
                    PREFETCH_L1(w[j] + (k + PREFETCH_K) * PANEL);
                    PREFETCH_L2(w[j] + (k + PREFETCH_L2_BYTES / (PANEL * 4)) * PANEL);
                }
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
 * A weight [N, K] kept as integer values q with, per column and block of `bk`
 * consecutive k, a scale s and an offset m (fp16, or fp32 where fp16 cannot hold them):
 * w = s * q + m, what GGUF's Q8_0 (no offsets), Q4_0 (m = -8 s), Q4_1 (m its block's
 * min), Q4_K (s = d * sc, m = -dmin * mn per 32: fp32) and Q6_K (q - 32, s = d * sc per
 * 16: fp32) dequantize to. Values are int8 (16 bytes a panel row) or, where they fit in
 * 0..15, nibbles: 16 bytes hold two panel rows, byte j column j of the even row in its
 * low half and of the odd row in its high half (one load, two rows).
 *
 * The layout is one stream (quant_panels.py packs it): records, pair of 16-column panels
 * by pair, then block of k by block, then panel by panel; a record is 16 scales, 16
 * offsets (when the weight has them) and the block's bk panel rows of values.
 * A thread's share of a matmul (a run of panel pairs) is then one sequential read,
 * which the prefetchers keep up with; values, scales and offsets in three arrays were
 * six short streams per pair and ran at half the memory's read rate.
 *
 * One row of x (a single stream's decode), and up to 8 on AVX-512 in groups of 4 (a
 * few streams, or one with a draft), never dequantize: per block and column each row
 * sums x_k * q_k in registers, then adds s * that + m * (x's sum over the block), so a
 * value costs one conversion for the group and one FMA per row. More rows convert and
 * scale each panel row once (one FMA shared by every row of x), then use it like an
 * fp32 panel row in the register block: in registers for one block of rows
 * (block_rows_cols_q), and for several through a chunk of K_CHUNK panel rows converted
 * into an L1 buffer (dequantize_chunk), which every row block of the group multiplies
 * (converted once per group of up to ROW_GROUP rows instead of once per block). */
#define Q_HALF_BYTES 2
#define Q_PREFETCH_RECORDS 3 /* pair-records ahead (about 2 KiB): measured best of 2..16 */

typedef struct {
    const uint8_t *records;
    int64_t bk;      /* k per scale; divides K and K_CHUNK */
    int64_t bits;    /* 8, 4, or 16: bf16 values (unit scales) */
    int64_t offsets; /* 1: records hold offsets */
    int64_t scale_bytes; /* 2 (fp16 scales and offsets) or 4 (fp32) */
} QPanels;

static inline int64_t q_header_bytes(int64_t offsets, int64_t scale_bytes) {
    return (offsets ? 2 : 1) * PANEL * scale_bytes;
}
static inline int64_t q_record_bytes(const QPanels *w) {
    return q_header_bytes(w->offsets, w->scale_bytes) + w->bk * PANEL * w->bits / 8;
}

/* fp16 bits to float, for builds without a conversion instruction. */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023;
    uint32_t bits;
    if (exp == 0) {  /* zero or subnormal: man * 2^-24, exact in float */
        float f = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | man << 13;
    } else {
        bits = sign | (exp + 112) << 23 | man << 13;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* VW fp16 values at p as floats. */
static inline vf vhalf_load(const uint8_t *p) {
#if VW == 16 && defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif VW == 8 && defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vf v;
    for (int i = 0; i < VW; i++) {
        uint16_t h;
        memcpy(&h, p + i * Q_HALF_BYTES, Q_HALF_BYTES);
        v[i] = half_to_float(h);
    }
    return v;
#endif
}

/* VW scales (or offsets) at p: fp16 or fp32. */
static inline vf vscale_load(const uint8_t *p, const int scale_bytes) {
    return scale_bytes == 4 ? vload((const float *)p) : vhalf_load(p);
}

typedef int8_t vq_unaligned __attribute__((vector_size(VW), aligned(1)));

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

/* VW columns of a nibble pair row at p: the even row's values in *lo, the odd row's in
 * *hi (one widening load; the high half needs no mask once widened). */
static inline __attribute__((always_inline)) void vq4_load2(const uint8_t *p, vf *lo, vf *hi) {
#if VW == 16 && defined(__AVX512F__)
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = (vf)_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    *hi = (vf)_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
#elif VW == 8 && defined(__AVX2__)
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *lo = (vf)_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    *hi = (vf)_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
#else
    for (int i = 0; i < VW; i++) {
        (*lo)[i] = (float)(p[i] & 15);
        (*hi)[i] = (float)(p[i] >> 4);
    }
#endif
}

/* VW bf16 values at p as floats (exact: a bf16 is a float's upper half). */
static inline vf vbf16_load(const uint8_t *p) {
#if VW == 16 && defined(__AVX512F__)
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif VW == 8 && defined(__AVX2__)
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    vf v;
    for (int i = 0; i < VW; i++) {
        uint16_t b;
        memcpy(&b, p + 2 * i, 2);
        const uint32_t bits = (uint32_t)b << 16;
        memcpy(&v[i], &bits, 4);
    }
    return v;
#endif
}

/* Bytes a column takes in a panel row of values: 2 for bf16, else 1 (an int8, or a
 * nibble pair's byte holding two panel rows). */
static inline int64_t q_column_bytes(int64_t bits) {
    return bits == 16 ? 2 : 1;
}

/* Panel rows k and k + 1 (k even) of a record's values, VW columns from the value
 * pointer v (already at the columns), as floats: q, not yet scaled. */
static inline __attribute__((always_inline)) void vq_rows2(const uint8_t *v, int64_t k,
                                                           const int bits, vf *v0, vf *v1) {
    if (bits == 16) {
        *v0 = vbf16_load(v + k * PANEL * 2);
        *v1 = vbf16_load(v + (k + 1) * PANEL * 2);
    } else if (bits == 4) {
        vq4_load2(v + (k / 2) * PANEL, v0, v1);
    } else {
        *v0 = vq8_load(v + k * PANEL);
        *v1 = vq8_load(v + (k + 1) * PANEL);
    }
}

/* ---- one to a few rows ---- */
#define PAIR_VECS (PAIR_COLS / VW)
#if VW == 16
#define ONE_ROW_SPLIT 4 /* sums per column vector, by k: 8 chains cover the FMA latency */
#define FEW_ROWS 4      /* rows at once: 4 x 2 x 2 sums and 4 x 2 totals fit 32 registers */
#define FEW_ROWS_ALL 8  /* rows this way at most, in groups of FEW_ROWS (measured) */
#else
#define ONE_ROW_SPLIT 2
#define FEW_ROWS 1      /* 16 registers: one row */
#define FEW_ROWS_ALL 1
#endif

/* acc[i][j] (row i, column vector j of the pair) += rows x times the pair's weight,
 * over all its blocks; R rows (x row stride K). pair: the pair's first record. Each
 * value is converted once for every row; sums run over k in a fixed order. */
static inline __attribute__((always_inline)) void pair_rows_q(
    const float *x, int64_t K, const QPanels *w, const uint8_t *pair,
    vf acc[FEW_ROWS][PAIR_VECS], const int bits, const int offsets, const int sb, const int R) {
    const int S = R == 1 ? ONE_ROW_SPLIT : 2;  /* sums per row and vector, by k */
    const int64_t bk = w->bk, hdr = q_header_bytes(offsets, sb), rec = hdr + bk * PANEL * bits / 8;
    for (int64_t b = 0; b < K / bk; b++) {
        const uint8_t *r = pair + b * 2 * rec;  /* panel 0's record; panel 1's follows */
        for (int64_t l = 0; l < 2 * rec; l += 64) PREFETCH_L1(r + Q_PREFETCH_RECORDS * 2 * rec + l);
        vf raw[FEW_ROWS][ONE_ROW_SPLIT][PAIR_VECS];
        for (int i = 0; i < R; i++)
            for (int u = 0; u < S; u++)
                for (int j = 0; j < PAIR_VECS; j++) raw[i][u][j] = vzero();
        for (int64_t k = 0; k < bk; k += S) {
#pragma GCC unroll 2
            for (int u = 0; u < S; u += 2) {
#pragma GCC unroll 8
                for (int j = 0; j < PAIR_VECS; j++) {
                    const int64_t panel = j * VW / PANEL, c0 = j * VW % PANEL;
                    vf v0, v1;
                    vq_rows2(r + panel * rec + hdr + c0 * q_column_bytes(bits), k + u, bits, &v0, &v1);
#pragma GCC unroll 4
                    for (int i = 0; i < R; i++) {
                        const float *xb = x + i * K + b * bk + k + u;
                        raw[i][u][j] = vfma(vset1(xb[0]), v0, raw[i][u][j]);
                        raw[i][u + 1][j] = vfma(vset1(xb[1]), v1, raw[i][u + 1][j]);
                    }
                }
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            float xsum = 0.0f;
            if (offsets) {
                vf s = vzero();
                for (int64_t k = 0; k < bk; k += VW) s += vload(x + i * K + b * bk + k);
                xsum = vsum(s);
            }
#pragma GCC unroll 8
            for (int j = 0; j < PAIR_VECS; j++) {
                const uint8_t *h = r + (j * VW / PANEL) * rec + (j * VW % PANEL) * sb;
                vf total = raw[i][0][j];
                for (int u = 1; u < S; u++) total += raw[i][u][j];
                acc[i][j] = vfma(total, vscale_load(h, sb), acc[i][j]);
                if (offsets)
                    acc[i][j] = vfma(vset1(xsum), vscale_load(h + PANEL * sb, sb), acc[i][j]);
            }
        }
    }
}

/* pair_rows_q for this weight's format (each a loop of its own). */
static inline __attribute__((always_inline)) void pair_rows_any(
    const float *x, int64_t K, const QPanels *w, const uint8_t *pair,
    vf acc[FEW_ROWS][PAIR_VECS], const int R) {
    if (w->bits == 16) {  /* bf16 values, a unit scale per block */
        pair_rows_q(x, K, w, pair, acc, 16, 0, 2, R);
    } else if (w->scale_bytes == 4) {  /* K-quants' products of two scales */
        if (w->bits == 4 && w->offsets) pair_rows_q(x, K, w, pair, acc, 4, 1, 4, R);
        else if (w->bits == 4) pair_rows_q(x, K, w, pair, acc, 4, 0, 4, R);
        else if (w->offsets) pair_rows_q(x, K, w, pair, acc, 8, 1, 4, R);
        else pair_rows_q(x, K, w, pair, acc, 8, 0, 4, R);
    } else if (w->bits == 4 && w->offsets) {
        pair_rows_q(x, K, w, pair, acc, 4, 1, 2, R);
    } else if (w->bits == 4) {
        pair_rows_q(x, K, w, pair, acc, 4, 0, 2, R);
    } else if (w->offsets) {
        pair_rows_q(x, K, w, pair, acc, 8, 1, 2, R);
    } else {
        pair_rows_q(x, K, w, pair, acc, 8, 0, 2, R);
    }
}

/* M <= FEW_ROWS_ALL rows against panel pairs [p0, p1) -> out (row stride ldo; + bias;
 * add_to: out += that): per pair, groups of FEW_ROWS rows, each rounded up to 1, 2 or 4
 * (x holds padded rows); a second group reads the pair's records from L1. */
static inline void matmul_pairs_few_rows_q(const float *x, int64_t M, int64_t K,
                                           const QPanels *w, int64_t N, const float *bias,
                                           float *out, int64_t ldo, int add_to, int64_t p0,
                                           int64_t p1) {
    const int64_t pair_bytes = (K / w->bk) * 2 * q_record_bytes(w);
    for (int64_t p = p0; p < p1; p++) {
        const uint8_t *pair = w->records + p * pair_bytes;
        for (int64_t g = 0; g < M; g += FEW_ROWS) {
            const int64_t rows = M - g < FEW_ROWS ? M - g : FEW_ROWS;
            vf acc[FEW_ROWS][PAIR_VECS];
            for (int i = 0; i < FEW_ROWS; i++)
                for (int j = 0; j < PAIR_VECS; j++) acc[i][j] = vzero();
#if FEW_ROWS >= 4
            if (rows > 2) pair_rows_any(x + g * K, K, w, pair, acc, 4);
            else if (rows == 2) pair_rows_any(x + g * K, K, w, pair, acc, 2);
            else
#endif
                pair_rows_any(x + g * K, K, w, pair, acc, 1);
            for (int64_t i = 0; i < rows; i++)
                for (int j = 0; j < PAIR_VECS; j++) {
                    const int64_t col = p * PAIR_COLS + j * VW, n = N - col;
                    float *o = out + (g + i) * ldo + col;
                    vf y = acc[i][j] + (bias ? vload_n(bias + col, n) : vzero());
                    if (add_to) y += vload_n(o, n);
                    vstore_n(o, y, n);
                }
        }
    }
}

/* Column vector `col` (of a pair, 0..PAIR_COLS) in the block record pair r: its scales,
 * offsets (zero without them) and values. */
static inline __attribute__((always_inline)) const uint8_t *q_vector_at(
    const QPanels *w, const uint8_t *r, int64_t col, const int bits, vf *s, vf *m) {
    const int64_t sb = w->scale_bytes, rec = q_record_bytes(w);
    const uint8_t *h = r + (col / PANEL) * rec + (col % PANEL) * sb;
    *s = vscale_load(h, (int)sb);
    *m = w->offsets ? vscale_load(h + PANEL * sb, (int)sb) : vzero();
    return r + (col / PANEL) * rec + q_header_bytes(w->offsets, sb) + (col % PANEL) * q_column_bytes(bits);
}

/* ---- several rows ---- */
/* block_rows_cols on quantized panels: column vector j starts at column c + j * VW;
 * panel rows [k0, k1) (whole blocks). */
static inline __attribute__((always_inline)) void block_rows_cols_q(
    const float *x, int64_t K, const QPanels *w, int64_t c, int64_t k0, int64_t k1,
    vf acc[BLOCK_ACCS], const int prefetch, const int bits) {
    const int64_t bk = w->bk, rec = q_record_bytes(w);
    const uint8_t *pair = w->records + (c / PAIR_COLS) * (K / bk) * 2 * rec;
    vf a[BLOCK_ACCS];
    for (int i = 0; i < BLOCK_ACCS; i++) a[i] = acc[i];
    for (int64_t kb = k0; kb < k1; kb += bk) {
        const uint8_t *r = pair + (kb / bk) * 2 * rec;
        vf s[BLOCK_VECS], m[BLOCK_VECS];
        const uint8_t *v[BLOCK_VECS];
        for (int j = 0; j < BLOCK_VECS; j++)
            v[j] = q_vector_at(w, r, c % PAIR_COLS + j * VW, bits, &s[j], &m[j]);
        if (prefetch)
            for (int64_t l = 0; l < 2 * rec; l += 64)
                PREFETCH_L1(r + Q_PREFETCH_RECORDS * 2 * rec + l);
        for (int64_t k = 0; k < bk; k += 2) {
            vf v0[BLOCK_VECS], v1[BLOCK_VECS];
#pragma GCC unroll 2
            for (int j = 0; j < BLOCK_VECS; j++) {
                vq_rows2(v[j], k, bits, &v0[j], &v1[j]);
                if (bits != 16) {  /* bf16 values are the weights (unit scales) */
                    v0[j] = vfma(v0[j], s[j], m[j]);
                    v1[j] = vfma(v1[j], s[j], m[j]);
                }
            }
#pragma GCC unroll 8
            for (int row = 0; row < BLOCK_ROWS; row++) {
                vf b0 = vset1(x[row * K + kb + k]), b1 = vset1(x[row * K + kb + k + 1]);
#pragma GCC unroll 2
                for (int j = 0; j < BLOCK_VECS; j++)
                    a[row * BLOCK_VECS + j] = vfma(b1, v1[j], vfma(b0, v0[j], a[row * BLOCK_VECS + j]));
            }
        }
    }
    for (int i = 0; i < BLOCK_ACCS; i++) acc[i] = a[i];
}

static inline void block_rows_cols_q8(const float *x, int64_t K, const QPanels *w, int64_t c,
                                      int64_t k0, int64_t k1, vf acc[BLOCK_ACCS],
                                      const int prefetch) {
    if (w->bits == 4)
        block_rows_cols_q(x, K, w, c, k0, k1, acc, prefetch, 4);
    else if (w->bits == 16)
        block_rows_cols_q(x, K, w, c, k0, k1, acc, prefetch, 16);
    else
        block_rows_cols_q(x, K, w, c, k0, k1, acc, prefetch, 8);
}

/* Quantized panels' column vectors from c on, panel rows [k0, k1) (whole blocks),
 * dequantized (s * q + m, as block_rows_cols_q does in registers) into `deq`, laid out
 * as fp32 panels of K_CHUNK rows: deq + (j * VW / PANEL) * K_CHUNK * PANEL holds vector
 * j's panel, row k - k0 at (k - k0) * PANEL. */
static inline __attribute__((always_inline)) void dequantize_chunk(
    const QPanels *w, int64_t K, int64_t c, int64_t k0, int64_t k1, float *deq, const int bits) {
    const int64_t bk = w->bk, rec = q_record_bytes(w);
    const uint8_t *pair = w->records + (c / PAIR_COLS) * (K / bk) * 2 * rec;
    for (int64_t kb = k0; kb < k1; kb += bk) {
        const uint8_t *r = pair + (kb / bk) * 2 * rec;
        for (int64_t l = 0; l < 2 * rec; l += 64) PREFETCH_L1(r + Q_PREFETCH_RECORDS * 2 * rec + l);
#pragma GCC unroll 2
        for (int j = 0; j < BLOCK_VECS; j++) {
            vf s, m;
            const uint8_t *v = q_vector_at(w, r, c % PAIR_COLS + j * VW, bits, &s, &m);
            float *d = deq + (j * VW / PANEL) * K_CHUNK * PANEL + (j * VW) % PANEL + (kb - k0) * PANEL;
            for (int64_t k = 0; k < bk; k += 2) {
                vf v0, v1;
                vq_rows2(v, k, bits, &v0, &v1);
                if (bits != 16) {
                    v0 = vfma(v0, s, m);
                    v1 = vfma(v1, s, m);
                }
                vstore(d + k * PANEL, v0);
                vstore(d + (k + 1) * PANEL, v1);
            }
        }
    }
}

/* One row block against the column vectors from c on, over [k0, k1): fp32 panels
 * (w: their column pointers) or, with q, quantized ones. */
static inline __attribute__((always_inline)) void block_any(
    const float *x, int64_t K, const float *const w[BLOCK_VECS], const QPanels *q, int64_t c,
    int64_t k0, int64_t k1, vf acc[BLOCK_ACCS], const int prefetch) {
    if (q)
        block_rows_cols_q8(x, K, q, c, k0, k1, acc, prefetch);
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
    if (q && M <= FEW_ROWS_ALL) {
        matmul_pairs_few_rows_q(x, M, K, q, N, bias, out, ldo, add_to, p0, p1);
        return;
    }
    vf acc[ROW_GROUP / BLOCK_ROWS][BLOCK_ACCS];
    float deq[(BLOCK_COLS + PANEL - 1) / PANEL * K_CHUNK * PANEL] __attribute__((aligned(64)));
    const float *dw[BLOCK_VECS];  /* block_rows_cols' column pointers into deq */
    for (int j = 0; j < BLOCK_VECS; j++) dw[j] = deq + (j * VW / PANEL) * K_CHUNK * PANEL + (j * VW) % PANEL;
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
                if (q && blocks > 1) {
                    /* Several row blocks: each value converted once for all of them
                     * (in registers it is converted once a block), then multiplied as
                     * an fp32 panel: the same FMAs in the same order. */
                    if (q->bits == 4) dequantize_chunk(q, K, c, k0, k1, deq, 4);
                    else if (q->bits == 16) dequantize_chunk(q, K, c, k0, k1, deq, 16);
                    else dequantize_chunk(q, K, c, k0, k1, deq, 8);
                    for (int64_t rb = 0; rb < blocks; rb++)
                        block_rows_cols(x + (g + rb * BLOCK_ROWS) * K + k0, K, dw, 0, k1 - k0,
                                        acc[rb], 0);
                    continue;
                }
                block_any(x + g * K, K, w, q, c, k0, k1, acc[0], 1);
                for (int64_t rb = 1; rb < blocks; rb++)
                    block_any(x + (g + rb * BLOCK_ROWS) * K, K, w, q, c, k0, k1, acc[rb], 0);
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
