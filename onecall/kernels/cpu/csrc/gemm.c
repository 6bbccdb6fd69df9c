/* The quantized GEMMs: y = x @ W^T (+ bias) over weights kept as the GGUF stored them, against
 * activations quantized row by row here (QuantRows: int16 steps; QuantRows8: int8 steps).
 *
 *   onecall_q4_gemm    4-bit weights (the q4 layout) x int16 activations: the projections
 *   onecall_q4a8_gemm  4-bit weights (the q4a8 layout) x int8 activations (EngineConfig.int8_activations)
 *   onecall_q8b_gemm   int8 weights (the q8b layout) x int16 activations: Q8_0/Q6_K projections, logits
 *   onecall_iq4_gemm   IQ4 / MXFP4 codes (the iq4 layout, codebook lookup by vpshufb) x int16 activations
 *
 * All four share one parallel structure (q4_gemm): the rows are quantized, then chunk by chunk of
 * Q4_ROW_CHUNK rows the weight units of 16 rows are split across the threads; each thread streams its
 * units' weights in one sequential pass. On CPUs with AVX-512 VNNI, q4, q8b and iq4 run each unit's rows
 * on the AVX-512 tiles of gemm_avx512.c instead (the same outputs bit for bit; onecall_set_avx512 turns
 * them off); q4a8 runs on AVX2 everywhere.
 *
 * Numerics:
 *   q4 (the projections): each activation row is quantized per group of 32 to int16 with a float32
 *   step (absmax / 32767, round to nearest: relative error <= 1.5e-5 of the group's largest value,
 *   finer than bfloat16's 2^-9 per value; llama.cpp's int8 steps measurably changed SmolLM2's greedy
 *   text); a group's weight x activation dot product is an exact integer (madd, then int32 adds),
 *   exactly representable in float32, scaled by weight scale x activation step in float32. The offset
 *   term uses the float32 sum of each activation group.
 *   q8b (int8 weights: Q8_0/Q6_K projections and logits): the same int16 activation steps, exact
 *   int32 dots per scale group. q4a8 (EngineConfig.int8_activations): int8 activation steps.
 *   Tolerances against the float32 reference are written down in tests/test_native_kernels.py.
 *
 * Batch invariance: every activation row goes through the same operations in the same order
 * whatever the number of rows M in the call, so a row's result never depends on its neighbours.
 *
 * Layouts (groups of 32 along K; K % 32 == 0):
 *   q4: weight rows in units of 16 (N padded with zero rows to a multiple of 16), two blocks of 8 rows;
 *       a unit's groups follow one another (a thread streams its units in one sequential pass), one
 *       group of a block is 128 contiguous bytes and its 8 scales one vector:
 *       qs (N16 / 16, G, 2, 8, 8, 2) uint8: unit, group g, block k, column pair c, row b of the block,
 *       column j of the pair; the byte holds q[16u + 8k + b, g*32 + 2c + j] in its low nibble and
 *       q[.., g*32 + 16 + 2c + j] in its high nibble;
 *       scale, offset (N16 / 16, G, 2, 8) float32 or IEEE half, or (Q4_K's form) super-block factors
 *       (act_quant.h's Q4_SUPER). w = q * scale + offset, q in 0..15.
 *   q4a8 (int8 activations) and q8b (int8 weights): below, in the same units.
 */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "act_quant.h"
#include "codebooks.h"
#include "gemm_avx512.h"
#include "kernels.h"
#include "simd.h"

/* QuantRows, quantize_row (the int16 activation steps), load8 and Q4_ROW_CHUNK: act_quant.h */

#ifndef Q4_PREFETCH
#define Q4_PREFETCH 16 /* groups ahead that the weight stream is prefetched */
#endif

/* One unit u (two blocks of 8 weight rows) against MT activation rows from m0 (MT a compile-time
 * constant at every call site, at most Q4_PAIR_TILE). A group of a block is 8 chunks of 16 bytes; chunk
 * c, widened to 16 int16 lanes and masked or shifted, holds the 8 rows' columns (2c, 2c + 1) (low
 * nibbles) or (16 + 2c, 17 + 2c) (high nibbles), row-major, so one madd against that column pair of an
 * activation row, broadcast, gives each row's partial dot in its own int32 lane (each broadcast feeds
 * both blocks): no horizontal sums. Lane b of acc_k[i] is output (m0 + i, 16u + 8k + b):
 *   acc = fma(float(exact int dot of group g), scale[n, g] * step[m, g], acc) over g in order,
 *   oacc = fma(offset[n, g], sum(x in group g), oacc) over g in order,
 *   y = (acc + oacc) + bias.
 * A group's int dot fits float32 exactly (|dot| <= 32 * 15 * 32767 < 2^24), so the order of its int32
 * adds does not matter. Every output goes through the same operations in the same order whatever MT, M
 * and the thread count are: batch invariance. */
#define Q4_PAIR_TILE 3  /* rows per tile: 2 x 3 int32 accumulators + weights stay in registers (4: 0-5% slower) */
static inline __attribute__((always_inline)) void q4_unit_tile(const int MT, const QuantRows *r, int64_t m0,
                                                               int64_t u, int64_t K, int64_t N, const uint8_t *qs,
                                                               const void *scale, const void *offset,
                                                               const float *bias, float *y, const int f16) {
    const int64_t G = K / 32;
    const uint8_t *wu = qs + u * G * 256;
    const __m256i low4 = _mm256_set1_epi16(0x0F);
    __m256 acc0[Q4_PAIR_TILE], oacc0[Q4_PAIR_TILE], acc1[Q4_PAIR_TILE], oacc1[Q4_PAIR_TILE];
    for (int i = 0; i < MT; i++) acc0[i] = oacc0[i] = acc1[i] = oacc1[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *wg0 = wu + g * 256, *wg1 = wg0 + 128;
        if (Q4_PREFETCH)
            for (int l = 0; l < 4; l++) _mm_prefetch((const char *)(wg0 + Q4_PREFETCH * 256 + 64 * l), _MM_HINT_T0);
        __m256i a0[Q4_PAIR_TILE], a1[Q4_PAIR_TILE];
        for (int i = 0; i < MT; i++) a0[i] = a1[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            const __m256i wb0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wg0 + c * 16)));
            const __m256i wb1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wg1 + c * 16)));
            const __m256i lo0 = _mm256_and_si256(wb0, low4), lo1 = _mm256_and_si256(wb1, low4);
            for (int i = 0; i < MT; i++) {
                int32_t xl; /* the column pair's two int16 values (low nibbles' columns), broadcast */
                memcpy(&xl, r->q + (m0 + i) * K + g * 32 + 2 * c, 4);
                const __m256i b = _mm256_set1_epi32(xl);
                a0[i] = _mm256_add_epi32(a0[i], _mm256_madd_epi16(lo0, b));
                a1[i] = _mm256_add_epi32(a1[i], _mm256_madd_epi16(lo1, b));
            }
            const __m256i hi0 = _mm256_srli_epi16(wb0, 4), hi1 = _mm256_srli_epi16(wb1, 4);
            for (int i = 0; i < MT; i++) {
                int32_t xh; /* the high nibbles' columns 16 + 2c, 17 + 2c */
                memcpy(&xh, r->q + (m0 + i) * K + g * 32 + 16 + 2 * c, 4);
                const __m256i b = _mm256_set1_epi32(xh);
                a0[i] = _mm256_add_epi32(a0[i], _mm256_madd_epi16(hi0, b));
                a1[i] = _mm256_add_epi32(a1[i], _mm256_madd_epi16(hi1, b));
                /* keep each running sum in its register as written: left alone, GCC reassociates the
                 * unrolled int32 adds into trees and spills the madd results to the stack (measured:
                 * 15-20% slower at one row, ~10% at 16) */
                __asm__("" : "+x"(a0[i]), "+x"(a1[i]));
            }
        }
        __m256 sc0, of0, sc1, of1; /* f16: the scales' mode (act_quant.h's q4_group_scales8) */
        q4_group_scales8(scale, offset, u, G, g, 0, f16, &sc0, &of0);
        q4_group_scales8(scale, offset, u, G, g, 1, f16, &sc1, &of1);
        for (int i = 0; i < MT; i++) {
            const int64_t m = m0 + i;
            const __m256 d = _mm256_broadcast_ss(r->d + m * G + g), s = _mm256_broadcast_ss(r->sum + m * G + g);
            acc0[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a0[i]), _mm256_mul_ps(sc0, d), acc0[i]);
            oacc0[i] = _mm256_fmadd_ps(of0, s, oacc0[i]);
            acc1[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a1[i]), _mm256_mul_ps(sc1, d), acc1[i]);
            oacc1[i] = _mm256_fmadd_ps(of1, s, oacc1[i]);
        }
    }
    for (int i = 0; i < MT; i++) {
        float out[16];
        _mm256_storeu_ps(out, _mm256_add_ps(acc0[i], oacc0[i]));
        _mm256_storeu_ps(out + 8, _mm256_add_ps(acc1[i], oacc1[i]));
        const int64_t n0 = u * 16, n_end = n0 + 16 < N ? n0 + 16 : N;
        for (int64_t n = n0; n < n_end; n++) y[(m0 + i) * N + n] = bias ? out[n - n0] + bias[n] : out[n - n0];
    }
}

/* Rows [m0, m_end) against unit u, in tiles of Q4_PAIR_TILE rows, then 2, then 1 */
static inline __attribute__((always_inline)) void q4_unit(const QuantRows *r, int64_t m0, int64_t m_end, int64_t u,
                                                          int64_t K, int64_t N, const uint8_t *qs, const void *scale,
                                                          const void *offset, const float *bias, float *y,
                                                          const int f16) {
    int64_t m = m0;
    for (; m + Q4_PAIR_TILE <= m_end; m += Q4_PAIR_TILE)
        q4_unit_tile(Q4_PAIR_TILE, r, m, u, K, N, qs, scale, offset, bias, y, f16);
    for (; m + 2 <= m_end; m += 2) q4_unit_tile(2, r, m, u, K, N, qs, scale, offset, bias, y, f16);
    if (m < m_end) q4_unit_tile(1, r, m, u, K, N, qs, scale, offset, bias, y, f16);
}

/* One parallel region: the rows are quantized (split across the threads), then, chunk by chunk of
 * Q4_ROW_CHUNK rows (a chunk's int16 activations stay in L2 while every weight unit passes over them;
 * a long prompt's rows would not), the weight units are split across the threads. */
static inline __attribute__((always_inline)) int q4_gemm(const float *x, int64_t M, int64_t K, const uint8_t *qs,
                                                         const void *scale, const void *offset, int64_t N,
                                                         const float *bias, float *y, int num_threads, const int f16) {
    QuantRows r;
    if (alloc_rows(M, K, &r)) return -1;
    const int64_t units = (N + 15) / 16;
    const int wide = avx512_gemm_enabled(); /* the AVX-512 tiles (gemm_avx512.c): the same bits */
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) quantize_row(x, m, K, &r);
        /* no barrier between chunks: a static schedule over the same trip count gives each thread the
         * same units in every chunk, and the outputs of different units never overlap */
        for (int64_t m0 = 0; m0 < M; m0 += Q4_ROW_CHUNK) {
            const int64_t m_end = m0 + Q4_ROW_CHUNK < M ? m0 + Q4_ROW_CHUNK : M;
#pragma omp for schedule(static) nowait
            for (int64_t u = 0; u < units; u++) {
                if (wide) q4_unit_avx512(&r, m0, m_end, u, K, N, qs, scale, offset, bias, y, f16);
                else q4_unit(&r, m0, m_end, u, K, N, qs, scale, offset, bias, y, f16);
            }
        }
    }
    free_rows(&r);
    return 0;
}

/* y (M, N) = x (M, K) @ W^T (+ bias), W in the q4 layout (see the top of this file; N padded to whole
 * units of 16 rows there, only the N rows written here); scale and offset float32, or IEEE half when
 * f16_scales is 1, or super-block factors in scale when it is Q4_SUPER (2; act_quant.h; K % 256 == 0).
 * 0 on success, -1 out of memory, -2 Q4_SUPER with K % 256 != 0. */
int onecall_q4_gemm(const float *x, int64_t M, int64_t K, const uint8_t *qs, const void *scale, const void *offset,
                    int64_t N, const float *bias, float *y, int num_threads, int f16_scales) {
    if (f16_scales == Q4_SUPER)
        return K % (32 * Q4_SUPER_GROUPS) ? -2 : q4_gemm(x, M, K, qs, scale, offset, N, bias, y, num_threads, Q4_SUPER);
    if (f16_scales) return q4_gemm(x, M, K, qs, scale, offset, N, bias, y, num_threads, 1);
    return q4_gemm(x, M, K, qs, scale, offset, N, bias, y, num_threads, 0);
}

/* ---- q4 weights x int8 activations (EngineConfig.int8_activations) ---------------------------------
 *
 * llama.cpp's arithmetic: each activation row is quantized per group of 32 to int8 (step absmax / 127,
 * round to nearest even), and a group's dot product is u8 x s8 maddubs pairs summed in int16, then in
 * int32: twice the multiplies per instruction of the int16 kernel above, at the cost of int8 steps
 * (relative error up to 1/254 of the group's largest value; tolerances in tests/test_native_kernels.py).
 * The rest is the q4 kernel's: a group's int dot is exact, scaled by weight scale x activation step,
 * plus offset x the group's float32 activation sum; every row through the same operations whatever M.
 *
 * Layout q4a8 (pack_q4(..., act8=True)), units of 16 rows as q4's: qs (N16 / 16, G, 2, 4, 8, 4) uint8:
 * unit, group, block k, quarter j, row b of the block, column t; the byte holds q[16u + 8k + b, g*32 +
 * 4j + t] in its low nibble and q[.., g*32 + 16 + 4j + t] in its high nibble. One 32-byte load of a
 * quarter, masked or shifted, is 8 rows x 4 columns as u8, row b in 32-bit lane b: against the
 * activation row's 4 int8 values of those columns, broadcast, one maddubs gives row b's two pair sums
 * in int16 lanes 2b and 2b + 1. A group's 8 maddubs per row add up in int16 (each <= 2 x 15 x 127 =
 * 3810, 8 of them <= 30480 < 2^15: no saturation), and one madd with ones sums the lane pair into row
 * b's int32 dot. */
#define ACT8_MAX 127.0f

typedef struct {
    int8_t *q;   /* (M, K) */
    float *d;    /* (M, G): activation step per group */
    float *sum;  /* (M, G): float32 sum per group */
} QuantRows8;

static void free_rows8(QuantRows8 *r) {
    free(r->q);
    free(r->d);
    free(r->sum);
}

static int alloc_rows8(int64_t M, int64_t K, QuantRows8 *r) {
    const int64_t G = K / 32;
    r->q = malloc((size_t)(M * K));
    r->d = malloc(sizeof(float) * (size_t)(M * G));
    r->sum = malloc(sizeof(float) * (size_t)(M * G));
    if (!r->q || !r->d || !r->sum) {
        free_rows8(r);
        return -1;
    }
    return 0;
}

/* quantize_row with int8 steps (d = absmax / ACT8_MAX); the group sum is the same float32 sum */
static inline void quantize_row8(const float *x, int64_t m, int64_t K, QuantRows8 *r) {
    const int64_t G = K / 32;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t g = 0; g < G; g++) {
        const float *p = x + m * K + g * 32;
        const __m256 v0 = _mm256_loadu_ps(p), v1 = _mm256_loadu_ps(p + 8);
        const __m256 v2 = _mm256_loadu_ps(p + 16), v3 = _mm256_loadu_ps(p + 24);
        const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                       _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        const float sum = hsum8(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
        float inv;
        const float d = group_step(hmax8(a), ACT8_MAX, sum, &inv);
        const __m256 iv = _mm256_set1_ps(inv);
        const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, iv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, iv));
        const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, iv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, iv));
        /* two packs work per 128-bit lane: 4-byte runs come out as i0a i1a i2a i3a i0b i1b i2b i3b */
        const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        _mm256_storeu_si256((__m256i *)(r->q + m * K + g * 32), _mm256_permutevar8x32_epi32(b, order));
        r->d[m * G + g] = d;
        r->sum[m * G + g] = sum;
    }
}

/* Unit u (two blocks of 8 weight rows) x MT activation rows from m0 (a compile-time constant at every
 * call site). Lane b of acc[k][i] is output (m0 + i, 16u + 8k + b):
 *   acc = fma(float(exact int dot of group g), scale[n, g] * step[m, g], acc) over g in order,
 *   oacc = fma(offset[n, g], sum(x in group g), oacc) over g in order, y = (acc + oacc) + bias:
 * the same operations for an output whichever tile computes it. Three rows a tile: 2 x 3 int16
 * accumulators, the unpacked weights and two broadcasts fit the 16 registers (four spill; same-process
 * A/B: three 0-7% faster than two at 512 rows, as fast at 16). */
#define Q4A8_TILE 3
static inline __attribute__((always_inline)) void q4a8_tile(const int MT, const QuantRows8 *r, int64_t m0, int64_t u,
                                                            int64_t K, int64_t N, const uint8_t *qs,
                                                            const void *scale, const void *offset, const float *bias,
                                                            float *y, const int f16) {
    const int64_t G = K / 32, es = f16 ? 2 : 4;
    const uint8_t *wu = qs + u * G * 256;
    const char *su = (const char *)scale + u * G * 16 * es, *ou = (const char *)offset + u * G * 16 * es;
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[2][Q4A8_TILE], oacc[2][Q4A8_TILE];
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < MT; i++) acc[k][i] = oacc[k][i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *wg = wu + g * 256;
        if (Q4_PREFETCH)
            for (int l = 0; l < 4; l++) _mm_prefetch((const char *)(wg + Q4_PREFETCH * 256 + 64 * l), _MM_HINT_T0);
        __m256i a[2][Q4A8_TILE];
        for (int k = 0; k < 2; k++)
            for (int i = 0; i < MT; i++) a[k][i] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            __m256i lo[2], hi[2];
            for (int k = 0; k < 2; k++) {
                const __m256i wb = _mm256_loadu_si256((const __m256i *)(wg + k * 128 + j * 32));
                lo[k] = _mm256_and_si256(wb, low4);
                hi[k] = _mm256_and_si256(_mm256_srli_epi16(wb, 4), low4);
            }
            for (int i = 0; i < MT; i++) {
                const int8_t *xq = r->q + (m0 + i) * K + g * 32 + 4 * j;
                int32_t xl, xh; /* columns 4j .. 4j + 3 and 16 + 4j .. 19 + 4j, broadcast to every lane */
                memcpy(&xl, xq, 4);
                memcpy(&xh, xq + 16, 4);
                const __m256i bl = _mm256_set1_epi32(xl), bh = _mm256_set1_epi32(xh);
                for (int k = 0; k < 2; k++)
                    a[k][i] = _mm256_add_epi16(a[k][i], _mm256_add_epi16(_mm256_maddubs_epi16(lo[k], bl),
                                                                         _mm256_maddubs_epi16(hi[k], bh)));
                __asm__("" : "+x"(a[0][i]), "+x"(a[1][i])); /* no add trees, no spills (see q4_unit_tile) */
            }
        }
        for (int k = 0; k < 2; k++) {
            const int64_t at = (g * 16 + 8 * k) * es;
            const __m256 sc = load8(su + at, f16), of = load8(ou + at, f16);
            for (int i = 0; i < MT; i++) {
                const int64_t m = m0 + i;
                const __m256 ds = _mm256_mul_ps(sc, _mm256_broadcast_ss(r->d + m * G + g));
                const __m256i dot = _mm256_madd_epi16(a[k][i], ones);
                acc[k][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), ds, acc[k][i]);
                oacc[k][i] = _mm256_fmadd_ps(of, _mm256_broadcast_ss(r->sum + m * G + g), oacc[k][i]);
            }
        }
    }
    for (int i = 0; i < MT; i++) {
        float out[16];
        for (int k = 0; k < 2; k++) _mm256_storeu_ps(out + 8 * k, _mm256_add_ps(acc[k][i], oacc[k][i]));
        const int64_t n0 = u * 16, n_end = n0 + 16 < N ? n0 + 16 : N;
        for (int64_t n = n0; n < n_end; n++) y[(m0 + i) * N + n] = bias ? out[n - n0] + bias[n] : out[n - n0];
    }
}

/* q4_gemm's parallel structure over the q4a8 layout and int8 activation rows */
static inline __attribute__((always_inline)) int q4a8_gemm(const float *x, int64_t M, int64_t K, const uint8_t *qs,
                                                           const void *scale, const void *offset, int64_t N,
                                                           const float *bias, float *y, int num_threads,
                                                           const int f16) {
    QuantRows8 r;
    if (alloc_rows8(M, K, &r)) return -1;
    const int64_t units = (N + 15) / 16;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) quantize_row8(x, m, K, &r);
        for (int64_t m0 = 0; m0 < M; m0 += Q4_ROW_CHUNK) {
            const int64_t m_end = m0 + Q4_ROW_CHUNK < M ? m0 + Q4_ROW_CHUNK : M;
#pragma omp for schedule(static) nowait
            for (int64_t u = 0; u < units; u++) {
                int64_t m = m0;
                for (; m + Q4A8_TILE <= m_end; m += Q4A8_TILE)
                    q4a8_tile(Q4A8_TILE, &r, m, u, K, N, qs, scale, offset, bias, y, f16);
                for (; m + 2 <= m_end; m += 2) q4a8_tile(2, &r, m, u, K, N, qs, scale, offset, bias, y, f16);
                if (m < m_end) q4a8_tile(1, &r, m, u, K, N, qs, scale, offset, bias, y, f16);
            }
        }
    }
    free_rows8(&r);
    return 0;
}

/* onecall_q4_gemm over the q4a8 layout with int8 activation rows (see above) */
int onecall_q4a8_gemm(const float *x, int64_t M, int64_t K, const uint8_t *qs, const void *scale, const void *offset,
                      int64_t N, const float *bias, float *y, int num_threads, int f16_scales) {
    if (f16_scales) return q4a8_gemm(x, M, K, qs, scale, offset, N, bias, y, num_threads, 1);
    return q4a8_gemm(x, M, K, qs, scale, offset, N, bias, y, num_threads, 0);
}

/* ---- int8 weights in pairs of 8-row blocks x int16 activations (the logits) -------------------------
 *
 * The q4 kernel's arithmetic for int8 weights (the checkpoint's Q8_0 groups of 32 or Q6_K groups of
 * 16): activation rows quantized to int16 per group of 32 (quantize_row), a scale group's dot an exact
 * int32 (madd of int8 weights widened to int16 against a broadcast activation pair, then int32 adds),
 * scaled by weight scale x activation step in float32. A group-32 dot (|dot| <= 32 x 127 x 32767) can
 * exceed 2^24, so its conversion to float32 may round (relative 6e-8): the same rounding whatever M.
 *
 * Layout q8b (native.pack_q8_blocked), N padded to whole units of 16 rows: qs (N16 / 16, K / 32, 2, 16,
 * 8, 2) int8: unit, group, block k of the unit (rows 8k .. 8k + 7), column pair c, row b of the block,
 * column j of the pair (column 2c + j of the group); scale (N16 / 16, K / group_size, 2, 8) float32. A
 * unit's groups follow one another, so a thread streams its units' weights in one sequential pass. One
 * 16-byte chunk widened to int16 is a block's 8 rows x one column pair: a madd against the pair,
 * broadcast, gives each row's partial dot in its own int32 lane. */
#define Q8B_MAX_TILE 4
#define Q8B_TILE 3 /* rows per tile: 2 x 3 int32 + 2 x 3 float accumulators fit the registers (4: 1.23-1.35x slower) */
#ifndef Q8B_PREFETCH
#define Q8B_PREFETCH 16 /* groups ahead (512 bytes each) that the weight stream is prefetched */
#endif

/* acc += float(a) * scale[unit, sg, k] * step[m, g] for the unit's 2 blocks x MT rows */
static inline __attribute__((always_inline)) void q8b_scale(const int MT, __m256 acc[2][Q8B_MAX_TILE],
                                                            const __m256i a[2][Q8B_MAX_TILE], const QuantRows *r,
                                                            int64_t m0, int64_t G, const float *sc, int64_t g) {
    for (int k = 0; k < 2; k++) {
        const __m256 s = _mm256_loadu_ps(sc + 8 * k);
        for (int i = 0; i < MT; i++) {
            const __m256 ds = _mm256_mul_ps(s, _mm256_broadcast_ss(r->d + (m0 + i) * G + g));
            acc[k][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[k][i]), ds, acc[k][i]);
        }
    }
}

/* Unit u (weight rows 16u .. 16u + 15) x MT activation rows from m0; G16: scale groups of 16 */
static inline __attribute__((always_inline)) void q8b_tile(const int MT, const int G16, const QuantRows *r,
                                                           int64_t m0, int64_t u, int64_t K, int64_t N,
                                                           const int8_t *qs, const float *scale, const float *bias,
                                                           float *y) {
    const int64_t G = K / 32, GS = G16 ? 2 * G : G; /* activation groups, scale groups per row */
    const int8_t *wu = qs + u * G * 512;
    const float *su = scale + u * GS * 16;
    __m256 acc[2][Q8B_MAX_TILE];
    __m256i a[2][Q8B_MAX_TILE];
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < MT; i++) acc[k][i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const int8_t *wg = wu + g * 512;
        if (Q8B_PREFETCH)
            for (int l = 0; l < 8; l++) _mm_prefetch((const char *)wg + Q8B_PREFETCH * 512 + 64 * l, _MM_HINT_T0);
        for (int k = 0; k < 2; k++)
            for (int i = 0; i < MT; i++) a[k][i] = _mm256_setzero_si256();
        for (int half = 0; half < 2; half++) { /* columns 0-15, then 16-31 */
            if (G16 && half == 1) { /* the first 16 columns end a scale group */
                q8b_scale(MT, acc, a, r, m0, G, su + 2 * g * 16, g);
                for (int k = 0; k < 2; k++)
                    for (int i = 0; i < MT; i++) a[k][i] = _mm256_setzero_si256();
            }
#pragma GCC unroll 8
            for (int cc = 0; cc < 8; cc++) { /* unrolled, with no scale-group test inside (measured faster) */
                const int c = 8 * half + cc;
                const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wg + c * 16)));
                const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wg + 256 + c * 16)));
                for (int i = 0; i < MT; i++) {
                    int32_t xp; /* the column pair's two int16 activations, broadcast to every 32-bit lane */
                    memcpy(&xp, r->q + (m0 + i) * K + g * 32 + 2 * c, 4);
                    const __m256i b = _mm256_set1_epi32(xp);
                    a[0][i] = _mm256_add_epi32(a[0][i], _mm256_madd_epi16(w0, b));
                    a[1][i] = _mm256_add_epi32(a[1][i], _mm256_madd_epi16(w1, b));
                    __asm__("" : "+x"(a[0][i]), "+x"(a[1][i])); /* no add trees, no spills (q4_unit_tile) */
                }
            }
        }
        q8b_scale(MT, acc, a, r, m0, G, su + (G16 ? 2 * g + 1 : g) * 16, g);
    }
    for (int i = 0; i < MT; i++) {
        float out[16];
        for (int k = 0; k < 2; k++) _mm256_storeu_ps(out + 8 * k, acc[k][i]);
        const int64_t n0 = u * 16, n_end = n0 + 16 < N ? n0 + 16 : N;
        for (int64_t n = n0; n < n_end; n++) y[(m0 + i) * N + n] = bias ? out[n - n0] + bias[n] : out[n - n0];
    }
}

/* q4_gemm's parallel structure over the q8b layout */
static inline __attribute__((always_inline)) int q8b_gemm(const int G16, const float *x, int64_t M, int64_t K,
                                                          const int8_t *qs, const float *scale, int64_t N,
                                                          const float *bias, float *y, int num_threads) {
    QuantRows r;
    if (alloc_rows(M, K, &r)) return -1;
    const int64_t units = (N + 15) / 16;
    const int wide = avx512_gemm_enabled(); /* the AVX-512 tiles (gemm_avx512.c): the same bits */
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) quantize_row(x, m, K, &r);
        for (int64_t m0 = 0; m0 < M; m0 += Q4_ROW_CHUNK) {
            const int64_t m_end = m0 + Q4_ROW_CHUNK < M ? m0 + Q4_ROW_CHUNK : M;
#pragma omp for schedule(static) nowait
            for (int64_t u = 0; u < units; u++) {
                if (wide) {
                    q8b_unit_avx512(&r, m0, m_end, u, K, N, qs, scale, bias, y, G16);
                    continue;
                }
                int64_t m = m0;
                for (; m + Q8B_TILE <= m_end; m += Q8B_TILE) q8b_tile(Q8B_TILE, G16, &r, m, u, K, N, qs, scale, bias, y);
                for (; m + 2 <= m_end; m += 2) q8b_tile(2, G16, &r, m, u, K, N, qs, scale, bias, y);
                if (m < m_end) q8b_tile(1, G16, &r, m, u, K, N, qs, scale, bias, y);
            }
        }
    }
    free_rows(&r);
    return 0;
}

/* y (M, N) = x (M, K) @ W^T (+ bias), W int8 in the q8b layout with float32 scales per group of
 * group_size (32 or 16; K % 32 == 0). 0 on success, -1 out of memory, -2 a group size it does not take. */
int onecall_q8b_gemm(const float *x, int64_t M, int64_t K, const int8_t *qs, const float *scale, int64_t N,
                     const float *bias, float *y, int num_threads, int group_size) {
    if (K % 32) return -2;
    if (group_size == 32) return q8b_gemm(0, x, M, K, qs, scale, N, bias, y, num_threads);
    if (group_size == 16) return q8b_gemm(1, x, M, K, qs, scale, N, bias, y, num_threads);
    return -2;
}

/* ---- IQ4 codes (IQ4_NL, IQ4_XS; MXFP4) x int16 activations ------------------------------------------
 *
 * An IQ4 weight is a 4-bit index per value into a 16-entry int8 codebook (codebooks.h, by the
 * `codebook` number: 0 the non-linear kvalues_iq4nl, -127 .. 113; 1 MXFP4's doubled e2m1 values, -12 ..
 * 12) with one scale per group of 32 (IQ4_NL: the block's d; IQ4_XS: d x (6-bit sub-scale - 32), exact in
 * float32; MXFP4: 2^(e - 128)): w = codebook[code] * scale (quants.Int4CodeGroups). The table is one
 * register loaded before the loops, so either codebook runs the same instructions. Layout iq4
 * (native.pack_iq4): the codes in exactly the q4 layout's bytes (qs (N16 / 16, G, 2, 8, 8, 2), a byte
 * holding column 2c + j in its low nibble and 16 + 2c + j in its high one), scale (N16 / 16, G, 2, 8)
 * float32 or IEEE half (no offset): 4 bits a weight plus the scales, half what the int8 conversion of
 * these files read.
 *
 * Arithmetic: the q8b kernel's, with the codebook lookup in the weight load. A block's chunk c (16
 * bytes: 8 rows x column pair) has its low and high nibbles masked out and turned into their int8
 * codebook values with one vpshufb each (the 16 values are the table), then sign-extended to int16, so
 * each 16-lane vector is the 8 rows' values at a column pair, row b in 32-bit lane b: one madd against the
 * activation pair (int16 steps per group of 32, act_quant.h's quantize_row, so a row rounds exactly as
 * for the other kernels), broadcast, gives each row's partial dot in its own lane. A group's dot is an
 * exact int32 (|dot| <= 32 x 127 x 32767 < 2^27; its conversion to float32 may round, relative 6e-8,
 * the same whatever M), then acc = fma(float(dot), scale[n, g] * step[m, g], acc) over g in order, y =
 * acc + bias: every row through the same operations in the same order whatever M, the tile or the thread
 * count (batch invariance). Tolerances: tests/kernels/test_iq4_kernel.py. */
#define IQ4_TILE 3 /* rows per tile, as q4's: 2 x 3 int32 + 2 x 3 float accumulators stay in registers */

static inline __attribute__((always_inline)) void iq4_tile(const int MT, const QuantRows *r, int64_t m0, int64_t u,
                                                           int64_t K, int64_t N, const uint8_t *qs,
                                                           const void *scale, const float *bias, float *y,
                                                           const int f16, const int codebook) {
    const int64_t G = K / 32, es = f16 ? 2 : 4;
    const uint8_t *wu = qs + u * G * 256;
    const char *su = (const char *)scale + u * G * 16 * es;
    const __m128i table = _mm_load_si128((const __m128i *)onecall_codebooks[codebook]);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    __m256 acc[2][Q4_PAIR_TILE];
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < MT; i++) acc[k][i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *wg = wu + g * 256;
        if (Q4_PREFETCH)
            for (int l = 0; l < 4; l++) _mm_prefetch((const char *)(wg + Q4_PREFETCH * 256 + 64 * l), _MM_HINT_T0);
        __m256i a[2][Q4_PAIR_TILE];
        for (int k = 0; k < 2; k++)
            for (int i = 0; i < MT; i++) a[k][i] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            __m256i lo[2], hi[2];
            for (int k = 0; k < 2; k++) {
                const __m128i wb = _mm_loadu_si128((const __m128i *)(wg + k * 128 + c * 16));
                lo[k] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(wb, low4)));
                hi[k] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(wb, 4), low4)));
            }
            for (int i = 0; i < MT; i++) {
                int32_t xl, xh; /* the column pair's int16 activations: low nibbles' columns, then high's */
                memcpy(&xl, r->q + (m0 + i) * K + g * 32 + 2 * c, 4);
                memcpy(&xh, r->q + (m0 + i) * K + g * 32 + 16 + 2 * c, 4);
                const __m256i bl = _mm256_set1_epi32(xl), bh = _mm256_set1_epi32(xh);
                a[0][i] = _mm256_add_epi32(a[0][i], _mm256_madd_epi16(lo[0], bl));
                a[1][i] = _mm256_add_epi32(a[1][i], _mm256_madd_epi16(lo[1], bl));
                a[0][i] = _mm256_add_epi32(a[0][i], _mm256_madd_epi16(hi[0], bh));
                a[1][i] = _mm256_add_epi32(a[1][i], _mm256_madd_epi16(hi[1], bh));
                __asm__("" : "+x"(a[0][i]), "+x"(a[1][i])); /* no add trees, no spills (q4_unit_tile) */
            }
        }
        for (int k = 0; k < 2; k++) {
            const __m256 sc = load8(su + (g * 16 + 8 * k) * es, f16);
            for (int i = 0; i < MT; i++) {
                const __m256 ds = _mm256_mul_ps(sc, _mm256_broadcast_ss(r->d + (m0 + i) * G + g));
                acc[k][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[k][i]), ds, acc[k][i]);
            }
        }
    }
    for (int i = 0; i < MT; i++) {
        float out[16];
        for (int k = 0; k < 2; k++) _mm256_storeu_ps(out + 8 * k, acc[k][i]);
        const int64_t n0 = u * 16, n_end = n0 + 16 < N ? n0 + 16 : N;
        for (int64_t n = n0; n < n_end; n++) y[(m0 + i) * N + n] = bias ? out[n - n0] + bias[n] : out[n - n0];
    }
}

/* Prompt rows: with IQ4_BUFFER_ROWS or more rows in a chunk, a unit's codes are looked up once into a
 * thread's int16 buffer (its 16 rows x K values, in the q8b layout's order widened: group g, block k,
 * column pair p, row b, column j of the pair), which every tile of the chunk then reads as the q8b
 * kernel reads its weights (madd straight from the buffer), instead of each tile of 3 rows doing the
 * lookups again (measured at 64 rows: ~1.3x faster). A group's int32 dot is exact either way and the
 * float32 operations are the same, so a row's bits do not depend on which path ran it. */
#define IQ4_BUFFER_ROWS 8

static void iq4_decode_unit(const uint8_t *wu, int64_t G, int16_t *buf, int codebook) {
    const __m128i table = _mm_load_si128((const __m128i *)onecall_codebooks[codebook]);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    for (int64_t gk = 0; gk < 2 * G; gk++) /* a group's block k: 128 bytes -> 16 pairs x 16 int16 */
        for (int c = 0; c < 8; c++) {
            const __m128i wb = _mm_loadu_si128((const __m128i *)(wu + gk * 128 + c * 16));
            const __m256i lo = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(wb, low4)));
            const __m256i hi =
                _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(wb, 4), low4)));
            _mm256_storeu_si256((__m256i *)(buf + (gk * 16 + c) * 16), lo);
            _mm256_storeu_si256((__m256i *)(buf + (gk * 16 + 8 + c) * 16), hi);
        }
}

/* iq4_tile's arithmetic over a unit looked up into buf (iq4_decode_unit) */
static inline __attribute__((always_inline)) void iq4_buffered_tile(const int MT, const QuantRows *r, int64_t m0,
                                                                    int64_t u, int64_t K, int64_t N,
                                                                    const int16_t *buf, const void *scale,
                                                                    const float *bias, float *y, const int f16) {
    const int64_t G = K / 32, es = f16 ? 2 : 4;
    const char *su = (const char *)scale + u * G * 16 * es;
    __m256 acc[2][Q4_PAIR_TILE];
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < MT; i++) acc[k][i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const int16_t *wg = buf + g * 512;
        __m256i a[2][Q4_PAIR_TILE];
        for (int k = 0; k < 2; k++)
            for (int i = 0; i < MT; i++) a[k][i] = _mm256_setzero_si256();
#pragma GCC unroll 16
        for (int p = 0; p < 16; p++) {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wg + p * 16));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wg + 256 + p * 16));
            for (int i = 0; i < MT; i++) {
                int32_t xp; /* the column pair's two int16 activations, broadcast */
                memcpy(&xp, r->q + (m0 + i) * K + g * 32 + 2 * p, 4);
                const __m256i b = _mm256_set1_epi32(xp);
                a[0][i] = _mm256_add_epi32(a[0][i], _mm256_madd_epi16(w0, b));
                a[1][i] = _mm256_add_epi32(a[1][i], _mm256_madd_epi16(w1, b));
                __asm__("" : "+x"(a[0][i]), "+x"(a[1][i])); /* no add trees, no spills (q4_unit_tile) */
            }
        }
        for (int k = 0; k < 2; k++) {
            const __m256 sc = load8(su + (g * 16 + 8 * k) * es, f16);
            for (int i = 0; i < MT; i++) {
                const __m256 ds = _mm256_mul_ps(sc, _mm256_broadcast_ss(r->d + (m0 + i) * G + g));
                acc[k][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[k][i]), ds, acc[k][i]);
            }
        }
    }
    for (int i = 0; i < MT; i++) {
        float out[16];
        for (int k = 0; k < 2; k++) _mm256_storeu_ps(out + 8 * k, acc[k][i]);
        const int64_t n0 = u * 16, n_end = n0 + 16 < N ? n0 + 16 : N;
        for (int64_t n = n0; n < n_end; n++) y[(m0 + i) * N + n] = bias ? out[n - n0] + bias[n] : out[n - n0];
    }
}

/* q4_gemm's parallel structure over the iq4 layout; bufs: num_threads buffers of 16 x K int16 (or NULL
 * when M < IQ4_BUFFER_ROWS or the AVX-512 tiles run, which keep their own: no chunk uses them) */
static inline __attribute__((always_inline)) int iq4_gemm(const float *x, int64_t M, int64_t K, const uint8_t *qs,
                                                          const void *scale, int64_t N, const float *bias, float *y,
                                                          int num_threads, const int f16, const int codebook) {
    QuantRows r;
    if (alloc_rows(M, K, &r)) return -1;
    const int wide = avx512_gemm_enabled(); /* the AVX-512 tiles (gemm_avx512.c): the same bits */
    int16_t *bufs = NULL;
    if (!wide && M >= IQ4_BUFFER_ROWS && !(bufs = malloc(sizeof(int16_t) * (size_t)(16 * K * (num_threads > 0 ? num_threads : 1))))) {
        free_rows(&r);
        return -1;
    }
    const int64_t units = (N + 15) / 16, G = K / 32;
#pragma omp parallel num_threads(num_threads)
    {
        int16_t *buf = bufs ? bufs + (int64_t)omp_get_thread_num() * 16 * K : NULL;
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) quantize_row(x, m, K, &r);
        for (int64_t m0 = 0; m0 < M; m0 += Q4_ROW_CHUNK) {
            const int64_t m_end = m0 + Q4_ROW_CHUNK < M ? m0 + Q4_ROW_CHUNK : M;
#pragma omp for schedule(static) nowait
            for (int64_t u = 0; u < units; u++) {
                if (wide) {
                    iq4_unit_avx512(&r, m0, m_end, u, K, N, qs, scale, bias, y, f16, codebook);
                    continue;
                }
                int64_t m = m0;
                if (buf && m_end - m0 >= IQ4_BUFFER_ROWS) {
                    iq4_decode_unit(qs + u * G * 256, G, buf, codebook);
                    for (; m + IQ4_TILE <= m_end; m += IQ4_TILE)
                        iq4_buffered_tile(IQ4_TILE, &r, m, u, K, N, buf, scale, bias, y, f16);
                    for (; m + 2 <= m_end; m += 2) iq4_buffered_tile(2, &r, m, u, K, N, buf, scale, bias, y, f16);
                    if (m < m_end) iq4_buffered_tile(1, &r, m, u, K, N, buf, scale, bias, y, f16);
                    continue;
                }
                for (; m + IQ4_TILE <= m_end; m += IQ4_TILE)
                    iq4_tile(IQ4_TILE, &r, m, u, K, N, qs, scale, bias, y, f16, codebook);
                for (; m + 2 <= m_end; m += 2) iq4_tile(2, &r, m, u, K, N, qs, scale, bias, y, f16, codebook);
                if (m < m_end) iq4_tile(1, &r, m, u, K, N, qs, scale, bias, y, f16, codebook);
            }
        }
    }
    free(bufs);
    free_rows(&r);
    return 0;
}

/* y (M, N) = x (M, K) @ W^T (+ bias), W codes into codebook `codebook` (codebooks.h) in the iq4 layout (see
 * above) with scales float32, or IEEE half when f16_scales. 0 on success, -1 out of memory, -2 K % 32 != 0
 * or a codebook number outside 0 .. ONECALL_NUM_CODEBOOKS - 1. */
int onecall_iq4_gemm(const float *x, int64_t M, int64_t K, const uint8_t *qs, const void *scale, int64_t N,
                     const float *bias, float *y, int num_threads, int f16_scales, int codebook) {
    if (K % 32 || codebook < 0 || codebook >= ONECALL_NUM_CODEBOOKS) return -2;
    if (f16_scales) return iq4_gemm(x, M, K, qs, scale, N, bias, y, num_threads, 1, codebook);
    return iq4_gemm(x, M, K, qs, scale, N, bias, y, num_threads, 0, codebook);
}
