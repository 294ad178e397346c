/* Block gather / scatter for KV hand-offs: rows of ``row_bytes`` between a KV cache
 * layer ([num_blocks, block_size, heads, dim], contiguous) and a payload's tensor
 * ([n, block_size, heads, dim], contiguous).
 *
 *   kv_gather(dst, src, idx, n, row_bytes):  dst row j  = src row idx[j]
 *   kv_scatter(dst, src, idx, n, row_bytes): dst row idx[j] = src row j
 *
 * Why not torch's index_select / index_copy_: a payload is written once and read by
 * another process (or the next decode step) much later, so on large copies the cache
 * only gets in the way: streaming (non-temporal) stores skip it and its read-for-
 * ownership, which measured 1.2-2x faster than torch's per-row copies for 8 KiB rows
 * here. Small copies (< STREAM_MIN_BYTES), unaligned rows and CPUs without SSE2 take
 * plain memcpy. Built for any x86-64 or other CPU: SSE2 is the x86-64 baseline.
 */
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define STREAM_MIN_BYTES (1 << 20)

static void copy_row(char *d, const char *s, int64_t n, int stream) {
#if defined(__SSE2__)
    if (stream) {
        for (int64_t o = 0; o < n; o += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + o));
            __m128i b = _mm_loadu_si128((const __m128i *)(s + o + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + o + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + o + 48));
            _mm_stream_si128((__m128i *)(d + o), a);
            _mm_stream_si128((__m128i *)(d + o + 16), b);
            _mm_stream_si128((__m128i *)(d + o + 32), c);
            _mm_stream_si128((__m128i *)(d + o + 48), e);
        }
        return;
    }
#endif
    (void)stream;
    memcpy(d, s, (size_t)n);
}

static int can_stream(const char *base, int64_t n, int64_t row_bytes) {
#if defined(__SSE2__)
    /* every destination row 16-byte aligned and a whole number of 64-byte lines */
    return n * row_bytes >= STREAM_MIN_BYTES && ((uintptr_t)base & 15) == 0
        && (row_bytes & 63) == 0;
#else
    (void)base; (void)n; (void)row_bytes;
    return 0;
#endif
}

static void fence(int stream) {
#if defined(__SSE2__)
    if (stream) _mm_sfence();  /* streamed stores visible before we return */
#endif
    (void)stream;
}

void kv_gather(char *dst, const char *src, const int64_t *idx, int64_t n, int64_t row_bytes) {
    int stream = can_stream(dst, n, row_bytes);
    for (int64_t j = 0; j < n; j++)
        copy_row(dst + j * row_bytes, src + idx[j] * row_bytes, row_bytes, stream);
    fence(stream);
}

void kv_scatter(char *dst, const char *src, const int64_t *idx, int64_t n, int64_t row_bytes) {
    int stream = can_stream(dst, n, row_bytes);
    for (int64_t j = 0; j < n; j++)
        copy_row(dst + idx[j] * row_bytes, src + j * row_bytes, row_bytes, stream);
    fence(stream);
}
