/* The greedy pick over a step's logits: onecall_argmax_rows, the index of each row's largest value,
 * exactly as torch.argmax gives it (the sampler's greedy rows; sampling/sampler.py): the first index
 * of the maximum, and where a row holds a NaN, the first NaN's index (torch ranks NaN above every
 * number). torch's CPU argmax walks a row one value at a time (~45 us for 49,152 logits here); this
 * is two vector passes over the row (its maximum, then its first position), rows split across the
 * threads. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include "simd.h"

static int64_t argmax_row(const float *r, int64_t N) {
    /* 1. the maximum of the numbers, and whether any value is NaN; max_ps(v, m) returns m where v is
     *    NaN, so the running maximum stays a number */
    __m256 vmax = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= N; i += 8) {
        const __m256 v = _mm256_loadu_ps(r + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vmax = _mm256_max_ps(v, vmax);
    }
    float best = hmax8(vmax);
    int any_nan = _mm256_movemask_ps(nan) != 0;
    for (int64_t t = i; t < N; t++) {
        any_nan |= isnan(r[t]);
        if (r[t] > best) best = r[t];
    }
    /* 2. the first index holding it (the first NaN if there is one) */
    if (any_nan) {
        for (int64_t t = 0; t < N; t++)
            if (isnan(r[t])) return t;
    }
    const __m256 target = _mm256_set1_ps(best);
    for (i = 0; i + 8 <= N; i += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(r + i), target, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
    for (; i < N; i++)
        if (r[i] == best) return i;
    return 0; /* N == 0: no row to pick from (the caller never asks) */
}

/* out[m] = argmax of row m of x (M, N) float32, for M rows; 0 on success, -2 for N < 1. */
int onecall_argmax_rows(const float *x, int64_t M, int64_t N, int64_t *out, int num_threads) {
    if (N < 1) return -2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M > 1)
    for (int64_t m = 0; m < M; m++) out[m] = argmax_row(x + m * N, N);
    return 0;
}
