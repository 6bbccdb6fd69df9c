/* The 5-bit GEMM: y = x @ W^T (+ bias) over weights kept as the GGUF's 5-bit groups of 32 (Q5_0, Q5_1,
 * Q5_K: quants.Int5Groups, w = q * scale + offset with q in 0..31), against activation rows quantized
 * per group of 32 to int16 steps exactly as the q4 kernel quantizes them (act_quant.h).
 *
 *   onecall_q5_gemm   5-bit weights (the q5 layout) x int16 activations: every row, decode and prompt
 *
 * Layout q5 (native.pack_q5), rows in units of 16 as q4's (N padded with zero rows to a multiple of 16):
 * per unit u and group g, Q5_GROUP_BYTES = 320 contiguous bytes, the unit's groups one after another (a
 * thread streams its units in one sequential pass):
 *   bytes 0 .. 255   the low 4 bits of the group's values, exactly as the q4 layout holds a group
 *                    (2, 8, 8, 2): block k, column pair c, row b of the block, column j of the pair; the
 *                    byte holds column 2c + j in its low nibble and column 16 + 2c + j in its high one;
 *   bytes 256 .. 319 16 little-endian uint32 words of 5th bits, word 8k + c for block k's column pair c:
 *                    its bit b + 8h + 16j is the 5th bit of q[16u + 8k + b, 32g + 16h + 2c + j].
 * scale, offset (N16 / 16, G, 2, 8) float32 or IEEE half, as q4's. So 5 bits a weight plus the scales:
 * 6 with half scales (Q5_0: d and -16 d; Q5_1: d and m; the files hold 5.5 and 6), 7 with float32 ones
 * (Q5_K's products d * sc, dmin * m; the file holds 5.5).
 *
 * Arithmetic (the q4 kernel's, gemm.c): chunk c of a block, 16 bytes widened to 16 int16 lanes, is the
 * 8 rows x column pair (2c, 2c + 1), row b in 32-bit lane b. Its 5th bits reach their lanes with one
 * variable shift: the chunk's word broadcast to every 32-bit lane and shifted right by b in lane b leaves
 * in int16 lane (b, j) bit 0 = the low nibble's 5th bit and bit 8 = the high nibble's, which are moved to
 * bit 4 and OR-ed onto the nibbles. One madd against the activation row's column pair, broadcast, gives
 * each row's partial dot in its own int32 lane; a group's dot is an exact int32 (|dot| <= 32 x 31 x 32767
 * < 2^25: its conversion to float32 may round, relative 6e-8, the same whatever M), then
 *   acc = fma(float(dot), scale[n, g] * step[m, g], acc), oacc = fma(offset[n, g], sum(x in g), oacc)
 * over g in order, y = (acc + oacc) + bias. Every row goes through the same operations in the same order
 * whatever M, the tile or the thread count: batch invariance. Tolerances: tests/kernels/test_quant_kernels.py.
 * On CPUs with AVX-512 VNNI the units' rows run on gemm_avx512.c's q5 tiles (the same outputs bit for bit).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "act_quant.h"
#include "gemm_avx512.h"
#include "kernels.h"

#define Q5_GROUP_BYTES 320 /* one unit's group: 256 bytes of nibbles, 64 of 5th bits */
#define Q5_TILE 4 /* activation rows per tile (the bit work per chunk is shared by more rows: 3 was 9% slower at 64) */
#ifndef Q5_PREFETCH
#define Q5_PREFETCH 16 /* groups ahead that the weight stream is prefetched */
#endif

/* The 16 int16 lanes of a chunk's low-nibble columns (lo) and high-nibble columns (hi) as 5-bit values:
 * wb the chunk's bytes widened, h its 5th-bit word shifted right by b in 32-bit lane b. */
static inline __attribute__((always_inline)) void q5_values(__m256i wb, __m256i h, __m256i *lo, __m256i *hi) {
    const __m256i low4 = _mm256_set1_epi16(0x0F), bit4 = _mm256_set1_epi16(0x10), bit8 = _mm256_set1_epi16(0x100);
    *lo = _mm256_or_si256(_mm256_and_si256(wb, low4), _mm256_and_si256(_mm256_slli_epi16(h, 4), bit4));
    *hi = _mm256_srli_epi16(_mm256_or_si256(wb, _mm256_and_si256(h, bit8)), 4); /* bit 8 lands on bit 4 */
}

/* Unit u (two blocks of 8 weight rows) x MT activation rows from m0 (a compile-time constant at every
 * call site). Lane b of acc_k[i] is output (m0 + i, 16u + 8k + b). */
static inline __attribute__((always_inline)) void q5_unit_tile(const int MT, const QuantRows *r, int64_t m0,
                                                               int64_t u, int64_t K, int64_t N, const uint8_t *qs,
                                                               const void *scale, const void *offset,
                                                               const float *bias, float *y, const int f16) {
    const int64_t G = K / 32, es = f16 ? 2 : 4;
    const uint8_t *wu = qs + u * G * Q5_GROUP_BYTES;
    const char *su = (const char *)scale + u * G * 16 * es, *ou = (const char *)offset + u * G * 16 * es;
    const __m256i rows = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 acc0[Q5_TILE], oacc0[Q5_TILE], acc1[Q5_TILE], oacc1[Q5_TILE];
    for (int i = 0; i < MT; i++) acc0[i] = oacc0[i] = acc1[i] = oacc1[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *wg0 = wu + g * Q5_GROUP_BYTES, *wg1 = wg0 + 128, *hb = wg0 + 256;
        if (Q5_PREFETCH)
            for (int l = 0; l < 5; l++)
                _mm_prefetch((const char *)(wg0 + Q5_PREFETCH * Q5_GROUP_BYTES + 64 * l), _MM_HINT_T0);
        __m256i a0[Q5_TILE], a1[Q5_TILE];
        for (int i = 0; i < MT; i++) a0[i] = a1[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            int32_t w0, w1; /* the two blocks' 5th-bit words of this column pair */
            memcpy(&w0, hb + 4 * c, 4);
            memcpy(&w1, hb + 32 + 4 * c, 4);
            __m256i lo0, hi0, lo1, hi1;
            q5_values(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wg0 + c * 16))),
                      _mm256_srlv_epi32(_mm256_set1_epi32(w0), rows), &lo0, &hi0);
            q5_values(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wg1 + c * 16))),
                      _mm256_srlv_epi32(_mm256_set1_epi32(w1), rows), &lo1, &hi1);
            for (int i = 0; i < MT; i++) {
                int32_t xl, xh; /* the column pair's int16 activations: low nibbles' columns, then high's */
                memcpy(&xl, r->q + (m0 + i) * K + g * 32 + 2 * c, 4);
                memcpy(&xh, r->q + (m0 + i) * K + g * 32 + 16 + 2 * c, 4);
                const __m256i bl = _mm256_set1_epi32(xl), bh = _mm256_set1_epi32(xh);
                a0[i] = _mm256_add_epi32(a0[i], _mm256_madd_epi16(lo0, bl));
                a1[i] = _mm256_add_epi32(a1[i], _mm256_madd_epi16(lo1, bl));
                a0[i] = _mm256_add_epi32(a0[i], _mm256_madd_epi16(hi0, bh));
                a1[i] = _mm256_add_epi32(a1[i], _mm256_madd_epi16(hi1, bh));
                __asm__("" : "+x"(a0[i]), "+x"(a1[i])); /* no add trees, no spills (gemm.c's q4_unit_tile) */
            }
        }
        const __m256 sc0 = load8(su + g * 16 * es, f16), of0 = load8(ou + g * 16 * es, f16);
        const __m256 sc1 = load8(su + (g * 16 + 8) * es, f16), of1 = load8(ou + (g * 16 + 8) * es, f16);
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

/* gemm.c's q4_gemm structure: the rows quantized (split across the threads), then chunk by chunk of
 * Q4_ROW_CHUNK rows the weight units split across the threads, each unit's rows in tiles of Q5_TILE,
 * then 2, then 1. */
static inline __attribute__((always_inline)) int q5_gemm(const float *x, int64_t M, int64_t K, const uint8_t *qs,
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
        for (int64_t m0 = 0; m0 < M; m0 += Q4_ROW_CHUNK) {
            const int64_t m_end = m0 + Q4_ROW_CHUNK < M ? m0 + Q4_ROW_CHUNK : M;
#pragma omp for schedule(static) nowait
            for (int64_t u = 0; u < units; u++) {
                if (wide) {
                    q5_unit_avx512(&r, m0, m_end, u, K, N, qs, scale, offset, bias, y, f16);
                    continue;
                }
                int64_t m = m0;
                for (; m + Q5_TILE <= m_end; m += Q5_TILE)
                    q5_unit_tile(Q5_TILE, &r, m, u, K, N, qs, scale, offset, bias, y, f16);
                for (; m + 2 <= m_end; m += 2) q5_unit_tile(2, &r, m, u, K, N, qs, scale, offset, bias, y, f16);
                if (m < m_end) q5_unit_tile(1, &r, m, u, K, N, qs, scale, offset, bias, y, f16);
            }
        }
    }
    free_rows(&r);
    return 0;
}

int onecall_q5_gemm(const float *x, int64_t M, int64_t K, const uint8_t *qs, const void *scale, const void *offset,
                    int64_t N, const float *bias, float *y, int num_threads, int f16_scales) {
    if (K % 32) return -2;
    if (f16_scales) return q5_gemm(x, M, K, qs, scale, offset, N, bias, y, num_threads, 1);
    return q5_gemm(x, M, K, qs, scale, offset, N, bias, y, num_threads, 0);
}

/* Rows ids[0 .. M) of an (N, K) table in the q5 layout, dequantized: float(q) * scale + offset (a
 * product then a sum, two float32 roundings, as Int5Groups.dequantize computes it). */
int onecall_q5_rows(const uint8_t *qs, const void *scale, const void *offset, int64_t N, int64_t K, int f16,
                    const int64_t *ids, int64_t M, float *out) {
    if (K % 32) return -2;
    for (int64_t m = 0; m < M; m++) /* checked before anything is written */
        if (ids[m] < 0 || ids[m] >= N) return -3;
    const int64_t G = K / 32;
    for (int64_t m = 0; m < M; m++) {
        const int64_t n = ids[m], u = n / 16, k = (n % 16) / 8, b = n % 8;
        float *row = out + m * K;
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *wg = qs + (u * G + g) * Q5_GROUP_BYTES;
            const int64_t at = ((u * G + g) * 2 + k) * 8 + b; /* this row's scale and offset */
            const float s = f16 ? _cvtsh_ss(((const uint16_t *)scale)[at]) : ((const float *)scale)[at];
            const float o = f16 ? _cvtsh_ss(((const uint16_t *)offset)[at]) : ((const float *)offset)[at];
            for (int64_t c = 0; c < 8; c++) {
                uint32_t word;
                memcpy(&word, wg + 256 + 4 * (8 * k + c), 4);
                for (int64_t j = 0; j < 2; j++) {
                    const uint8_t byte = wg[k * 128 + c * 16 + b * 2 + j];
                    const int lo = (byte & 0x0F) | (int)((word >> (b + 16 * j)) & 1) << 4;
                    const int hi = (byte >> 4) | (int)((word >> (b + 8 + 16 * j)) & 1) << 4;
                    row[g * 32 + 2 * c + j] = (float)lo * s + o;
                    row[g * 32 + 16 + 2 * c + j] = (float)hi * s + o;
                }
            }
        }
    }
    return 0;
}
