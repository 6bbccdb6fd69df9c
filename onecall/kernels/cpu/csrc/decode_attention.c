/* Attention over the paged KV cache, one query per sequence (decode): onecall_paged_decode_attention.
 * The prompt's causal attention is prefill_attention.c; both take their exp from simd.h (exp256).
 *
 * out (S, H, D) = softmax(q k^T * scale) v for each sequence s over its seq_lens[s] cached positions
 * (row s of q starts at q + s * q_stride; its H heads of D values are contiguous),
 * reading K and V where they lie: position p of sequence s is slot
 * block_tables[s, p / block_size] * block_size + p % block_size of the (num_slots, KVH, D) caches.
 * GQA: query heads kvh*G .. kvh*G + G - 1 (G = H / KVH) share KV head kvh.
 * Attention sinks (gpt-oss; sinks != NULL): head h's softmax denominator also holds exp(sinks[h]), a
 * logit with no value, so out = sum_p exp(s_p) v_p / (sum_p exp(s_p) + exp(sinks[h])); it joins at the
 * merge (step 4), where the running max takes it in first so no exp overflows.
 *
 * Work is split into tasks (s, chunk of ATTN_CHUNK positions), each reading its slots' K and then V
 * rows whole (all KV heads: contiguous memory) once, keeping per query head a running max, sum and
 * weighted V sum; the chunks of a sequence are merged in position order afterwards. Chunk
 * boundaries are fixed positions, so a sequence's result depends only on its own query, KV and
 * length: never on the batch or the thread count.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "simd.h"

#define ATTN_CHUNK 128
#define ATTN_MAX_HEADS 128 /* query heads handled here (more: the caller falls back) */

/* 8 K/V values from a float32 or (f16) IEEE half cache row, as float32. */
static inline __attribute__((always_inline)) __m256 load_kv8(const void *row, int64_t i, const int f16) {
    if (f16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
    return _mm256_loadu_ps((const float *)row + i);
}

/* out[g] = dot(q + g * D, k, D) for g < n <= 4: four independent FMA chains share each load of k. */
static inline __attribute__((always_inline)) void dots4(const float *q, const void *k, int64_t D, int n, float *out,
                                                        const int f16) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < D; i += 8) {
        const __m256 kv = load_kv8(k, i, f16);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), kv, a0);
        if (n > 1) a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + D + i), kv, a1);
        if (n > 2) a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 2 * D + i), kv, a2);
        if (n > 3) a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 3 * D + i), kv, a3);
    }
    out[0] = hsum8(a0);
    if (n > 1) out[1] = hsum8(a1);
    if (n > 2) out[2] = hsum8(a2);
    if (n > 3) out[3] = hsum8(a3);
}

/* The first position a decode query at position len - 1 sees: len - window with a sliding window
 * (window > 0: the query and the window - 1 positions before it), else 0. */
static inline int64_t window_start(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

static inline __attribute__((always_inline)) int paged_decode_attention(
    const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, const int32_t *block_tables,
    int64_t max_blocks, const int32_t *seq_lens, int64_t S, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
    float scale, int64_t window, float softcap, const float *sinks, float *out, int num_threads, const int f16) {
    const int64_t elem = f16 ? 2 : 4; /* bytes per cached value */
    if (H > ATTN_MAX_HEADS || H % KVH || D % 8) return -2;
    const int64_t G = H / KVH;
    int64_t max_chunks = 1;
    for (int64_t s = 0; s < S; s++) {
        const int64_t span = seq_lens[s] - window_start(seq_lens[s], window);
        const int64_t c = (span + ATTN_CHUNK - 1) / ATTN_CHUNK;
        max_chunks = c > max_chunks ? c : max_chunks;
    }
    /* per task and query head: [max, sum, acc (D)] */
    const int64_t stride = 2 + D;
    const int64_t num_tasks = S * max_chunks;
    float *part = malloc(sizeof(float) * (size_t)(num_tasks * H * stride));
    if (!part) return -1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t t = 0; t < num_tasks; t++) {
        const int64_t s = t / max_chunks, c = t % max_chunks;
        const int64_t len = seq_lens[s], start = window_start(len, window) + c * ATTN_CHUNK;
        float *pt = part + t * H * stride;
        if (start >= len) {
            for (int64_t h = 0; h < H; h++) pt[h * stride] = -INFINITY;
            continue;
        }
        const int64_t n = (start + ATTN_CHUNK < len ? start + ATTN_CHUNK : len) - start;
        const int32_t *table = block_tables + s * max_blocks;
        const float *qs = q + s * q_stride; /* (H, D) contiguous */
        float sc[ATTN_MAX_HEADS][ATTN_CHUNK];
        int64_t slots[ATTN_CHUNK];
        for (int64_t i = 0; i < n; i++) {
            const int64_t p = start + i;
            slots[i] = (int64_t)table[p / block_size] * block_size + p % block_size;
        }
        /* 1. scores: each slot's K row (all KV heads) read once */
        for (int64_t i = 0; i < n; i++) {
            const char *krow = (const char *)k_cache + slots[i] * KVH * D * elem;
            for (int64_t kh = 0; kh < KVH; kh++)
                for (int64_t g0 = 0; g0 < G; g0 += 4) {
                    float d4[4];
                    const int m = (int)(G - g0 < 4 ? G - g0 : 4);
                    dots4(qs + (kh * G + g0) * D, krow + kh * D * elem, D, m, d4, f16);
                    for (int j = 0; j < m; j++) sc[kh * G + g0 + j][i] = d4[j] * scale;
                }
        }
        if (softcap > 0.0f) /* Gemma 2's logit soft-capping: softcap * tanh(score / softcap) */
            for (int64_t h = 0; h < H; h++)
                for (int64_t i = 0; i < n; i++) sc[h][i] = softcap * tanhf(sc[h][i] / softcap);
        /* 2. per query head: max, exp, sum */
        for (int64_t h = 0; h < H; h++) {
            float mx = -INFINITY;
            for (int64_t i = 0; i < n; i++) mx = sc[h][i] > mx ? sc[h][i] : mx;
            const __m256 m8 = _mm256_set1_ps(mx);
            __m256 sum8 = _mm256_setzero_ps();
            int64_t i = 0;
            for (; i + 8 <= n; i += 8) {
                const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(&sc[h][i]), m8));
                _mm256_storeu_ps(&sc[h][i], e);
                sum8 = _mm256_add_ps(sum8, e);
            }
            float sum = hsum8(sum8);
            for (; i < n; i++) {
                const float e = expf(sc[h][i] - mx);
                sc[h][i] = e;
                sum += e;
            }

            pt[h * stride] = mx;
            pt[h * stride + 1] = sum;
            for (int64_t d = 0; d < D; d++) pt[h * stride + 2 + d] = 0.0f;
        }
        /* 3. weighted values: each slot's V row read once */
        for (int64_t j = 0; j < n; j++) {
            const char *vrow = (const char *)v_cache + slots[j] * KVH * D * elem;
            for (int64_t h = 0; h < H; h++) {
                const char *vp = vrow + (h / G) * D * elem;
                float *acc = pt + h * stride + 2;
                const __m256 w = _mm256_set1_ps(sc[h][j]);
                for (int64_t d = 0; d < D; d += 8)
                    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(w, load_kv8(vp, d, f16), _mm256_loadu_ps(acc + d)));
            }
        }
    }
    /* 4. merge the chunks of each (sequence, query head), in position order */
    for (int64_t s = 0; s < S; s++)
        for (int64_t h = 0; h < H; h++) {
            const float *first = part + s * max_chunks * H * stride + h * stride;
            /* the sink (if any) joins the max, then the denominator; no sinks: m and total as before */
            const float sink = sinks ? sinks[h] : -INFINITY;
            float m = sink;
            for (int64_t c = 0; c < max_chunks; c++) {
                const float cm = first[c * H * stride];
                m = cm > m ? cm : m;
            }
            float *o = out + (s * H + h) * D;
            float total = sinks ? expf(sink - m) : 0.0f;
            for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
            for (int64_t c = 0; c < max_chunks; c++) {
                const float *pc = first + c * H * stride;
                if (pc[0] == -INFINITY) continue;
                const float w = expf(pc[0] - m);
                total += w * pc[1];
                for (int64_t d = 0; d < D; d++) o[d] += w * pc[2 + d];
            }
            const float inv = 1.0f / total;
            for (int64_t d = 0; d < D; d++) o[d] *= inv;
        }
    free(part);
    return 0;
}

/* kv_f16: the caches hold IEEE half values (EngineConfig.kv_cache_dtype "float16"), else float32.
 * window > 0: a sliding window (each query sees its last `window` positions); softcap > 0: scores
 * are soft-capped before the softmax. 0 turns either off. */
int onecall_paged_decode_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                                   const int32_t *block_tables, int64_t max_blocks, const int32_t *seq_lens,
                                   int64_t S, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                                   float scale, int64_t window, float softcap, float *out, int num_threads,
                                   int kv_f16) {
    return onecall_paged_decode_attention_sinks(q, q_stride, k_cache, v_cache, block_tables, max_blocks, seq_lens,
                                                S, H, KVH, D, block_size, scale, window, softcap, NULL, out,
                                                num_threads, kv_f16);
}

/* The same with attention sinks: sinks (H,) float32, one logit per query head, or NULL (none). */
int onecall_paged_decode_attention_sinks(const float *q, int64_t q_stride, const void *k_cache,
                                         const void *v_cache, const int32_t *block_tables, int64_t max_blocks,
                                         const int32_t *seq_lens, int64_t S, int64_t H, int64_t KVH, int64_t D,
                                         int64_t block_size, float scale, int64_t window, float softcap,
                                         const float *sinks, float *out, int num_threads, int kv_f16) {
    if (kv_f16)
        return paged_decode_attention(q, q_stride, k_cache, v_cache, block_tables, max_blocks, seq_lens, S, H, KVH,
                                      D, block_size, scale, window, softcap, sinks, out, num_threads, 1);
    return paged_decode_attention(q, q_stride, k_cache, v_cache, block_tables, max_blocks, seq_lens, S, H, KVH, D,
                                  block_size, scale, window, softcap, sinks, out, num_threads, 0);
}
