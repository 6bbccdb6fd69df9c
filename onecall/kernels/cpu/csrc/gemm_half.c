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
 *
 * On CPUs with AVX-512 the same operations run 16 lanes wide (the AVX-512 section below: a unit's column
 * in one register, tiles of 6 rows x 4 units), the same outputs bit for bit; onecall_set_avx512(0) turns
 * them off (tests/kernels/test_half_gemm_avx512.py compares the two).
 */
#include <immintrin.h>
#include <stdint.h>

#include "gemm_avx512.h"
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

/* ---- AVX-512 F: the same outputs, a unit's 16 rows in one register ----
 *
 * On CPUs with AVX-512 (avx512_gemm_enabled, gemm_avx512.h: decided once, onecall_set_avx512 turns it off)
 * a unit's column widens into one 16-lane register (_mm512_cvtph_ps, or the 16-bit shift for bfloat16)
 * and each output still runs acc = fma(w[n, k], x[m, k], acc) over k in order from 0, then + bias: the
 * lanes are the AVX2 tile's two registers side by side, so the outputs are the AVX2 path's bit for bit.
 * With 32 registers the tile grows to HALF512_ROWS rows x 4 units (24 accumulators), so each widened
 * column feeds HALF512_ROWS FMAs and each broadcast activation 4 (6 rows: 4 and 7 were no faster on a
 * shared Zen 5; one row keeps 4 chains, enough where decode waits on memory). Only AVX-512 F is used;
 * the tiles sit here, beside the layout they read, rather than with the quantized ones in gemm_avx512.c. */
#define HALF512_TARGET __attribute__((target("avx512f")))
#define HALF512_INLINE static inline __attribute__((always_inline, target("avx512f")))
#ifndef HALF512_ROWS
#define HALF512_ROWS 6
#endif
#define HALF512_MAX_ROWS 8
_Static_assert(HALF512_ROWS >= 4 && HALF512_ROWS <= HALF512_MAX_ROWS, "HALF512_ROWS outside 4 .. 8");

HALF512_INLINE __m512 widen16(const uint16_t *p, const int bf16) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (bf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* MT activation rows from m0 x UT units from u0 (compile-time constants at every call site) */
HALF512_INLINE void half_tile16(const int MT, const int UT, const float *x, int64_t m0, int64_t u0, int64_t K,
                                int64_t N, const uint16_t *w, const float *bias, float *y, const int bf16) {
    __m512 acc[HALF_MAX_UNITS][HALF512_MAX_ROWS];
    for (int t = 0; t < UT; t++)
        for (int i = 0; i < MT; i++) acc[t][i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        for (int t = 0; t < UT; t++) {
            const uint16_t *col = w + ((u0 + t) * K + k) * 16;
            _mm_prefetch((const char *)(col + 16 * 32), _MM_HINT_T0); /* 32 columns (1 KiB) ahead */
            const __m512 wt = widen16(col, bf16);
            for (int i = 0; i < MT; i++)
                acc[t][i] = _mm512_fmadd_ps(wt, _mm512_set1_ps(x[(m0 + i) * K + k]), acc[t][i]);
        }
    }
    for (int t = 0; t < UT; t++) {
        const int64_t n0 = (u0 + t) * 16, count = N - n0 < 16 ? N - n0 : 16;
        const __mmask16 mask = (__mmask16)((1u << count) - 1u);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
        for (int i = 0; i < MT; i++) /* the AVX2 tile's out[n - n0] + bias[n], per lane */
            _mm512_mask_storeu_ps(y + (m0 + i) * N + n0, mask, bias ? _mm512_add_ps(acc[t][i], b) : acc[t][i]);
    }
}

/* MT rows from m0 against UT = u_end - u0 units (1 to 4) */
HALF512_INLINE void half_rows16(const int MT, const float *x, int64_t m0, int64_t u0, int64_t u_end, int64_t K,
                                int64_t N, const uint16_t *w, const float *bias, float *y, const int bf16) {
    switch (u_end - u0) {
    case 4: half_tile16(MT, 4, x, m0, u0, K, N, w, bias, y, bf16); break;
    case 3: half_tile16(MT, 3, x, m0, u0, K, N, w, bias, y, bf16); break;
    case 2: half_tile16(MT, 2, x, m0, u0, K, N, w, bias, y, bf16); break;
    default: half_tile16(MT, 1, x, m0, u0, K, N, w, bias, y, bf16); break;
    }
}

HALF512_INLINE void half_units16(const float *x, int64_t m0, int64_t m_end, int64_t u0, int64_t u_end, int64_t K,
                                 int64_t N, const uint16_t *w, const float *bias, float *y, const int bf16) {
    int64_t m = m0;
    for (; m + HALF512_ROWS <= m_end; m += HALF512_ROWS)
        half_rows16(HALF512_ROWS, x, m, u0, u_end, K, N, w, bias, y, bf16);
    for (; m + 4 <= m_end; m += 4) half_rows16(4, x, m, u0, u_end, K, N, w, bias, y, bf16);
    for (; m + 2 <= m_end; m += 2) half_rows16(2, x, m, u0, u_end, K, N, w, bias, y, bf16);
    if (m < m_end) half_rows16(1, x, m, u0, u_end, K, N, w, bias, y, bf16);
}

static HALF512_TARGET void half_units_avx512(const float *x, int64_t m0, int64_t m_end, int64_t u0, int64_t u_end,
                                             int64_t K, int64_t N, const uint16_t *w, const float *bias, float *y,
                                             int bf16) {
    if (bf16) half_units16(x, m0, m_end, u0, u_end, K, N, w, bias, y, 1);
    else half_units16(x, m0, m_end, u0, u_end, K, N, w, bias, y, 0);
}

static inline __attribute__((always_inline)) void half_gemm(const float *x, int64_t M, int64_t K, const uint16_t *w,
                                                            int64_t N, const float *bias, float *y, int num_threads,
                                                            const int bf16) {
    const int64_t units = (N + 15) / 16, quads = (units + HALF_MAX_UNITS - 1) / HALF_MAX_UNITS;
    const int wide = avx512_gemm_enabled(); /* the AVX-512 tiles above: the same bits */
#pragma omp parallel num_threads(num_threads)
    for (int64_t m0 = 0; m0 < M; m0 += HALF_ROW_CHUNK) {
        const int64_t m_end = m0 + HALF_ROW_CHUNK < M ? m0 + HALF_ROW_CHUNK : M;
#pragma omp for schedule(static) nowait
        for (int64_t q = 0; q < quads; q++) {
            const int64_t u0 = q * HALF_MAX_UNITS, u_end = u0 + HALF_MAX_UNITS < units ? u0 + HALF_MAX_UNITS : units;
            if (wide) half_units_avx512(x, m0, m_end, u0, u_end, K, N, w, bias, y, bf16);
            else half_units(x, m0, m_end, u0, u_end, K, N, w, bias, y, bf16);
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
