/* Rows of a token embedding kept as the checkpoint stored it, dequantized on lookup, so no float32 copy
 * of the table is kept (model/fast_embedding.py):
 *
 *   onecall_q8b_rows  int8 groups (Q8_0, Q6_K) in the q8b layout (gemm.c): the same bytes the logits
 *                     kernel reads when the embedding is tied
 *   onecall_q4_rows   4-bit groups of 32 (Q4_0, Q4_1, Q4_K) row by row (an untied embedding)
 *
 * q8b: element (n, col) of the (N, K) table lives at qs[n / 16][col / 32][(n % 16) / 8][(col % 32) / 2][n % 8]
 * [col % 2] and its scale at scale[n / 16][col / group_size][(n % 16) / 8][n % 8]; the value is
 * float(q) * scale, the float32 product the GGUF dequantization computes (exact: an int8 times a
 * half-precision scale, or Q6_K's half x int8 sub-scale, fits float32's 24 bits). */
#include <stdint.h>

#include "kernels.h"

int onecall_q8b_rows(const int8_t *qs, const float *scale, int64_t N, int64_t K, int64_t group_size,
                     const int64_t *ids, int64_t M, float *out) {
    if (K % 32 || (group_size != 16 && group_size != 32)) return -2;
    for (int64_t m = 0; m < M; m++) /* checked before anything is written */
        if (ids[m] < 0 || ids[m] >= N) return -3;
    const int64_t G = K / 32, GS = K / group_size;
    for (int64_t m = 0; m < M; m++) {
        const int64_t n = ids[m], u = n / 16, blk = (n % 16) / 8, b = n % 8;
        const int8_t *unit = qs + u * G * 512 + blk * 256 + b * 2;   /* + g * 512 + c * 16 + j */
        const float *su = scale + u * GS * 16 + blk * 8 + b;         /* + gs * 16 */
        float *row = out + m * K;
        for (int64_t col = 0; col < K; col++) {
            const int64_t g = col / 32, c = (col % 32) / 2, j = col % 2;
            row[col] = (float)unit[g * 512 + c * 16 + j] * su[(col / group_size) * 16];
        }
    }
    return 0;
}

/* 4-bit rows: byte i of row n of qs (N, K / 2) holds column 2i in its low nibble and 2i + 1 in its high
 * one; scale, offset (N, K / 32) float32. The value is float(q) * scale + offset, a product then a sum
 * (two float32 roundings, no FMA: the library is built with -ffp-contract=off), as Int4Groups.dequantize
 * computes it. 0 on success, -2 a K it does not take, -3 an id outside 0..N-1 (nothing written). */
int onecall_q4_rows(const uint8_t *qs, const float *scale, const float *offset, int64_t N, int64_t K,
                    const int64_t *ids, int64_t M, float *out) {
    if (K % 32) return -2;
    for (int64_t m = 0; m < M; m++)
        if (ids[m] < 0 || ids[m] >= N) return -3;
    const int64_t G = K / 32;
    for (int64_t m = 0; m < M; m++) {
        const uint8_t *q = qs + ids[m] * (K / 2);
        const float *sc = scale + ids[m] * G, *of = offset + ids[m] * G;
        float *row = out + m * K;
        for (int64_t i = 0; i < K / 2; i++) {
            const float s = sc[(2 * i) / 32], o = of[(2 * i) / 32];
            const float lo = (float)(q[i] & 0x0F) * s, hi = (float)(q[i] >> 4) * s;
            row[2 * i] = lo + o;
            row[2 * i + 1] = hi + o;
        }
    }
    return 0;
}
