/* The K-quants' low-bit GEMM: y = x @ W^T (+ bias) over weights kept as the GGUF's Q6_K, Q3_K or Q2_K
 * codes on their own bits (quants.KQuantGroups), one scale per 16 columns, against activation rows
 * quantized per group of 32 to int16 steps exactly as the q4 kernel quantizes them (act_quant.h).
 *
 *   onecall_kq_gemm   6-, 3- or 2-bit codes (the kq layout) x int16 activations: every row, decode and prompt
 *   onecall_kq_rows   rows of a table in the kq layout, dequantized (a token embedding, a tied head)
 *   onecall_kq_pack   codes (N, K) -> the layout's bytes (one pass; native.pack_kq lays out the scales)
 *
 * The values, per 16 columns (a sub-block of the file's super-block of 256), with z the code's zero point:
 *   Q6_K (bits 6): w = (d * sc) * (q - 32), q 0..63, sc int8;        z = 32
 *   Q3_K (bits 3): w = (d * sc) * (q - 4),  q 0..7,  sc = s - 32;    z = 4
 *   Q2_K (bits 2): w = (d * sc) * q - dmin * m, q 0..3, sc, m 0..15; z = 0
 * d, dmin the super-block's float16 numbers; d * sc (and dmin * m) are exact float32 products (11 bits
 * times 8), so forming them here gives the bits the float32 products ggml forms.
 *
 * Layout kq (native.pack_kq), rows in units of 16 as q4's (N padded with zero rows to a multiple of 16),
 * two blocks k of 8 rows b; per unit u and group g of 32 columns, KQ_BYTES(bits) contiguous bytes (a
 * thread streams its units in one sequential pass):
 *   bits 6: bytes 0 .. 255 the codes' low 4 bits exactly as the q4 layout holds a group (gemm_q5.c's
 *           top comment), then bytes 256 .. 383 their top 2 bits as a 2-bit plane;
 *   bits 3: bytes 0 .. 127 the codes' low 2 bits as a 2-bit plane, then bytes 128 .. 191 their 3rd bits
 *           as the q5 layout's 16 words of 5th bits (bit b + 8h + 16j of word 8k + c);
 *   bits 2: bytes 0 .. 127 the codes as a 2-bit plane.
 * The 2-bit plane: chunk c (16 bytes) of the group, byte 2b + j holds row b's column 2c + j of block 0
 * in bits 0-1, its column 16 + 2c + j in bits 2-3, and the same two of block 1 in bits 4-5 and 6-7: the
 * chunk's 16 bytes widened to 16 int16 lanes line up with the nibble chunks' lanes.
 * scales int8 (planes, N16 / 16, G, 2, 2, 8): sc of (unit, group, block k, half h, row b), half h the
 * group's columns 16h .. 16h + 15; Q2_K's m in a second plane. supers IEEE half (planes, N16 / 16,
 * K / 256, 2, 8): d (Q2_K: then dmin). So 6.56, 3.56 and 3.13 bits a weight (the files: 6.56, 3.44, 2.63).
 *
 * Arithmetic: each half h of a group (its own scale) in turn: per chunk c the int16 lanes of both blocks'
 * signed values (q - z) in half h, each madd-ed with the activation row's column pair there (broadcast),
 * accumulate in two int32 accumulators per row (one a block), so a tile of 4 rows shares each chunk's
 * unpacking (prompt chunks of KQ_BUFFER_ROWS rows or more unpack a unit once, into a thread's int16
 * buffer, kq_widen). A half's dot is an exact integer, |dot| <= 16 x 32 x 32767 < 2^24, so its
 * conversion to float32 is exact too; then, over
 * g in order, acc = fma(float(dot_h), (d * sc_h) * step[m, g], acc) for h = 0, 1 and (Q2_K) oacc =
 * fma(-(dmin * m_h), sum16[m, 2g + h], oacc) with sum16 the float32 sum of the activations of those 16
 * columns (kq_sums: a fixed order), y = (acc + oacc) + bias. Every row goes through the same operations
 * in the same order whatever M, the tile or the thread count: batch invariance. Q6_K and Q3_K so run the
 * very float32 operations the q8b kernel runs on their int8 groups of 16 (gemm.c): the same values. Tolerances:
 * tests/kernels/test_kquant_kernels.py. On CPUs with AVX-512 VNNI the units' rows run on gemm_kq_avx512.c's
 * tile (the same outputs bit for bit).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "act_quant.h"
#include "gemm_avx512.h" /* KQ_BYTES, and the AVX-512 tile */
#include "kernels.h"

#define KQ_TILE 4 /* activation rows per tile: two int32 accumulators a row, one half-group at a time */
#define KQ_BUFFER_ROWS 8 /* chunks of this many rows or more read a unit's values widened once (kq_widen) */
#ifndef KQ_PREFETCH
#define KQ_PREFETCH 16 /* groups ahead that the weight stream is prefetched */
#endif

/* Chunk c's lanes of half h (columns 16h + 2c, 16h + 2c + 1) as signed values q - z, block 0 in *v0 and
 * block 1 in *v1 (lane (b, j): row b, column 16h + 2c + j) */
static inline __attribute__((always_inline)) void kq_values(const int bits, const int h, const uint8_t *wg, int c,
                                                            __m256i *v0, __m256i *v1) {
    const __m256i m2 = _mm256_set1_epi16(3), top = _mm256_set1_epi16(0x30);
    const uint8_t *plane2 = wg + (bits == 6 ? 256 : 0);
    const __m256i p = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(plane2 + c * 16)));
    if (bits == 6) { /* nibbles | the 2-bit plane's pair << 4 */
        const __m256i n0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wg + c * 16)));
        const __m256i n1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wg + 128 + c * 16)));
        const __m256i low4 = _mm256_set1_epi16(0x0F), z = _mm256_set1_epi16(32);
        const __m256i l0 = h ? _mm256_srli_epi16(n0, 4) : _mm256_and_si256(n0, low4);
        const __m256i l1 = h ? _mm256_srli_epi16(n1, 4) : _mm256_and_si256(n1, low4);
        const __m256i t0 = _mm256_and_si256(h ? _mm256_slli_epi16(p, 2) : _mm256_slli_epi16(p, 4), top);
        const __m256i t1 = _mm256_and_si256(h ? _mm256_srli_epi16(p, 2) : p, top);
        *v0 = _mm256_sub_epi16(_mm256_or_si256(l0, t0), z);
        *v1 = _mm256_sub_epi16(_mm256_or_si256(l1, t1), z);
        return;
    }
    *v0 = _mm256_and_si256(h ? _mm256_srli_epi16(p, 2) : p, m2);
    *v1 = h ? _mm256_srli_epi16(p, 6) : _mm256_and_si256(_mm256_srli_epi16(p, 4), m2); /* zero-extended byte */
    if (bits == 3) { /* | the 3rd bit << 2, as gemm_q5.c brings its 5th bits to their lanes */
        const __m256i rows = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i b2 = _mm256_set1_epi16(4), z = _mm256_set1_epi16(4);
        int32_t w0, w1;
        memcpy(&w0, wg + 128 + 4 * c, 4);
        memcpy(&w1, wg + 128 + 32 + 4 * c, 4);
        const __m256i h0 = _mm256_srlv_epi32(_mm256_set1_epi32(w0), rows);
        const __m256i h1 = _mm256_srlv_epi32(_mm256_set1_epi32(w1), rows);
        const __m256i e0 = h ? _mm256_srli_epi16(h0, 6) : _mm256_slli_epi16(h0, 2); /* bit 8h -> bit 2 */
        const __m256i e1 = h ? _mm256_srli_epi16(h1, 6) : _mm256_slli_epi16(h1, 2);
        *v0 = _mm256_sub_epi16(_mm256_or_si256(*v0, _mm256_and_si256(e0, b2)), z);
        *v1 = _mm256_sub_epi16(_mm256_or_si256(*v1, _mm256_and_si256(e1, b2)), z);
    }
}

/* 8 int8 sub-scales (or mins) of one block and half, times the block's rows' super-block numbers */
static inline __attribute__((always_inline)) __m256 kq_scale8(const int8_t *sc, __m256 d) {
    int64_t raw;
    memcpy(&raw, sc, 8);
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(raw))), d);
}

/* Half h of group g for MT rows: its 8 chunks' dots, then acc[k] = fma(float(dot), (d sc) step, acc[k])
 * and (Q2_K) oacc[k] = fma(-(dmin m), sum16, oacc[k]) */
static inline __attribute__((always_inline)) void kq_half(const int bits, const int MT, const int h, const QuantRows *r,
                                                          const float *sums, int64_t m0, int64_t g, int64_t K,
                                                          const uint8_t *wg, const int8_t *sg, const int8_t *mg,
                                                          __m256 d[2], __m256 dm[2], __m256 acc[2][KQ_TILE],
                                                          __m256 oacc[2][KQ_TILE], const int16_t *buf) {
    const int64_t G = K / 32;
    __m256i a0[KQ_TILE], a1[KQ_TILE];
    for (int i = 0; i < MT; i++) a0[i] = a1[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
        __m256i v0, v1;
        if (buf) { /* kq_widen's values of this group, half and chunk */
            v0 = _mm256_load_si256((const __m256i *)(buf + ((g * 2 + h) * 8 + c) * 32));
            v1 = _mm256_load_si256((const __m256i *)(buf + ((g * 2 + h) * 8 + c) * 32 + 16));
        } else {
            kq_values(bits, h, wg, c, &v0, &v1);
        }
        for (int i = 0; i < MT; i++) {
            int32_t xp; /* the column pair's int16 activations, broadcast */
            memcpy(&xp, r->q + (m0 + i) * K + g * 32 + 16 * h + 2 * c, 4);
            const __m256i b = _mm256_set1_epi32(xp);
            a0[i] = _mm256_add_epi32(a0[i], _mm256_madd_epi16(v0, b));
            a1[i] = _mm256_add_epi32(a1[i], _mm256_madd_epi16(v1, b));
            __asm__("" : "+x"(a0[i]), "+x"(a1[i])); /* no add trees, no spills (gemm.c's q4_unit_tile) */
        }
    }
    const __m256 sc0 = kq_scale8(sg + 8 * h, d[0]), sc1 = kq_scale8(sg + 16 + 8 * h, d[1]);
    __m256 of0 = _mm256_setzero_ps(), of1 = _mm256_setzero_ps();
    if (bits == 2) { /* -(dmin * m): an exact product, negated */
        const __m256 sign = _mm256_set1_ps(-0.0f);
        of0 = _mm256_xor_ps(kq_scale8(mg + 8 * h, dm[0]), sign);
        of1 = _mm256_xor_ps(kq_scale8(mg + 16 + 8 * h, dm[1]), sign);
    }
    for (int i = 0; i < MT; i++) {
        const int64_t m = m0 + i;
        const __m256 step = _mm256_broadcast_ss(r->d + m * G + g);
        acc[0][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a0[i]), _mm256_mul_ps(sc0, step), acc[0][i]);
        acc[1][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a1[i]), _mm256_mul_ps(sc1, step), acc[1][i]);
        if (bits == 2) {
            const __m256 s = _mm256_broadcast_ss(sums + m * 2 * G + 2 * g + h);
            oacc[0][i] = _mm256_fmadd_ps(of0, s, oacc[0][i]);
            oacc[1][i] = _mm256_fmadd_ps(of1, s, oacc[1][i]);
        }
    }
}

/* kq_half for h = 0 then 1 with both halves' chunks unpacked in one pass (four int32 accumulators a row,
 * so for tiles of 1 or 2 rows): the same dots, the same float32 operations in the same order. */
static inline __attribute__((always_inline)) void kq_both_halves(const int bits, const int MT, const QuantRows *r,
                                                                 const float *sums, int64_t m0, int64_t g, int64_t K,
                                                                 const uint8_t *wg, const int8_t *sg,
                                                                 const int8_t *mg, __m256 d[2], __m256 dm[2],
                                                                 __m256 acc[2][KQ_TILE], __m256 oacc[2][KQ_TILE]) {
    const int64_t G = K / 32;
    __m256i a[2][2][KQ_TILE]; /* [half][block][row] */
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < MT; i++) a[h][0][i] = a[h][1][i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
        __m256i v[2][2];
        kq_values(bits, 0, wg, c, &v[0][0], &v[0][1]);
        kq_values(bits, 1, wg, c, &v[1][0], &v[1][1]);
        for (int i = 0; i < MT; i++)
            for (int h = 0; h < 2; h++) {
                int32_t xp;
                memcpy(&xp, r->q + (m0 + i) * K + g * 32 + 16 * h + 2 * c, 4);
                const __m256i b = _mm256_set1_epi32(xp);
                a[h][0][i] = _mm256_add_epi32(a[h][0][i], _mm256_madd_epi16(v[h][0], b));
                a[h][1][i] = _mm256_add_epi32(a[h][1][i], _mm256_madd_epi16(v[h][1], b));
            }
    }
    for (int h = 0; h < 2; h++) {
        const __m256 sc0 = kq_scale8(sg + 8 * h, d[0]), sc1 = kq_scale8(sg + 16 + 8 * h, d[1]);
        __m256 of0 = _mm256_setzero_ps(), of1 = _mm256_setzero_ps();
        if (bits == 2) {
            const __m256 sign = _mm256_set1_ps(-0.0f);
            of0 = _mm256_xor_ps(kq_scale8(mg + 8 * h, dm[0]), sign);
            of1 = _mm256_xor_ps(kq_scale8(mg + 16 + 8 * h, dm[1]), sign);
        }
        for (int i = 0; i < MT; i++) {
            const int64_t m = m0 + i;
            const __m256 step = _mm256_broadcast_ss(r->d + m * G + g);
            acc[0][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[h][0][i]), _mm256_mul_ps(sc0, step), acc[0][i]);
            acc[1][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[h][1][i]), _mm256_mul_ps(sc1, step), acc[1][i]);
            if (bits == 2) {
                const __m256 s = _mm256_broadcast_ss(sums + m * 2 * G + 2 * g + h);
                oacc[0][i] = _mm256_fmadd_ps(of0, s, oacc[0][i]);
                oacc[1][i] = _mm256_fmadd_ps(of1, s, oacc[1][i]);
            }
        }
    }
}

/* Unit u's values widened once into buf (16 K int16, 32-byte aligned): per group g, half h and chunk c, 32
 * lanes at ((g * 2 + h) * 8 + c) * 32, block 0's then block 1's, as kq_values gives them. */
static inline __attribute__((always_inline)) void kq_widen(const int bits, int64_t u, int64_t K, const uint8_t *qs,
                                                           int16_t *buf) {
    const int64_t G = K / 32, bytes = KQ_BYTES(bits);
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *wg = qs + (u * G + g) * bytes;
        for (int h = 0; h < 2; h++)
            for (int c = 0; c < 8; c++) {
                __m256i v0, v1;
                if (h) kq_values(bits, 1, wg, c, &v0, &v1);
                else kq_values(bits, 0, wg, c, &v0, &v1);
                _mm256_store_si256((__m256i *)(buf + ((g * 2 + h) * 8 + c) * 32), v0);
                _mm256_store_si256((__m256i *)(buf + ((g * 2 + h) * 8 + c) * 32 + 16), v1);
            }
    }
}

/* Unit u (two blocks of 8 weight rows) x MT activation rows from m0 (a compile-time constant at every
 * call site). Lane b of acc[k][i] is output (m0 + i, 16u + 8k + b). */
static inline __attribute__((always_inline)) void kq_unit_tile(const int bits, const int MT, const QuantRows *r,
                                                               const float *sums, int64_t m0, int64_t u, int64_t K,
                                                               int64_t N, const uint8_t *qs, const int8_t *scales,
                                                               const uint16_t *supers, const float *bias, float *y,
                                                               const int16_t *buf) {
    const int64_t G = K / 32, S = K / 256, units = (N + 15) / 16, bytes = KQ_BYTES(bits);
    const uint8_t *wu = qs + u * G * bytes;
    const int8_t *su = scales + u * G * 32, *mu = scales + units * G * 32 + u * G * 32;
    const uint16_t *du = supers + u * S * 16, *dmu = supers + units * S * 16 + u * S * 16;
    __m256 acc[2][KQ_TILE], oacc[2][KQ_TILE];
    for (int i = 0; i < MT; i++) acc[0][i] = acc[1][i] = oacc[0][i] = oacc[1][i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *wg = wu + g * bytes;
        if (KQ_PREFETCH && !buf)
            for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch((const char *)(wg + KQ_PREFETCH * bytes + l), _MM_HINT_T0);
        const int64_t s = g / 8;
        __m256 d[2], dm[2];
        for (int k = 0; k < 2; k++) {
            d[k] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(du + (s * 2 + k) * 8)));
            dm[k] = bits == 2 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dmu + (s * 2 + k) * 8)))
                              : _mm256_setzero_ps();
        }
        if (MT <= 2 && !buf) { /* decode rows: both halves per chunk, their shared loads and shifts once */
            kq_both_halves(bits, MT, r, sums, m0, g, K, wg, su + g * 32, mu + g * 32, d, dm, acc, oacc);
            continue;
        }
        kq_half(bits, MT, 0, r, sums, m0, g, K, wg, su + g * 32, mu + g * 32, d, dm, acc, oacc, buf);
        kq_half(bits, MT, 1, r, sums, m0, g, K, wg, su + g * 32, mu + g * 32, d, dm, acc, oacc, buf);
    }
    for (int i = 0; i < MT; i++) {
        float out[16];
        _mm256_storeu_ps(out, _mm256_add_ps(acc[0][i], oacc[0][i]));
        _mm256_storeu_ps(out + 8, _mm256_add_ps(acc[1][i], oacc[1][i]));
        const int64_t n0 = u * 16, n_end = n0 + 16 < N ? n0 + 16 : N;
        for (int64_t n = n0; n < n_end; n++) y[(m0 + i) * N + n] = bias ? out[n - n0] + bias[n] : out[n - n0];
    }
}

/* Row m's float32 sums of each 16 activations (Q2_K's offset term): 8 lanes, then hsum8's fixed order. */
static inline void kq_sums(const float *x, int64_t m, int64_t K, float *sums) {
    for (int64_t h = 0; h < K / 16; h++) {
        const float *p = x + m * K + h * 16;
        sums[m * (K / 16) + h] = hsum8(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)));
    }
}

/* gemm_q5.c's structure: the rows quantized (split across the threads), then chunk by chunk of
 * Q4_ROW_CHUNK rows the weight units split across the threads, each unit's rows in tiles of KQ_TILE, then 2, then 1. */
static inline __attribute__((always_inline)) int kq_gemm(const int bits, const float *x, int64_t M, int64_t K,
                                                         const uint8_t *qs, const int8_t *scales,
                                                         const uint16_t *supers, int64_t N, const float *bias,
                                                         float *y, int num_threads) {
    QuantRows r;
    if (alloc_rows(M, K, &r)) return -1;
    float *sums = NULL;
    if (bits == 2 && !(sums = malloc(sizeof(float) * (size_t)(M * (K / 16))))) {
        free_rows(&r);
        return -1;
    }
    const int64_t units = (N + 15) / 16;
    const int wide = avx512_gemm_enabled(); /* the AVX-512 tile (gemm_kq_avx512.c): the same bits */
#pragma omp parallel num_threads(num_threads)
    {
        /* prompt chunks (KQ_BUFFER_ROWS rows or more): a unit's values widened once per chunk, not per tile
         * (a thread that cannot allocate its buffer unpacks per tile: the same bits) */
        int16_t *buf = !wide && M >= KQ_BUFFER_ROWS ? aligned_alloc(32, sizeof(int16_t) * (size_t)(16 * K)) : NULL;
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            quantize_row(x, m, K, &r);
            if (bits == 2) kq_sums(x, m, K, sums);
        }
        for (int64_t m0 = 0; m0 < M; m0 += Q4_ROW_CHUNK) {
            const int64_t m_end = m0 + Q4_ROW_CHUNK < M ? m0 + Q4_ROW_CHUNK : M;
#pragma omp for schedule(static) nowait
            for (int64_t u = 0; u < units; u++) {
                if (wide) {
                    kq_unit_avx512(bits, &r, sums, m0, m_end, u, K, N, qs, scales, supers, bias, y);
                    continue;
                }
                const int16_t *values = NULL;
                if (buf && m_end - m0 >= KQ_BUFFER_ROWS) {
                    kq_widen(bits, u, K, qs, buf);
                    values = buf;
                }
                int64_t m = m0;
                for (; m + KQ_TILE <= m_end; m += KQ_TILE)
                    kq_unit_tile(bits, KQ_TILE, &r, sums, m, u, K, N, qs, scales, supers, bias, y, values);
                for (; m + 2 <= m_end; m += 2)
                    kq_unit_tile(bits, 2, &r, sums, m, u, K, N, qs, scales, supers, bias, y, values);
                if (m < m_end) kq_unit_tile(bits, 1, &r, sums, m, u, K, N, qs, scales, supers, bias, y, values);
            }
        }
        free(buf);
    }
    free(sums);
    free_rows(&r);
    return 0;
}

int onecall_kq_gemm(const float *x, int64_t M, int64_t K, const uint8_t *qs, const void *scales, const void *supers,
                    int64_t N, const float *bias, float *y, int num_threads, int bits) {
    if (K % 256) return -2;
    const int8_t *sc = (const int8_t *)scales;
    const uint16_t *d = (const uint16_t *)supers;
    if (bits == 6) return kq_gemm(6, x, M, K, qs, sc, d, N, bias, y, num_threads);
    if (bits == 3) return kq_gemm(3, x, M, K, qs, sc, d, N, bias, y, num_threads);
    if (bits == 2) return kq_gemm(2, x, M, K, qs, sc, d, N, bias, y, num_threads);
    return -2;
}

/* Code (unsigned, 0 .. 2^bits - 1) of row b of block k, column 32g + col, from its group's bytes wg. */
static int kq_code(int bits, const uint8_t *wg, int64_t k, int64_t b, int64_t col) {
    const int64_t h = col / 16, c = (col % 16) / 2, j = col % 2;
    const uint8_t pair = (wg[(bits == 6 ? 256 : 0) + c * 16 + 2 * b + j] >> (4 * k + 2 * h)) & 3;
    if (bits == 6) {
        const uint8_t byte = wg[k * 128 + c * 16 + b * 2 + j];
        return (h ? byte >> 4 : byte & 0x0F) | pair << 4;
    }
    if (bits == 3) {
        uint32_t word;
        memcpy(&word, wg + 128 + 4 * (8 * k + c), 4);
        return pair | (int)((word >> (b + 8 * h + 16 * j)) & 1) << 2;
    }
    return pair;
}

/* Rows ids[0 .. M) of an (N, K) table in the kq layout, dequantized: (d * sc) * (q - z), and for Q2_K
 * (d * sc) * q - dmin * m (the float32 operations KQuantGroups.dequantize and ggml do). */
int onecall_kq_rows(const uint8_t *qs, const void *scales, const void *supers, int64_t N, int64_t K, int bits,
                    const int64_t *ids, int64_t M, float *out) {
    if (K % 256 || (bits != 6 && bits != 3 && bits != 2)) return -2;
    for (int64_t m = 0; m < M; m++) /* checked before anything is written */
        if (ids[m] < 0 || ids[m] >= N) return -3;
    const int64_t G = K / 32, S = K / 256, units = (N + 15) / 16, bytes = KQ_BYTES(bits);
    const int z = bits == 6 ? 32 : bits == 3 ? 4 : 0;
    const int8_t *sc = (const int8_t *)scales, *mn = sc + units * G * 32;
    const uint16_t *d = (const uint16_t *)supers, *dmin = d + units * S * 16;
    for (int64_t m = 0; m < M; m++) {
        const int64_t n = ids[m], u = n / 16, k = (n % 16) / 8, b = n % 8;
        float *row = out + m * K;
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *wg = qs + (u * G + g) * bytes;
            const int64_t at_d = ((u * S + g / 8) * 2 + k) * 8 + b;
            for (int64_t h = 0; h < 2; h++) {
                const int64_t at = (((u * G + g) * 2 + k) * 2 + h) * 8 + b;
                const float scale = _cvtsh_ss(d[at_d]) * (float)sc[at];
                const float offset = bits == 2 ? _cvtsh_ss(dmin[at_d]) * (float)mn[at] : 0.0f;
                for (int64_t col = 16 * h; col < 16 * h + 16; col++) {
                    const int q = kq_code(bits, wg, k, b, col) - z;
                    row[g * 32 + col] = bits == 2 ? scale * (float)q - offset : scale * (float)q;
                }
            }
        }
    }
    return 0;
}

/* The kq layout's bytes of (N, K) codes (uint8, 0 .. 2^bits - 1, row-major): qs (N16 / 16, G, KQ_BYTES),
 * rows N .. N16 - 1 as zero codes. One pass over the codes, the units split across the threads. */
int onecall_kq_pack(const uint8_t *codes, int64_t N, int64_t K, int bits, uint8_t *qs, int num_threads) {
    if (K % 256 || (bits != 6 && bits != 3 && bits != 2)) return -2;
    const int64_t G = K / 32, units = (N + 15) / 16, bytes = KQ_BYTES(bits);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t u = 0; u < units; u++) {
        for (int64_t g = 0; g < G; g++) {
            uint8_t *wg = qs + (u * G + g) * bytes;
            memset(wg, 0, (size_t)bytes);
            uint8_t *plane2 = wg + (bits == 6 ? 256 : 0);
            for (int64_t k = 0; k < 2; k++)
                for (int64_t b = 0; b < 8; b++) {
                    const int64_t n = u * 16 + k * 8 + b;
                    if (n >= N) continue;
                    const uint8_t *q = codes + n * K + g * 32;
                    for (int64_t c = 0; c < 8; c++)
                        for (int64_t j = 0; j < 2; j++)
                            for (int64_t h = 0; h < 2; h++) {
                                const int v = q[16 * h + 2 * c + j];
                                const int low = bits == 6 ? v >> 4 : v & 3; /* the 2-bit plane's pair */
                                plane2[c * 16 + 2 * b + j] |= (uint8_t)((low & 3) << (4 * k + 2 * h));
                                if (bits == 6) wg[k * 128 + c * 16 + b * 2 + j] |= (uint8_t)((v & 15) << (4 * h));
                                if (bits == 3) {
                                    uint8_t *word = wg + 128 + 4 * (8 * k + c); /* little-endian */
                                    const int bit = (int)(b + 8 * h + 16 * j);
                                    word[bit / 8] |= (uint8_t)(((v >> 2) & 1) << (bit % 8));
                                }
                            }
                }
        }
    }
    return 0;
}
