/* int8 activations against integer weight panels: integer dot products, as llama.cpp
 * computes on the same GGUF blocks (activation_precision "int8", kernels/quant_panels.py).
 *
 * Each row of x is quantized once per matmul: per tile of the weights it meets
 * (tile_k values: 8 for nibbles, 4 for int8 values) a step d = u * s (u a float per X_UNIT
 * (32) values, s an integer sub-scale, at most X_SUBSCALE_MAX, the block whose largest
 * magnitude is the unit's taking the largest), q = x / d rounded to nearest (even),
 * |q| <= 127; and d * sum(q) (for the weights' offsets). The sub-scale is why:
 * vpmaddubsw's int16 pairs are widened by vpmaddwd (vpdpwssd with VNNI), which
 * multiplies them by anything for free, so the products are summed times s in 32-bit
 * integers over a whole block of the weights and converted once per 32 values, not
 * once per tile (a conversion and an FMA per tile less). VNNI's nibbles are the
 * exception: vpdpbusd sums a block of x's two tiles into 32 bits directly, converted
 * per 8 and scaled by d. Per block of the weights (bk, 16 or 32) it adds s_w times
 * those + m_w times the sums.
 *
 * The weights' values are laid out for the dot-product instructions ("dots", packed by
 * QuantPanels.pack(dots=True)): a record's values come in 64-byte tiles of 16 columns
 * by 4 consecutive k, byte 4c + j holding column c's value at k + j (int8 values, one
 * tile per 4 k), or its nibble at k + j low and at k + 4 + j high (one tile per 8 k).
 * A 32-bit lane then holds four k of one column, which is what VNNI's vpdpbusd (u8 x s8
 * products summed by four into a lane) and AVX2's vpmaddubsw + vpmaddwd multiply: one
 * instruction (or two) per 4 x VW products, where the fp32 path spends a widening load,
 * a conversion and an FMA per VW. Nibbles are unsigned (0..15) already; int8 values are
 * multiplied as |w| times x with w's sign (vpmaddubsw's pairs then stay within int16:
 * 2 * 128 * 127).
 *
 * Written once for every width: VW lanes of four bytes each (a column vector of the
 * fp32 kernels), with the instruction per ISA in the dot_* functions and a plain loop
 * elsewhere. */
#ifndef PDSERVE_DOT_BLOCK_H
#define PDSERVE_DOT_BLOCK_H
#include <math.h>

#include "skinny_block.h"

typedef int32_t v4si __attribute__((vector_size(16)));

#define DOT_TILE 64 /* bytes: 16 columns x 4 k */
/* k per tile: 8 of nibbles (low and high halves of each byte), 4 of int8 values. */
static inline int64_t tile_k(int64_t bits) { return bits == 4 ? 8 : 4; }
/* Rows sharing each tile load: their int sums, block totals and results in registers
 * (32 on AVX-512, 16 elsewhere). On AVX2, 3 rows (some spilled) measured 0.93-0.95x the
 * time of 2 at 16 and 128 rows (`quant_panels.matmul`, the real model's Q4_1 gate|up and
 * down, its Q8_0 head; docs/benchmarks.md: 0.89-0.93x), 4 no faster than 2. */
#if VW == 16
#define DOT_ROWS 4
#elif VW == 8
#define DOT_ROWS 3
#else
#define DOT_ROWS 2
#endif

#if defined(__AVX512VNNI__) && VW == 16
#define PDSERVE_DOT "vnni"
#define DOT_SUBSCALED 0 /* nibbles: products summed per 8 k, converted and scaled by d */
#elif (VW == 16 && defined(__AVX512BW__)) || (VW == 8 && defined(__AVX2__))
#define PDSERVE_DOT "maddubs"
#define DOT_SUBSCALED 1 /* summed times s over a block of the weights, converted once */
#else
#define PDSERVE_DOT "plain"
#define DOT_SUBSCALED 1
#endif

/* Which integer dot product this build multiplies with. */
const char *simd_dot(void) { return PDSERVE_DOT; }

/* x's step covers one tile of the weights (tile_k values), finer than the weights' 32,
 * since a block's largest value sets every other's step. A step per tile costs no
 * instruction more than a coarser one (every tile's products are summed times their own
 * sub-scale, see the top); nibbles per 4 would split a tile's two halves, which are
 * summed in int16 before one widening. Measured on the real model (mean KL from fp32
 * activations', 4 chunks of 512): per 32 (llama.cpp's) 3.1e-3 nats a token, per 16
 * 1.65e-3, per 8 8.0e-4, per 4 3.6e-4; the Q8_0 LM head per 8 alone 2.6e-4
 * (docs/models.md). */
#define X_BLOCK_MIN 4 /* the finest step: QRows' layout is sized for it */
/* Values of x per unit u: a block of the weights (16 or 32) lies within one. */
#define X_UNIT 32
/* The largest sub-scale: a block of the weights' 32-bit sums then stay below 2^31 (int8
 * weights: 8 tiles x 2 pairs x 2 * 128 * 127 x 4095; nibbles: a quarter of that). A
 * block's step is its own (largest magnitude / 127) rounded up to a multiple of u, the
 * largest block's / 4095: a block a hundredth of the largest gets a step within 2.5% of
 * its own; one below 1/4095 of it, u. */
#define X_SUBSCALE_MAX 4095

/* x's rows quantized (see the top) per xb values (tile_k of the weight they meet): q
 * [rows][K]; per block d, sum and s (the sub-scale in both int16 halves of a lane)
 * [rows][K / xb]; u [rows][K / X_UNIT]. */
typedef struct {
    int8_t *q;
    float *d, *sum;
    int32_t *s;
    float *u;
    int64_t xb;
} QRows;

static inline int64_t qrows_units(int64_t K) { return (K + X_UNIT - 1) / X_UNIT; }

/* Bytes QRows needs for `rows` rows of K, whatever their xb: values, then the per-block
 * and per-unit numbers, rounded to 64. */
static inline int64_t qrows_bytes(int64_t rows, int64_t K) {
    return ((rows * K + 3) / 4 * 4 + (3 * (K / X_BLOCK_MIN) + qrows_units(K)) * rows * 4 + 63) / 64 * 64;
}
static inline QRows qrows_at(void *mem, int64_t rows, int64_t K, int64_t xb) {
    QRows r;
    const int64_t nb = rows * (K / X_BLOCK_MIN);
    r.q = (int8_t *)mem;
    r.d = (float *)((char *)mem + (rows * K + 3) / 4 * 4);
    r.sum = r.d + nb;
    r.s = (int32_t *)(r.sum + nb);
    r.u = (float *)(r.s + nb);
    r.xb = xb;
    return r;
}

/* Eight values of x at a time on every ISA (a ymm register, or two xmm). */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v8f_unaligned __attribute__((vector_size(32), aligned(4)));
typedef float v4f __attribute__((vector_size(16)));

static inline float v4_fold(v4f a, const int is_max) {
    v4f b = __builtin_shufflevector(a, a, 2, 3, 0, 1);
    a = is_max ? (v4f)((a > b) & (v4si)a) + (v4f)(~(a > b) & (v4si)b) : a + b;
    return is_max ? (a[0] > a[1] ? a[0] : a[1]) : a[0] + a[1];
}
static inline v4f v8_half(v8f v, int h) {
    return h ? __builtin_shufflevector(v, v, 4, 5, 6, 7) : __builtin_shufflevector(v, v, 0, 1, 2, 3);
}
static inline float v8_fold(v8f v, const int is_max) {
    v4f lo = v8_half(v, 0), hi = v8_half(v, 1);
    return v4_fold(is_max ? (v4f)((lo > hi) & (v4si)lo) + (v4f)(~(lo > hi) & (v4si)hi) : lo + hi,
                   is_max);
}

/* Units [u0, u1) (X_UNIT values each; the last may be shorter) of row r of x (row stride
 * K, a multiple of 8) into qx, per qx->xb values: each unit on its own. The sum is the
 * quantized block's (d times its integers' sum), not x's: the offsets' term then
 * multiplies the same x as the values' term, and the rounding errors meet the weights
 * w = s q + m rather than s q alone (Q4_1's m is about -8 s; measured per 32, x's own
 * sum put the perplexity 0.53% off fp32's, this one 0.41%). */
static inline void quantize_units(const float *x, int64_t r, int64_t u0, int64_t u1, int64_t K,
                                  const QRows *qx) {
    const v8i abs_mask = {S4(0x7fffffff), S4(0x7fffffff)};
    const v8f magic = {S4(12582912.0f), S4(12582912.0f)}; /* 1.5 * 2^23: rounds to an integer */
    const int64_t halves = 8 / qx->xb; /* blocks per 8 values: 1 or 2 */
    const int64_t nc = K / 8, per_unit = X_UNIT / 8, nb = K / qx->xb;
    const int64_t c1 = u1 * per_unit < nc ? u1 * per_unit : nc;
    for (int64_t c0 = u0 * per_unit; c0 < c1; c0 += per_unit) {
        const int64_t n = nc - c0 < per_unit ? nc - c0 : per_unit;
        float amax[X_UNIT / X_BLOCK_MIN], top = 0.0f;
        for (int64_t c = 0; c < n; c++) {
            const v8f v = *(const v8f_unaligned *)(x + r * K + (c0 + c) * 8);
            const v8f a = (v8f)((v8i)v & abs_mask);
            if (halves == 1) amax[c] = v8_fold(a, 1);
            else for (int h = 0; h < 2; h++) amax[2 * c + h] = v4_fold(v8_half(a, h), 1);
        }
        for (int64_t b = 0; b < n * halves; b++) top = amax[b] > top ? amax[b] : top;
        const float u = top / (127.0f * X_SUBSCALE_MAX);
        const float per = top > 0.0f ? (float)X_SUBSCALE_MAX / top : 0.0f;
        qx->u[r * qrows_units(K) + c0 / per_unit] = u;
        for (int64_t c = 0; c < n; c++) {
            float s[2], d[2], inv[2];
            for (int h = 0; h < halves; h++) {
                s[h] = ceilf(amax[c * halves + h] * per);
                s[h] = s[h] < (float)X_SUBSCALE_MAX ? s[h] : (float)X_SUBSCALE_MAX;
                d[h] = u * s[h];
                inv[h] = d[h] > 0.0f ? 1.0f / d[h] : 0.0f;
            }
            const float inv_hi = halves == 1 ? inv[0] : inv[1];
            const v8f by = {S4(inv[0]), S4(inv_hi)};
            const v8f v = *(const v8f_unaligned *)(x + r * K + (c0 + c) * 8);
            const v8f rounded = (v * by + magic) - magic;
            const v8i q = __builtin_convertvector(rounded, v8i);
            int8_t *out = qx->q + r * K + (c0 + c) * 8;
#if defined(__AVX512VL__)
            _mm_storel_epi64((__m128i *)out, _mm256_cvtepi32_epi8((__m256i)q));
#elif defined(__AVX2__)  /* packed with saturation, exact for |q| <= 127: 1.3x faster than 8 stores */
            const __m128i halves16 = _mm_packs_epi32(_mm256_castsi256_si128((__m256i)q),
                                                     _mm256_extracti128_si256((__m256i)q, 1));
            _mm_storel_epi64((__m128i *)out, _mm_packs_epi16(halves16, halves16));
#else
            for (int i = 0; i < 8; i++) out[i] = (int8_t)q[i];
#endif
            for (int h = 0; h < halves; h++) {
                const int64_t at = r * nb + (c0 + c) * halves + h;
                qx->d[at] = d[h];
                qx->s[at] = (int32_t)s[h] * 0x10001;
                qx->sum[at] = d[h] * (halves == 1 ? v8_fold(rounded, 0) : v4_fold(v8_half(rounded, h), 0));
            }
        }
    }
}

/* Rows [r0, r1) of x into qx, whole. */
static inline void quantize_rows(const float *x, int64_t r0, int64_t r1, int64_t K,
                                 const QRows *qx) {
    for (int64_t r = r0; r < r1; r++) quantize_units(x, r, 0, qrows_units(K), K, qx);
}

/* The sum of each lane's four byte products a x s (s signed; a signed or not): the
 * plain build's loop. */
static inline vi dot_bytes(vi a, vi s, const int a_signed) {
    vi sum = {0};
    for (int i = 0; i < VW; i++)
        for (int j = 0; j < 4; j++) {
            const uint8_t byte = (uint8_t)((uint32_t)a[i] >> (8 * j));
            sum[i] += (a_signed ? (int32_t)(int8_t)byte : (int32_t)byte) *
                      (int32_t)(int8_t)((uint32_t)s[i] >> (8 * j));
        }
    return sum;
}

/* acc + for each lane, its four byte products u (unsigned) x s (signed) summed, times
 * `by` (the same int16 in both halves of each lane): vpmaddwd's widening multiplies
 * vpmaddubsw's pairs by it (vpdpwssd, the same sum, with VNNI). u0, u1 two tiles of
 * nibbles (u1 may be 0): where the products come in int16 pairs, the two are added
 * there first (each pair at most 2 * 15 * 127, their sum 7620) and widened once. */
static inline vi dot2_u8s8(vi acc, vi u0, vi s0, vi u1, vi s1, vi by, const int two) {
#if VW == 16
    __m512i p = _mm512_maddubs_epi16((__m512i)u0, (__m512i)s0);
    if (two) p = _mm512_add_epi16(p, _mm512_maddubs_epi16((__m512i)u1, (__m512i)s1));
#if defined(__AVX512VNNI__)
    return (vi)_mm512_dpwssd_epi32((__m512i)acc, p, (__m512i)by);
#else
    return acc + (vi)_mm512_madd_epi16(p, (__m512i)by);
#endif
#elif VW == 8 && defined(__AVX2__)
    __m256i p = _mm256_maddubs_epi16((__m256i)u0, (__m256i)s0);
    if (two) p = _mm256_add_epi16(p, _mm256_maddubs_epi16((__m256i)u1, (__m256i)s1));
    return acc + (vi)_mm256_madd_epi16(p, (__m256i)by);
#else
    vi sum = dot_bytes(u0, s0, 0);
    if (two) sum += dot_bytes(u1, s1, 0);
    return acc + sum * (by & 0xffff);
#endif
}

/* acc + the byte products w (signed) x s (signed), summed by four, times `by`: |w|
 * times s with w's sign. */
static inline vi dot_s8s8(vi acc, vi w, vi s, vi by) {
#if VW == 16
    const __mmask64 neg = _mm512_movepi8_mask((__m512i)w);
    const __m512i signed_s = _mm512_mask_sub_epi8((__m512i)s, neg, _mm512_setzero_si512(), (__m512i)s);
    return dot2_u8s8(acc, (vi)_mm512_abs_epi8((__m512i)w), (vi)signed_s, acc, acc, by, 0);
#elif VW == 8 && defined(__AVX2__)
    return dot2_u8s8(acc, (vi)_mm256_sign_epi8((__m256i)w, (__m256i)w),
                     (vi)_mm256_sign_epi8((__m256i)s, (__m256i)w), acc, acc, by, 0);
#else
    return acc + dot_bytes(w, s, 1) * (by & 0xffff);
#endif
}

#if !DOT_SUBSCALED
/* VNNI, nibbles: acc + for each lane, the sum of its four byte products u (unsigned) x
 * s (signed), of both tiles (u1 may be 0); `by` unused (d scales the sums instead). */
static inline vi dot2_u8s8_vnni(vi acc, vi u0, vi s0, vi u1, vi s1, vi by, const int two) {
    (void)by;
    acc = (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)u0, (__m512i)s0);
    return two ? (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)u1, (__m512i)s1) : acc;
}
#endif

typedef int32_t vi_unaligned __attribute__((vector_size(VW * 4), aligned(1)));

static inline vi vi_load(const uint8_t *p) { return *(const vi_unaligned *)p; }
static inline vi vi_splat4(const int8_t *p) {  /* four bytes into every lane */
    int32_t v;
    memcpy(&v, p, 4);
    return (vi){0} + v;
}

/* isum[i][j] += the products of x's block xb (row g + i) and the weights' tile there
 * (the same k: a block is a tile; column vector j of the pair at r), summed by four,
 * times BY (an expression of i) where the loop sums them times a sub-scale; NIBBLES:
 * the dot for tiles of nibbles. Both pair_rows_dots expand it: a macro, so that each
 * build's loop compiles exactly as if written out (a helper taking the sums as arrays
 * kept them in memory, 1.5x slower). */
#define TILE_TIMES(BY, NIBBLES)                                                           \
    _Pragma("GCC unroll 8")                                                               \
    for (int j = 0; j < PAIR_VECS; j++) {                                                 \
        const int64_t col = j * VW, panel = col / PANEL, c0 = col % PANEL;                \
        const vi v = vi_load(r + panel * rec + hdr + xb * DOT_TILE + c0 * 4);             \
        const vi lo = v & low, hi = (v >> 4) & low;                                       \
        _Pragma("GCC unroll 4")                                                           \
        for (int i = 0; i < R; i++) {                                                     \
            const int8_t *xq = qx->q + (g + i) * K + b * bk + xb * XB;                    \
            if (bits == 4)                                                                \
                isum[i][j] = NIBBLES(isum[i][j], lo, vi_splat4(xq), hi, vi_splat4(xq + 4), \
                                     BY, 1);                                              \
            else                                                                          \
                isum[i][j] = dot_s8s8(isum[i][j], v, vi_splat4(xq), BY);                  \
        }                                                                                 \
    }

/* acc[i][j] (row i of R, column vector j of the pair) += rows [g, g + R) of qx times
 * the pair's weight (dots layout), over all its blocks: the products summed times
 * their x block's sub-scale over a block of the weights, converted once. Every build,
 * but the VNNI build's nibbles (pair_rows_dots_vnni). Two loops, one per way of
 * scaling: written as one, either build's code came out 3-15% slower. */
static inline __attribute__((always_inline)) void pair_rows_dots(
    const QRows *qx, int64_t g, int64_t K, const QPanels *w, const uint8_t *pair,
    vf acc[DOT_ROWS][PAIR_VECS], const int bits, const int offsets, const int sb, const int R) {
    const int64_t bk = w->bk, nb = K / bk, hdr = q_header_bytes(offsets, sb);
    const int64_t rec = hdr + bk * PANEL * bits / 8, XB = tile_k(bits);
    const int64_t xn = K / XB, un = qrows_units(K);
    const vi low = (vi)SPLAT(0x0f0f0f0f);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *r = pair + b * 2 * rec;
        for (int64_t l = 0; l < 2 * rec; l += 64) PREFETCH_L1(r + Q_PREFETCH_RECORDS * 2 * rec + l);
        for (int64_t l = 0; l < 2 * rec; l += 64) PREFETCH_L2(r + PREFETCH_L2_BYTES + l);
        vi isum[DOT_ROWS][PAIR_VECS];  /* over the block: each product times its x block's s */
        float sum[DOT_ROWS];
        for (int i = 0; i < R; i++) {
            sum[i] = 0.0f;
            for (int j = 0; j < PAIR_VECS; j++) isum[i][j] = (vi){0};
        }
        for (int64_t xb = 0; xb < bk / XB; xb++) {
            const int64_t at = (b * bk) / XB + xb;
            vi by[DOT_ROWS];
            for (int i = 0; i < R; i++) by[i] = (vi){0} + qx->s[(g + i) * xn + at];
            TILE_TIMES(by[i], dot2_u8s8)
#pragma GCC unroll 4
            for (int i = 0; i < R; i++) {
                sum[i] += qx->sum[(g + i) * xn + at];
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            const vf u = vset1(qx->u[(g + i) * un + b * bk / X_UNIT]);
#pragma GCC unroll 8
            for (int j = 0; j < PAIR_VECS; j++) {
                const uint8_t *h = r + (j * VW / PANEL) * rec + (j * VW % PANEL) * sb;
                acc[i][j] = vfma(__builtin_convertvector(isum[i][j], vf), vscale_load(h, sb) * u, acc[i][j]);
                if (offsets) acc[i][j] = vfma(vset1(sum[i]), vscale_load(h + PANEL * sb, sb), acc[i][j]);
            }
        }
    }
}

#if !DOT_SUBSCALED
/* pair_rows_dots for nibbles on VNNI: vpdpbusd sums both tiles of an x block into 32
 * bits directly, converted and scaled by d per block of x. */
static inline __attribute__((always_inline)) void pair_rows_dots_vnni(
    const QRows *qx, int64_t g, int64_t K, const QPanels *w, const uint8_t *pair,
    vf acc[DOT_ROWS][PAIR_VECS], const int bits, const int offsets, const int sb, const int R) {
    const int64_t bk = w->bk, nb = K / bk, hdr = q_header_bytes(offsets, sb);
    const int64_t rec = hdr + bk * PANEL * bits / 8, XB = tile_k(bits), xn = K / XB;
    const vi low = (vi)SPLAT(0x0f0f0f0f);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *r = pair + b * 2 * rec;
        for (int64_t l = 0; l < 2 * rec; l += 64) PREFETCH_L1(r + Q_PREFETCH_RECORDS * 2 * rec + l);
        for (int64_t l = 0; l < 2 * rec; l += 64) PREFETCH_L2(r + PREFETCH_L2_BYTES + l);
        vf scaled[DOT_ROWS][PAIR_VECS];  /* sum over x's blocks of d * (q_x . q_w) */
        float sum[DOT_ROWS];
        for (int i = 0; i < R; i++) {
            sum[i] = 0.0f;
            for (int j = 0; j < PAIR_VECS; j++) scaled[i][j] = vzero();
        }
        for (int64_t xb = 0; xb < bk / XB; xb++) {
            const int64_t at = (b * bk) / XB + xb;
            vi isum[DOT_ROWS][PAIR_VECS];
            for (int i = 0; i < R; i++)
                for (int j = 0; j < PAIR_VECS; j++) isum[i][j] = (vi){0};
            TILE_TIMES(low, dot2_u8s8_vnni)  /* no multiplier: d scales the sums */
#pragma GCC unroll 4
            for (int i = 0; i < R; i++) {
                const vf d = vset1(qx->d[(g + i) * xn + at]);
                sum[i] += qx->sum[(g + i) * xn + at];
#pragma GCC unroll 8
                for (int j = 0; j < PAIR_VECS; j++)
                    scaled[i][j] = vfma(__builtin_convertvector(isum[i][j], vf), d, scaled[i][j]);
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < R; i++)
#pragma GCC unroll 8
            for (int j = 0; j < PAIR_VECS; j++) {
                const uint8_t *h = r + (j * VW / PANEL) * rec + (j * VW % PANEL) * sb;
                acc[i][j] = vfma(scaled[i][j], vscale_load(h, sb), acc[i][j]);
                if (offsets) acc[i][j] = vfma(vset1(sum[i]), vscale_load(h + PANEL * sb, sb), acc[i][j]);
            }
    }
}
#define PAIR_ROWS_NIBBLES pair_rows_dots_vnni
#else
#define PAIR_ROWS_NIBBLES pair_rows_dots
#endif
#undef TILE_TIMES

/* pair_rows_dots for this weight's format (each a loop of its own). */
static inline __attribute__((always_inline)) void pair_rows_dots_any(
    const QRows *qx, int64_t g, int64_t K, const QPanels *w, const uint8_t *pair,
    vf acc[DOT_ROWS][PAIR_VECS], const int R) {
    if (w->scale_bytes == 4) {
        if (w->bits == 4 && w->offsets) PAIR_ROWS_NIBBLES(qx, g, K, w, pair, acc, 4, 1, 4, R);
        else if (w->bits == 4) PAIR_ROWS_NIBBLES(qx, g, K, w, pair, acc, 4, 0, 4, R);
        else if (w->offsets) pair_rows_dots(qx, g, K, w, pair, acc, 8, 1, 4, R);
        else pair_rows_dots(qx, g, K, w, pair, acc, 8, 0, 4, R);
    } else if (w->bits == 4 && w->offsets) {
        PAIR_ROWS_NIBBLES(qx, g, K, w, pair, acc, 4, 1, 2, R);
    } else if (w->bits == 4) {
        PAIR_ROWS_NIBBLES(qx, g, K, w, pair, acc, 4, 0, 2, R);
    } else if (w->offsets) {
        pair_rows_dots(qx, g, K, w, pair, acc, 8, 1, 2, R);
    } else {
        pair_rows_dots(qx, g, K, w, pair, acc, 8, 0, 2, R);
    }
}
#undef PAIR_ROWS_NIBBLES

/* Rows [0, M) of qx times panel pairs [p0, p1) of w (dots layout) -> out (row stride
 * ldo) + bias; add_to: out += that. qx holds rows up to a multiple of DOT_ROWS (a
 * padding row is read, its results dropped); per pair, groups of DOT_ROWS rows (1 or
 * 2 when that is all), the pair's records read from memory by the first group and
 * from L1 by the others. */
static inline void matmul_pairs_dots(const QRows *qx, int64_t M, int64_t K, const QPanels *w,
                                     int64_t N, const float *bias, float *out, int64_t ldo,
                                     int add_to, int64_t p0, int64_t p1) {
    const int64_t pair_bytes = (K / w->bk) * 2 * q_record_bytes(w);
    for (int64_t p = p0; p < p1; p++) {
        const uint8_t *pair = w->records + p * pair_bytes;
        for (int64_t g = 0; g < M; g += DOT_ROWS) {
            const int64_t rows = M - g < DOT_ROWS ? M - g : DOT_ROWS;
            vf acc[DOT_ROWS][PAIR_VECS];
            for (int i = 0; i < DOT_ROWS; i++)
                for (int j = 0; j < PAIR_VECS; j++) acc[i][j] = vzero();
            if (rows == 1) pair_rows_dots_any(qx, g, K, w, pair, acc, 1);
#if DOT_ROWS >= 3
            else if (rows == 2) pair_rows_dots_any(qx, g, K, w, pair, acc, 2);
#endif
            else pair_rows_dots_any(qx, g, K, w, pair, acc, DOT_ROWS);
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

/* Where panel row k's value of column col starts in a record's values: its byte, and
 * the shift to its nibble (bits 4). dots: the dot-product layout above. */
static inline int64_t q_value_at(int64_t k, int64_t col, int64_t bits, int64_t dots, int *shift) {
    *shift = 0;
    if (dots) {
        if (bits == 4) *shift = k % 8 >= 4 ? 4 : 0;
        return k / tile_k(bits) * DOT_TILE + col * 4 + k % 4;
    }
    if (bits == 4) {
        *shift = k % 2 ? 4 : 0;
        return k / 2 * PANEL + col;
    }
    return (k * PANEL + col) * q_column_bytes(bits);
}

/* Column id of quantized panels [K values] as the row out: an embedding lookup in a tied
 * LM head's records. Each value is scale * q, then + offset, rounded after each
 * (volatile: no FMA), as numpy and QuantRows.dequantize compute them, so the row equals
 * the dequantized weight's bit for bit. */
static void q_column(const QPanels *w, int64_t dots, int64_t K, int64_t id, float *out) {
    const int64_t bk = w->bk, bits = w->bits, sb = w->scale_bytes;
    const int64_t rec = q_record_bytes(w), hdr = q_header_bytes(w->offsets, sb);
    const int64_t pair = id / PAIR_COLS, panel = id % PAIR_COLS / PANEL, col = id % PANEL;
    const int64_t blocks = K / bk;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *r = w->records + ((pair * blocks + b) * 2 + panel) * rec;
        float scale, offset = 0.0f;
        if (sb == 4) {
            memcpy(&scale, r + col * 4, 4);
            if (w->offsets) memcpy(&offset, r + (PANEL + col) * 4, 4);
        } else {
            uint16_t h;
            memcpy(&h, r + col * 2, 2);
            scale = half_to_float(h);
            if (w->offsets) {
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
            out[b * bk + k] = w->offsets ? scaled + offset : scaled;
        }
    }
}

#endif
