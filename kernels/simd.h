/* The vector layer every kernel here is written in: one source, built for the widest
 * vector ISA the compiler is told to target (cbuild.py passes -mavx512f, -mavx2 -mfma,
 * or nothing: SSE2 on x86-64, NEON on aarch64). GCC/Clang vector extensions do the
 * arithmetic; the few operations C's operators lack (masked tails, horizontal sums,
 * max, exp, 2^n) are written once below for any width.
 *
 * VW floats per vector: 16 (AVX-512), 8 (AVX2), 4 (anything else). Weight panels are 16
 * floats wide on every ISA (one 64-byte line per panel row, see skinny_gemm.py), so
 * VW always divides a panel row, a 16-float hidden chunk and half a 32-float head. */
#ifndef PDSERVE_SIMD_H
#define PDSERVE_SIMD_H
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VW 16
#define PDSERVE_ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#define VW 8
#define PDSERVE_ISA "avx2"
#else
#define VW 4
#define PDSERVE_ISA "generic"
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
/* The same vectors at float alignment: loads and stores at any float address. */
typedef float vf_unaligned __attribute__((vector_size(VW * 4), aligned(4)));
typedef float v4 __attribute__((vector_size(16)));

/* Which build this is, for the Python side to check it loaded what it asked for. */
const char *simd_isa(void) { return PDSERVE_ISA; }

static inline vf vload(const float *p) { return *(const vf_unaligned *)p; }
static inline void vstore(float *p, vf v) { *(vf_unaligned *)p = v; }
static inline vf vzero(void) { return (vf){0}; }
/* A splat as an initializer, the form compilers turn into one broadcast (a lane loop
 * becomes inserts; `vzero() + s` keeps the add, since 0 + -0 is +0). */
#define S4(s) s, s, s, s
#if VW == 16
#define SPLAT(s) {S4(s), S4(s), S4(s), S4(s)}
#elif VW == 8
#define SPLAT(s) {S4(s), S4(s)}
#else
#define SPLAT(s) {S4(s)}
#endif
static inline vf vset1(float s) { return (vf)SPLAT(s); }
/* a * b + c; one FMA instruction where the ISA has one (cbuild builds with
 * -ffp-contract=fast), else a multiply and an add. */
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }

/* The first n floats of p (n < VW: the rest zero), and the first n lanes of v to p. */
static inline vf vload_n(const float *p, int64_t n) {
    if (n >= VW) return vload(p);
    float t[VW] = {0};
    if (n > 0) memcpy(t, p, (size_t)n * sizeof(float));
    return vload(t);
}
static inline void vstore_n(float *p, vf v, int64_t n) {
    if (n >= VW) { vstore(p, v); return; }
    if (n > 0) memcpy(p, &v, (size_t)n * sizeof(float));
}

/* fp16 <-> fp32 (a 16-bit KV cache): VW halves widened, or a vector rounded to the
 * nearest half, ties to even (torch's rounding: the same bits either way). */
#if VW == 16 || VW == 8
#include <immintrin.h>
#endif
static inline vf vload_half(const uint16_t *p) {
#if VW == 16
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif VW == 8
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vf v;
    for (int i = 0; i < VW; i++) {
        _Float16 h;
        memcpy(&h, p + i, 2);
        v[i] = (float)h;
    }
    return v;
#endif
}
static inline void vstore_half(uint16_t *p, vf v) {
#if VW == 16
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT));
#elif VW == 8
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT));
#else
    for (int i = 0; i < VW; i++) {
        _Float16 h = (_Float16)v[i];
        memcpy(p + i, &h, 2);
    }
#endif
}

/* Lane-wise select and max/min with x86's rules: where either lane is NaN the second
 * operand is the answer (a NaN in `a` never wins). */
static inline vf vselect(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }
static inline vf vmax(vf a, vf b) { return vselect(a > b, a, b); }
static inline vf vmin(vf a, vf b) { return vselect(a < b, a, b); }

/* Lane i holds i; v with the lanes from n on replaced by `fill`. */
static inline vi vlanes(void) {
    vi v;
    for (int i = 0; i < VW; i++) v[i] = i;
    return v;
}
static inline vf vfirst_n(vf v, int64_t n, float fill) {
    return vselect(vlanes() < (int32_t)(n < VW ? n : VW), v, vset1(fill));
}
/* Does any lane of a comparison's mask hold true? */
static inline int vany(vi m) {
    for (int i = 0; i < VW; i++)
        if (m[i]) return 1;
    return 0;
}

/* Horizontal sum and max: 128-bit quarters folded together, then the four lanes. */
static inline float vsum(vf v) {
    v4 acc;
    memcpy(&acc, &v, 16);
    for (int i = 1; i < VW / 4; i++) {
        v4 part;
        memcpy(&part, (const char *)&v + 16 * i, 16);
        acc += part;
    }
    return (acc[0] + acc[2]) + (acc[1] + acc[3]);
}
static inline float vmax_lanes(vf v) {
    float m = v[0];
    for (int i = 1; i < VW; i++) m = v[i] > m ? v[i] : m;
    return m;
}

/* 2^n for integer-valued n in [-150, 128], as two normal powers (2^n alone would be a
 * denormal or infinity at the ends, which the exponent-field trick cannot build). */
static inline vf vpow2(vf n) {
    vi k = __builtin_convertvector(n, vi), half = k >> 1;
    vf a = (vf)((half + 127) << 23), b = (vf)((k - half + 127) << 23);
    return a * b;
}

/* exp(x): Cody-Waite reduction and Cephes' degree-6 polynomial (~1 ulp); NaN stays NaN. */
static inline vf vexp(vf x) {
    x = vmax(vset1(-103.0f), vmin(vset1(88.7f), x));
    /* round to nearest: adding 1.5 * 2^23 pushes the fraction out of the mantissa */
    const vf magic = vset1(12582912.0f);
    vf n = (x * 1.44269504088896341f + magic) - magic;
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = vset1(1.9875691500e-4f);
    p = vfma(p, r, vset1(1.3981999507e-3f));
    p = vfma(p, r, vset1(8.3334519073e-3f));
    p = vfma(p, r, vset1(4.1665795894e-2f));
    p = vfma(p, r, vset1(1.6666665459e-1f));
    p = vfma(p, r, vset1(5.0000001201e-1f));
    p = vfma(p, r * r, r);
    return (p + 1.0f) * vpow2(n);
}

/* Prefetch hints (no-ops where the compiler has none) and a spin-wait pause. */
#define PREFETCH_L1(p) __builtin_prefetch((const void *)(p), 0, 3)
#define PREFETCH_L2(p) __builtin_prefetch((const void *)(p), 0, 2)
static inline void cpu_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

#endif
