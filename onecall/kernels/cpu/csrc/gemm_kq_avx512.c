/* The AVX-512 VNNI tile of the K-quants' low-bit GEMM (gemm_kq.c: Q6_K, Q3_K, Q2_K codes in the kq layout),
 * chosen at run time as gemm_avx512.c's tiles are (avx512_gemm_enabled: the CPU has AVX-512 F/BW/VL +
 * VNNI and onecall_set_avx512 left them on); compiled for that target by its own attribute, so the
 * library still loads on an AVX2-only CPU.
 *
 * The same layout and arithmetic as gemm_kq.c's AVX2 tile, twice as wide: a chunk's codes of block 0 and
 * block 1 sit side by side in 32 int16 lanes (32-bit lane l = weight row l of the unit), the 2-bit plane's
 * byte broadcast to both halves and shifted right by 4 in block 1's lanes (its pairs sit at bits 4-7), the
 * 1-bit words of both blocks in one register. One vpdpwssd a half (columns 0-15, then 16-31) against the
 * broadcast activation pair does the AVX2 tile's two madds and adds. Per row two int32 accumulators (one
 * a half), so tiles of 8 rows share each chunk's unpacking.
 *
 * Bit for bit the AVX2 tile's outputs: a half's int32 dot is the same integer (exact: |dot| < 2^24), and
 * each output lane then goes through the same float32 operations in the same order (the sub-scale times
 * d, times the step, the two FMAs a group, Q2_K's two offset FMAs, acc + oacc, + bias).
 * tests/kernels/test_kquant_kernels.py checks both paths agree.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "gemm_avx512.h"
#include "kernels.h"

#define KQ_AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512vnni"
#define KQ_AVX512_INLINE static inline __attribute__((always_inline, target(KQ_AVX512_TARGET)))
#define KQ_AVX512_TILE 8 /* rows per tile: 2 int32 + 1-2 float accumulators a row, of 32 registers */

/* Chunk c's lanes of the group at wg as signed values q - z: *lo columns 2c, 2c + 1, *hi 16 + 2c, 17 + 2c */
KQ_AVX512_INLINE void kq_values16(const int bits, const uint8_t *wg, int c, __m512i *lo, __m512i *hi) {
    const __m512i m2 = _mm512_set1_epi16(3);
    const __m512i halves = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1); /* 0 | 4 */
    const uint8_t *plane2 = wg + (bits == 6 ? 256 : 0);
    const __m512i p = _mm512_srlv_epi16(
        _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(plane2 + c * 16)))),
        halves); /* bits 0-3: this lane's block's pair for half 0 (bits 0-1) and half 1 (bits 2-3) */
    __m512i l = _mm512_and_si512(p, m2), h = _mm512_and_si512(_mm512_srli_epi16(p, 2), m2);
    if (bits == 6) {
        const __m256i both = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(wg + c * 16))),
            _mm_loadu_si128((const __m128i *)(wg + 128 + c * 16)), 1);
        const __m512i n = _mm512_cvtepu8_epi16(both), z = _mm512_set1_epi16(32);
        l = _mm512_or_si512(_mm512_and_si512(n, _mm512_set1_epi16(0x0F)), _mm512_slli_epi16(l, 4));
        h = _mm512_or_si512(_mm512_srli_epi16(n, 4), _mm512_slli_epi16(h, 4));
        *lo = _mm512_sub_epi16(l, z);
        *hi = _mm512_sub_epi16(h, z);
        return;
    }
    if (bits == 3) {
        int32_t w0, w1;
        memcpy(&w0, wg + 128 + 4 * c, 4);
        memcpy(&w1, wg + 128 + 32 + 4 * c, 4);
        const __m512i rows = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
        const __m512i w = _mm512_inserti64x4(_mm512_set1_epi32(w0), _mm256_set1_epi32(w1), 1);
        const __m512i hb = _mm512_srlv_epi32(w, rows), b2 = _mm512_set1_epi16(4), z = _mm512_set1_epi16(4);
        l = _mm512_sub_epi16(_mm512_or_si512(l, _mm512_and_si512(_mm512_slli_epi16(hb, 2), b2)), z);
        h = _mm512_sub_epi16(_mm512_or_si512(h, _mm512_and_si512(_mm512_srli_epi16(hb, 6), b2)), z);
    }
    *lo = l;
    *hi = h;
}

/* 16 int8 values (block 0's 8 at p, block 1's at p + 16) times d (the unit's 16 rows), as float32 */
KQ_AVX512_INLINE __m512 kq_scale16(const int8_t *p, __m512 d) {
    int64_t b0, b1;
    memcpy(&b0, p, 8);
    memcpy(&b1, p + 16, 8);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_set_epi64x(b1, b0))), d);
}

KQ_AVX512_INLINE void kq_tile16(const int bits, const int MT, const QuantRows *r, const float *sums, int64_t m0,
                                int64_t u, int64_t K, int64_t N, const uint8_t *qs, const int8_t *scales,
                                const uint16_t *supers, const float *bias, float *y) {
    const int64_t G = K / 32, S = K / 256, units = (N + 15) / 16, bytes = KQ_BYTES(bits);
    const uint8_t *wu = qs + u * G * bytes;
    const int8_t *su = scales + u * G * 32, *mu = scales + units * G * 32 + u * G * 32;
    const uint16_t *du = supers + u * S * 16, *dmu = supers + units * S * 16 + u * S * 16;
    __m512 acc[KQ_AVX512_TILE], oacc[KQ_AVX512_TILE];
    for (int i = 0; i < MT; i++) acc[i] = oacc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *wg = wu + g * bytes;
        for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch((const char *)(wg + 16 * bytes + l), _MM_HINT_T0);
        __m512i alo[KQ_AVX512_TILE], ahi[KQ_AVX512_TILE];
        for (int i = 0; i < MT; i++) alo[i] = ahi[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            __m512i lo, hi;
            kq_values16(bits, wg, c, &lo, &hi);
            for (int i = 0; i < MT; i++) {
                int32_t xl, xh;
                memcpy(&xl, r->q + (m0 + i) * K + g * 32 + 2 * c, 4);
                memcpy(&xh, r->q + (m0 + i) * K + g * 32 + 16 + 2 * c, 4);
                alo[i] = _mm512_dpwssd_epi32(alo[i], lo, _mm512_set1_epi32(xl));
                ahi[i] = _mm512_dpwssd_epi32(ahi[i], hi, _mm512_set1_epi32(xh));
            }
        }
        const int64_t s = g / 8;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(du + s * 16)));
        const __m512 sc0 = kq_scale16(su + g * 32, d), sc1 = kq_scale16(su + g * 32 + 8, d);
        __m512 of0 = _mm512_setzero_ps(), of1 = _mm512_setzero_ps();
        if (bits == 2) {
            const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dmu + s * 16)));
            const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
            of0 = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(kq_scale16(mu + g * 32, dm)), sign));
            of1 = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(kq_scale16(mu + g * 32 + 8, dm)), sign));
        }
        for (int i = 0; i < MT; i++) {
            const int64_t m = m0 + i;
            const __m512 step = _mm512_set1_ps(r->d[m * G + g]);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(alo[i]), _mm512_mul_ps(sc0, step), acc[i]);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ahi[i]), _mm512_mul_ps(sc1, step), acc[i]);
            if (bits == 2) {
                oacc[i] = _mm512_fmadd_ps(of0, _mm512_set1_ps(sums[m * 2 * G + 2 * g]), oacc[i]);
                oacc[i] = _mm512_fmadd_ps(of1, _mm512_set1_ps(sums[m * 2 * G + 2 * g + 1]), oacc[i]);
            }
        }
    }
    const int64_t n0 = u * 16, count = N - n0 < 16 ? N - n0 : 16;
    const __mmask16 mask = (__mmask16)((1u << count) - 1u);
    for (int i = 0; i < MT; i++) {
        __m512 v = _mm512_add_ps(acc[i], oacc[i]);
        if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + n0));
        _mm512_mask_storeu_ps(y + (m0 + i) * N + n0, mask, v);
    }
}

KQ_AVX512_INLINE void kq_rows16(const int bits, const QuantRows *r, const float *sums, int64_t m0, int64_t m_end,
                                int64_t u, int64_t K, int64_t N, const uint8_t *qs, const int8_t *scales,
                                const uint16_t *supers, const float *bias, float *y) {
    int64_t m = m0;
    for (; m + KQ_AVX512_TILE <= m_end; m += KQ_AVX512_TILE)
        kq_tile16(bits, KQ_AVX512_TILE, r, sums, m, u, K, N, qs, scales, supers, bias, y);
    for (; m + 4 <= m_end; m += 4) kq_tile16(bits, 4, r, sums, m, u, K, N, qs, scales, supers, bias, y);
    for (; m < m_end; m++) kq_tile16(bits, 1, r, sums, m, u, K, N, qs, scales, supers, bias, y);
}

__attribute__((target(KQ_AVX512_TARGET))) void kq_unit_avx512(int bits, const QuantRows *r, const float *sums,
                                                               int64_t m0, int64_t m_end, int64_t u, int64_t K,
                                                               int64_t N, const uint8_t *qs, const int8_t *scales,
                                                               const uint16_t *supers, const float *bias, float *y) {
    if (bits == 6) kq_rows16(6, r, sums, m0, m_end, u, K, N, qs, scales, supers, bias, y);
    if (bits == 3) kq_rows16(3, r, sums, m0, m_end, u, K, N, qs, scales, supers, bias, y);
    if (bits == 2) kq_rows16(2, r, sums, m0, m_end, u, K, N, qs, scales, supers, bias, y);
}
