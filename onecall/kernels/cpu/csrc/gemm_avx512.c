/* AVX-512 VNNI tiles of the quantized GEMMs (q4, q8b, iq4: gemm.c; q5: gemm_q5.c), chosen at run time.
 *
 * The library is built for AVX2 (native_build.py's flags); only the functions here are compiled for
 * AVX-512 F/BW/VL + VNNI, each by its own target attribute, and they run only when the CPU has those
 * (avx512_gemm_enabled: __builtin_cpu_supports, decided once) and onecall_set_avx512 left them on. So the
 * library loads and runs on an AVX2-only CPU.
 *
 * The same layouts and the same arithmetic as the AVX2 tiles, twice as wide: one 512-bit register of 16
 * int32 lanes holds a whole unit's 16 weight rows (lanes 0-7 block 0, lanes 8-15 block 1, the AVX2
 * tiles' two registers side by side). A chunk's 16 bytes of block 0 and of block 1 are loaded side by
 * side and widened to 32 int16 lanes, so one vpdpwssd against a broadcast activation pair does the AVX2
 * tile's two madds and two adds.
 *
 * Bit for bit the AVX2 tiles' outputs: a group's int32 dot is the same integer (exact, or the same
 * modular int32 arithmetic where an input is NaN or infinite: madd + add and vpdpwssd both wrap), and
 * each output lane then goes through the same float32 operations in the same order (conversion, the
 * product scale x step, the FMA into its accumulator, the offset FMA, acc + oacc, + bias), so the width
 * changes nothing per lane. Every row goes through those operations whatever the tile, M or the thread
 * count: batch invariance, as in gemm.c. tests/kernels/test_avx512_gemm.py checks both paths agree. */
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "codebooks.h"
#include "gemm_avx512.h"
#include "kernels.h"

#define AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512vnni"
#define AVX512_FN __attribute__((target(AVX512_TARGET)))
#define AVX512_INLINE static inline __attribute__((always_inline, target(AVX512_TARGET)))

/* Rows per tile (same-process A/Bs at M = 512, N = 4864, K = 896, one thread, CPU time, on a shared
 * 2-core Zen 5 VM: differences under ~5% were noise there):
 *   AVX512_TILE         chunks of fewer than AVX512_BUFFER_ROWS rows (decode), the weights unpacked per
 *                       tile: 4 (before the buffered path, prompts ran here too: 4 beat 6-12 by 1.2x for
 *                       q4, q5 and iq4, whose unpacking every tile repeats);
 *   AVX512_WIDE_TILE    a chunk's rows over the widened unit without offsets (q8b, iq4): 12, 12 int32 +
 *                       12 float accumulators (8: ~5% slower, 4: 1.15x slower);
 *   AVX512_OFFSET_TILE  the same with offsets (q4, q5; 3 accumulators a row): 8 (6 to 10: the same). */
#ifndef AVX512_TILE
#define AVX512_TILE 4
#endif
#ifndef AVX512_WIDE_TILE
#define AVX512_WIDE_TILE 12
#endif
#ifndef AVX512_OFFSET_TILE
#define AVX512_OFFSET_TILE 8
#endif
#define AVX512_MAX_TILE 12 /* the largest of the three: the accumulator arrays' size */
_Static_assert(AVX512_TILE <= AVX512_MAX_TILE && AVX512_WIDE_TILE <= AVX512_MAX_TILE &&
                   AVX512_OFFSET_TILE <= AVX512_MAX_TILE,
               "a tile larger than the accumulator arrays");
#define AVX512_PREFETCH 16 /* groups ahead that the weight stream is prefetched (the AVX2 tiles' distance) */

/* -1: not decided yet; then 0 or 1. Read once per GEMM call. */
static int avx512_state = -1;

static int avx512_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

int avx512_gemm_enabled(void) {
    int state = __atomic_load_n(&avx512_state, __ATOMIC_RELAXED);
    if (state < 0) {
        state = avx512_supported();
        __atomic_store_n(&avx512_state, state, __ATOMIC_RELAXED);
    }
    return state;
}

int onecall_set_avx512(int enable) {
    if (enable >= 0) __atomic_store_n(&avx512_state, enable && avx512_supported(), __ATOMIC_RELAXED);
    return avx512_gemm_enabled();
}

/* 16 scales or offsets of one group (a unit's 16 rows), as float32 (act_quant.h's load8, twice) */
AVX512_INLINE __m512 load16(const void *p, const int f16) {
    if (f16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_loadu_ps(p);
}

/* Block 0's 16 bytes at p0 and block 1's at p1, side by side */
AVX512_INLINE __m256i load_blocks(const void *p0, const void *p1) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p0)),
                                   _mm_loadu_si128((const __m128i *)p1), 1);
}

/* The int16 activation pair at p, in every 32-bit lane */
AVX512_INLINE __m512i pair(const int16_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* Outputs (row, n0 .. min(n0 + 16, N)) = v (+ bias): the AVX2 tiles' out[n - n0] + bias[n], per lane */
AVX512_INLINE void store16(float *row, int64_t n0, int64_t N, __m512 v, const float *bias) {
    const int64_t count = N - n0 < 16 ? N - n0 : 16;
    const __mmask16 mask = (__mmask16)((1u << count) - 1u);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + n0));
    _mm512_mask_storeu_ps(row + n0, mask, v);
}

/* Group g's 16 scales and offsets of unit u (lane l: row 16u + l) as float32, laid out by mode: 0 float32,
 * 1 IEEE half ((units, G, 2, 8) each), Q4_SUPER the q4 layout's super-block factors (act_quant.h: d * sc and
 * nmin * mn, the AVX2 tiles' q4_group_scales8 per lane); offsets zero without has_offset */
AVX512_INLINE void group_scales16(const int mode, const int has_offset, const void *scale, const void *offset,
                                  int64_t u, int64_t G, int64_t g, __m512 *sc, __m512 *of) {
    if (mode == Q4_SUPER) {
        const uint8_t *sb = (const uint8_t *)scale + (u * (G / Q4_SUPER_GROUPS) + g / Q4_SUPER_GROUPS) * Q4_SUPER_BYTES;
        const uint8_t *f = sb + 128 + 32 * (g % Q4_SUPER_GROUPS);
        const __m512 d = _mm512_loadu_ps(sb), nmin = _mm512_loadu_ps(sb + 64);
        *sc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)f))));
        *of = _mm512_mul_ps(nmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(f + 16)))));
        return;
    }
    const int64_t at = (u * G + g) * 16 * (mode ? 2 : 4);
    *sc = load16((const char *)scale + at, mode);
    *of = has_offset ? load16((const char *)offset + at, mode) : _mm512_setzero_ps();
}

AVX512_INLINE void prefetch_group(const void *p, int lines) {
    for (int l = 0; l < lines; l++) _mm_prefetch((const char *)p + 64 * l, _MM_HINT_T0);
}

/* ---- prompt rows: a unit's weights widened once into a thread's int16 buffer ----
 *
 * With AVX512_BUFFER_ROWS or more rows in a chunk, a unit's weights (any of the four layouts) are
 * widened once into 16 x K int16 values, one 64-byte vector per column pair p of group g at buf + (g * 16
 * + p) * 32 (block 0's 8 rows x the pair's 2 columns, then block 1's), and every tile of the chunk reads
 * them with one load per pair (wide_tile) instead of unpacking them again per tile of rows. The int32
 * dots are the same integers and the float32 operations the same, so a row's bits do not depend on which
 * path ran it. Column pair p is columns 2p, 2p + 1 of the group (for the 4- and 5-bit layouts, pairs 0-7
 * are the low nibbles' columns, 8-15 the high nibbles'). */
#define AVX512_BUFFER_ROWS 8

/* the calling thread's buffer of at least n int16 (64-byte aligned), grown on demand and kept while the
 * thread lives (an OpenMP pool thread holds one of 16 x K x 2 bytes); the thread-specific key frees it
 * when the thread exits. NULL if it cannot be allocated (the caller then unpacks per tile). */
static _Thread_local int16_t *unit_buffer;
static _Thread_local int64_t unit_buffer_len;
static pthread_key_t unit_buffer_key;
static pthread_once_t unit_buffer_once = PTHREAD_ONCE_INIT;
static int unit_buffer_keyed; /* 1 once the key exists (else a buffer is never freed: a leak, not a fault) */

static void make_unit_buffer_key(void) { unit_buffer_keyed = pthread_key_create(&unit_buffer_key, free) == 0; }

static int16_t *thread_buffer(int64_t n) {
    if (unit_buffer_len < n) {
        pthread_once(&unit_buffer_once, make_unit_buffer_key);
        free(unit_buffer);
        unit_buffer = aligned_alloc(64, (size_t)n * sizeof(int16_t)); /* n = 16 K, K % 32 == 0: whole lines */
        unit_buffer_len = unit_buffer ? n : 0;
        if (unit_buffer_keyed) pthread_setspecific(unit_buffer_key, unit_buffer);
    }
    return unit_buffer;
}

/* Rows [m0, m_end) x the widened unit in buf: acc = fma(float(dot), scale x step, acc) per scale group
 * (groups of 16 columns when G16), oacc = fma(offset, group sum, oacc) per group when has_offset, then
 * y = (acc + oacc) + bias, or acc + bias: each of the four layouts' own tile's operations */
AVX512_INLINE void wide_tile(const int MT, const int has_offset, const int G16, const QuantRows *r, int64_t m0,
                             int64_t u, int64_t K, int64_t N, const int16_t *buf, const void *scale,
                             const void *offset, const float *bias, float *y, const int f16) {
    const int64_t G = K / 32, GS = G16 ? 2 * G : G, es = f16 ? 2 : 4;
    const char *su = (const char *)scale + u * GS * 16 * es; /* G16 (q8b) only: its float32 scales */
    __m512 acc[AVX512_MAX_TILE], oacc[AVX512_MAX_TILE];
    __m512i a[AVX512_MAX_TILE];
    for (int i = 0; i < MT; i++) acc[i] = oacc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const int16_t *wg = buf + g * 512, *xg = r->q + m0 * K + g * 32;
        for (int i = 0; i < MT; i++) a[i] = _mm512_setzero_si512();
        for (int half = 0; half < 2; half++) { /* column pairs 0-7, then 8-15 */
            if (G16 && half == 1) {            /* the first 16 columns end a scale group */
                const __m512 sc = load16(su + 2 * g * 16 * es, f16);
                for (int i = 0; i < MT; i++) {
                    const __m512 ds = _mm512_mul_ps(sc, _mm512_set1_ps(r->d[(m0 + i) * G + g]));
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[i]), ds, acc[i]);
                    a[i] = _mm512_setzero_si512();
                }
            }
#pragma GCC unroll 8
            for (int pp = 0; pp < 8; pp++) {
                const int p = 8 * half + pp;
                const __m512i w = _mm512_load_si512((const void *)(wg + p * 32));
                for (int i = 0; i < MT; i++) {
                    a[i] = _mm512_dpwssd_epi32(a[i], w, pair(xg + i * K + 2 * p));
                    __asm__("" : "+v"(a[i]));
                }
            }
        }
        __m512 sc, of;
        if (G16) sc = load16(su + (2 * g + 1) * 16 * es, f16), of = _mm512_setzero_ps();
        else group_scales16(f16, has_offset, scale, offset, u, G, g, &sc, &of);
        for (int i = 0; i < MT; i++) {
            const int64_t m = m0 + i;
            const __m512 ds = _mm512_mul_ps(sc, _mm512_set1_ps(r->d[m * G + g]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[i]), ds, acc[i]);
            if (has_offset) oacc[i] = _mm512_fmadd_ps(of, _mm512_set1_ps(r->sum[m * G + g]), oacc[i]);
        }
    }
    for (int i = 0; i < MT; i++)
        store16(y + (m0 + i) * N, u * 16, N, has_offset ? _mm512_add_ps(acc[i], oacc[i]) : acc[i], bias);
}

/* Rows [m0, m_end) in tiles of T rows, then 4, 2, 1 (each row the same operations whatever tile it
 * lands in); TILE(MT, m) runs one tile */
#define AVX512_ROWS(T, TILE)                                  \
    do {                                                      \
        int64_t m_ = m0;                                      \
        for (; m_ + (T) <= m_end; m_ += (T)) TILE((T), m_);   \
        for (; m_ + 4 <= m_end; m_ += 4) TILE(4, m_);         \
        for (; m_ + 2 <= m_end; m_ += 2) TILE(2, m_);         \
        if (m_ < m_end) TILE(1, m_);                          \
    } while (0)

AVX512_INLINE void wide_rows(const int has_offset, const int G16, const QuantRows *r, int64_t m0, int64_t m_end,
                             int64_t u, int64_t K, int64_t N, const int16_t *buf, const void *scale,
                             const void *offset, const float *bias, float *y, const int f16) {
#define WIDE_TILE(MT, m) wide_tile(MT, has_offset, G16, r, m, u, K, N, buf, scale, offset, bias, y, f16)
    if (has_offset) AVX512_ROWS(AVX512_OFFSET_TILE, WIDE_TILE);
    else AVX512_ROWS(AVX512_WIDE_TILE, WIDE_TILE);
#undef WIDE_TILE
}

/* ---- the layouts' chunks: chunk c of group g (column pairs c and 8 + c of the 4- and 5-bit layouts, pair
 * c of q8b's) as 32 int16 lanes, block 0's 8 rows x 2 columns then block 1's ---- */

/* q4 (gemm.c's q4_unit_tile): the low nibbles (columns 2c, 2c + 1) and the high ones (16 + 2c, 17 + 2c) */
AVX512_INLINE void q4_chunk(const uint8_t *wg, int c, __m512i *lo, __m512i *hi) {
    const __m512i wb = _mm512_cvtepu8_epi16(load_blocks(wg + c * 16, wg + 128 + c * 16));
    *lo = _mm512_and_si512(wb, _mm512_set1_epi16(0x0F));
    *hi = _mm512_srli_epi16(wb, 4);
}

/* iq4 (gemm.c's iq4_tile): q4's nibbles as indices into codebook `codebook` (codebooks.h: a constant at
 * each use, so the table is one register loaded before the loops, as a literal table would be) */
AVX512_INLINE void iq4_chunk(const int codebook, const uint8_t *wg, int c, __m512i *lo, __m512i *hi) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)onecall_codebooks[codebook]));
    const __m256i low4 = _mm256_set1_epi8(0x0F), wb = load_blocks(wg + c * 16, wg + 128 + c * 16);
    *lo = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(table, _mm256_and_si256(wb, low4)));
    *hi = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(wb, 4), low4)));
}

/* q5 (gemm_q5.c's q5_unit_tile: 256 bytes of nibbles as q4's, then 16 words of 5th bits, word 8k + c for
 * block k's pair c): each row's word shifted right by its row b in 32-bit lane b puts the low nibble's
 * 5th bit on bit 0 and the high one's on bit 8 of each int16 lane, moved to bit 4 */
#define Q5_GROUP_BYTES 320
AVX512_INLINE void q5_chunk(const uint8_t *wg, int c, __m512i *lo, __m512i *hi) {
    const __m512i rows = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
    int32_t w0, w1;
    memcpy(&w0, wg + 256 + 4 * c, 4);
    memcpy(&w1, wg + 256 + 32 + 4 * c, 4);
    const __m512i h = _mm512_srlv_epi32(_mm512_mask_set1_epi32(_mm512_set1_epi32(w0), 0xFF00, w1), rows);
    const __m512i wb = _mm512_cvtepu8_epi16(load_blocks(wg + c * 16, wg + 128 + c * 16));
    *lo = _mm512_or_si512(_mm512_and_si512(wb, _mm512_set1_epi16(0x0F)),
                          _mm512_and_si512(_mm512_slli_epi16(h, 4), _mm512_set1_epi16(0x10)));
    *hi = _mm512_srli_epi16(_mm512_or_si512(wb, _mm512_and_si512(h, _mm512_set1_epi16(0x100))), 4);
}

/* q8b (gemm.c's q8b_tile): column pair p, int8 widened */
AVX512_INLINE __m512i q8b_pair(const int8_t *wg, int p) {
    return _mm512_cvtepi8_epi16(load_blocks(wg + p * 16, wg + 256 + p * 16));
}

/* The layouts' chunk functions by number, for the tiles below (a compile-time constant at each use); the iq4
 * layout once per codebook (LAYOUT_IQ4 + codebooks.h's number), all of them without offsets */
enum { LAYOUT_Q4, LAYOUT_Q5, LAYOUT_IQ4 };
#define LAYOUT_HAS_OFFSET(layout) ((layout) < LAYOUT_IQ4)
AVX512_INLINE void nibble_chunk(const int layout, const uint8_t *wg, int c, __m512i *lo, __m512i *hi) {
    if (layout == LAYOUT_Q4) q4_chunk(wg, c, lo, hi);
    else if (layout == LAYOUT_Q5) q5_chunk(wg, c, lo, hi);
    else iq4_chunk(layout - LAYOUT_IQ4, wg, c, lo, hi);
}

/* ---- decode and short chunks: the chunks unpacked per tile of rows ---- */

/* q4, iq4 or q5 (the 4- and 5-bit layouts; iq4 has no offset): lane l of acc[i] is output (m0 + i, 16u + l) */
AVX512_INLINE void nibble_tile(const int MT, const int layout, const QuantRows *r, int64_t m0, int64_t u, int64_t K,
                               int64_t N, const uint8_t *qs, const void *scale, const void *offset,
                               const float *bias, float *y, const int f16) {
    const int has_offset = LAYOUT_HAS_OFFSET(layout);
    const int64_t G = K / 32, gb = layout == LAYOUT_Q5 ? Q5_GROUP_BYTES : 256;
    const uint8_t *wu = qs + u * G * gb;
    __m512 acc[AVX512_MAX_TILE], oacc[AVX512_MAX_TILE];
    for (int i = 0; i < MT; i++) acc[i] = oacc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *wg = wu + g * gb;
        const int16_t *xg = r->q + m0 * K + g * 32;
        prefetch_group(wg + AVX512_PREFETCH * gb, layout == LAYOUT_Q5 ? 5 : 4);
        __m512i a[AVX512_MAX_TILE];
        for (int i = 0; i < MT; i++) a[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            __m512i lo, hi;
            nibble_chunk(layout, wg, c, &lo, &hi);
            for (int i = 0; i < MT; i++) {
                a[i] = _mm512_dpwssd_epi32(a[i], lo, pair(xg + i * K + 2 * c));
                a[i] = _mm512_dpwssd_epi32(a[i], hi, pair(xg + i * K + 16 + 2 * c));
                __asm__("" : "+v"(a[i])); /* each running sum stays in its register (gemm.c's q4_unit_tile) */
            }
        }
        __m512 sc, of;
        group_scales16(f16, has_offset, scale, offset, u, G, g, &sc, &of);
        for (int i = 0; i < MT; i++) {
            const int64_t m = m0 + i;
            const __m512 ds = _mm512_mul_ps(sc, _mm512_set1_ps(r->d[m * G + g]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[i]), ds, acc[i]);
            if (has_offset) oacc[i] = _mm512_fmadd_ps(of, _mm512_set1_ps(r->sum[m * G + g]), oacc[i]);
        }
    }
    for (int i = 0; i < MT; i++)
        store16(y + (m0 + i) * N, u * 16, N, has_offset ? _mm512_add_ps(acc[i], oacc[i]) : acc[i], bias);
}

/* q8b: lane l of acc[i] is output (m0 + i, 16u + l); G16: a scale per 16 columns */
AVX512_INLINE void q8b_tile(const int MT, const int G16, const QuantRows *r, int64_t m0, int64_t u, int64_t K,
                            int64_t N, const int8_t *qs, const float *scale, const float *bias, float *y) {
    const int64_t G = K / 32, GS = G16 ? 2 * G : G;
    const int8_t *wu = qs + u * G * 512;
    const float *su = scale + u * GS * 16;
    __m512 acc[AVX512_MAX_TILE];
    __m512i a[AVX512_MAX_TILE];
    for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const int8_t *wg = wu + g * 512;
        const int16_t *xg = r->q + m0 * K + g * 32;
        prefetch_group(wg + AVX512_PREFETCH * 512, 8);
        for (int i = 0; i < MT; i++) a[i] = _mm512_setzero_si512();
        for (int half = 0; half < 2; half++) { /* columns 0-15, then 16-31 */
            if (G16 && half == 1) {            /* the first 16 columns end a scale group */
                const __m512 sc = _mm512_loadu_ps(su + 2 * g * 16);
                for (int i = 0; i < MT; i++) {
                    const __m512 ds = _mm512_mul_ps(sc, _mm512_set1_ps(r->d[(m0 + i) * G + g]));
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[i]), ds, acc[i]);
                    a[i] = _mm512_setzero_si512();
                }
            }
#pragma GCC unroll 8
            for (int pp = 0; pp < 8; pp++) {
                const int p = 8 * half + pp;
                const __m512i w = q8b_pair(wg, p);
                for (int i = 0; i < MT; i++) {
                    a[i] = _mm512_dpwssd_epi32(a[i], w, pair(xg + i * K + 2 * p));
                    __asm__("" : "+v"(a[i]));
                }
            }
        }
        const __m512 sc = _mm512_loadu_ps(su + (G16 ? 2 * g + 1 : g) * 16);
        for (int i = 0; i < MT; i++) {
            const __m512 ds = _mm512_mul_ps(sc, _mm512_set1_ps(r->d[(m0 + i) * G + g]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[i]), ds, acc[i]);
        }
    }
    for (int i = 0; i < MT; i++) store16(y + (m0 + i) * N, u * 16, N, acc[i], bias);
}

/* ---- the unit's rows: widened once for a chunk of prompt rows, else tile by tile ---- */

AVX512_INLINE void nibble_unit(const int layout, const QuantRows *r, int64_t m0, int64_t m_end, int64_t u, int64_t K,
                               int64_t N, const uint8_t *qs, const void *scale, const void *offset,
                               const float *bias, float *y, const int f16) {
    const int64_t G = K / 32, gb = layout == LAYOUT_Q5 ? Q5_GROUP_BYTES : 256;
    int16_t *buf;
    if (m_end - m0 >= AVX512_BUFFER_ROWS && (buf = thread_buffer(16 * K))) {
        const uint8_t *wu = qs + u * G * gb;
        for (int64_t g = 0; g < G; g++)
            for (int c = 0; c < 8; c++) {
                __m512i lo, hi;
                nibble_chunk(layout, wu + g * gb, c, &lo, &hi);
                _mm512_store_si512((void *)(buf + (g * 16 + c) * 32), lo);
                _mm512_store_si512((void *)(buf + (g * 16 + 8 + c) * 32), hi);
            }
        wide_rows(LAYOUT_HAS_OFFSET(layout), 0, r, m0, m_end, u, K, N, buf, scale, offset, bias, y, f16);
        return;
    }
#define NIBBLE_TILE(MT, m) nibble_tile(MT, layout, r, m, u, K, N, qs, scale, offset, bias, y, f16)
    AVX512_ROWS(AVX512_TILE, NIBBLE_TILE);
#undef NIBBLE_TILE
}

AVX512_FN void q4_unit_avx512(const QuantRows *r, int64_t m0, int64_t m_end, int64_t u, int64_t K, int64_t N,
                              const uint8_t *qs, const void *scale, const void *offset, const float *bias, float *y,
                              int f16) {
    if (f16 == Q4_SUPER) nibble_unit(LAYOUT_Q4, r, m0, m_end, u, K, N, qs, scale, offset, bias, y, Q4_SUPER);
    else if (f16) nibble_unit(LAYOUT_Q4, r, m0, m_end, u, K, N, qs, scale, offset, bias, y, 1);
    else nibble_unit(LAYOUT_Q4, r, m0, m_end, u, K, N, qs, scale, offset, bias, y, 0);
}

AVX512_FN void iq4_unit_avx512(const QuantRows *r, int64_t m0, int64_t m_end, int64_t u, int64_t K, int64_t N,
                               const uint8_t *qs, const void *scale, const float *bias, float *y, int f16,
                               int codebook) {
    _Static_assert(ONECALL_NUM_CODEBOOKS == 2, "a layout per codebook below");
    if (f16 && codebook == 0) nibble_unit(LAYOUT_IQ4, r, m0, m_end, u, K, N, qs, scale, NULL, bias, y, 1);
    else if (codebook == 0) nibble_unit(LAYOUT_IQ4, r, m0, m_end, u, K, N, qs, scale, NULL, bias, y, 0);
    else if (f16) nibble_unit(LAYOUT_IQ4 + 1, r, m0, m_end, u, K, N, qs, scale, NULL, bias, y, 1);
    else nibble_unit(LAYOUT_IQ4 + 1, r, m0, m_end, u, K, N, qs, scale, NULL, bias, y, 0);
}

AVX512_FN void q5_unit_avx512(const QuantRows *r, int64_t m0, int64_t m_end, int64_t u, int64_t K, int64_t N,
                              const uint8_t *qs, const void *scale, const void *offset, const float *bias, float *y,
                              int f16) {
    if (f16) nibble_unit(LAYOUT_Q5, r, m0, m_end, u, K, N, qs, scale, offset, bias, y, 1);
    else nibble_unit(LAYOUT_Q5, r, m0, m_end, u, K, N, qs, scale, offset, bias, y, 0);
}

AVX512_INLINE void q8b_unit(const int G16, const QuantRows *r, int64_t m0, int64_t m_end, int64_t u, int64_t K,
                            int64_t N, const int8_t *qs, const float *scale, const float *bias, float *y) {
    const int64_t G = K / 32;
    int16_t *buf;
    if (m_end - m0 >= AVX512_BUFFER_ROWS && (buf = thread_buffer(16 * K))) {
        const int8_t *wu = qs + u * G * 512;
        for (int64_t g = 0; g < G; g++)
            for (int p = 0; p < 16; p++)
                _mm512_store_si512((void *)(buf + (g * 16 + p) * 32), q8b_pair(wu + g * 512, p));
        wide_rows(0, G16, r, m0, m_end, u, K, N, buf, scale, NULL, bias, y, 0);
        return;
    }
#define Q8B_TILE(MT, m) q8b_tile(MT, G16, r, m, u, K, N, qs, scale, bias, y)
    AVX512_ROWS(AVX512_TILE, Q8B_TILE);
#undef Q8B_TILE
}

AVX512_FN void q8b_unit_avx512(const QuantRows *r, int64_t m0, int64_t m_end, int64_t u, int64_t K, int64_t N,
                               const int8_t *qs, const float *scale, const float *bias, float *y, int G16) {
    if (G16) q8b_unit(1, r, m0, m_end, u, K, N, qs, scale, bias, y);
    else q8b_unit(0, r, m0, m_end, u, K, N, qs, scale, bias, y);
}
