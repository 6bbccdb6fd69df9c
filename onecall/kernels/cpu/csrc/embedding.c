/* Rows of a token embedding kept as the checkpoint stored it, dequantized on lookup, so no float32 copy
 * of the table is kept (kernels/cpu/fast_embedding.py):
 *
 *   onecall_q8b_rows  int8 groups (Q8_0, Q6_K) in the q8b layout (gemm.c): the same bytes the logits
 *                     kernel reads when the embedding is tied
 *   onecall_q4_rows   4-bit groups of 32 (Q4_0, Q4_1, Q4_K) in the q4 layout (gemm.c): the logits
 *                     head's own bytes when tied, a packed copy when untied
 *   onecall_iq4_rows  IQ4 codes (IQ4_NL, IQ4_XS; MXFP4) in the iq4 layout (gemm.c), the same way
 *
 * q8b: element (n, col) of the (N, K) table lives at qs[n / 16][col / 32][(n % 16) / 8][(col % 32) / 2][n % 8]
 * [col % 2] and its scale at scale[n / 16][col / group_size][(n % 16) / 8][n % 8]; the value is
 * float(q) * scale, the float32 product the GGUF dequantization computes (exact: an int8 times a
 * half-precision scale, or Q6_K's half x int8 sub-scale, fits float32's 24 bits). */
#include <immintrin.h>
#include <stdint.h>

#include "codebooks.h"
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

/* 4-bit groups of 32 in the q4 layout (gemm.c): element (n, col) of group g = col / 32 is nibble
 * col % 32 / 16 (low, high) of byte qs[n / 16][g][(n % 16) / 8][(col % 16) / 2][n % 8][col % 2], with
 * scale and offset at [n / 16][g][(n % 16) / 8][n % 8] (float32, or IEEE half when f16). The value is
 * float(q) * scale + offset, a product then a sum (two float32 roundings, no FMA: the library is built
 * with -ffp-contract=off), as Int4Groups.dequantize computes it. 0 on success, -2 a K it does not take,
 * -3 an id outside 0..N-1 (nothing written). */
static inline float scalar(const void *p, int64_t i, int f16) {
    if (f16) return _cvtsh_ss(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

int onecall_q4_rows(const uint8_t *qs, const void *scale, const void *offset, int64_t N, int64_t K, int f16,
                    const int64_t *ids, int64_t M, float *out) {
    if (K % 32) return -2;
    for (int64_t m = 0; m < M; m++)
        if (ids[m] < 0 || ids[m] >= N) return -3;
    const int64_t G = K / 32;
    for (int64_t m = 0; m < M; m++) {
        const int64_t n = ids[m], u = n / 16, blk = (n % 16) / 8, b = n % 8;
        float *row = out + m * K;
        for (int64_t g = 0; g < G; g++) {
            const int64_t block = (u * G + g) * 2 + blk; /* this row's block of the group */
            const uint8_t *q = qs + block * 128 + b * 2;  /* + c * 16 + j */
            const float s = scalar(scale, block * 8 + b, f16), o = scalar(offset, block * 8 + b, f16);
            for (int64_t c = 0; c < 8; c++)
                for (int64_t j = 0; j < 2; j++) {
                    const uint8_t byte = q[c * 16 + j];
                    const float lo = (float)(byte & 0x0F) * s, hi = (float)(byte >> 4) * s;
                    row[g * 32 + 2 * c + j] = lo + o;
                    row[g * 32 + 16 + 2 * c + j] = hi + o;
                }
        }
    }
    return 0;
}

/* IQ4 codes in the iq4 layout (gemm.c): the q4 layout's bytes, each nibble an index into codebooks.h's table
 * number `codebook_id` (kvalues_iq4nl, or MXFP4's doubled e2m1 values), one scale per row and group (float32,
 * or IEEE half when f16). The value is float(codebook[code]) * scale, one float32 product, as
 * Int4CodeGroups.dequantize (and ggml) computes it. 0 on success, -2 a K or codebook it does not take, -3 an
 * id outside 0..N-1 (nothing written). */
int onecall_iq4_rows(const uint8_t *qs, const void *scale, int64_t N, int64_t K, int f16, const int64_t *ids,
                     int64_t M, float *out, int codebook_id) {
    if (K % 32 || codebook_id < 0 || codebook_id >= ONECALL_NUM_CODEBOOKS) return -2;
    const int8_t *codebook = onecall_codebooks[codebook_id];
    for (int64_t m = 0; m < M; m++)
        if (ids[m] < 0 || ids[m] >= N) return -3;
    const int64_t G = K / 32;
    for (int64_t m = 0; m < M; m++) {
        const int64_t n = ids[m], u = n / 16, blk = (n % 16) / 8, b = n % 8;
        float *row = out + m * K;
        for (int64_t g = 0; g < G; g++) {
            const int64_t block = (u * G + g) * 2 + blk;
            const uint8_t *q = qs + block * 128 + b * 2;
            const float s = scalar(scale, block * 8 + b, f16);
            for (int64_t c = 0; c < 8; c++)
                for (int64_t j = 0; j < 2; j++) {
                    const uint8_t byte = q[c * 16 + j];
                    row[g * 32 + 2 * c + j] = (float)codebook[byte & 0x0F] * s;
                    row[g * 32 + 16 + 2 * c + j] = (float)codebook[byte >> 4] * s;
                }
        }
    }
    return 0;
}
