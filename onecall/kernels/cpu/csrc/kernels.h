/* onecall's native CPU kernels: the one declaration of everything the library exports.
 *
 * The library: gemm.c (the quantized GEMMs, IQ4 codes included), gemm_q5.c (the 5-bit one), gemm_kq.c (the
 * K-quants' 6-, 3- and 2-bit codes), gemm_avx512.c
 * (their AVX-512 VNNI tiles, compiled per function for that target and chosen at run time where the CPU
 * has it, bit for bit the AVX2 tiles' results), gemm_half.c (F16 / BF16
 * weights), decode_attention.c (paged decode attention), decode_step.c (the small fused ops and the
 * whole decode step), prefill_attention.c (causal prefill attention), embedding.c (rows of a quantized
 * table), argmax.c (the greedy pick over logits), delta_rule.c (a Gated DeltaNet layer's decode rows),
 * layout.c (the layout of the structs below), with
 * simd.h's and act_quant.h's shared helpers. Built at first use by kernels/cpu/native_build.py (every
 * source compiled at once, then linked into one shared library), cached on disk, loaded with ctypes
 * after torch, so these loops run on torch's libgomp thread pool.
 *
 * This header is the truth about the interface, and three checks hold everything else to it:
 *   - the C: every source includes it, so a definition that differs from its prototype does not compile,
 *     and the build passes -Werror=missing-prototypes, so no function is exported without one here;
 *   - Python's calls: kernels/cpu/native_abi.py parses the prototypes below at load and derives each
 *     function's ctypes argtypes and restype from them (no second list); a call with another number of
 *     arguments is a TypeError, a function not declared here an AttributeError;
 *   - Python's structs: the ctypes mirrors in native_abi.py are checked at load against the fields below
 *     (names, order, types) and against onecall_struct_layout (this compiler's sizes and offsets).
 * So this file holds only what native_abi.py's parser reads (its docstring gives the C subset): the
 * include guard, <stdint.h>, `typedef struct { ... } Name;` and `type onecall_name(type name, ...);`,
 * each with its comment. Pointers cross as addresses (ctypes c_void_p).
 *
 * Shapes are (rows, columns), row-major and contiguous unless a stride is passed. Return codes: 0 on
 * success; -1 out of memory; -2 shapes or parameters the kernel does not take (the caller falls back);
 * -3 a token id outside the table; -4 a position outside the RoPE tables. Where a function checks its
 * ids or positions, it does so before writing anything.
 */
#ifndef ONECALL_KERNELS_H
#define ONECALL_KERNELS_H

#include <stdint.h>

/* ---- gemm.c: y = x @ W^T over weights kept as the GGUF stored them (layouts at the top of gemm.c) ---- */

/* y (M, N) = x (M, K) @ W^T (+ bias (N,) unless NULL), W 4-bit in the q4 layout (N padded to whole units
 * of 16 rows there; only N rows written), activations quantized per group of 32 to int16 steps. scale,
 * offset: float32, or IEEE half when f16_scales is 1; f16_scales 2: Q4_K's super-block factors in scale
 * (act_quant.h's Q4_SUPER; offset unused; K % 256 == 0). K % 32 == 0. 0 on success, -1 out of memory, -2
 * super-block factors with K % 256 != 0. */
int onecall_q4_gemm(const float *x, int64_t M, int64_t K, const uint8_t *qs, const void *scale, const void *offset,
                    int64_t N, const float *bias, float *y, int num_threads, int f16_scales);

/* onecall_q4_gemm's product over the q4a8 layout, with activations quantized to int8 steps
 * (EngineConfig.int8_activations); the same shapes. 0 on success, -1 out of memory. */
int onecall_q4a8_gemm(const float *x, int64_t M, int64_t K, const uint8_t *qs, const void *scale, const void *offset,
                      int64_t N, const float *bias, float *y, int num_threads, int f16_scales);

/* y (M, N) = x (M, K) @ W^T (+ bias (N,) unless NULL), W int8 in the q8b layout with float32 scales per
 * group of group_size (32: Q8_0, 16: Q6_K), int16 activation steps. 0 on success, -1 out of memory, -2 a
 * group size other than 16 or 32, or K % 32 != 0. */
int onecall_q8b_gemm(const float *x, int64_t M, int64_t K, const int8_t *qs, const float *scale, int64_t N,
                     const float *bias, float *y, int num_threads, int group_size);

/* y (M, N) = x (M, K) @ W^T (+ bias (N,) unless NULL), W 4-bit indices into a 16-value int8 codebook
 * (codebooks.h's table number `codebook`: 0 kvalues_iq4nl for IQ4_NL and IQ4_XS, 1 MXFP4's doubled e2m1
 * values) in the iq4 layout (the q4 layout's bytes, N padded to whole units of 16 rows there; only N rows
 * written) with one scale per group of 32, float32 or IEEE half when f16_scales; int16 activation steps as
 * onecall_q4_gemm's. 0 on success, -1 out of memory, -2 K % 32 != 0 or another codebook number. */
int onecall_iq4_gemm(const float *x, int64_t M, int64_t K, const uint8_t *qs, const void *scale, int64_t N,
                     const float *bias, float *y, int num_threads, int f16_scales, int codebook);

/* The AVX-512 tiles of the q4, q8b, iq4, q5 and kq GEMMs (gemm_avx512.c, gemm_kq_avx512.c: VNNI) and of
 * the half GEMM (gemm_half.c: AVX-512 F), each bit for bit the AVX2 tiles' outputs: enable 1 turns them on where the CPU has AVX-512 F/BW/VL and VNNI (the default there), 0
 * off (the AVX2 tiles), -1 changes nothing; returns 1 if they run from now on, else 0. Not for use
 * while a GEMM runs on another thread (a call reads it once, at its start). */
int onecall_set_avx512(int enable);

/* ---- gemm_q5.c: 5-bit groups (Q5_0, Q5_1, Q5_K), layout at the top of gemm_q5.c ---- */

/* y (M, N) = x (M, K) @ W^T (+ bias (N,) unless NULL), W 5-bit groups of 32 in the q5 layout (N padded to
 * whole units of 16 rows there; only N rows written), activations quantized per group of 32 to int16
 * steps as onecall_q4_gemm's. scale, offset: float32, or IEEE half when f16_scales. 0 on success, -1 out
 * of memory, -2 K % 32 != 0. */
int onecall_q5_gemm(const float *x, int64_t M, int64_t K, const uint8_t *qs, const void *scale, const void *offset,
                    int64_t N, const float *bias, float *y, int num_threads, int f16_scales);

/* out (M, K) = rows ids[0 .. M) (int64) of an (N, K) table in the q5 layout, dequantized (float(q) * scale
 * + offset; scale and offset float32, or IEEE half when f16). 0 on success, -2 K % 32 != 0, -3 an id
 * outside 0 .. N - 1. */
int onecall_q5_rows(const uint8_t *qs, const void *scale, const void *offset, int64_t N, int64_t K, int f16,
                    const int64_t *ids, int64_t M, float *out);

/* ---- gemm_half.c: F16 / BF16 weights, layout at the top of gemm_half.c ---- */

/* y (M, N) = x (M, K) @ W^T (+ bias (N,) unless NULL), W 16-bit floats in the h16 layout (N padded to whole
 * units of 16 rows there; only N rows written): IEEE half, or bfloat16 when bf16; each value widened to
 * float32 exactly, float32 accumulation. 0 on success (it always succeeds: no buffers). */
int onecall_half_gemm(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, const float *bias,
                      float *y, int num_threads, int bf16);

/* ---- decode_attention.c, prefill_attention.c: attention over the paged KV cache, read in place ---- */

/* One query per sequence: out (S, H, D) = softmax(q k^T * scale) v for sequence s over its seq_lens[s]
 * positions. q: S rows of (H, D) floats, q_stride floats apart; k_cache, v_cache (num_slots, KVH, D),
 * float32 or IEEE half when kv_f16; position p of s at slot block_tables[s, p / block_size] * block_size
 * + p % block_size, block_tables (S, max_blocks) int32, seq_lens (S,) int32. window > 0: a query sees its
 * last `window` positions; softcap > 0: scores -> softcap * tanh(score / softcap); 0 turns either off.
 * 0 on success, -1 out of memory, -2 H > 128, H % KVH != 0 or D % 8 != 0. */
int onecall_paged_decode_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                                   const int32_t *block_tables, int64_t max_blocks, const int32_t *seq_lens,
                                   int64_t S, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                                   float scale, int64_t window, float softcap, float *out, int num_threads,
                                   int kv_f16);

/* onecall_paged_decode_attention with attention sinks (gpt-oss): sinks (H,) float32, one logit per query
 * head that joins its softmax denominator and carries no value, out = sum_p exp(s_p) v_p / (sum_p exp(s_p)
 * + exp(sinks[h])), s_p the scores after the scale and soft-cap; NULL: none (the call above is this one
 * with NULL). 0 on success, -1 out of memory, -2 H > 128, H % KVH != 0 or D % 8 != 0. */
int onecall_paged_decode_attention_sinks(const float *q, int64_t q_stride, const void *k_cache,
                                         const void *v_cache, const int32_t *block_tables, int64_t max_blocks,
                                         const int32_t *seq_lens, int64_t S, int64_t H, int64_t KVH, int64_t D,
                                         int64_t block_size, float scale, int64_t window, float softcap,
                                         const float *sinks, float *out, int num_threads, int kv_f16);

/* One sequence's causal attention: out (query_len, H, D) for its query_len new rows (positions seq_len -
 * query_len .. seq_len - 1) over its keys 0 .. seq_len - 1. q: query_len rows of (H, D) floats, q_stride
 * floats apart; the KV (num_slots, KVH, D), float32 or IEEE half when kv_f16, at slots kv_start + p when
 * blocks is NULL, else at blocks[p / block_size] * block_size + p % block_size (blocks int64). window,
 * softcap: as onecall_paged_decode_attention's; sinks (H,) float32 or NULL: as
 * onecall_paged_decode_attention_sinks'. 0 on success, -1 out of memory, -2 KVH < 1, H % KVH != 0,
 * D % 16 != 0, D > 512 or query_len outside 1 .. seq_len. */
int onecall_prefill_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                              const int64_t *blocks, int64_t kv_start, int64_t block_size, int64_t query_len,
                              int64_t seq_len, int64_t H, int64_t KVH, int64_t D, float scale, int64_t window,
                              float softcap, const float *sinks, float *out, int num_threads, int kv_f16);

/* ---- decode_step.c: the small fused row-wise ops (float32, fixed order: a row's bits never depend on
 * its batch) and the whole decode step ---- */

/* h (M, K) += r (M, K) unless r is NULL; then y (M, K) = h / sqrt(mean(h^2) + eps) * w (K,), row by row:
 * a pre-norm decoder's residual add and RMSNorm in one pass. y may be h. */
void onecall_add_rms_norm(float *h, const float *r, const float *w, int64_t M, int64_t K, float eps, float *y);

/* out (M, I) = silu(y[:, :I]) * y[:, I:] for y (M, 2I): the gated MLP's activation in one pass. */
void onecall_silu_mul(const float *y, int64_t M, int64_t I, float *out);

/* RoPE (rotate_half layout) on the q and k heads of qkv (M, (H + 2 KVH) * D), in place, then row m's
 * rotated k heads and its v heads stored at slot slot_mapping[m] (int64) of the (num_slots, KVH, D)
 * caches, float32, or IEEE half when kv_f16 (KVH * D % 8 == 0 then). cos, sin (M, D / 2): each row's
 * position's tables. q_norm, k_norm (D,) or NULL: Qwen3's per-head RMSNorm (eps norm_eps), applied to
 * each q / k head before it is rotated. */
void onecall_rope_store(float *qkv, int64_t M, int64_t H, int64_t KVH, int64_t D, const float *q_norm,
                        const float *k_norm, float norm_eps, const float *cos, const float *sin,
                        const int64_t *slot_mapping, void *k_cache, void *v_cache, int kv_f16);

/* One projection of the decode step, a (n, k) weight: 4-bit groups (q8_group, q5, half, iq4 all 0:
 * onecall_q4_gemm, or onecall_q4a8_gemm with act8), int8 groups (q8_group 32 or 16: onecall_q8b_gemm),
 * 5-bit groups (q5 1: onecall_q5_gemm), codes (iq4 1 + codebook: onecall_iq4_gemm) or 16-bit floats (half 1:
 * IEEE half, 2: bfloat16, in qs: onecall_half_gemm). A projection stored in parts of different forms (a Q4_K_M file's q/k beside its
 * v) is a chain: this struct its first n rows, `next` the Q4Weight of the rows after them, and so on;
 * the first part's bias is then the whole projection's, added once every part is in. */
typedef struct {
    const uint8_t *qs;  /* the q4 (or q4a8) layout; int8: the q8b layout; q5: the q5 layout; half: h16 */
    const void *scale;  /* q4, q5: float32, IEEE half (f16 1), q4 super-block factors (f16 2); int8: float32; half: unused */
    const void *offset; /* q4, q5 only */
    const float *bias;  /* (n,) or NULL; a chain's first part: the whole projection's */
    int64_t n, k, f16;
    int64_t q8_group; /* 0: not int8; 32 or 16: int8 groups of that size */
    int64_t act8;     /* 4-bit only: the q4a8 layout, run with int8 activations */
    int64_t q5;       /* 1: 5-bit groups in the q5 layout */
    int64_t half;     /* 1: IEEE half, 2: bfloat16 weights in the h16 layout */
    int64_t iq4;      /* 1 + codebook: codes in the iq4 layout (1 IQ4, 2 MXFP4; scale float32, or half when f16) */
    const void *next; /* the next part (a Q4Weight), or NULL: this part is the projection's last */
    int64_t kbits;    /* 6, 3, 2: Q6_K / Q3_K / Q2_K codes in the kq layout (scale: sub-scales, offset: supers) */
} Q4Weight;

/* One decoder layer of the decode step: its two norm weights, its q/k norm weights (or NULL), its
 * attention options and its four projections. */
typedef struct {
    const float *input_norm, *post_norm; /* (hidden,) */
    const float *q_norm, *k_norm;        /* (D,), or NULL: no per-head q/k norm */
    int64_t window;                      /* sliding window, 0: none */
    float softcap;                       /* attention logit soft-cap, 0: none */
    Q4Weight qkv, o, gate_up, down;
} DecodeLayer;

/* A whole decode step, every layer, in one call: for M one-query sequences, out (M, hidden) = the final
 * norm of the residual stream after layers[0 .. num_layers), each run as DecoderLayer.forward runs it
 * (the kernels above, in the per-op path's order: the same bits). h starts as the rows ids (M,) of the
 * embedding: embed (vocab, hidden) float32, or with embed NULL the stored groups (embed_qs, embed_scale:
 * 4-bit in the q4 layout when embed_offset is given, embed_group_or_f16 1 for half scales; else int8 in
 * the q8b layout with groups of embed_group_or_f16). positions (M,) index cos_table, sin_table
 * (max_positions, D / 2). Layer l's KV lives at k_cache, v_cache + l * layer_stride values, float32 or
 * IEEE half when kv_f16; slot_mapping, block_tables (M, max_blocks), seq_lens, block_size: as
 * onecall_rope_store's and onecall_paged_decode_attention's. 0 on success, -1 out of memory, -2 shapes
 * the attention does not take, -3 an id outside 0 .. vocab - 1, -4 a position outside the tables. */
int onecall_decode_layers(const DecodeLayer *layers, int64_t num_layers, const int64_t *ids, const float *embed,
                          const void *embed_qs, const void *embed_scale, const void *embed_offset,
                          int64_t embed_group_or_f16, int64_t vocab, int64_t M, int64_t hidden, int64_t H,
                          int64_t KVH, int64_t D, int64_t I, float eps, float attn_scale, const int64_t *positions,
                          const float *cos_table, const float *sin_table, int64_t max_positions,
                          const int64_t *slot_mapping, void *k_cache, void *v_cache, int64_t layer_stride,
                          int kv_f16, const int32_t *block_tables, int64_t max_blocks, const int32_t *seq_lens,
                          int64_t block_size, const float *final_norm, float *out, int num_threads);

/* ---- gemm_kq.c: the K-quants' low-bit codes on their own bits (Q6_K, Q3_K, Q2_K; layout kq there) ---- */

/* y (M, N) = x (M, K) @ W^T (+ bias (N,) unless NULL), W the codes of `bits` 6 (Q6_K), 3 (Q3_K) or 2
 * (Q2_K) in the kq layout with their int8 sub-scales (Q2_K: then the mins) per 16 columns in scales and
 * their super-blocks' IEEE half d (Q2_K: then dmin) in supers; activations quantized per group of 32 to
 * int16 steps. 0 on success, -1 out of memory, -2 K % 256 != 0 or another `bits`. */
int onecall_kq_gemm(const float *x, int64_t M, int64_t K, const uint8_t *qs, const void *scales, const void *supers,
                    int64_t N, const float *bias, float *y, int num_threads, int bits);

/* out (M, K) = rows ids[0 .. M) (int64) of an (N, K) table in the kq layout, dequantized ((d * sc) * (q - z);
 * Q2_K: (d * sc) * q - dmin * m). 0 on success, -2 K % 256 != 0 or another `bits`, -3 an id outside
 * 0 .. N - 1. */
int onecall_kq_rows(const uint8_t *qs, const void *scales, const void *supers, int64_t N, int64_t K, int bits,
                    const int64_t *ids, int64_t M, float *out);

/* qs (N16 / 16, K / 32, 384 | 192 | 128 bytes for bits 6 | 3 | 2) = the kq layout of (N, K) uint8 codes in
 * 0 .. 2^bits - 1, rows N .. N16 - 1 zero codes. 0 on success, -2 K % 256 != 0 or another `bits`. */
int onecall_kq_pack(const uint8_t *codes, int64_t N, int64_t K, int bits, uint8_t *qs, int num_threads);

/* ---- embedding.c: rows of a token embedding kept as the checkpoint stored it ---- */

/* out (M, K) = rows ids[0 .. M) (int64) of an (N, K) int8 table in the q8b layout, dequantized
 * (float(q) * scale). 0 on success, -2 a group size other than 16 or 32, or K % 32 != 0, -3 an id
 * outside 0 .. N - 1. */
int onecall_q8b_rows(const int8_t *qs, const float *scale, int64_t N, int64_t K, int64_t group_size,
                     const int64_t *ids, int64_t M, float *out);

/* The same over 4-bit groups of 32 in the q4 layout (float(q) * scale + offset; scale and offset float32,
 * or IEEE half when f16). 0 on success, -2 K % 32 != 0, -3 an id outside 0 .. N - 1. */
int onecall_q4_rows(const uint8_t *qs, const void *scale, const void *offset, int64_t N, int64_t K, int f16,
                    const int64_t *ids, int64_t M, float *out);

/* The same over codes in the iq4 layout (float(codebook[code]) * scale, codebook as onecall_iq4_gemm's; scale
 * float32, or IEEE half when f16). 0 on success, -2 K % 32 != 0 or another codebook number, -3 an id outside
 * 0 .. N - 1. */
int onecall_iq4_rows(const uint8_t *qs, const void *scale, int64_t N, int64_t K, int f16, const int64_t *ids,
                     int64_t M, float *out, int codebook);

/* ---- argmax.c ---- */

/* out[m] (int64) = the index of row m's largest value in x (M, N) float32, as torch.argmax gives it: the
 * first maximum, or a row's first NaN. 0 on success, -2 N < 1. */
int onecall_argmax_rows(const float *x, int64_t M, int64_t N, int64_t *out, int num_threads);

/* ---- layout.c ---- */

/* How this compiler lays out each struct above, for native_abi.py's check of its ctypes mirrors. Row i
 * is names[i] = "Struct" with values[2i], values[2i + 1] = its sizeof and alignof, or "Struct.field" with
 * the field's offsetof and sizeof; structs in this header's order, each followed by its fields in
 * declaration order. Fills at most `capacity` rows; returns the number of rows there are. */
int64_t onecall_struct_layout(const char **names, int64_t *values, int64_t capacity);

/* ---- delta_rule.c: a Gated DeltaNet layer's decode rows (Qwen3.5 / Qwen3-Next), states in place ---- */

/* For M one-token rows: row m of proj, proj_stride floats apart, is [q (HK * DK) | k (HK * DK) | v (HV * DV)
 * | z (HV * DV) | b (HV) | a (HV)] (the layer's input projection); its sequence's states live in slot
 * slots[m] (int64) of conv_state (num_slots, conv_dim, kernel - 1) and recurrent_state (num_slots, HV, DK,
 * DV), float32, conv_dim = 2 HK DK + HV DV; fresh (M,) bytes, or NULL: a nonzero row starts from zero
 * states (its token is its sequence's position 0). Per row: the causal conv step (conv_weight (conv_dim,
 * kernel)) and SiLU over q, k, v, the conv state shifted; q, k l2-normalised (eps l2_eps), q scaled by
 * DK ** -0.5; per value head h (key head h / (HV / HK)): beta = sigmoid(b), g = -exp(A_log) * softplus(a +
 * dt_bias) (A_log, dt_bias (HV,)), S = exp(g) S, S += k (beta (v - S^T k))^T, o = S^T q, the state written
 * back in place; out (M, HV * DV) = o / sqrt(mean(o^2) + norm_eps) * norm_weight (DV,) * silu(z) per
 * head. 0 on success, -1 out of memory, -2 shapes it does not take (kernel < 2, HV % HK != 0, DK or DV
 * outside 1 .. 512, proj_stride too short), -3 a slot outside 0 .. num_slots - 1 or used by two rows
 * (checked before anything is written). */
int onecall_delta_decode_rows(const float *proj, int64_t proj_stride, int64_t M, const int64_t *slots,
                              const uint8_t *fresh, float *conv_state, float *recurrent_state, int64_t num_slots,
                              const float *conv_weight, int64_t kernel, const float *A_log, const float *dt_bias,
                              const float *norm_weight, int64_t HK, int64_t HV, int64_t DK, int64_t DV,
                              float l2_eps, float norm_eps, float *out, int num_threads);

#endif /* ONECALL_KERNELS_H */
