/* The 16-bit float GEMM: y = x @ W^T (+ bias) over weights the GGUF stored as F16 or BF16, read as they
 * are (each value widened to float32 exactly: F16C's conversion for IEEE half, a 16-bit shift for
 * bfloat16) and multiplied in float32, so no float32 copy of such a weight is ever made.
 *
 *   onecall_half_gemm  16-bit weights (the h16 layout) x float32 activations: every row
 *
 * Layout h16 (native.pack_half): rows in units of 16 (N padded with zero rows to a multiple of 16),
 * (N16 / 16, K, 16) uint16: unit u, column k, row r of the unit holds W[16u + r, k]. One column of a
 * unit is 32 contiguous bytes, two vectors of 8 rows once widened, and a unit is one sequential stream.
 *
 * Arithmetic: output (m, n) = fma(w[n, k], x[m, k], acc) over k = 0 .. K - 1 in order, one float32
 * accumulator per output (an outer product per column: the column's 16 weights, widened, times x[m, k]
 * broadcast), then + bias: float32 with a sequential sum, so |y - x @ W^T| <= K * 2^-24 * (|x| @ |W|^T)
 * (tests/kernels/test_quant_kernels.py). Every output goes through those operations in that order
 * whatever M, the tile shape or the thread count: batch invariance. Tiles: 4 rows x 1 unit for prompt
 * rows, 2 x 2 and 1 x 4 for the rest, so even one row keeps 8 independent FMA chains in flight; the
 * tile shape changes which outputs are computed together, never an output's operations.
 */
#include <immintrin.h>
#include <stdint.h>

#include "kernels.h"

#define HALF_ROW_CHUNK 64 /* activation rows per pass over the weights */
#define HALF_MAX_ROWS 4
#define HALF_MAX_UNITS 4

/* 8 weights (one column of one block of 8 rows) widened to float32 */
static inline __attribute__((always_inline)) __m256 widen8(const uint16_t *p, const int bf16) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (bf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* MT activation rows from m0 x UT units from u0 (compile-time constants at every call site) */
static inline __attribute__((always_inline)) void half_tile(const int MT, const int UT, const float *x, int64_t m0,
                                                            int64_t u0, int64_t K, int64_t N, const uint16_t *w,
                                                            const float *bias, float *y, const int bf16) {
    __m256 acc[HALF_MAX_UNITS][2][HALF_MAX_ROWS];
    for (int t = 0; t < UT; t++)
        for (int i = 0; i < MT; i++) acc[t][0][i] = acc[t][1][i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        for (int t = 0; t < UT; t++) {
            const uint16_t *col = w + ((u0 + t) * K + k) * 16;
            _mm_prefetch((const char *)(col + 16 * 32), _MM_HINT_T0); /* 32 columns (1 KiB) ahead */
            const __m256 w0 = widen8(col, bf16), w1 = widen8(col + 8, bf16);
            for (int i = 0; i < MT; i++) {
                const __m256 xb = _mm256_broadcast_ss(x + (m0 + i) * K + k);
                acc[t][0][i] = _mm256_fmadd_ps(w0, xb, acc[t][0][i]);
                acc[t][1][i] = _mm256_fmadd_ps(w1, xb, acc[t][1][i]);
            }
        }
    }
    for (int t = 0; t < UT; t++)
        for (int i = 0; i < MT; i++) {
            float out[16];
            _mm256_storeu_ps(out, acc[t][0][i]);
            _mm256_storeu_ps(out + 8, acc[t][1][i]);
            const int64_t n0 = (u0 + t) * 16, n_end = n0 + 16 < N ? n0 + 16 : N;
            for (int64_t n = n0; n < n_end; n++) y[(m0 + i) * N + n] = bias ? out[n - n0] + bias[n] : out[n - n0];
        }
}

/* Rows [m0, m_end) against the units [u0, u_end) (at most HALF_MAX_UNITS of them): tiles of 4 rows x 1
 * unit, then 2 x 2, then 1 x 4, each at most 8 accumulators (12 spilled: 6 x 1 and 3 x 2 ran 1.4x slower) */
static inline __attribute__((always_inline)) void half_units(const float *x, int64_t m0, int64_t m_end, int64_t u0,
                                                             int64_t u_end, int64_t K, int64_t N, const uint16_t *w,
                                                             const float *bias, float *y, const int bf16) {
    int64_t m = m0;
    for (; m + 4 <= m_end; m += 4)
        for (int64_t u = u0; u < u_end; u++) half_tile(4, 1, x, m, u, K, N, w, bias, y, bf16);
    for (; m + 2 <= m_end; m += 2) {
        int64_t u = u0;
        for (; u + 2 <= u_end; u += 2) half_tile(2, 2, x, m, u, K, N, w, bias, y, bf16);
        if (u < u_end) half_tile(2, 1, x, m, u, K, N, w, bias, y, bf16);
    }
    for (; m < m_end; m++) {
        int64_t u = u0;
        if (u + 4 <= u_end) {
            half_tile(1, 4, x, m, u, K, N, w, bias, y, bf16);
            u += 4;
        }
        for (; u < u_end; u++) half_tile(1, 1, x, m, u, K, N, w, bias, y, bf16);
    }
}

static inline __attribute__((always_inline)) void half_gemm(const float *x, int64_t M, int64_t K, const uint16_t *w,
                                                            int64_t N, const float *bias, float *y, int num_threads,
                                                            const int bf16) {
    const int64_t units = (N + 15) / 16, quads = (units + HALF_MAX_UNITS - 1) / HALF_MAX_UNITS;
#pragma omp parallel num_threads(num_threads)
    for (int64_t m0 = 0; m0 < M; m0 += HALF_ROW_CHUNK) {
        const int64_t m_end = m0 + HALF_ROW_CHUNK < M ? m0 + HALF_ROW_CHUNK : M;
#pragma omp for schedule(static) nowait
        for (int64_t q = 0; q < quads; q++) {
            const int64_t u0 = q * HALF_MAX_UNITS, u_end = u0 + HALF_MAX_UNITS < units ? u0 + HALF_MAX_UNITS : units;
            half_units(x, m0, m_end, u0, u_end, K, N, w, bias, y, bf16);
        }
    }
}

int onecall_half_gemm(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, const float *bias,
                      float *y, int num_threads, int bf16) {
    if (bf16)
        half_gemm(x, M, K, w, N, bias, y, num_threads, 1);
    else
        half_gemm(x, M, K, w, N, bias, y, num_threads, 0);
    return 0;
}
