"""RoPE frequencies and cos/sin tables, plain and scaled (linear, dynamic, llama3, yarn, longrope).

Every rope type comes down to two things (transformers' ROPE_INIT_FUNCTIONS return the same pair):
`inv_freq`, one angle per position step for each of the rotary_dim / 2 rotated pairs, and an
`attention_factor` that multiplies cos and sin (so q.k of the rotated dims by its square). The
tables are then cos/sin(position * inv_freq) * attention_factor for every position of the context,
computed once: the torch path and the native kernel (native.rope_store) both only look rows up.

Symbols in the docstrings: theta the base (rope_theta), d = rotary_dim, i = 0 .. d/2 - 1,
base_i = theta^(-2i/d) the plain inverse frequency, s the scaling factor, L the original
(pretraining) context length, wavelen_i = 2 pi / base_i.

Partial rotary (Phi-4-mini rotates the first 0.75 of each head) runs as full-width RoPE on a
permuted head: see partial_rotary_permutation. The pass-through pairs get cos 1 and sin 0.
"""

from __future__ import annotations

import math

import torch

from onecall.model.config import RopeScaling


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """base_i = 1 / theta^(2i/d), float32 (the arithmetic of transformers' default RoPE)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def linear_inv_freq(theta: float, dim: int, factor: float) -> torch.Tensor:
    """Position interpolation: base_i / s (positions squeezed s times)."""
    return default_inv_freq(theta, dim) / factor


def llama3_inv_freq(
    theta: float, dim: int, factor: float, low_freq_factor: float, high_freq_factor: float, original: int
) -> torch.Tensor:
    """Llama 3.1: high frequencies kept, low ones interpolated, a linear blend between.

    wavelen_i < L / high_freq_factor: base_i;  wavelen_i > L / low_freq_factor: base_i / s;
    otherwise (1 - a) base_i / s + a base_i with a = (L / wavelen_i - low) / (high - low).
    """
    inv_freq = default_inv_freq(theta, dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > original / low_freq_factor, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= original / high_freq_factor) & (wavelen <= original / low_freq_factor)
    return torch.where(is_medium, blended, scaled)


def yarn_inv_freq(
    theta: float, dim: int, factor: float, original: int, beta_fast: float, beta_slow: float, truncate: bool
) -> torch.Tensor:
    """YaRN ("NTK-by-parts"): pairs that turn more than beta_fast times over L keep base_i
    (extrapolation), pairs that turn fewer than beta_slow times get base_i / s (interpolation),
    a linear ramp between. The ramp ends are the pair indices
    c(r) = d * ln(L / (2 pi r)) / (2 ln theta) at r = beta_fast (low) and beta_slow (high),
    floored / ceiled when `truncate`, clamped to [0, d - 1];
    ramp_i = clamp((i - low) / (high - low), 0, 1); inv_freq_i = base_i / s * ramp_i + base_i * (1 - ramp_i).
    """

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-pair ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # weight of the unscaled frequency
    return interpolated * (1 - keep) + extrapolated * keep


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(s) + 1 (1 when s <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(scaling: RopeScaling) -> float:
    """The config's attention_factor, else mscale(s, mscale) / mscale(s, mscale_all_dim) when both are
    set (DeepSeek's form), else mscale(s) = 0.1 ln(s) + 1."""
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(
            scaling.factor, scaling.mscale_all_dim
        )
    return yarn_mscale(scaling.factor)


def longrope_inv_freq(theta: float, dim: int, ext_factors: tuple[float, ...]) -> torch.Tensor:
    """LongRoPE (Phi-3): a searched divisor per pair, base_i / ext_i (short_factor or long_factor)."""
    ext = torch.tensor(ext_factors, dtype=torch.float32)
    return 1.0 / (ext * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def longrope_attention_factor(scaling: RopeScaling) -> float:
    """The config's attention_factor, else sqrt(1 + ln(s) / ln(L)) (1 when s <= 1)."""
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    original = scaling.original_max_position_embeddings
    assert original is not None
    if scaling.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(scaling.factor) / math.log(original))


def longrope_uses_long_factors(scaling: RopeScaling, context_len: int) -> bool:
    """Whether a context of `context_len` positions runs on long_factor.

    transformers picks per forward, by max(position) + 1 > L, and Phi3ForCausalLM drops its KV cache
    and re-prefills when a sequence first crosses L, so every key of a sequence uses one set. A KV
    cache shared between sequences (the prefix cache) cannot follow a per-sequence switch, so the
    choice is made once per table, by the longest context it serves, as vLLM does by max_model_len:
    identical to transformers for every sequence when context_len <= L (short factors) and for every
    sequence longer than L otherwise (long factors).
    """
    original = scaling.original_max_position_embeddings
    assert original is not None
    return context_len > original


def inv_freq_and_attention_factor(
    theta: float, rotary_dim: int, scaling: RopeScaling | None, context_len: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq (rotary_dim // 2,) float32, attention_factor) for a table of `context_len` positions.

    `dynamic` (NTK) only changes theta for contexts past max_position_embeddings
    (theta * (s * n / max - (s - 1))^(d / (d - 2)) with n = max(seq_len, max)), which onecall never
    runs: the tables stop at max_position_embeddings, so within them it is plain RoPE.
    """
    if scaling is None or scaling.rope_type == "dynamic":
        return default_inv_freq(theta, rotary_dim), 1.0
    s = scaling
    if s.rope_type == "linear":
        return linear_inv_freq(theta, rotary_dim, s.factor), 1.0
    if s.rope_type == "llama3":
        if s.freq_factors is not None:
            return default_inv_freq(theta, rotary_dim) / torch.tensor(
                s.freq_factors, dtype=torch.float32
            ), 1.0
        assert s.original_max_position_embeddings is not None
        inv_freq = llama3_inv_freq(
            theta,
            rotary_dim,
            s.factor,
            s.low_freq_factor,
            s.high_freq_factor,
            s.original_max_position_embeddings,
        )
        return inv_freq, 1.0
    if s.rope_type == "yarn":
        assert s.original_max_position_embeddings is not None
        inv_freq = yarn_inv_freq(
            theta,
            rotary_dim,
            s.factor,
            s.original_max_position_embeddings,
            s.beta_fast,
            s.beta_slow,
            s.truncate,
        )
        return inv_freq, yarn_attention_factor(s)
    if s.rope_type == "longrope":
        ext = s.long_factor if longrope_uses_long_factors(s, context_len) else s.short_factor
        assert ext is not None
        return longrope_inv_freq(theta, rotary_dim, ext), longrope_attention_factor(s)
    raise AssertionError(f"rope_type {s.rope_type!r} passed ModelConfig's validation")


def cos_sin_tables(
    inv_freq: torch.Tensor, attention_factor: float, num_positions: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (num_positions, head_dim // 2) float32: cos/sin(p * inv_freq_i) * attention_factor for
    the rotated pairs, then cos 1, sin 0 for the pass-through pairs of a partial rotary head (exactly:
    transformers leaves those dims untouched, not scaled by attention_factor)."""
    freqs = torch.arange(num_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
    num_pass = head_dim // 2 - inv_freq.shape[0]
    if num_pass:
        cos = torch.cat((cos, torch.ones(num_positions, num_pass)), dim=1)
        sin = torch.cat((sin, torch.zeros(num_positions, num_pass)), dim=1)
    return cos, sin


def partial_rotary_permutation(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Index `perm` (head_dim,) so that head[perm] puts transformers' partial rotary head in the
    full-width rotate_half layout that every onecall RoPE path (torch and native) applies.

    transformers rotates pairs (j, j + r/2), j < r/2, of the first r = rotary_dim dims and passes the
    other p = head_dim - r through. Full-width RoPE rotates pairs (j, j + head_dim/2). The permuted head
    is [rot first half (r/2), pass first half (p/2), rot second half (r/2), pass second half (p/2)],
    so each rotated pair lands on a full-width pair, and the pass-through dims pair with each other
    under cos 1, sin 0 (cos_sin_tables). Applied to the rows of q and k alike (and q/k norm weights),
    it leaves every q.k, hence attention, unchanged; v and o_proj are not touched.
    """
    assert rotary_dim % 2 == 0 and (head_dim - rotary_dim) % 2 == 0
    half_r, half_p = rotary_dim // 2, (head_dim - rotary_dim) // 2
    rot, pass_ = torch.arange(rotary_dim), torch.arange(rotary_dim, head_dim)
    return torch.cat((rot[:half_r], pass_[:half_p], rot[half_r:], pass_[half_p:]))
