/* The AVX-512 VNNI tiles of the quantized GEMMs (gemm_avx512.c, gemm_kq_avx512.c), internal to the library:
 * gemm.c, gemm_q5.c and gemm_kq.c call them in place of their AVX2 tiles when avx512_gemm_enabled() says so
 * (once per call, so a call runs one path; gemm_half.c's AVX-512 F tiles follow the same switch). Hidden: not exported, not in kernels.h (the switch, onecall_set_avx512, is).
 *
 * Each *_unit_avx512 computes rows [m0, m_end) of the activation rows r against weight unit u (rows
 * 16u .. 16u + 15) in the layout its AVX2 twin reads, and writes outputs (m, 16u .. min(16u + 16, N)),
 * bit for bit what the AVX2 twin writes: the same exact int32 group dots, the same float32 operations in
 * the same order per output (see gemm_avx512.c). */
#ifndef ONECALL_GEMM_AVX512_H
#define ONECALL_GEMM_AVX512_H

#include <stdint.h>

#include "act_quant.h"

#define ONECALL_HIDDEN __attribute__((visibility("hidden")))

/* 1 when the AVX-512 tiles run: the CPU has AVX-512 F/BW/VL and VNNI (decided once) and
 * onecall_set_avx512 did not turn them off */
ONECALL_HIDDEN int avx512_gemm_enabled(void);

/* gemm.c's q4_unit: the q4 layout, scale and offset float32 or IEEE half (f16 1), or super-block factors
 * (f16 Q4_SUPER, act_quant.h) */
ONECALL_HIDDEN void q4_unit_avx512(const QuantRows *r, int64_t m0, int64_t m_end, int64_t u, int64_t K, int64_t N,
                                   const uint8_t *qs, const void *scale, const void *offset, const float *bias,
                                   float *y, int f16);

/* gemm.c's q8b tiles: the q8b layout, float32 scales per group of 16 (G16) or 32 */
ONECALL_HIDDEN void q8b_unit_avx512(const QuantRows *r, int64_t m0, int64_t m_end, int64_t u, int64_t K, int64_t N,
                                    const int8_t *qs, const float *scale, const float *bias, float *y, int G16);

/* gemm.c's iq4 tiles: the iq4 layout, scale float32 or IEEE half (f16), codes into codebooks.h's table
 * number `codebook` */
ONECALL_HIDDEN void iq4_unit_avx512(const QuantRows *r, int64_t m0, int64_t m_end, int64_t u, int64_t K, int64_t N,
                                    const uint8_t *qs, const void *scale, const float *bias, float *y, int f16,
                                    int codebook);

/* gemm_q5.c's q5 tiles: the q5 layout, scale and offset float32 or IEEE half (f16) */
ONECALL_HIDDEN void q5_unit_avx512(const QuantRows *r, int64_t m0, int64_t m_end, int64_t u, int64_t K, int64_t N,
                                   const uint8_t *qs, const void *scale, const void *offset, const float *bias,
                                   float *y, int f16);

/* gemm_kq.c's kq tiles (gemm_kq_avx512.c): the kq layout of `bits` 6, 3 or 2, sums the rows' float32 sums
 * per 16 activations (Q2_K; else unused) */
#define KQ_BYTES(bits) ((bits) == 6 ? 384 : (bits) == 3 ? 192 : 128) /* one unit's group of 32 columns */
ONECALL_HIDDEN void kq_unit_avx512(int bits, const QuantRows *r, const float *sums, int64_t m0, int64_t m_end,
                                   int64_t u, int64_t K, int64_t N, const uint8_t *qs, const int8_t *scales,
                                   const uint16_t *supers, const float *bias, float *y);

#endif /* ONECALL_GEMM_AVX512_H */
