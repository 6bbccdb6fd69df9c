/* Rows of an int8 table kept in the q8b layout (gemm.c), dequantized: the token embedding of a model
 * whose embedding is stored as int8 groups (Q8_0, Q6_K), gathered from the same bytes the logits
 * kernel reads when the embedding is tied, so no float32 copy of the table is kept.
 *
 * Element (n, col) of the (N, K) table lives at qs[n / 16][col / 32][(n % 16) / 8][(col % 32) / 2][n % 8]
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
