/* A decode step in C: the small fused row-wise ops a decoder layer runs between its GEMMs
 * (onecall_add_rms_norm, onecall_silu_mul, onecall_rope_store; also called one by one from Python,
 * through native.py) and onecall_decode_layers, the whole decode step, every layer in one call, over the
 * GEMMs of gemm.c and the decode attention of decode_attention.c (declared in kernels.h).
 *
 * Every op here is row-wise and runs a row through the same operations in the same order whatever the
 * number of rows or threads (float32, fixed order): a decode row's bits never depend on its batch.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

/* Rows from which the small row-wise passes below split their rows across the threads (a prompt
 * chunk); fewer rows (decode) run on the calling thread, with no parallel region at all. A row's
 * arithmetic is the same either way. */
#define SMALL_OPS_PAR_ROWS 32

/* One row of onecall_add_rms_norm; y may be h (y[i] reads only h[i]). */
static inline void add_rms_norm_row(float *hr, const float *rr, const float *w, int64_t K, float eps, float *yr) {
    if (rr)
        for (int64_t i = 0; i < K; i++) hr[i] += rr[i];
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= K; i += 8) {
        const __m256 v = _mm256_loadu_ps(hr + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum8(acc);
    for (; i < K; i++) ss += hr[i] * hr[i];
    const float inv = 1.0f / sqrtf(ss / (float)K + eps);
    for (i = 0; i < K; i++) yr[i] = hr[i] * inv * w[i];
}

/* h (M, K) += r (M, K) when r is given; then y = h / sqrt(mean(h^2) + eps) * w, row by row
 * (the residual add and RMSNorm of a pre-norm decoder in one pass; float32, fixed order). */
void onecall_add_rms_norm(float *h, const float *r, const float *w, int64_t M, int64_t K, float eps,
                          float *y) {
    if (M < SMALL_OPS_PAR_ROWS) {
        for (int64_t m = 0; m < M; m++) add_rms_norm_row(h + m * K, r ? r + m * K : NULL, w, K, eps, y + m * K);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < M; m++) add_rms_norm_row(h + m * K, r ? r + m * K : NULL, w, K, eps, y + m * K);
}

/* One row of onecall_silu_mul. */
static inline void silu_mul_row(const float *gate, int64_t I, float *o) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    const float *up = gate + I;
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, g))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i)));
    }
    for (; i < I; i++) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* out (M, I) = silu(y[:, :I]) * y[:, I:] for y (M, 2I): the gated MLP's activation, one pass. */
void onecall_silu_mul(const float *y, int64_t M, int64_t I, float *out) {
    if (M < SMALL_OPS_PAR_ROWS) {
        for (int64_t m = 0; m < M; m++) silu_mul_row(y + m * 2 * I, I, out + m * I);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < M; m++) silu_mul_row(y + m * 2 * I, I, out + m * I);
}

/* RoPE (rotate_half layout) on the q and k heads of qkv (M, (H + 2 KVH) * D), in place, then the
 * rotated k heads and the v heads of each row m are stored at slot slot_mapping[m] of the
 * (num_slots, KVH, D) caches (float32, or IEEE half when kv_f16; KVH * D % 8 == 0 then).
 * cos, sin: (M, D / 2), the row's position's tables. q_norm, k_norm (D,) or NULL: Qwen3's per-head
 * RMSNorm (eps norm_eps), applied to each q / k head before it is rotated. */
static inline void rope_store_row(float *row, int64_t H, int64_t KVH, int64_t D, const float *q_norm,
                                  const float *k_norm, float norm_eps, const float *c, const float *sn,
                                  int64_t slot, void *k_cache, void *v_cache, int kv_f16) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < H + KVH; h++) {
        float *x = row + h * D;
        const float *w = h < H ? q_norm : k_norm;
        if (w) add_rms_norm_row(x, NULL, w, D, norm_eps, x); /* in place: y[i] reads only x[i] */
        for (int64_t i = 0; i < half; i++) {
            const float x1 = x[i], x2 = x[i + half];
            x[i] = x1 * c[i] - x2 * sn[i];
            x[i + half] = x2 * c[i] + x1 * sn[i];
        }
    }
    if (kv_f16) { /* round to nearest even, like torch's .half() */
        uint16_t *k = (uint16_t *)k_cache + slot * KVH * D, *v = (uint16_t *)v_cache + slot * KVH * D;
        for (int64_t i = 0; i < KVH * D; i += 8) {
            _mm_storeu_si128((__m128i *)(k + i), _mm256_cvtps_ph(_mm256_loadu_ps(row + H * D + i), _MM_FROUND_TO_NEAREST_INT));
            _mm_storeu_si128((__m128i *)(v + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(row + (H + KVH) * D + i), _MM_FROUND_TO_NEAREST_INT));
        }
    } else {
        memcpy((float *)k_cache + slot * KVH * D, row + H * D, sizeof(float) * (size_t)(KVH * D));
        memcpy((float *)v_cache + slot * KVH * D, row + (H + KVH) * D, sizeof(float) * (size_t)(KVH * D));
    }
}

void onecall_rope_store(float *qkv, int64_t M, int64_t H, int64_t KVH, int64_t D, const float *q_norm,
                        const float *k_norm, float norm_eps, const float *cos, const float *sin,
                        const int64_t *slot_mapping, void *k_cache, void *v_cache, int kv_f16) {
    const int64_t half = D / 2, width = (H + 2 * KVH) * D;
    if (M < SMALL_OPS_PAR_ROWS) {
        for (int64_t m = 0; m < M; m++)
            rope_store_row(qkv + m * width, H, KVH, D, q_norm, k_norm, norm_eps, cos + m * half, sin + m * half,
                           slot_mapping[m], k_cache, v_cache, kv_f16);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < M; m++) /* each row writes its own slot (the engine never maps two rows to one) */
        rope_store_row(qkv + m * width, H, KVH, D, q_norm, k_norm, norm_eps, cos + m * half, sin + m * half,
                       slot_mapping[m], k_cache, v_cache, kv_f16);
}

/* ---- a whole decode step, every layer in one call ----------------------------------------------
 *
 * The per-op path (model/layers.py) calls the kernels (gemm*.c, decode_attention.c, the ops above) one
 * by one from Python, about twenty calls a layer. For a step where every row is a decode row and every
 * projection's parts run on native GEMMs (4-bit, 5-bit, int8 groups, IQ4 codes, 16-bit floats), this runs the same
 * kernels in the same order on the same values, from C: a decode row gets the same bits either way
 * (tests/kernels/test_native_step.py checks it bitwise), and the step costs one call into C instead of
 * hundreds of Python-level dispatches.
 *
 * Per layer, as DecoderLayer.forward does it: x = norm(h += r); qkv = x W_qkv (+b); q/k norms (Qwen3),
 * RoPE + K/V store; a = attention(q); h += a W_o and x = norm(h); r = silu(x W_gate) * (x W_up) W_down. After
 * the last layer, out = norm(h += r). The step starts from the token ids and positions: h (the residual
 * stream, a scratch buffer here) is gathered from the embedding table (float32 rows; with embed NULL, the
 * checkpoint's groups, embedding.c: 4-bit groups in the q4 layout when embed_offset is given, their
 * scales IEEE half when embed_group_or_f16 is 1, else int8 groups in the q8b layout with groups of
 * embed_group_or_f16), each row's cos/sin from the RoPE tables, as DecoderLM.forward's lookups do
 * (the same values).
 *
 * Q4Weight and DecodeLayer, the structs Python fills (native_abi.py mirrors them), are declared in
 * kernels.h.
 */

/* One part of a projection (its own n rows) on its kernel, with `bias` (or NULL) */
static int part_apply(const Q4Weight *w, const float *bias, const float *x, int64_t M, float *y, int num_threads) {
    if (w->half)
        return onecall_half_gemm(x, M, w->k, (const uint16_t *)w->qs, w->n, bias, y, num_threads, w->half == 2);
    if (w->iq4)
        return onecall_iq4_gemm(x, M, w->k, w->qs, w->scale, w->n, bias, y, num_threads, (int)w->f16,
                                (int)w->iq4 - 1);
    if (w->kbits)
        return onecall_kq_gemm(x, M, w->k, w->qs, w->scale, w->offset, w->n, bias, y, num_threads, (int)w->kbits);
    if (w->q5)
        return onecall_q5_gemm(x, M, w->k, w->qs, w->scale, w->offset, w->n, bias, y, num_threads, (int)w->f16);
    if (w->q8_group)
        return onecall_q8b_gemm(x, M, w->k, (const int8_t *)w->qs, (const float *)w->scale, w->n, bias, y,
                                num_threads, (int)w->q8_group);
    if (w->act8)
        return onecall_q4a8_gemm(x, M, w->k, w->qs, w->scale, w->offset, w->n, bias, y, num_threads, (int)w->f16);
    return onecall_q4_gemm(x, M, w->k, w->qs, w->scale, w->offset, w->n, bias, y, num_threads, (int)w->f16);
}

/* y (M, N) = x W^T (+ bias) for a projection of one part or a chain of them (kernels.h's Q4Weight): each
 * part into a scratch buffer, copied into its columns, then the bias added, as FastLinear's per-op path
 * does it (the same float32 additions, so the same bits). */
static int q4_apply(const Q4Weight *w, const float *x, int64_t M, float *y, int num_threads) {
    if (!w->next) return part_apply(w, w->bias, x, M, y, num_threads);
    int64_t N = 0, widest = 0;
    for (const Q4Weight *p = w; p; p = p->next) {
        N += p->n;
        widest = p->n > widest ? p->n : widest;
    }
    float *part = malloc(sizeof(float) * (size_t)(M * widest));
    if (!part) return -1;
    int rc = 0;
    int64_t col = 0;
    for (const Q4Weight *p = w; p && rc == 0; col += p->n, p = p->next) {
        if ((rc = part_apply(p, NULL, x, M, part, num_threads))) break;
        for (int64_t m = 0; m < M; m++) memcpy(y + m * N + col, part + m * p->n, sizeof(float) * (size_t)p->n);
    }
    free(part);
    if (rc == 0 && w->bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) y[m * N + n] += w->bias[n];
    return rc;
}

/* Its contract (shapes, return codes) is kernels.h's. */
int onecall_decode_layers(const DecodeLayer *layers, int64_t num_layers, const int64_t *ids, const float *embed,
                          const void *embed_qs, const void *embed_scale, const void *embed_offset,
                          int64_t embed_group_or_f16, int64_t vocab, int64_t M, int64_t hidden, int64_t H, int64_t KVH, int64_t D, int64_t I,
                          float eps, float attn_scale, const int64_t *positions, const float *cos_table,
                          const float *sin_table, int64_t max_positions, const int64_t *slot_mapping, void *k_cache,
                          void *v_cache, int64_t layer_stride, int kv_f16, const int32_t *block_tables,
                          int64_t max_blocks, const int32_t *seq_lens, int64_t block_size,
                          const float *final_norm, float *out, int num_threads) {
    const int64_t width = (H + 2 * KVH) * D, elem = kv_f16 ? 2 : 4, half = D / 2;
    for (int64_t m = 0; m < M; m++) { /* checked before anything is written: a bad row costs nothing */
        if (ids[m] < 0 || ids[m] >= vocab) return -3;
        if (positions[m] < 0 || positions[m] >= max_positions) return -4;
    }
    float *h = malloc(sizeof(float) * (size_t)(M * hidden));
    float *cos = malloc(sizeof(float) * (size_t)(M * half)), *sin = malloc(sizeof(float) * (size_t)(M * half));
    float *x = malloc(sizeof(float) * (size_t)(M * hidden));
    float *qkv = malloc(sizeof(float) * (size_t)(M * width));
    float *attn = malloc(sizeof(float) * (size_t)(M * H * D));
    float *o = malloc(sizeof(float) * (size_t)(M * hidden));
    float *gu = malloc(sizeof(float) * (size_t)(M * 2 * I));
    float *act = malloc(sizeof(float) * (size_t)(M * I));
    float *r = malloc(sizeof(float) * (size_t)(M * hidden));
    int rc = (h && cos && sin && x && qkv && attn && o && gu && act && r) ? 0 : -1;
    if (rc == 0 && !embed && embed_offset)
        rc = onecall_q4_rows(embed_qs, embed_scale, embed_offset, vocab, hidden, (int)embed_group_or_f16, ids, M, h);
    else if (rc == 0 && !embed)
        rc = onecall_q8b_rows(embed_qs, embed_scale, vocab, hidden, embed_group_or_f16, ids, M, h);
    for (int64_t m = 0; rc == 0 && m < M; m++) {
        if (embed) memcpy(h + m * hidden, embed + ids[m] * hidden, sizeof(float) * (size_t)hidden);
        memcpy(cos + m * half, cos_table + positions[m] * half, sizeof(float) * (size_t)half);
        memcpy(sin + m * half, sin_table + positions[m] * half, sizeof(float) * (size_t)half);
    }
    for (int64_t l = 0; l < num_layers && rc == 0; l++) {
        const DecodeLayer *L = layers + l;
        char *kc = (char *)k_cache + l * layer_stride * elem, *vc = (char *)v_cache + l * layer_stride * elem;
        onecall_add_rms_norm(h, l ? r : NULL, L->input_norm, M, hidden, eps, x);
        if ((rc = q4_apply(&L->qkv, x, M, qkv, num_threads))) break;
        onecall_rope_store(qkv, M, H, KVH, D, L->q_norm, L->k_norm, eps, cos, sin, slot_mapping, kc, vc, kv_f16);
        rc = onecall_paged_decode_attention(qkv, width, kc, vc, block_tables, max_blocks, seq_lens, M, H, KVH, D,
                                            block_size, attn_scale, L->window, L->softcap, attn, num_threads,
                                            kv_f16);
        if (rc || (rc = q4_apply(&L->o, attn, M, o, num_threads))) break;
        onecall_add_rms_norm(h, o, L->post_norm, M, hidden, eps, x);
        if ((rc = q4_apply(&L->gate_up, x, M, gu, num_threads))) break;
        onecall_silu_mul(gu, M, I, act);
        rc = q4_apply(&L->down, act, M, r, num_threads);
    }
    if (rc == 0) onecall_add_rms_norm(h, num_layers ? r : NULL, final_norm, M, hidden, eps, out);
    free(h);
    free(cos);
    free(sin);
    free(x);
    free(qkv);
    free(attn);
    free(o);
    free(gu);
    free(act);
    free(r);
    return rc;
}
