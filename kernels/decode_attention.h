/* Attention of the decode step (decode_step.c): a row's keys and values, a group of
 * rows that share them, the split of long rows into parts and the merge of the parts. */
#ifndef PDSERVE_DECODE_ATTENTION_H
#define PDSERVE_DECODE_ATTENTION_H
#include <math.h>
#include <stdint.h>

#include "simd.h"

/* Where a row's keys and values live: runs of consecutive store rows (each row holds
 * one position, every kv head side by side). A paged layer's runs are the row's blocks
 * (positions [0, len)); a sliding-window layer's are at most two stretches of its ring
 * (positions [len - window, len), wrapping at the ring's end). */
typedef struct {
    int64_t start, count;
} Run;

typedef struct {
    const void *k, *v;  /* fp32, or fp16 in a 16-bit cache (attend's `half`) */
    const Run *runs;
    int64_t nruns, hk;
} RowKV;

/* The VW keys or values at element `at` of a store: fp32, or fp16 widened. */
static inline __attribute__((always_inline)) vf kv_load(const void *store, int64_t at,
                                                        const int half) {
    return half ? vload_half((const uint16_t *)store + at) : vload((const float *)store + at);
}

/* The rows of a group (GroupRows: m rows, at most GROUP_ROWS, of one sequence at
 * consecutive positions, so that each attends to a prefix of the same positions; most
 * often one row) against their positions: row i's query heads of kv heads [j0, j1)
 * (q[i]: hq x D; head h uses kv head h / g) against its first len[i] positions: scores
 * scaled, softmax, weighted sum of values -> out[i] (hq x D). With ml[i], a part of the row's
 * positions: the sum is left unnormalised and each head's score maximum and exp-sum go
 * to ml[i][2h], ml[i][2h + 1] (merge_parts combines the parts). Positions are read
 * whole (every kv head: contiguous memory), except where a step of a few rows of one
 * part would leave threads idle: there a task takes a kv head (j1 = j0 + 1), so that
 * one row's attention runs on every thread (one row at 150 positions: the other
 * thread's wait 0.44 -> 0.09 ms a step, the step 4.80 -> 4.41 ms). A kv head a task
 * reads 2 of every 6 lines of a position (SmolLM2): split so beyond one part, the
 * one-row step at 1,024 positions took 8.5 ms against 7.9 whole at one thread, 5.8
 * against 5.0 at two. Keys are read once for the group
 * (a speculative step's drafted rows read the sequence's keys once, not once each);
 * values are prefetched into L2 during the key pass for the value pass, which reads each
 * kv head's values once for several of its query heads (value_heads). A
 * row's arithmetic is the same, in the same order, whatever its group. dc = D / VW and
 * half (a 16-bit cache: half the bytes to read) are constants at each call site, so
 * that the loops over a head unroll into registers and no load branches. */
#define MAX_HEAD_VECS (256 / VW)
#define GROUP_ROWS 8

typedef struct {
    int64_t m;
    const float *q[GROUP_ROWS];
    int64_t len[GROUP_ROWS];
    float *out[GROUP_ROWS], *ml[GROUP_ROWS];
} GroupRows;

/* out[h] (D floats) for query heads [h0, h0 + hb) of kv head j: their probabilities
 * (s + h * len, len each) times the row's first len values, each value loaded once. */
static inline __attribute__((always_inline)) void value_heads(
    RowKV kv, const float *s, int64_t len, int64_t j, int64_t h0, const int hb,
    const int dc, const int half, float *out) {
    const int64_t D = dc * VW, rs = kv.hk * D;
    vf acc[4][MAX_HEAD_VECS];
#pragma GCC unroll 4
    for (int b = 0; b < hb; b++)
#pragma GCC unroll 16
        for (int c = 0; c < dc; c++) acc[b][c] = vzero();
    for (int64_t u = 0, t = 0; u < kv.nruns && t < len; u++) {
        const int64_t v0 = kv.runs[u].start * rs + j * D;
        for (int64_t i = 0; i < kv.runs[u].count && t < len; i++, t++) {
#pragma GCC unroll 16
            for (int c = 0; c < dc; c++) {
                const vf v = kv_load(kv.v, v0 + i * rs + c * VW, half);
#pragma GCC unroll 4
                for (int b = 0; b < hb; b++)
                    acc[b][c] = vfma(vset1(s[(h0 + b) * len + t]), v, acc[b][c]);
            }
        }
    }
#pragma GCC unroll 4
    for (int b = 0; b < hb; b++)
#pragma GCC unroll 16
        for (int c = 0; c < dc; c++) vstore(out + (h0 + b) * D + c * VW, acc[b][c]);
}

static inline __attribute__((always_inline)) void attend(
    const GroupRows *rows, RowKV kv, int64_t hq, int64_t g, int64_t j0, int64_t j1,
    const int dc, const int half, float scale, float *scores) {
    const int64_t D = dc * VW, rs = kv.hk * D, m = rows->m, es = half ? 2 : 4;
    const int64_t line0 = j0 * D * es / 64, line1 = (j1 * D * es + 63) / 64;  /* heads' lines */
    const char *kb = (const char *)kv.k, *vb = (const char *)kv.v;
    int64_t longest = 0;
    for (int64_t i = 0; i < m; i++) longest = rows->len[i] > longest ? rows->len[i] : longest;
    for (int64_t u = 0, t = 0; u < kv.nruns; u++) {
        const int64_t k0 = kv.runs[u].start * rs, count = kv.runs[u].count;
        for (int64_t i = 0; i < count; i++, t++) {
            if (i + 4 < count)
                for (int64_t c = line0; c < line1; c++)
                    PREFETCH_L1(kb + (k0 + (i + 4) * rs) * es + c * 64);
            for (int64_t c = line0; c < line1; c++) PREFETCH_L2(vb + (k0 + i * rs) * es + c * 64);
            for (int64_t j = j0; j < j1; j++) {
                vf kr[MAX_HEAD_VECS];
#pragma GCC unroll 16
                for (int c = 0; c < dc; c++) kr[c] = kv_load(kv.k, k0 + i * rs + j * D + c * VW, half);
                for (int64_t r = 0; r < m; r++) {
                    if (t >= rows->len[r]) continue;
                    const float *q = rows->q[r];
                    float *s = scores + r * hq * longest;
                    for (int64_t h = j * g; h < (j + 1) * g; h++) {
                        vf acc = vzero();
#pragma GCC unroll 16
                        for (int c = 0; c < dc; c++) acc = vfma(vload(q + h * D + c * VW), kr[c], acc);
                        s[h * rows->len[r] + t] = vsum(acc) * scale;
                    }
                }
            }
        }
    }
    for (int64_t r = 0; r < m; r++) {
        const int64_t len = rows->len[r];
        float *out = rows->out[r], *ml = rows->ml[r];
        for (int64_t h = j0 * g; h < j1 * g; h++) {
            float *s = scores + r * hq * longest + h * len;
            vf mv = vset1(-INFINITY);
            for (int64_t t = 0; t < len; t += VW)
                mv = vmax(vfirst_n(vload_n(s + t, len - t), len - t, -INFINITY), mv);
            const float mx = vmax_lanes(mv);
            vf sum = vzero();
            for (int64_t t = 0; t < len; t += VW) {
                vf e = vfirst_n(vexp(vload_n(s + t, len - t) - mx), len - t, 0.0f);
                vstore_n(s + t, e, len - t);
                sum += e;
            }
            const float total = vsum(sum);
            if (ml) {
                ml[2 * h] = mx;
                ml[2 * h + 1] = total;
            } else {
                for (int64_t t = 0; t < len; t += VW)
                    vstore_n(s + t, vload_n(s + t, len - t) / total, len - t);
            }
        }
        /* each kv head's values read once for up to `most` of its query heads (their
         * sums in registers): the same sums, in the same order, as head by head */
        const int most = dc >= 16 ? 1 : dc >= 8 ? 2 : 4;
        const float *s = scores + r * hq * longest;
        for (int64_t j = j0; j < j1; j++)
            for (int64_t h = j * g; h < (j + 1) * g; h += most) {
                const int64_t left = (j + 1) * g - h;
                switch (left < most ? left : most) {
                case 1: value_heads(kv, s, len, j, h, 1, dc, half, out); break;
                case 2: value_heads(kv, s, len, j, h, 2, dc, half, out); break;
                case 3: value_heads(kv, s, len, j, h, 3, dc, half, out); break;
                default: value_heads(kv, s, len, j, h, 4, dc, half, out); break;
                }
            }
    }
}

static void attend_any(const GroupRows *rows, RowKV kv, int64_t hq, int64_t g, int64_t j0,
                       int64_t j1, int64_t D, int half, float scale, float *scores) {
    switch (D * 2 + !!half) {
    case 128: attend(rows, kv, hq, g, j0, j1, 64 / VW, 0, scale, scores); break;
    case 129: attend(rows, kv, hq, g, j0, j1, 64 / VW, 1, scale, scores); break;
    case 256: attend(rows, kv, hq, g, j0, j1, 128 / VW, 0, scale, scores); break;
    case 257: attend(rows, kv, hq, g, j0, j1, 128 / VW, 1, scale, scores); break;
    default:
        if (half) attend(rows, kv, hq, g, j0, j1, (int)(D / VW), 1, scale, scores);
        else attend(rows, kv, hq, g, j0, j1, (int)(D / VW), 0, scale, scores);
        break;
    }
}

/* A step of at most SPLIT_ROWS rows (a single stream, a few, or one with a draft) cuts
 * each row's positions into parts of SPLIT_LEN, attended by whichever thread takes
 * them, then merged: one row's attention no longer runs on one thread while the others
 * wait (at 2000 positions it reads as many bytes as the weights). The cut depends only
 * on the row's length, so results do not depend on the thread count; a row of at most
 * SPLIT_LEN positions is one part, computed as before. 128, not 256: a one-row step of
 * the real model at 129-256 positions then splits into 2 parts x 3 kv heads, 3 tasks a
 * thread instead of 2 and 1 (its attention phase ~0.39 -> ~0.29 ms a step). */
#define SPLIT_ROWS 4
#define SPLIT_LEN 128

/* The first position row r attends to: 0, or in a sliding-window layer its window's. */
static inline int64_t attended_from(const int64_t *pos, int64_t r, int64_t window) {
    return window && pos[r] + 1 > window ? pos[r] + 1 - window : 0;
}

static int64_t split_parts(int64_t len, int split) {
    return split ? (len + SPLIT_LEN - 1) / SPLIT_LEN : 1;
}

/* How many parts row r's attended positions are cut into. */
static inline int64_t row_parts(const int64_t *pos, int64_t r, int64_t window, int split) {
    return split_parts(pos[r] + 1 - attended_from(pos, r, window), split);
}

/* A part's unnormalised sums (hq x D), then its maxima and exp-sums (hq x 2). */
static int64_t part_floats(const int64_t *dims) {
    return dims[D_Q_HEADS] * (dims[D_HEAD_DIM] + 2);
}

/* The K/V rows of logical positions [a, b) as runs: paged, the table's blocks; a ring
 * (base: the row's ring), the stretch from a % R, wrapping once. Returns the count. */
static int64_t position_runs(const int64_t *table, int64_t bs, int64_t window, int64_t base,
                             int64_t R, int64_t a, int64_t b, Run *runs) {
    int64_t n = 0;
    if (!window) {
        for (int64_t p = a; p < b;) {
            const int64_t left = bs - p % bs, count = b - p < left ? b - p : left;
            runs[n++] = (Run){table[p / bs] * bs + p % bs, count};
            p += count;
        }
    } else {
        const int64_t at = a % R, len = b - a;
        runs[n++] = (Run){base + at, len < R - at ? len : R - at};
        if (len > R - at) runs[n++] = (Run){base, len - (R - at)};
    }
    return n;
}

/* The parts' sums of one row, rescaled to their common maximum -> out (hq x D). */
static void merge_parts(const float *parts, int64_t count, int64_t hq, int64_t D,
                        int64_t stride, float *out) {
    for (int64_t h = 0; h < hq; h++) {
        float m = -INFINITY, total = 0.0f;
        for (int64_t i = 0; i < count; i++) {
            const float mi = parts[i * stride + hq * D + 2 * h];
            m = mi > m ? mi : m;
        }
        for (int64_t c = 0; c < D; c += VW) vstore(out + h * D + c, vzero());
        for (int64_t i = 0; i < count; i++) {
            const float *part = parts + i * stride;
            const float w = expf(part[hq * D + 2 * h] - m);
            total += w * part[hq * D + 2 * h + 1];
            for (int64_t c = 0; c < D; c += VW)
                vstore(out + h * D + c, vfma(vset1(w), vload(part + h * D + c), vload(out + h * D + c)));
        }
        for (int64_t c = 0; c < D; c += VW) vstore(out + h * D + c, vload(out + h * D + c) / total);
    }
}


#endif
