/* Causal prefill attention over the paged KV cache, read in place (AVX2/FMA, float32 math).
 *
 * One call attends one sequence's query_len new rows (positions seq_len - query_len ... seq_len - 1)
 * over its keys 0 .. seq_len - 1. Its K/V live either in one run of slots (kv_start >= 0: position
 * p at slot kv_start + p) or in blocks (blocks[p / block_size] * block_size + p % block_size).
 * Cache rows are (num_slots, KVH, D), float32 or IEEE half (kv_f16; converted per key tile).
 *
 * Work: tasks (KV head kh, query tile of BQ positions). A task's rows are the BQ positions x the G
 * query heads that share kh (row rho = (position - tile start) * G + g), padded to a multiple of 24
 * (the micro-tile), so each K/V tile it reads serves G * BQ rows: GQA without copies. Keys go in
 * tiles of PF_BK positions that start at absolute multiples of PF_BK; a task visits the tiles from
 * its first window's to its last row's diagonal, and skips the rest.
 *
 * Layout per task (its thread's scratch), rows vectorized, so the softmax needs no horizontal sums:
 *   qt (D, R): the task's queries transposed, times `scale`
 *   st (PF_BK, R): scores of a key tile, transposed (key j, row rho), then their exps
 *   o (R, D): the running weighted V sums; m, l (R): running max and sum of exps (online softmax)
 *
 * Attention sinks (gpt-oss; sinks != NULL): row rho of head h = kh * G + g ends with its running max m
 * and sum l over its visible keys; the sink joins them once, at the end (step 7): with M = max(m, sink),
 * out = o * exp(m - M) / (l * exp(m - M) + exp(sink - M)), the softmax over the keys and the sink
 * (whose value is zero). Without sinks step 7 is o / l as before, bit for bit.
 *
 * Numerics and invariance: a row's score with key j is one FMA chain over d = 0..D-1; its softmax and
 * V sums run over its visible key tiles in position order; a tile where the row sees no key is an
 * exact no-op (alpha = exp(0) = 1, every p = exp(-inf) = 0, o + 0 * v = o). So a row's bits depend
 * only on its query, its position and the KV: not on the other rows of the call, the query tile it
 * landed in, how the prompt was chunked, or the thread count.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

/* Tile sizes (-DPF_BK=.. -DPF_ROWS=.. to try others; native.py builds with these). A row's bits depend
 * on PF_BK (its key tiles' bounds), not on PF_ROWS. */
#ifndef PF_BK
#define PF_BK 64 /* keys per tile (a multiple of 4: the score micro-tile) */
#endif
#ifndef PF_ROWS
#define PF_ROWS 96 /* target rows (positions x heads of a group) per task */
#endif
#define PF_RV 24     /* rows per score micro-tile (3 vectors); R is a multiple of it (and so of 6) */
#define PF_MAX_D 512 /* head_dim handled here */

/* st[k * R + i] = dot(kp[k], qt[:, i]) for 4 keys k and 24 rows i (qt, st already offset to the
 * micro-tile's first row): 12 accumulators, each one FMA chain over d in order. */
static inline __attribute__((always_inline)) void score_tile(const float *qt, int64_t R, const float *const *kp,
                                                             int64_t D, float *st) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a10 = a00, a11 = a00, a12 = a00;
    __m256 a20 = a00, a21 = a00, a22 = a00, a30 = a00, a31 = a00, a32 = a00;
    const float *k0 = kp[0], *k1 = kp[1], *k2 = kp[2], *k3 = kp[3];
    for (int64_t d = 0; d < D; d++) {
        const float *qd = qt + d * R;
        const __m256 q0 = _mm256_loadu_ps(qd), q1 = _mm256_loadu_ps(qd + 8), q2 = _mm256_loadu_ps(qd + 16);
        __m256 k = _mm256_broadcast_ss(k0 + d);
        a00 = _mm256_fmadd_ps(k, q0, a00), a01 = _mm256_fmadd_ps(k, q1, a01), a02 = _mm256_fmadd_ps(k, q2, a02);
        k = _mm256_broadcast_ss(k1 + d);
        a10 = _mm256_fmadd_ps(k, q0, a10), a11 = _mm256_fmadd_ps(k, q1, a11), a12 = _mm256_fmadd_ps(k, q2, a12);
        k = _mm256_broadcast_ss(k2 + d);
        a20 = _mm256_fmadd_ps(k, q0, a20), a21 = _mm256_fmadd_ps(k, q1, a21), a22 = _mm256_fmadd_ps(k, q2, a22);
        k = _mm256_broadcast_ss(k3 + d);
        a30 = _mm256_fmadd_ps(k, q0, a30), a31 = _mm256_fmadd_ps(k, q1, a31), a32 = _mm256_fmadd_ps(k, q2, a32);
    }
    _mm256_storeu_ps(st, a00), _mm256_storeu_ps(st + 8, a01), _mm256_storeu_ps(st + 16, a02);
    st += R;
    _mm256_storeu_ps(st, a10), _mm256_storeu_ps(st + 8, a11), _mm256_storeu_ps(st + 16, a12);
    st += R;
    _mm256_storeu_ps(st, a20), _mm256_storeu_ps(st + 8, a21), _mm256_storeu_ps(st + 16, a22);
    st += R;
    _mm256_storeu_ps(st, a30), _mm256_storeu_ps(st + 8, a31), _mm256_storeu_ps(st + 16, a32);
}

/* o[r, d0 .. d0 + 15] = o[r, ..] * alpha[r] + sum_j st[j * R + r] * vp[j][d0 ..] for 6 rows r (o, alpha,
 * st offset to the first), keys j in order. */
static inline __attribute__((always_inline)) void pv_tile(float *o, int64_t D, const float *alpha,
                                                          const float *st, int64_t R, const float *const *vp,
                                                          int64_t nk, int64_t d0) {
    __m256 acc[6][2];
    for (int r = 0; r < 6; r++) {
        const __m256 a = _mm256_broadcast_ss(alpha + r);
        acc[r][0] = _mm256_mul_ps(_mm256_loadu_ps(o + r * D + d0), a);
        acc[r][1] = _mm256_mul_ps(_mm256_loadu_ps(o + r * D + d0 + 8), a);
    }
    for (int64_t j = 0; j < nk; j++) {
        const __m256 v0 = _mm256_loadu_ps(vp[j] + d0), v1 = _mm256_loadu_ps(vp[j] + d0 + 8);
        const float *p = st + j * R;
        for (int r = 0; r < 6; r++) {
            const __m256 w = _mm256_broadcast_ss(p + r);
            acc[r][0] = _mm256_fmadd_ps(w, v0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w, v1, acc[r][1]);
        }
    }
    for (int r = 0; r < 6; r++) {
        _mm256_storeu_ps(o + r * D + d0, acc[r][0]);
        _mm256_storeu_ps(o + r * D + d0 + 8, acc[r][1]);
    }
}

typedef struct {
    float *qt, *st, *o, *m, *l, *alpha, *kbuf, *vbuf;
    int32_t *pos;
} Scratch;

static int scratch_alloc(Scratch *s, int64_t R, int64_t D, int f16) {
    memset(s, 0, sizeof *s);
    const size_t fl = sizeof(float);
    s->qt = aligned_alloc(32, fl * (size_t)(D * R));
    s->st = aligned_alloc(32, fl * (size_t)(PF_BK * R));
    s->o = aligned_alloc(32, fl * (size_t)(R * D));
    s->m = aligned_alloc(32, fl * (size_t)R * 3 + sizeof(int32_t) * (size_t)R);
    if (f16) {
        s->kbuf = aligned_alloc(32, fl * (size_t)(PF_BK * D));
        s->vbuf = aligned_alloc(32, fl * (size_t)(PF_BK * D));
    }
    if (!s->qt || !s->st || !s->o || !s->m || (f16 && (!s->kbuf || !s->vbuf))) return -1;
    s->l = s->m + R, s->alpha = s->l + R, s->pos = (int32_t *)(s->alpha + R);
    return 0;
}

static void scratch_free(Scratch *s) {
    free(s->qt), free(s->st), free(s->o), free(s->m), free(s->kbuf), free(s->vbuf);
}

typedef struct {
    const float *q;
    int64_t q_stride; /* floats between query rows; a row's heads (H, D) are contiguous */
    const char *k_cache, *v_cache;
    const int64_t *blocks; /* NULL: one run from kv_start */
    int64_t kv_start, block_size, query_len, seq_len, H, KVH, D, window;
    float scale, softcap;
    const float *sinks; /* (H,) or NULL */
    float *out;         /* (query_len, H, D) */
} Problem;

static inline int64_t slot_of(const Problem *pb, int64_t p) {
    if (!pb->blocks) return pb->kv_start + p;
    return pb->blocks[p / pb->block_size] * pb->block_size + p % pb->block_size;
}

/* One task: KV head kh, query rows r0 .. r0 + n - 1 (n <= BQ). Phases numbered in the body. */
static inline __attribute__((always_inline)) void prefill_task(const Problem *pb, Scratch *s, int64_t kh,
                                                               int64_t r0, int64_t n, int64_t R,
                                                               const float *zero_row, const int f16) {
    const int64_t D = pb->D, G = pb->H / pb->KVH, rows = n * G, cached = pb->seq_len - pb->query_len;
    const int64_t elem = f16 ? 2 : 4, row_bytes = pb->KVH * pb->D * elem;
    /* 1. queries transposed and scaled; padding rows (rho >= rows) are zero queries at the last position */
    for (int64_t rho = 0; rho < R; rho++) {
        const int64_t r = rho < rows ? r0 + rho / G : r0 + n - 1;
        s->pos[rho] = (int32_t)(cached + r);
        const float *qr = pb->q + r * pb->q_stride + (kh * G + rho % G) * D;
        for (int64_t d = 0; d < D; d++) s->qt[d * R + rho] = rho < rows ? qr[d] * pb->scale : 0.0f;
        s->m[rho] = -INFINITY, s->l[rho] = 0.0f;
    }
    memset(s->o, 0, sizeof(float) * (size_t)(R * D));
    /* 2. the key tiles some row sees: from the first row's window start to the last row's position */
    const int64_t first_pos = cached + r0, last_pos = cached + r0 + n - 1;
    const int64_t lo = pb->window > 0 && first_pos - pb->window + 1 > 0 ? first_pos - pb->window + 1 : 0;
    const float *kp[PF_BK], *vp[PF_BK];
    for (int64_t t0 = lo / PF_BK * PF_BK; t0 <= last_pos; t0 += PF_BK) {
        /* keys some row may see: up to the last row's position (which is < seq_len, so they exist);
         * the tile's later keys are masked for every row, and leaving them out is the exact no-op */
        const int64_t nk = t0 + PF_BK <= last_pos + 1 ? PF_BK : last_pos + 1 - t0;
        const int64_t nk4 = (nk + 3) / 4 * 4; /* whole score micro-tiles */
        /* 3. row pointers of the tile's K and V (in place, or converted from half); keys past nk read
         * a zero row (up to nk4), their scores are masked (they are past every row's position) */
        for (int64_t j = 0; j < nk4; j++) {
            if (j >= nk) {
                kp[j] = vp[j] = zero_row;
                continue;
            }
            const int64_t off = slot_of(pb, t0 + j) * row_bytes + kh * D * elem;
            if (f16) {
                for (int64_t d = 0; d < D; d += 8) {
                    _mm256_storeu_ps(s->kbuf + j * D + d, _mm256_cvtph_ps(_mm_loadu_si128(
                                                              (const __m128i *)(pb->k_cache + off) + d / 8)));
                    _mm256_storeu_ps(s->vbuf + j * D + d, _mm256_cvtph_ps(_mm_loadu_si128(
                                                              (const __m128i *)(pb->v_cache + off) + d / 8)));
                }
                kp[j] = s->kbuf + j * D, vp[j] = s->vbuf + j * D;
            } else {
                kp[j] = (const float *)(pb->k_cache + off), vp[j] = (const float *)(pb->v_cache + off);
            }
        }
        /* 4. scores (key j, row rho), then soft-capping and the mask */
        for (int64_t i0 = 0; i0 < R; i0 += PF_RV)
            for (int64_t j0 = 0; j0 < nk4; j0 += 4) score_tile(s->qt + i0, R, kp + j0, D, s->st + j0 * R + i0);
        if (pb->softcap > 0.0f)
            for (int64_t j = 0; j < nk * R; j++) s->st[j] = pb->softcap * tanhf(s->st[j] / pb->softcap);
        const int needs_mask = t0 + nk4 - 1 > first_pos || (pb->window > 0 && t0 <= last_pos - pb->window);
        if (needs_mask)
            for (int64_t j = 0; j < nk4; j++) {
                const __m256i kpos = _mm256_set1_epi32((int32_t)(t0 + j));
                const __m256i w = _mm256_set1_epi32((int32_t)pb->window);
                for (int64_t i = 0; i < R; i += 8) {
                    const __m256i p = _mm256_loadu_si256((const __m256i *)(s->pos + i));
                    __m256i hide = _mm256_cmpgt_epi32(kpos, p); /* key after the row */
                    if (pb->window > 0) /* key at or before row - window */
                        hide = _mm256_or_si256(hide, _mm256_cmpgt_epi32(_mm256_sub_epi32(p, kpos), _mm256_sub_epi32(w, _mm256_set1_epi32(1))));
                    float *sp = s->st + j * R + i;
                    _mm256_storeu_ps(sp, _mm256_blendv_ps(_mm256_loadu_ps(sp), _mm256_set1_ps(-INFINITY),
                                                          _mm256_castsi256_ps(hide)));
                }
            }
        /* 5. online softmax, 8 rows at a time: new max, alpha = exp(old - new), p = exp(score - new);
         * a row with no visible key yet keeps m = -inf and uses 0 in place of it, so nothing is NaN */
        for (int64_t i = 0; i < R; i += 8) {
            const __m256 m_old = _mm256_loadu_ps(s->m + i);
            __m256 m_new = m_old;
            for (int64_t j = 0; j < nk; j++) m_new = _mm256_max_ps(m_new, _mm256_loadu_ps(s->st + j * R + i));
            const __m256 none = _mm256_cmp_ps(m_new, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
            const __m256 m_use = _mm256_andnot_ps(none, m_new);
            __m256 sum = _mm256_setzero_ps();
            for (int64_t j = 0; j < nk; j++) {
                float *sp = s->st + j * R + i;
                const __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(sp), m_use));
                _mm256_storeu_ps(sp, p);
                sum = _mm256_add_ps(sum, p);
            }
            const __m256 alpha = exp256(_mm256_sub_ps(m_old, m_use));
            _mm256_storeu_ps(s->alpha + i, alpha);
            _mm256_storeu_ps(s->l + i, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(s->l + i), alpha), sum));
            _mm256_storeu_ps(s->m + i, m_new);
        }
        /* 6. o = o * alpha + p @ V, over the keys that exist */
        for (int64_t i0 = 0; i0 < R; i0 += 6)
            for (int64_t d0 = 0; d0 < D; d0 += 16) pv_tile(s->o + i0 * D, D, s->alpha + i0, s->st + i0, R, vp, nk, d0);
    }
    /* 7. out[r, kh * G + g] = o / l (every real row saw at least key 0 of its window: l > 0); with
     * sinks, o * exp(m - M) / (l * exp(m - M) + exp(sink - M)), M = max(m, sink) */
    for (int64_t rho = 0; rho < rows; rho++) {
        float *dst = pb->out + ((r0 + rho / G) * pb->H + kh * G + rho % G) * D;
        if (pb->sinks) {
            const float sink = pb->sinks[kh * G + rho % G], m = s->m[rho], mx = sink > m ? sink : m;
            const float alpha = expf(m - mx);
            const __m256 w = _mm256_set1_ps(alpha / (s->l[rho] * alpha + expf(sink - mx)));
            for (int64_t d = 0; d < D; d += 8)
                _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(s->o + rho * D + d), w));
            continue;
        }
        const __m256 l = _mm256_set1_ps(s->l[rho]);
        for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(dst + d, _mm256_div_ps(_mm256_loadu_ps(s->o + rho * D + d), l));
    }
}

static inline __attribute__((always_inline)) int prefill_attention(const Problem *pb, int num_threads,
                                                                   const int f16) {
    const int64_t H = pb->H, KVH = pb->KVH, D = pb->D;
    if (KVH <= 0 || H % KVH || D % 16 || D > PF_MAX_D || pb->query_len < 1 || pb->query_len > pb->seq_len)
        return -2;
    const int64_t G = H / KVH, bq = G >= PF_ROWS ? 1 : PF_ROWS / G;
    const int64_t R = (bq * G + PF_RV - 1) / PF_RV * PF_RV;
    const int64_t num_tiles = (pb->query_len + bq - 1) / bq, num_tasks = num_tiles * KVH;
    static const float zero_row[PF_MAX_D]; /* the K/V of keys past seq_len (masked, but read) */
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        Scratch s;
        const int ok = scratch_alloc(&s, R, D, f16) == 0;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        /* the last query tiles see the most keys: hand them out first */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < num_tasks; t++) {
            if (!ok) continue;
            const int64_t tile = num_tiles - 1 - t / KVH, kh = t % KVH, r0 = tile * bq;
            const int64_t n = r0 + bq <= pb->query_len ? bq : pb->query_len - r0;
            prefill_task(pb, &s, kh, r0, n, R, zero_row, f16);
        }
        scratch_free(&s);
    }
    return failed ? -1 : 0;
}

/* q (query_len rows of (H, D) floats, q_stride floats apart) -> out (query_len, H, D), causal over the
 * sequence's seq_len positions (the first seq_len - query_len cached). blocks: NULL when the KV is one
 * run of slots from kv_start. window > 0: a sliding window (a row sees its last `window` positions);
 * softcap > 0: scores -> softcap * tanh(score / softcap). sinks: (H,) float32 attention sinks, or NULL.
 * kv_f16: the caches hold IEEE half values.
 * Returns 0, -1 (out of memory) or -2 (shapes not handled: the caller falls back). */
int onecall_prefill_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                              const int64_t *blocks, int64_t kv_start, int64_t block_size, int64_t query_len,
                              int64_t seq_len, int64_t H, int64_t KVH, int64_t D, float scale, int64_t window,
                              float softcap, const float *sinks, float *out, int num_threads, int kv_f16) {
    const Problem pb = {q, q_stride, k_cache, v_cache, blocks, kv_start, block_size, query_len, seq_len, H, KVH, D,
                        window, scale, softcap, sinks, out};
    if (kv_f16) return prefill_attention(&pb, num_threads, 1);
    return prefill_attention(&pb, num_threads, 0);
}
