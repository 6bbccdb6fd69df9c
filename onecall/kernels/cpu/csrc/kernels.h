/* onecall's native CPU kernels: what one source file calls in another.
 *
 * The library: gemm.c (the quantized GEMMs), decode_attention.c (paged decode attention),
 * decode_step.c (the small fused ops and the whole decode step), prefill_attention.c (causal prefill
 * attention), embedding.c (rows of a quantized table), argmax.c (the greedy pick over logits), with
 * simd.h's shared helpers. Built at first use by kernels/cpu/native_build.py (gcc -O3 -mavx2 -mfma -mf16c
 * -fopenmp -ffp-contract=off, every source compiled at once, then linked into one shared library),
 * cached on disk, loaded with ctypes; native_build.py's _declare lists every exported function's
 * arguments. The OpenMP runtime here is the libgomp torch has already loaded (same soname), so these
 * loops run on torch's thread pool rather than spinning up a
 * second one beside it.
 *
 * Declared here: the kernels onecall_decode_layers (decode_step.c) runs from the other files. Each
 * function's contract is documented where it is defined.
 */
#ifndef ONECALL_KERNELS_H
#define ONECALL_KERNELS_H

#include <stdint.h>

/* gemm.c: y (M, N) = x (M, K) @ W^T (+ bias). 0 on success, -1 out of memory (q8b: -2 a group size or K
 * it does not take). */
int onecall_q4_gemm(const float *x, int64_t M, int64_t K, const uint8_t *qs, const void *scale, const void *offset,
                    int64_t N, const float *bias, float *y, int num_threads, int f16_scales);
int onecall_q4a8_gemm(const float *x, int64_t M, int64_t K, const uint8_t *qs, const void *scale, const void *offset,
                      int64_t N, const float *bias, float *y, int num_threads, int f16_scales);
int onecall_q8b_gemm(const float *x, int64_t M, int64_t K, const int8_t *qs, const float *scale, int64_t N,
                     const float *bias, float *y, int num_threads, int group_size);

/* decode_attention.c: one query per sequence over its paged KV. 0 on success, -1 out of memory, -2
 * shapes it does not take. */
int onecall_paged_decode_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                                   const int32_t *block_tables, int64_t max_blocks, const int32_t *seq_lens,
                                   int64_t S, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                                   float scale, int64_t window, float softcap, float *out, int num_threads,
                                   int kv_f16);

/* embedding.c: rows ids[0..M) of an (N, K) int8 table in the q8b layout, dequantized into out (M, K). 0 on
 * success, -2 a group size or K it does not take, -3 an id outside 0..N-1 (nothing written). */
int onecall_q8b_rows(const int8_t *qs, const float *scale, int64_t N, int64_t K, int64_t group_size,
                     const int64_t *ids, int64_t M, float *out);
/* embedding.c: the same over 4-bit groups of 32 in the q4 layout (scale and offset float32, or IEEE half
 * when f16). */
int onecall_q4_rows(const uint8_t *qs, const void *scale, const void *offset, int64_t N, int64_t K, int f16,
                    const int64_t *ids, int64_t M, float *out);

#endif /* ONECALL_KERNELS_H */
