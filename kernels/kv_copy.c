/* Block gather / scatter for KV hand-offs: rows of ``row_bytes`` between a KV cache
 * layer ([num_blocks, block_size, heads, dim], contiguous) and a payload's tensor
 * ([n, block_size, heads, dim], contiguous).
 *
 *   kv_gather(dst, src, idx, n, row_bytes):  dst row j  = src row idx[j]
 *   kv_scatter(dst, src, idx, n, row_bytes): dst row idx[j] = src row j
 *   kv_gather_layers / kv_scatter_layers(rows, pools, layers, idx, n, num_blocks,
 *       row_bytes, threads): the same for every layer l at once, between pools[l] and
 *       the rows at rows + l * n * row_bytes; they check the ids first (-1, nothing
 *       copied, if one lies outside [0, num_blocks)), the single-layer ones do not.
 *       ``threads`` > 1 splits the layers' rows into that many contiguous shares, one
 *       an OpenMP thread (copies under THREAD_MIN_BYTES a thread take fewer threads).
 *
 * Why not torch's index_select / index_copy_: a payload is written once and read by
 * another process (or the next decode step) much later, so on large copies the cache
 * only gets in the way: streaming (non-temporal) stores skip it and its read-for-
 * ownership, which measured 1.2-2x faster than torch's per-row copies for 8 KiB rows
 * here.
 *
 * Large copies (>= STREAM_MIN_BYTES, rows a whole number of 64-byte lines, destination
 * aligned for the stores) stream, as wide as the build allows (AVX-512: one whole line
 * per store), and prefetch the source PREFETCH_AHEAD bytes ahead along the rows in copy
 * order, into L2. Why the prefetch: a gather's source rows lie anywhere in the pool, and
 * the hardware prefetchers stop at every 4 KiB page, so without it each row (and each
 * page of the payload a scatter reads) starts with a full memory round trip. Measured
 * on a 2-vCPU Xeon (family 6 model 207) KVM guest (8 KiB rows, 8 layers, shuffled
 * ids, caches flushed between runs; gather / scatter GB/s; glibc memcpy of the whole
 * 256 MiB: ~9-10):
 *   256 MiB: 16-byte streams, no prefetch: 6.9 / 7.8; 64-byte streams + 8 KiB ahead:
 *   9.1-9.4 / 10.0-10.3;  16 MiB: 6.9 / 6.8 -> 9.3 / 9.5.
 * (Prefetching into L1 (T0) measured 5-15% slower; 4 and 16 KiB ahead were within
 * the noise of 8 KiB, for 32 KiB rows too. In the bench's ranks, 16 MiB: 7.8 / 7.8.)
 *
 * Why threads: one core's copy is bounded by how many cache misses it keeps in flight,
 * not by the memory: on the same guest one thread's memcpy of 16 MiB measured ~11 GB/s
 * and two threads' (halves) ~20 GB/s. A hand-off's copy is a short burst while the
 * rank does nothing else (the import and the export hold the engine), so it takes the
 * rank's copy threads (EngineConfig.kv_copy_threads).
 *
 * Small copies (< STREAM_MIN_BYTES), unaligned rows and CPUs without SSE2 take plain
 * memcpy, one call per run of consecutive ascending block ids (a fresh or lightly used
 * pool hands a prompt such runs; shuffled ids are runs of one). Built per ISA
 * (cbuild.py); every build is correct on every table, only the store width differs.
 */
#include <stdint.h>
#include <string.h>

#include <omp.h>

#include "simd.h" /* simd_isa(), PREFETCH_L2 */

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#define STREAM_MIN_BYTES (1 << 20)
#define THREAD_MIN_BYTES (1 << 20) /* less a thread: its start-up is not worth it */
#ifndef PREFETCH_AHEAD /* -DPREFETCH_AHEAD=... to measure other distances */
#define PREFETCH_AHEAD 8192
#endif

/* Row j of a table side: ``base`` row ``idx[j]``, or row ``j`` where ``idx`` is NULL. */
static inline const char *row_at(const char *base, const int64_t *idx, int64_t j, int64_t rb) {
    return base + (idx ? idx[j] : j) * rb;
}

#if defined(__SSE2__)
/* One 64-byte line from s (any alignment) to d (aligned to the store width) with
 * streaming stores: 16, 32 or 64 bytes a store. */
static inline void line16(char *d, const char *s) {
    __m128i a = _mm_loadu_si128((const __m128i *)s);
    __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
    __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
    _mm_stream_si128((__m128i *)d, a);
    _mm_stream_si128((__m128i *)(d + 16), b);
    _mm_stream_si128((__m128i *)(d + 32), c);
    _mm_stream_si128((__m128i *)(d + 48), e);
}
#if defined(__AVX__)
static inline void line32(char *d, const char *s) {
    __m256i a = _mm256_loadu_si256((const __m256i *)s);
    __m256i b = _mm256_loadu_si256((const __m256i *)(s + 32));
    _mm256_stream_si256((__m256i *)d, a);
    _mm256_stream_si256((__m256i *)(d + 32), b);
}
#endif
#if defined(__AVX512F__)
static inline void line64(char *d, const char *s) {
    _mm512_stream_si512((void *)d, _mm512_loadu_si512((const void *)s));
}
#endif

/* Stream n rows (dst row j <- src row j, either side indexed) one line at a time; the
 * prefetch cursor (row pj, byte po) runs PREFETCH_AHEAD bytes ahead of the copy on the
 * source side. */
#define STREAM_ROWS(name, line)                                                           \
    static void name(char *dst, const int64_t *didx, const char *src, const int64_t *sidx, \
                     int64_t n, int64_t rb) {                                             \
        int64_t pj = PREFETCH_AHEAD / rb, po = PREFETCH_AHEAD % rb;                       \
        const char *ahead = pj < n ? row_at(src, sidx, pj, rb) : NULL;                    \
        for (int64_t j = 0; j < n; j++) {                                                 \
            char *d = (char *)row_at(dst, didx, j, rb);                                   \
            const char *s = row_at(src, sidx, j, rb);                                     \
            for (int64_t o = 0; o < rb; o += 64) {                                        \
                if (ahead) {                                                              \
                    PREFETCH_L2(ahead + po);                                              \
                    if ((po += 64) == rb) {                                               \
                        po = 0;                                                           \
                        ahead = ++pj < n ? row_at(src, sidx, pj, rb) : NULL;              \
                    }                                                                     \
                }                                                                         \
                line(d + o, s + o);                                                       \
            }                                                                             \
        }                                                                                 \
        _mm_sfence(); /* streamed stores visible before we return */                      \
    }
STREAM_ROWS(stream16, line16)
#if defined(__AVX__)
STREAM_ROWS(stream32, line32)
#endif
#if defined(__AVX512F__)
STREAM_ROWS(stream64, line64)
#endif
#endif /* __SSE2__ */

/* The widest streaming copy this build has for destination rows starting at ``base``
 * (every row then shares its alignment: row_bytes is a multiple of 64), or 0: memcpy. */
static int stream_width(const char *base, int64_t n, int64_t row_bytes) {
    if (n * row_bytes < STREAM_MIN_BYTES || (row_bytes & 63) != 0) return 0;
#if defined(__AVX512F__)
    if (((uintptr_t)base & 63) == 0) return 64;
#endif
#if defined(__AVX__)
    if (((uintptr_t)base & 31) == 0) return 32;
#endif
#if defined(__SSE2__)
    if (((uintptr_t)base & 15) == 0) return 16;
#endif
    (void)base;
    return 0;
}

/* ``total`` rows decide whether to stream (a thread's share of a large copy streams too). */
static void copy_rows(char *dst, const int64_t *didx, const char *src, const int64_t *sidx,
                      int64_t n, int64_t rb, int64_t total) {
    switch (stream_width(dst, total, rb)) {
#if defined(__AVX512F__)
    case 64: stream64(dst, didx, src, sidx, n, rb); return;
#endif
#if defined(__AVX__)
    case 32: stream32(dst, didx, src, sidx, n, rb); return;
#endif
#if defined(__SSE2__)
    case 16: stream16(dst, didx, src, sidx, n, rb); return;
#endif
    default: break;
    }
    /* one memcpy per run of consecutive ascending ids on the indexed side (the other
     * side's rows are consecutive already) */
    const int64_t *idx = didx ? didx : sidx;
    for (int64_t j = 0, k; j < n; j += k) {
        for (k = 1; j + k < n && idx[j + k] == idx[j] + k; k++) {
        }
        memcpy((char *)row_at(dst, didx, j, rb), row_at(src, sidx, j, rb), (size_t)(k * rb));
    }
}

void kv_gather(char *dst, const char *src, const int64_t *idx, int64_t n, int64_t row_bytes) {
    copy_rows(dst, NULL, src, idx, n, row_bytes, n);
}

void kv_scatter(char *dst, const char *src, const int64_t *idx, int64_t n, int64_t row_bytes) {
    copy_rows(dst, idx, src, NULL, n, row_bytes, n);
}

/* All layers in one call: from Python, a call per layer (and the tensor ops around it)
 * measured ~0.3 ms of each side of a hand-off in a process whose caches are cold. */
static int ids_in_range(const int64_t *idx, int64_t n, int64_t num_blocks) {
    for (int64_t j = 0; j < n; j++)
        if (idx[j] < 0 || idx[j] >= num_blocks) return 0;
    return 1;
}

/* Every layer's rows, split into ``threads`` contiguous shares of the layers x n rows
 * (rows + l * n * row_bytes is row l * n of the flat range): a share may span layers. */
static void copy_layers(char *rows, char *const *pools, int64_t layers, const int64_t *idx,
                        int64_t n, int64_t rb, int gather, int64_t threads) {
    const int64_t total = layers * n;
    if (total <= 0) return;
    int64_t most = total * rb / THREAD_MIN_BYTES;
    if (threads > most) threads = most;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads((int)threads) if (threads > 1)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t a = total * t / nt, b = total * (t + 1) / nt;
        for (int64_t l = a / n; l < layers && l * n < b; l++) {
            const int64_t j0 = (a > l * n ? a : l * n) - l * n;
            const int64_t j1 = (b < (l + 1) * n ? b : (l + 1) * n) - l * n;
            char *lrows = rows + (l * n + j0) * rb;
            if (j1 <= j0) continue;
            if (gather)
                copy_rows(lrows, NULL, pools[l], idx + j0, j1 - j0, rb, total);
            else
                copy_rows(pools[l], idx + j0, lrows, NULL, j1 - j0, rb, total);
        }
    }
}

int kv_gather_layers(char *rows, char *const *pools, int64_t layers, const int64_t *idx,
                     int64_t n, int64_t num_blocks, int64_t row_bytes, int64_t threads) {
    if (!ids_in_range(idx, n, num_blocks)) return -1;
    copy_layers(rows, pools, layers, idx, n, row_bytes, 1, threads);
    return 0;
}

int kv_scatter_layers(const char *rows, char *const *pools, int64_t layers, const int64_t *idx,
                      int64_t n, int64_t num_blocks, int64_t row_bytes, int64_t threads) {
    if (!ids_in_range(idx, n, num_blocks)) return -1;
    copy_layers((char *)rows, pools, layers, idx, n, row_bytes, 0, threads);
    return 0;
}
