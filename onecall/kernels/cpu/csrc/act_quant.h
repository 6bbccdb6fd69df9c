/* Activation rows quantized per group of 32 for the quantized GEMMs (gemm.c: q4, q8b; gemm_q5.c: q5):
 * one copy, so every kernel that reads int16 activation steps rounds a row to the same integers.
 * Also the weight scales' loader (float32 or IEEE half) they share. AVX2 + F16C. */
#ifndef ONECALL_ACT_QUANT_H
#define ONECALL_ACT_QUANT_H

#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

#define ACT_MAX 32767.0f /* activations are quantized to int16 steps of absmax / ACT_MAX per group */

typedef struct {
    int16_t *q;  /* (M, K) */
    float *d;    /* (M, G): activation step per group */
    float *sum;  /* (M, G): float32 sum per group */
} QuantRows;

static inline void free_rows(QuantRows *r) {
    free(r->q);
    free(r->d);
    free(r->sum);
}

static inline int alloc_rows(int64_t M, int64_t K, QuantRows *r) {
    const int64_t G = K / 32;
    r->q = malloc(sizeof(int16_t) * (size_t)(M * K));
    r->d = malloc(sizeof(float) * (size_t)(M * G));
    r->sum = malloc(sizeof(float) * (size_t)(M * G));
    if (!r->q || !r->d || !r->sum) {
        free_rows(r);
        return -1;
    }
    return 0;
}

/* A group's step d = absmax / qmax and *inv = 1 / d where that is a normal float (a group of zeros, or
 * of values so small that 1 / d would overflow, quantizes to zeros: it adds nothing); d = NaN when the
 * group holds a NaN or infinities of both signs (its float32 sum is NaN), so every output it feeds is
 * NaN as in float32 math, rather than the NaN turning into an integer. */
static inline float group_step(float amax, float qmax, float sum, float *inv) {
    const float d = amax / qmax;
    *inv = d >= FLT_MIN ? 1.0f / d : 0.0f;
    return isnan(sum) ? NAN : d;
}

/* Quantize row m of x (M, K) to int16 per group of 32: step d = absmax / ACT_MAX, q = round-to-nearest-even(x / d)
 * (the default rounding mode, as nearbyintf), and the group's float32 sum (fixed order: 8 lanes, then
 * a fixed horizontal sum). */
static inline void quantize_row(const float *x, int64_t m, int64_t K, QuantRows *r) {
    const int64_t G = K / 32;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t g = 0; g < G; g++) {
        const float *p = x + m * K + g * 32;
        const __m256 v0 = _mm256_loadu_ps(p), v1 = _mm256_loadu_ps(p + 8);
        const __m256 v2 = _mm256_loadu_ps(p + 16), v3 = _mm256_loadu_ps(p + 24);
        const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                       _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        const float sum = hsum8(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
        float inv;
        const float d = group_step(hmax8(a), ACT_MAX, sum, &inv);
        const __m256 iv = _mm256_set1_ps(inv);
        const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, iv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, iv));
        const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, iv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, iv));
        /* packs works per 128-bit lane: 0xD8 puts the four quarters back in order */
        int16_t *out = r->q + m * K + g * 32;
        _mm256_storeu_si256((__m256i *)out, _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8));
        _mm256_storeu_si256((__m256i *)(out + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(i2, i3), 0xD8));
        r->d[m * G + g] = d;
        r->sum[m * G + g] = sum;
    }
}

/* 8 scales or offsets of one group (one per weight row of a block), as float32 */
static inline __attribute__((always_inline)) __m256 load8(const void *p, const int f16) {
    if (f16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    return _mm256_loadu_ps((const float *)p);
}

/* The q4 layout's scales and offsets kept as super-block factors (scales mode Q4_SUPER, native.py's
 * pack_q4_super: Q4_K's own form, d x 6-bit sub-scale and -dmin x 6-bit min, a quarter of float32's bytes):
 * per unit u and super-block s of Q4_SUPER_GROUPS groups, Q4_SUPER_BYTES bytes at scale + (u * G / 8 + s) *
 * Q4_SUPER_BYTES: float32 d[16] (lane l: row 16u + l), float32 nmin[16], then per group j of the block
 * uint8 sc[16] and uint8 mn[16]. A group's scale is d * sc and its offset nmin * mn, float32 products that
 * pack_q4_super checked are the float32 scale and offset exactly (up to the sign of a zero, which never
 * changes an output: a zero's product is added to an accumulator that starts at +0), so every kernel that
 * reads them computes the same bits as from the float32 layout. offset is unused (NULL). */
#define Q4_SUPER 2
#define Q4_SUPER_GROUPS 8
#define Q4_SUPER_BYTES 384

/* Group g's 8 scales and offsets of block k of unit u (rows 16u + 8k ..), as float32: mode 0 float32, 1
 * IEEE half (both (units, G, 2, 8)), Q4_SUPER the factors above. mode is a constant at every call site. */
static inline __attribute__((always_inline)) void q4_group_scales8(const void *scale, const void *offset, int64_t u,
                                                                   int64_t G, int64_t g, int k, const int mode,
                                                                   __m256 *sc, __m256 *of) {
    if (mode == Q4_SUPER) {
        const uint8_t *sb = (const uint8_t *)scale + (u * (G / Q4_SUPER_GROUPS) + g / Q4_SUPER_GROUPS) * Q4_SUPER_BYTES;
        const uint8_t *f = sb + 128 + 32 * (g % Q4_SUPER_GROUPS) + 8 * k;
        const __m256 d = _mm256_loadu_ps((const float *)sb + 8 * k);
        const __m256 nmin = _mm256_loadu_ps((const float *)sb + 16 + 8 * k);
        *sc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)f))));
        *of = _mm256_mul_ps(nmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(f + 16)))));
        return;
    }
    const int64_t es = mode ? 2 : 4, at = ((u * G + g) * 16 + 8 * k) * es;
    *sc = load8((const char *)scale + at, mode);
    *of = load8((const char *)offset + at, mode);
}

#define Q4_ROW_CHUNK 64 /* activation rows per pass over the weights (64 x K int16: 72-192 KiB for K 576-1536) */

#endif /* ONECALL_ACT_QUANT_H */
