/* Gated DeltaNet's decode rows in C (Qwen3.5 / Qwen3-Next linear-attention layers, model/qwen35.py):
 * everything a layer does to its one-token rows between its input projection and its output projection,
 * reading and writing each row's conv and recurrent states in place in the state cache, by slot.
 *
 * Per row m (slot s) of the projection [qkv (conv_dim) | z (HV * DV) | b (HV) | a (HV)], in three phases
 * (one parallel region, a barrier between phases):
 *
 *   1. conv   per (row, block of channels): window = [conv_state[s, c, :], qkv[c]], mixed[c] =
 *             silu(sum_j window[j] w[c, j]), conv_state[s, c, :] <- window[1:]           (model: CausalConv1d.step)
 *   2. q, k   per (row, key head): l2-normalised (x / sqrt(sum x^2 + l2_eps)), q then scaled by
 *             DK ** -0.5, in the scratch rows                                              (model/delta_rule.py: prepare_qk)
 *   3. rule   per (row, value head h; key head h / (HV / HK)): beta = sigmoid(b), g = -exp(A_log) *
 *             softplus(a + dt_bias); S = exp(g) S; d = beta (v - S^T k); S += k d^T; o = S^T q
 *             (gated_delta_step_), then out = o / sqrt(mean(o^2) + norm_eps) * norm_w * silu(z)
 *             (RMSNormGated)
 *
 * The state S (DK, DV) of a head is row-major, so both passes over it run along DV (contiguous): pass one
 * decays a row of S and accumulates the prediction S^T k, pass two writes the rank-one correction and
 * accumulates the read S^T q. A row flagged fresh (its token is its sequence's position 0) starts from
 * zeros: its slot's states are cleared first. float32 throughout, the same operations in the same order
 * whatever the number of rows or threads: a row's bits never depend on its batch.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

#define DELTA_MAX_DIM 512   /* the largest key or value head dimension taken (stack buffers below) */
#define DELTA_CONV_BLOCK 256 /* channels of one row a conv task takes */

/* y[i] = silu(x[i]) = x[i] / (1 + exp(-x[i])), 8 lanes at a time (simd.h's exp), the tail in libm. */
static void silu_vec(const float *x, int64_t n, float *y) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        _mm256_storeu_ps(y + i, _mm256_div_ps(v, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, v)))));
    }
    for (; i < n; i++) y[i] = x[i] / (1.0f + expf(-x[i]));
}

/* Phase 1 for channels [c0, c1) of one row: the conv step over its slot's state (shifted in place). */
static void conv_block(const float *qkv, float *conv_state, const float *conv_weight, int64_t kernel, int fresh,
                       int64_t c0, int64_t c1, float *mixed) {
    const int64_t width = kernel - 1;
    for (int64_t c = c0; c < c1; c++) {
        float *st = conv_state + c * width;
        const float *w = conv_weight + c * kernel;
        if (fresh) memset(st, 0, (size_t)width * sizeof(float));
        const float x = qkv[c];
        float acc = 0.0f;
        for (int64_t j = 0; j < width; j++) acc += st[j] * w[j];
        acc += x * w[width];
        for (int64_t j = 0; j + 1 < width; j++) st[j] = st[j + 1];
        st[width - 1] = x;
        mixed[c] = acc;
    }
    silu_vec(mixed + c0, c1 - c0, mixed + c0);
}

/* x (n,) <- x / sqrt(sum(x^2) + eps) * scale (prepare_qk's order: normalise, then scale). */
static void l2_normalize(float *x, int64_t n, float eps, float scale) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss + eps);
    for (int64_t i = 0; i < n; i++) x[i] = x[i] * inv;
    if (scale != 1.0f)
        for (int64_t i = 0; i < n; i++) x[i] = x[i] * scale;
}

/* Phase 3 for one (row, value head): the gates, the state step in place, the read and the gated norm. */
static void rule_head(const float *restrict q, const float *restrict k, const float *restrict v, const float *z,
                      float b, float a, float A_log, float dt_bias, const float *norm_weight, float *restrict S,
                      int64_t DK, int64_t DV, float norm_eps, int fresh, float *out) {
    float pred[DELTA_MAX_DIM], delta[DELTA_MAX_DIM], o[DELTA_MAX_DIM], gate[DELTA_MAX_DIM];
    const float beta = 1.0f / (1.0f + expf(-b));
    const float x = a + dt_bias;
    const float softplus = x > 20.0f ? x : log1pf(expf(x)); /* torch's softplus (threshold 20) */
    const float decay = expf(-expf(A_log) * softplus);
    if (fresh) memset(S, 0, (size_t)(DK * DV) * sizeof(float));
    for (int64_t j = 0; j < DV; j++) pred[j] = 0.0f;
    for (int64_t i = 0; i < DK; i++) { /* S = decay S; pred = S^T k */
        float *restrict row = S + i * DV;
        const float ki = k[i];
        for (int64_t j = 0; j < DV; j++) {
            row[j] = row[j] * decay;
            pred[j] += ki * row[j];
        }
    }
    for (int64_t j = 0; j < DV; j++) {
        delta[j] = beta * (v[j] - pred[j]);
        o[j] = 0.0f;
    }
    for (int64_t i = 0; i < DK; i++) { /* S += k delta^T; o = S^T q */
        float *restrict row = S + i * DV;
        const float ki = k[i], qi = q[i];
        for (int64_t j = 0; j < DV; j++) {
            row[j] = row[j] + ki * delta[j];
            o[j] += qi * row[j];
        }
    }
    float ss = 0.0f;
    for (int64_t j = 0; j < DV; j++) ss += o[j] * o[j];
    const float inv = 1.0f / sqrtf(ss / (float)DV + norm_eps);
    silu_vec(z, DV, gate);
    for (int64_t j = 0; j < DV; j++) out[j] = o[j] * inv * norm_weight[j] * gate[j];
}

int onecall_delta_decode_rows(const float *proj, int64_t proj_stride, int64_t M, const int64_t *slots,
                              const uint8_t *fresh, float *conv_state, float *recurrent_state, int64_t num_slots,
                              const float *conv_weight, int64_t kernel, const float *A_log, const float *dt_bias,
                              const float *norm_weight, int64_t HK, int64_t HV, int64_t DK, int64_t DV,
                              float l2_eps, float norm_eps, float *out, int num_threads) {
    const int64_t key_dim = HK * DK, value_dim = HV * DV, conv_dim = 2 * key_dim + value_dim;
    if (M < 0 || kernel < 2 || HK < 1 || HV < 1 || HV % HK != 0 || DK < 1 || DV < 1 || DK > DELTA_MAX_DIM ||
        DV > DELTA_MAX_DIM || proj_stride < conv_dim + value_dim + 2 * HV)
        return -2;
    for (int64_t m = 0; m < M; m++) { /* every slot in range and used once, before anything is written */
        if (slots[m] < 0 || slots[m] >= num_slots) return -3;
        for (int64_t p = 0; p < m; p++)
            if (slots[p] == slots[m]) return -3;
    }
    if (M == 0) return 0;
    float *mixed = malloc((size_t)(M * conv_dim) * sizeof(float)); /* (M, conv_dim): q, k, v after the conv */
    if (!mixed) return -1;
    const int64_t width = kernel - 1, ratio = HV / HK, blocks = (conv_dim + DELTA_CONV_BLOCK - 1) / DELTA_CONV_BLOCK;
    const float q_scale = 1.0f / sqrtf((float)DK);
#pragma omp parallel num_threads(num_threads)
    {
        /* 1. conv + silu, per (row, block of channels) */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < M * blocks; t++) {
            const int64_t m = t / blocks, c0 = (t % blocks) * DELTA_CONV_BLOCK;
            const int64_t c1 = c0 + DELTA_CONV_BLOCK < conv_dim ? c0 + DELTA_CONV_BLOCK : conv_dim;
            conv_block(proj + m * proj_stride, conv_state + slots[m] * conv_dim * width, conv_weight, kernel,
                       fresh && fresh[m], c0, c1, mixed + m * conv_dim);
        }
        /* 2. q and k l2-normalised, q scaled, per (row, key head) */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < M * HK; t++) {
            float *row = mixed + (t / HK) * conv_dim;
            const int64_t h = t % HK;
            l2_normalize(row + h * DK, DK, l2_eps, q_scale);
            l2_normalize(row + key_dim + h * DK, DK, l2_eps, 1.0f);
        }
        /* 3. the gates, the delta rule and the gated norm, per (row, value head) */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < M * HV; t++) {
            const int64_t m = t / HV, h = t % HV, kh = h / ratio;
            const float *row = mixed + m * conv_dim, *p = proj + m * proj_stride;
            const float *gates = p + conv_dim + value_dim; /* b (HV), then a (HV) */
            float *S = recurrent_state + (slots[m] * HV + h) * DK * DV;
            rule_head(row + kh * DK, row + key_dim + kh * DK, row + 2 * key_dim + h * DV, p + conv_dim + h * DV,
                      gates[h], gates[HV + h], A_log[h], dt_bias[h], norm_weight, S, DK, DV, norm_eps,
                      fresh && fresh[m], out + m * value_dim + h * DV);
        }
    }
    free(mixed);
    return 0;
}
