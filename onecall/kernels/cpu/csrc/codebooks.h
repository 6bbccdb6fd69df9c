/* The 16-value int8 codebooks the iq4 kernels index with 4-bit codes (gemm.c's iq4 tiles, gemm_avx512.c's
 * iq4 chunk, embedding.c's iq4 rows), by the number kernels.h's iq4 functions take as `codebook`:
 *
 *   0  IQ4_NL / IQ4_XS: ggml's kvalues_iq4nl, a non-linear code (-127 .. 113)
 *   1  MXFP4: ggml's kvalues_mxfp4, the e2m1 values 0, 0.5, 1, 1.5, 2, 3, 4, 6 (and their negatives)
 *      doubled so they are integers; the block's E8M0 scale is halved to match (2^(e - 128), exact)
 *
 * formats/quants.py's CODEBOOKS holds the same tables, by name, in the same order. A kernel loads its
 * table into one vector register before its loops: which table it is costs nothing in the hot loop. */
#ifndef ONECALL_CODEBOOKS_H
#define ONECALL_CODEBOOKS_H

#include <stdint.h>

#define ONECALL_NUM_CODEBOOKS 2

static const int8_t onecall_codebooks[ONECALL_NUM_CODEBOOKS][16] __attribute__((aligned(16))) = {
    {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113},
    {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12},
};

#endif /* ONECALL_CODEBOOKS_H */
