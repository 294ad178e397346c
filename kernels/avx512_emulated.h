/* The AVX-512 build's source on a CPU without AVX-512, for tests: cbuild.py's
 * emulated builds compile a kernel for AVX2 with this header included first. It claims
 * AVX-512 (F, BW, VL; VNNI where asked by PDSERVE_EMULATE_VNNI), so simd.h picks 16-lane
 * vectors, which GCC lowers to pairs of AVX2 registers, and writes the AVX-512
 * intrinsics the kernels call in AVX2 halves, with the instructions'
 * exact results (wrapping and saturating where they do, the same conversions and
 * rounding). The loops, lane orders and tile layouts of the AVX-512 and VNNI paths
 * then run, bit for bit, where only AVX2 exists: slowly, so never for serving.
 *
 * immintrin.h comes first, while the AVX-512 macros are unset (so its own AVX-512
 * functions stay behind their target pragmas); the kernels' later #include of it is
 * then a no-op, and their calls reach the functions below by the macros at the end. */
#ifndef PDSERVE_AVX512_EMULATED_H
#define PDSERVE_AVX512_EMULATED_H
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__) || defined(__AVX512F__)
#error "the emulated AVX-512 build is compiled for AVX2 (-mavx2 -mfma -mf16c)"
#endif
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512VL__ 1
#ifdef PDSERVE_EMULATE_VNNI
#define __AVX512VNNI__ 1
#endif

typedef long long emu_q8 __attribute__((vector_size(64)));
typedef long long emu_q4 __attribute__((vector_size(32)));

/* A 512-bit value as two AVX2 halves and back, in registers. */
static inline __m256i emu_lo(__m512i a) { return (__m256i)__builtin_shufflevector((emu_q8)a, (emu_q8)a, 0, 1, 2, 3); }
static inline __m256i emu_hi(__m512i a) { return (__m256i)__builtin_shufflevector((emu_q8)a, (emu_q8)a, 4, 5, 6, 7); }
static inline __m512i emu_join(__m256i lo, __m256i hi) {
    return (__m512i)__builtin_shufflevector((emu_q4)lo, (emu_q4)hi, 0, 1, 2, 3, 4, 5, 6, 7);
}

/* Lane-wise within 128-bit lanes on both architectures: two AVX2 halves are the same. */
#define EMU_HALVES(op, a, b) emu_join(op(emu_lo(a), emu_lo(b)), op(emu_hi(a), emu_hi(b)))

static inline __m512i emu_maddubs_epi16(__m512i a, __m512i b) { return EMU_HALVES(_mm256_maddubs_epi16, a, b); }
static inline __m512i emu_madd_epi16(__m512i a, __m512i b) { return EMU_HALVES(_mm256_madd_epi16, a, b); }
static inline __m512i emu_add_epi16(__m512i a, __m512i b) { return EMU_HALVES(_mm256_add_epi16, a, b); }
static inline __m512i emu_and_si512(__m512i a, __m512i b) { return EMU_HALVES(_mm256_and_si256, a, b); }
static inline __m512i emu_add_epi32(__m512i a, __m512i b) { return EMU_HALVES(_mm256_add_epi32, a, b); }

/* vpdpwssd: the pairs' int32 sum (vpmaddwd's) added to acc, wrapping. */
static inline __m512i emu_dpwssd_epi32(__m512i acc, __m512i a, __m512i b) {
    return emu_add_epi32(acc, emu_madd_epi16(a, b));
}

/* Per 32-bit lane of 32 bytes, four unsigned x signed byte products summed, exactly:
 * the products widened to int16 (|u s| < 2^15), vpmaddwd's pairs, then pairs again. */
static inline __m256i emu_busd(__m256i u, __m256i s) {
    const __m256i lo = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(u)),
                                         _mm256_cvtepi8_epi16(_mm256_castsi256_si128(s)));
    const __m256i hi = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(u, 1)),
                                         _mm256_cvtepi8_epi16(_mm256_extracti128_si256(s, 1)));
    /* hadd interleaves 128-bit lanes: lo's sums 0-1, hi's 0-1, lo's 2-3, hi's 2-3 */
    return _mm256_permute4x64_epi64(_mm256_hadd_epi32(lo, hi), 0xD8);
}

/* vpdpbusd: the four byte products of each 32-bit lane added to acc (no saturation). */
static inline __m512i emu_dpbusd_epi32(__m512i acc, __m512i u, __m512i s) {
    return emu_add_epi32(acc, EMU_HALVES(emu_busd, u, s));
}

static inline __mmask64 emu_movepi8_mask(__m512i a) {
    return (__mmask64)(uint32_t)_mm256_movemask_epi8(emu_lo(a))
           | (__mmask64)(uint32_t)_mm256_movemask_epi8(emu_hi(a)) << 32;
}

/* 32 mask bits -> 32 bytes, each all ones where its bit is set. */
static inline __m256i emu_bytes_of(uint32_t k) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)k),
        _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                          0x0101010101010101LL, 0x0000000000000000LL));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

/* Lanes whose bit is set: a - b (wrapping); the others: src. */
static inline __m512i emu_mask_sub_epi8(__m512i src, __mmask64 k, __m512i a, __m512i b) {
    return emu_join(_mm256_blendv_epi8(emu_lo(src), _mm256_sub_epi8(emu_lo(a), emu_lo(b)),
                                       emu_bytes_of((uint32_t)k)),
                    _mm256_blendv_epi8(emu_hi(src), _mm256_sub_epi8(emu_hi(a), emu_hi(b)),
                                       emu_bytes_of((uint32_t)(k >> 32))));
}

static inline __m512i emu_abs_epi8(__m512i a) { return emu_join(_mm256_abs_epi8(emu_lo(a)), _mm256_abs_epi8(emu_hi(a))); }
static inline __m512i emu_setzero_si512(void) { return (__m512i)(emu_q8){0}; }
static inline __m512i emu_set1_epi32(int a) { return emu_join(_mm256_set1_epi32(a), _mm256_set1_epi32(a)); }
static inline __m512i emu_loadu_si512(const void *p) { __m512i r; memcpy(&r, p, 64); return r; }
/* Non-temporal on the hardware; the values are what matter here. */
static inline void emu_stream_si512(void *p, __m512i a) { memcpy(p, &a, 64); }

static inline __m512i emu_srli_epi32(__m512i a, unsigned n) {
    return emu_join(_mm256_srli_epi32(emu_lo(a), (int)n), _mm256_srli_epi32(emu_hi(a), (int)n));
}
static inline __m512i emu_slli_epi32(__m512i a, unsigned n) {
    return emu_join(_mm256_slli_epi32(emu_lo(a), (int)n), _mm256_slli_epi32(emu_hi(a), (int)n));
}

/* Widening: 16 values from a 128-bit (bytes) or 256-bit (words) source. */
static inline __m512i emu_cvtepu8_epi32(__m128i a) {
    return emu_join(_mm256_cvtepu8_epi32(a), _mm256_cvtepu8_epi32(_mm_srli_si128(a, 8)));
}
static inline __m512i emu_cvtepi8_epi32(__m128i a) {
    return emu_join(_mm256_cvtepi8_epi32(a), _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
}
static inline __m512i emu_cvtepu16_epi32(__m256i a) {
    return emu_join(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)),
                    _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1)));
}
static inline __m512 emu_cvtepi32_ps(__m512i a) {
    return (__m512)emu_join((__m256i)_mm256_cvtepi32_ps(emu_lo(a)), (__m256i)_mm256_cvtepi32_ps(emu_hi(a)));
}
static inline __m512 emu_cvtph_ps(__m256i a) {
    return (__m512)emu_join((__m256i)_mm256_cvtph_ps(_mm256_castsi256_si128(a)),
                            (__m256i)_mm256_cvtph_ps(_mm256_extracti128_si256(a, 1)));
}
/* Ties to even, the one rounding the kernels ask for (F16C's immediate is fixed). */
static inline __m256i emu_cvtps_ph(__m512 a, int rounding) {
    (void)rounding;
    return _mm256_set_m128i(_mm256_cvtps_ph((__m256)emu_hi((__m512i)a), _MM_FROUND_TO_NEAREST_INT),
                            _mm256_cvtps_ph((__m256)emu_lo((__m512i)a), _MM_FROUND_TO_NEAREST_INT));
}

/* vpmovdb (AVX512VL): each int32's low byte, eight of them in the low 64 bits. */
static inline __m128i emu_mm256_cvtepi32_epi8(__m256i a) {
    int32_t d[8];
    uint8_t out[16] = {0};
    memcpy(d, &a, 32);
    for (int i = 0; i < 8; i++) out[i] = (uint8_t)d[i];
    __m128i r;
    memcpy(&r, out, 16);
    return r;
}

#define _mm512_maddubs_epi16 emu_maddubs_epi16
#define _mm512_madd_epi16 emu_madd_epi16
#define _mm512_add_epi16 emu_add_epi16
#define _mm512_and_si512 emu_and_si512
#define _mm512_dpwssd_epi32 emu_dpwssd_epi32
#define _mm512_dpbusd_epi32 emu_dpbusd_epi32
#define _mm512_movepi8_mask emu_movepi8_mask
#define _mm512_mask_sub_epi8 emu_mask_sub_epi8
#define _mm512_abs_epi8 emu_abs_epi8
#define _mm512_setzero_si512 emu_setzero_si512
#define _mm512_set1_epi32 emu_set1_epi32
#define _mm512_loadu_si512 emu_loadu_si512
#define _mm512_stream_si512 emu_stream_si512
#define _mm512_srli_epi32 emu_srli_epi32
#define _mm512_slli_epi32 emu_slli_epi32
#define _mm512_cvtepu8_epi32 emu_cvtepu8_epi32
#define _mm512_cvtepi8_epi32 emu_cvtepi8_epi32
#define _mm512_cvtepu16_epi32 emu_cvtepu16_epi32
#define _mm512_cvtepi32_ps emu_cvtepi32_ps
#define _mm512_cvtph_ps emu_cvtph_ps
#define _mm512_cvtps_ph emu_cvtps_ph
#define _mm256_cvtepi32_epi8 emu_mm256_cvtepi32_epi8

#endif
