/* A whole decode step of a Llama-family model on the CPU in one call: every layer's
 * norms, matmuls (skinny_block.h on column panels), rope, KV writes, attention over the
 * paged KV cache, SiLU MLP and residuals, the final norm and optionally the LM
 * head. See decode_step.py for why, the layouts and the limits. One OpenMP region for
 * the step; phases meet at a spinning barrier (an OpenMP barrier sleeps under
 * OMP_WAIT_POLICY=PASSIVE and costs a wake-up per phase). Written once in simd.h's
 * vectors, built for AVX-512, AVX2 or neither (cbuild.py). */
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "argmax_row.h"
#include "dot_block.h"

enum { D_ROWS, D_HIDDEN, D_Q_HEADS, D_KV_HEADS, D_HEAD_DIM, D_INTER, D_LAYERS, D_BLOCK_SIZE,
       D_NUM_BLOCKS, D_TABLE_WIDTH, D_MAX_LEN, D_RING_LEN, D_STATE_SLOTS, D_KV_HALF, D_VOCAB,
       D_COUNT };
/* Per layer: weights, then its K/V store: paged blocks [NUM_BLOCKS, BLOCK_SIZE, Hk, D]
 * when P_WINDOW is 0, else the sliding-window rings [STATE_SLOTS * RING_LEN, Hk, D];
 * fp32, or fp16 where dims[D_KV_HALF] (a 16-bit cache). */
enum { P_LN, P_QKV, P_QKV_B, P_O, P_O_B, P_LN2, P_GATE_UP, P_GATE_UP_B, P_DOWN, P_DOWN_B,
       P_Q_NORM, P_K_NORM, P_K_STORE, P_V_STORE, P_WINDOW, P_COUNT };

enum { PH_NORM, PH_QKV, PH_ATTENTION, PH_O, PH_POST_NORM, PH_GATE_UP, PH_SILU_MUL, PH_DOWN,
       PH_LM_HEAD, PH_GREEDY, PH_COUNT };

#define SPINS_BEFORE_YIELD 2000 /* ~0.1 ms of pause instructions */

typedef struct {
    int count, phase;
} Barrier;

static void barrier_wait(Barrier *b, int threads) {
    if (threads == 1) return;
    int phase = __atomic_load_n(&b->phase, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&b->count, 1, __ATOMIC_ACQ_REL) == threads) {
        __atomic_store_n(&b->count, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->phase, phase + 1, __ATOMIC_RELEASE);
        return;
    }
    /* Yield after a while: on a loaded machine the peer may be descheduled. */
    for (int spins = 0; __atomic_load_n(&b->phase, __ATOMIC_ACQUIRE) == phase; spins++)
        if (spins < SPINS_BEFORE_YIELD) cpu_pause(); else sched_yield();
}

static inline double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

/* The end of a phase: wait for every thread. With a times buffer, thread 0 adds the
 * phase's work (ns) to times[phase] and its wait at the barrier to times[PH_COUNT + phase]. */
static void end_phase(Barrier *b, int t, int threads, double *times, int phase, double *mark) {
    if (times && t == 0) {
        double x = now_ns();
        times[phase] += x - *mark;
        *mark = x;
    }
    barrier_wait(b, threads);
    if (times && t == 0) {
        double x = now_ns();
        times[PH_COUNT + phase] += x - *mark;
        *mark = x;
    }
}

/* out = x * rsqrt(mean(x^2) + eps) * w over H floats (H % 16 == 0). */
static void rms_norm_row(const float *x, const float *w, int64_t H, float eps, float *out) {
    vf s = vzero();
    for (int64_t k = 0; k < H; k += VW) {
        vf v = vload(x + k);
        s = vfma(v, v, s);
    }
    float r = 1.0f / sqrtf(vsum(s) / (float)H + eps);
    for (int64_t k = 0; k < H; k += VW) vstore(out + k, vload(x + k) * r * vload(w + k));
}

/* A matmul's weight (decode_step.py's _descriptor): fp32 column panels, or quantized
 * ones (skinny_block.h's QPanels: records, bk, bits, offsets, scale_bytes), multiplied
 * by fp32 rows, or in the dots layout by int8 rows (dot_block.h). */
enum { W_FP32 = 0, W_QUANT = 1, W_DOTS = 2 };
typedef struct {
    int64_t format;
    const void *values;
    int64_t bk, bits, offsets, scale_bytes;
} Weight;

/* Work counters: one per thread per work item, each on its own cache line. */
#define COUNTER_STRIDE 8

/* Thread t first takes the panel pairs of its own contiguous share, in order, a chunk
 * at a time from its own counter (a line no other core touches until t is done), so
 * its weights stream as one sequential read; then it helps the others, taking chunks
 * from their counters, so one slowed by its neighbours on the memory bus does not hold
 * the rest at the barrier. (One shared counter handed out interleaved pairs: every
 * take moved its line between the cores, and each thread's stream jumped.) Each
 * output column is still computed whole by one thread, in the same order: results do
 * not depend on who took which chunk. A W_DOTS weight multiplies x's rows quantized:
 * `ready` (quantized by the threads that made the rows, quantize_made), or else
 * quantized first by each thread into its own `qmem` (a few rows: cheaper than a
 * barrier). */
static void matmul(int64_t *item, int t, int nt, const float *x, int64_t M, int64_t K,
                   const Weight *w, int64_t N, const float *bias, float *out, int add_to,
                   void *qmem, void *ready) {
    const int64_t pairs = (N + PAIR_COLS - 1) / PAIR_COLS;
    const QPanels q = {(const uint8_t *)w->values, w->bk, w->bits, w->offsets, w->scale_bytes};
    QRows qx = {0};
    if (w->format == W_DOTS) {
        qx = qrows_at(ready ? ready : qmem, padded_rows(M), K, tile_k(w->bits));
        if (!ready) quantize_rows(x, 0, M, K, &qx);
    }
    for (int v = 0; v < nt; v++) {
        const int u = (t + v) % nt;
        const int64_t lo = pairs * u / nt, hi = pairs * (u + 1) / nt;
        const int64_t chunk = (hi - lo) / 8 > 1 ? (hi - lo) / 8 : 1;
        for (;;) {
            const int64_t p0 = lo + __atomic_fetch_add(item + u * COUNTER_STRIDE, chunk,
                                                       __ATOMIC_RELAXED);
            if (p0 >= hi) break;
            const int64_t p1 = p0 + chunk < hi ? p0 + chunk : hi;
            if (w->format == W_DOTS)
                matmul_pairs_dots(&qx, M, K, &q, N, bias, out, N, add_to, p0, p1);
            else
                matmul_pairs(x, M, K, (const float *)w->values, w->format == W_QUANT ? &q : NULL,
                             N, bias, out, N, add_to, p0, p1);
        }
    }
}

/* D floats to a K/V store's row: fp32, or rounded to fp16 (`half`). */
static inline void store_kv(void *store, int64_t at, const float *x, int64_t D, int half) {
    if (!half) {
        memcpy((float *)store + at, x, D * sizeof(float));
        return;
    }
    for (int64_t c = 0; c < D; c += VW) vstore_half((uint16_t *)store + at + c, vload(x + c));
}

/* x * cos + rotate(x) * sin with sin's first half negated (RopeTable's signed sin). */
static inline void rope(const float *x, const float *cos, const float *sin, int64_t D,
                        float *out) {
    int64_t half = D / 2;
    for (int64_t c = 0; c < half; c += VW) {
        vf a = vload(x + c), b = vload(x + half + c);
        vstore(out + c, a * vload(cos + c) + b * vload(sin + c));
        vstore(out + half + c, b * vload(cos + half + c) + a * vload(sin + half + c));
    }
}

#include "decode_attention.h"

/* The rows this thread made (r = t, t + nt, ...) of x (row stride K), quantized into
 * `shared` for w when it multiplies int8 rows: each row once, by the thread that just
 * wrote it (while it is in L1), rather than every row by every thread in matmul.
 * Returns what matmul's `ready` takes: `shared`, or NULL for other weights. */
static void *quantize_made(const Weight *w, const float *x, int64_t n, int64_t K, int t, int nt,
                           void *shared) {
    if (!w || w->format != W_DOTS) return NULL;
    const QRows q = qrows_at(shared, padded_rows(n), K, tile_k(w->bits));
    for (int64_t r = t; r < n; r += nt) quantize_rows(x, r, r + 1, K, &q);
    return shared;
}

/* act = SiLU(gate) * up for the rows of gu [n, 2I] (gate's I columns, then up's), and
 * act quantized into `shared` for w when it multiplies int8 rows (returns what matmul's
 * `ready` takes, as quantize_made). Rows by thread; with fewer rows than threads, each
 * row's X_UNIT units split among them (a one-row step: otherwise one thread works and
 * the other waits). Elementwise, quantized per unit: the same values either way. */
static void *silu_mul(const float *gu, float *act, int64_t n, int64_t I, const Weight *w, int t,
                      int nt, void *shared) {
    const int split = n < nt, dots = w->format == W_DOTS;
    const int64_t units = qrows_units(I);
    const QRows q = qrows_at(shared, padded_rows(n), I, tile_k(w->bits));
    for (int64_t r = split ? 0 : t; r < n; r += split ? 1 : nt) {
        const int64_t u0 = split ? units * t / nt : 0, u1 = split ? units * (t + 1) / nt : units;
        const int64_t c1 = u1 * X_UNIT < I ? u1 * X_UNIT : I;
        const float *gate = gu + r * 2 * I, *up = gate + I;
        float *a = act + r * I;
        for (int64_t k = u0 * X_UNIT; k < c1; k += VW) {
            vf gv = vload_n(gate + k, c1 - k);
            vstore_n(a + k, gv / (1.0f + vexp(-gv)) * vload_n(up + k, c1 - k), c1 - k);
        }
        if (dots) quantize_units(act, r, u0, u1, I, &q);
    }
    return dots ? shared : NULL;
}

/* Floats of the row buffers (x, qkv, attn, gate|up, act) for rows padded to whole
 * matmul blocks, rounded to 16 so the thread scratch after them starts on a line. */
static int64_t row_floats(const int64_t *dims) {
    int64_t n = padded_rows(dims[D_ROWS]), H = dims[D_HIDDEN], D = dims[D_HEAD_DIM];
    int64_t hq = dims[D_Q_HEADS], hk = dims[D_KV_HEADS], I = dims[D_INTER];
    return (n * (H + (hq + 2 * hk) * D + hq * D + 2 * I + I) + 15) / 16 * 16;
}

/* Floats of quantized matmul rows (dot_block.h's QRows) for the widest input: each
 * thread's, and the step's shared ones (quantize_made). */
static int64_t qrows_floats(const int64_t *dims) {
    int64_t k = dims[D_HIDDEN], attn = dims[D_Q_HEADS] * dims[D_HEAD_DIM], I = dims[D_INTER];
    k = attn > k ? attn : k;
    k = I > k ? I : k;
    return qrows_bytes(padded_rows(dims[D_ROWS]), k) / 4;
}

/* One thread's scratch: its attention runs (Run, 4 floats each: table width + 2), then
 * scores (hq x MAX_LEN) and roped queries (hq x D), then its quantized matmul rows; a
 * multiple of 16 floats (64 bytes), so every thread's block starts aligned and on its
 * own cache line. */
static int64_t thread_floats(const int64_t *dims) {
    int64_t hq = dims[D_Q_HEADS];
    int64_t f = 4 * (dims[D_TABLE_WIDTH] + 2) + hq * (GROUP_ROWS * dims[D_MAX_LEN] + dims[D_HEAD_DIM]);
    return (f + 15) / 16 * 16 + qrows_floats(dims);
}

/* Floats of the attention parts of a split step (at most SPLIT_ROWS groups), rounded to 16. */
static int64_t split_floats(const int64_t *dims) {
    const int64_t rows = dims[D_ROWS] < SPLIT_ROWS * GROUP_ROWS ? dims[D_ROWS] : SPLIT_ROWS * GROUP_ROWS;
    return (rows * split_parts(dims[D_MAX_LEN], 1) * part_floats(dims) + 15) / 16 * 16;
}

/* Cuts rows [0, n) into groups that attend together (decode_attention.h's GroupRows):
 * row r joins row r - 1's group when it writes the next position through the same
 * blocks (its table equal over row r - 1's positions), up to GROUP_ROWS rows; first[u]
 * is group u's first row, first[count] = n. Returns the count. Without paged layers
 * (tables NULL) every row is its own group. */
static int64_t group_rows(const int64_t *tables, int64_t tw, int64_t bs, const int64_t *pos,
                          int64_t n, int64_t *first) {
    int64_t count = 0;
    for (int64_t r = 0; r < n; r++) {
        const int joins = tables && r > 0 && r - first[count - 1] < GROUP_ROWS && pos[r] == pos[r - 1] + 1
            && !memcmp(tables + r * tw, tables + (r - 1) * tw, (size_t)(pos[r - 1] / bs + 1) * sizeof(int64_t));
        if (!joins) first[count++] = r;
    }
    first[count] = n;
    return count;
}

/* The rows [*r0, *last] of attention unit u: group u in a paged layer, row u in a
 * sliding-window one (its rows attend alone). */
static inline void unit_rows(int64_t u, int64_t window, const int64_t *group_first,
                             int64_t *r0, int64_t *last) {
    *r0 = window ? u : group_first[u];
    *last = window ? u : group_first[u + 1] - 1;
}

/* Floats of scratch that decode_step needs for these dims and thread count. */
int64_t decode_step_workspace(const int64_t *dims, int64_t threads) {
    return row_floats(dims) + (qrows_floats(dims) + 15) / 16 * 16 + split_floats(dims) +
           threads * thread_floats(dims);
}

/* tokens [n]: the rows' tokens, each below dims[D_VOCAB], looked up in `embedding` (its
 * format W_FP32: rows [VOCAB, H]; else quantized panels whose columns are the rows: a
 * tied LM head's) into h [n, H], the residual stream, which ends as the last layer's
 * output (before the final norm); out [n, H]: after the final norm. cos/sin [MAX_LEN,
 * D]: RopeTable's tables (sin signed), row pos[r] for row r; tables [n, TABLE_WIDTH]:
 * each row's block table (paged layers); states [n]: its state slot (ring layers); pos
 * [n]: the position each row writes (pos < MAX_LEN; it attends to [0, pos], or to its
 * last `window` positions in a sliding-window layer, whose ring row pos % RING_LEN it
 * overwrites: the position window-or-more before, which no query needs again).
 * layers: P_COUNT pointers per layer (biases may be 0; a matmul's is to its Weight).
 * lm_head: NULL, or the LM head's Weight for `vocab` outputs, whose logits [n, vocab] are
 * then written to `logits`, and with `greedy` (else NULL) each row's first largest logit's
 * index to greedy [n] (argmax_row.h: torch.argmax's answer).
 * times: NULL, or 2 * PH_COUNT doubles that thread 0's phase times are added to (see
 * end_phase). Returns 0; -1 when the work counters could not be allocated; -2 - r when
 * row r's token, position or a block id it reads is outside dims' bounds (nothing is
 * written then). */
int decode_step(const int64_t *dims, const int64_t *layers, const int64_t *tokens,
                const Weight *embedding, float *h, const float *cos, const float *sin,
                const int64_t *tables, const int64_t *states, const int64_t *pos,
                const float *norm_w, float *out, const Weight *lm_head, int64_t vocab,
                float *logits, int64_t *greedy, float *work, double eps_d, double scale_d,
                int threads, double *times) {
    const int64_t n = dims[D_ROWS], H = dims[D_HIDDEN], hq = dims[D_Q_HEADS];
    const int64_t hk = dims[D_KV_HEADS], D = dims[D_HEAD_DIM], I = dims[D_INTER];
    const int64_t L = dims[D_LAYERS], bs = dims[D_BLOCK_SIZE], tw = dims[D_TABLE_WIDTH];
    const int64_t max_len = dims[D_MAX_LEN], g = hq / hk, n8 = padded_rows(n), R = dims[D_RING_LEN];
    const int64_t W = (hq + 2 * hk) * D;
    const float eps = (float)eps_d, scale = (float)scale_d;
    const int half = (int)dims[D_KV_HALF];
    float *x = work, *qkv = x + n8 * H, *attn = qkv + n8 * W, *gu = attn + n8 * hq * D;
    float *act = gu + n8 * 2 * I, *shared_q = work + row_floats(dims);
    float *partials = shared_q + (qrows_floats(dims) + 15) / 16 * 16;
    float *thread_scratch = partials + split_floats(dims);
    const int64_t max_parts = split_parts(max_len, 1), pf = part_floats(dims);
    int paged = 0, ringed = 0;
    for (int64_t l = 0; l < L; l++) {
        if (layers[l * P_COUNT + P_WINDOW]) ringed = 1; else paged = 1;
    }
    /* A bad index would read or write outside the cache: refuse the step instead. */
    for (int64_t r = 0; r < n; r++) {
        int bad = pos[r] < 0 || pos[r] >= max_len || tokens[r] < 0 || tokens[r] >= dims[D_VOCAB];
        if (paged) bad = bad || pos[r] / bs >= tw;
        for (int64_t b = 0; paged && !bad && b <= pos[r] / bs; b++)
            bad = tables[r * tw + b] < 0 || tables[r * tw + b] >= dims[D_NUM_BLOCKS];
        if (ringed) bad = bad || states[r] < 0 || states[r] >= dims[D_STATE_SLOTS];
        if (bad) return -2 - (int)(r < 1000000 ? r : 1000000);
    }
    Barrier barrier = {0, 0};
    /* Work items: per layer, four matmuls and the two attention passes; the LM head.
     * Each has a counter per thread (the attention passes use the first). */
    const int64_t item = (int64_t)threads * COUNTER_STRIDE;
    int64_t *counters = (int64_t *)calloc((size_t)((6 * L + 1) * item + n + 1), sizeof(int64_t));
    if (!counters) return -1;
    /* Paged layers attend by groups (ring layers row by row); a step of at most
     * SPLIT_ROWS groups splits its rows' positions into parts. Both depend on the rows
     * alone: the results do not depend on the thread count. */
    int64_t *group_first = counters + (6 * L + 1) * item;
    const int64_t groups = group_rows(paged ? tables : NULL, tw, bs, pos, n, group_first);
    const int split = groups <= SPLIT_ROWS;

#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        float *mine = thread_scratch + t * thread_floats(dims);
        Run *runs = (Run *)mine;
        float *scores = mine + 4 * (tw + 2), *q = scores + GROUP_ROWS * hq * max_len;
        void *qmem = mine + thread_floats(dims) - qrows_floats(dims);
        double mark = times && t == 0 ? now_ns() : 0.0;
        for (int64_t r = t; r < n; r += nt) {
            if (embedding->format == W_FP32)
                memcpy(h + r * H, (const float *)embedding->values + tokens[r] * H, H * sizeof(float));
            else
                q_column(&(QPanels){(const uint8_t *)embedding->values, embedding->bk, embedding->bits,
                                    embedding->offsets, embedding->scale_bytes},
                         embedding->format == W_DOTS, H, tokens[r], h + r * H);
            rms_norm_row(h + r * H, (const float *)layers[P_LN], H, eps, x + r * H);
        }
        void *ready = quantize_made((const Weight *)layers[P_QKV], x, n, H, t, nt, shared_q);
        end_phase(&barrier, t, nt, times, PH_NORM, &mark);
        for (int64_t l = 0; l < L; l++) {
            const int64_t *p = layers + l * P_COUNT;
            int64_t *next = counters + 6 * l * item;
            matmul(next, t, nt, x, n, H, (const Weight *)p[P_QKV], W, (const float *)p[P_QKV_B], qkv, 0, qmem,
                   ready);
            end_phase(&barrier, t, nt, times, PH_QKV, &mark);
            void *ks = (void *)p[P_K_STORE], *vs = (void *)p[P_V_STORE];
            const int64_t window = p[P_WINDOW];
            /* Two passes, so that rows may share a block table (a speculative step's
             * positions of one sequence, each a row): first every row's K/V are written
             * and its queries roped in place, then (after the barrier) every row attends
             * to its positions, the other rows' new ones included. */
            for (int64_t r; (r = __atomic_fetch_add(next + 4 * item, 1, __ATOMIC_RELAXED)) < n;) {
                const int64_t *table = tables + r * tw;
                float *row = qkv + r * W;
                const float *c = cos + pos[r] * D, *s = sin + pos[r] * D;
                const int64_t dest = !window ? table[pos[r] / bs] * bs + pos[r] % bs
                                             : states[r] * R + pos[r] % R;
                /* Qwen3: each q and k head is RMS-normalised before the rotation. */
                const float *q_norm = (const float *)p[P_Q_NORM], *k_norm = (const float *)p[P_K_NORM];
                float normed[256];
                for (int64_t j = 0; j < hk; j++) {
                    const float *kh = row + (hq + j) * D;
                    if (k_norm) rms_norm_row(kh, k_norm, D, eps, normed);
                    rope(k_norm ? normed : kh, c, s, D, q);
                    store_kv(ks, (dest * hk + j) * D, q, D, half);
                    store_kv(vs, (dest * hk + j) * D, row + (hq + hk + j) * D, D, half);
                }
                for (int64_t i = 0; i < hq; i++) {
                    float *qh = row + i * D;
                    if (q_norm) rms_norm_row(qh, q_norm, D, eps, normed);
                    rope(q_norm ? normed : qh, c, s, D, q);
                    memcpy(qh, q, D * sizeof(float));
                }
            }
            barrier_wait(&barrier, nt);
            /* Tasks from a counter (rows attend to different lengths): a group (a row,
             * or a sequence's consecutive rows) each, or in a split step a kv head of a
             * part of a group each: positions [a, a + SPLIT_LEN) of its longest (last)
             * row, so that a few rows' work divides among the threads (one row of 2
             * parts and 3 kv heads: 3 tasks each on 2 threads, not 2 parts against 1).
             * Heads are independent: a row's results are the same either way. */
            const int64_t units = window ? n : groups;
            int64_t tasks = 0, merges = 0;
            for (int64_t r = 0; r < n; r++) merges += row_parts(pos, r, window, split) > 1;
            const int64_t heads = split && nt > 1 ? hk : 1;
            for (int64_t u = 0, r0, last; u < units; u++) {
                unit_rows(u, window, group_first, &r0, &last);
                tasks += row_parts(pos, last, window, split) * heads;
            }
            for (int64_t task; (task = __atomic_fetch_add(next + 5 * item, 1, __ATOMIC_RELAXED)) < tasks;) {
                int64_t u = 0, r0, last;
                const int64_t j0 = task % heads, j1 = heads > 1 ? j0 + 1 : hk;
                task /= heads;
                for (;; u++) {
                    unit_rows(u, window, group_first, &r0, &last);
                    const int64_t parts = row_parts(pos, last, window, split);
                    if (task < parts) break;
                    task -= parts;
                }
                const int64_t a = attended_from(pos, last, window) + task * SPLIT_LEN;
                GroupRows rows = {0};
                int64_t b_max = a;
                for (int64_t r = r0; r <= last; r++) {
                    const int64_t parts = row_parts(pos, r, window, split), end = pos[r] + 1;
                    if (task >= parts) continue;  /* its positions ended in an earlier part */
                    const int64_t b = parts > 1 && a + SPLIT_LEN < end ? a + SPLIT_LEN : end;
                    float *part = partials + (r * max_parts + task) * pf;
                    rows.q[rows.m] = qkv + r * W;
                    rows.len[rows.m] = b - a;
                    rows.out[rows.m] = parts > 1 ? part : attn + r * hq * D;
                    rows.ml[rows.m++] = parts > 1 ? part + hq * D : NULL;
                    b_max = b > b_max ? b : b_max;
                }
                const int64_t ring = window ? states[last] * R : 0;  /* paged rows have no slot */
                RowKV kv = {ks, vs, runs,
                            position_runs(tables + last * tw, bs, window, ring, R, a, b_max, runs), hk};
                attend_any(&rows, kv, hq, g, j0, j1, D, half, scale, scores);
            }
            if (merges) {
                end_phase(&barrier, t, nt, times, PH_ATTENTION, &mark);
                for (int64_t r = t; r < n; r += nt) {
                    const int64_t parts = row_parts(pos, r, window, split);
                    if (parts > 1)
                        merge_parts(partials + r * max_parts * pf, parts, hq, D, pf, attn + r * hq * D);
                }
            }
            end_phase(&barrier, t, nt, times, PH_ATTENTION, &mark);
            matmul(next + item, t, nt, attn, n, hq * D, (const Weight *)p[P_O], H, (const float *)p[P_O_B], h, 1, qmem, NULL);
            end_phase(&barrier, t, nt, times, PH_O, &mark);
            for (int64_t r = t; r < n; r += nt)
                rms_norm_row(h + r * H, (const float *)p[P_LN2], H, eps, x + r * H);
            ready = quantize_made((const Weight *)p[P_GATE_UP], x, n, H, t, nt, shared_q);
            end_phase(&barrier, t, nt, times, PH_POST_NORM, &mark);
            matmul(next + 2 * item, t, nt, x, n, H, (const Weight *)p[P_GATE_UP], 2 * I, (const float *)p[P_GATE_UP_B],
                   gu, 0, qmem, ready);
            end_phase(&barrier, t, nt, times, PH_GATE_UP, &mark);
            ready = silu_mul(gu, act, n, I, (const Weight *)p[P_DOWN], t, nt, shared_q);
            end_phase(&barrier, t, nt, times, PH_SILU_MUL, &mark);
            matmul(next + 3 * item, t, nt, act, n, I, (const Weight *)p[P_DOWN], H, (const float *)p[P_DOWN_B], h, 1, qmem,
                   ready);
            end_phase(&barrier, t, nt, times, PH_DOWN, &mark);
            const float *next_w = l + 1 < L ? (const float *)layers[(l + 1) * P_COUNT + P_LN] : norm_w;
            for (int64_t r = t; r < n; r += nt) {
                rms_norm_row(h + r * H, next_w, H, eps, x + r * H);
                if (l + 1 == L) memcpy(out + r * H, x + r * H, H * sizeof(float));
            }
            ready = quantize_made(l + 1 < L ? (const Weight *)layers[(l + 1) * P_COUNT + P_QKV] : lm_head,
                                  x, n, H, t, nt, shared_q);
            end_phase(&barrier, t, nt, times, PH_NORM, &mark);
        }
        if (lm_head) {  /* x holds the final-normed rows (padded to whole blocks) */
            matmul(counters + 6 * L * item, t, nt, x, n, H, lm_head, vocab, NULL, logits, 0, qmem, ready);
            end_phase(&barrier, t, nt, times, PH_LM_HEAD, &mark);
            if (greedy) {
                for (int64_t r = t; r < n; r += nt) greedy[r] = row_argmax(logits + r * vocab, vocab);
                end_phase(&barrier, t, nt, times, PH_GREEDY, &mark);
            }
        }
    }
    free(counters);
    return 0;
}
