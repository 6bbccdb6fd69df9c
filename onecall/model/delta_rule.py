"""The gated delta rule (Gated DeltaNet's recurrence) in plain PyTorch: a recurrent form, one token after
another (what decode rows run), and a chunked form (what prompt chunks run), which compute the same thing.

Per value head, a state S (k_dim, v_dim), and for each token t a query q_t, key k_t (both L2-normalised,
q_t also scaled by k_dim ** -0.5: prepare_qk), value v_t, decay g_t <= 0 (log space) and step size
beta_t in (0, 1):

    S   <- exp(g_t) S                        decay the memory
    d_t  = beta_t (v_t - S^T k_t)            the delta: what the decayed memory mispredicts for k_t
    S   <- S + k_t d_t^T                     write the correction
    o_t  = S^T q_t                           read

Chunked form. Within a chunk of C tokens starting from state S0, let G_t = g_1 + ... + g_t (the log
decay from the chunk's start through t) and D[t, j] = exp(G_t - G_j) for j <= t, else 0. Unrolling
the recurrence, S_t = exp(G_t) S0 + sum_{j <= t} D[t, j] k_j d_j^T, so the deltas solve a unit lower
triangular system

    (I + A) d = beta v - diag(beta exp(G)) K S0,   A[t, j] = beta_t D[t, j] (k_t . k_j) for j < t

that is d = U - W S0 with U = (I + A)^-1 (beta v) and W = (I + A)^-1 (diag(beta exp(G)) K), both
independent of S0 (one triangular solve per chunk, all chunks at once). Then

    O   = diag(exp(G)) Q S0 + (D * Q K^T) d                     the chunk's outputs
    S_C = exp(G_C) S0 + (diag(exp(G_C - G)) K)^T d              the state after it

and only this last line and d's S0 term run chunk after chunk. exp is only ever taken of G_t - G_j
(j <= t) or G_t, all <= 0, so nothing overflows whatever the decays. A sequence is padded to whole
chunks with beta = 0 and g = 0: a padded token writes nothing and decays nothing, so the final state
is the unpadded sequence's.

Shapes: q, k (batch, tokens, heads, k_dim) after prepare_qk (the key heads repeated for the value
heads they serve), v (batch, tokens, heads, v_dim), g and beta (batch, tokens, heads), the state
(batch, heads, k_dim, v_dim); everything in float32, as transformers' torch path computes it (float64
stays float64: widen, so the layer's torch path in float64 is the native kernels' oracle).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64
L2_EPS = 1e-6  # inside q and k's l2 norms (flash-linear-attention's)


def widen(x: torch.Tensor) -> torch.Tensor:
    """x in float32, or float64 where it is float64 already (never narrowed)."""
    return x if x.dtype == torch.float64 else x.float()


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (flash-linear-attention's l2norm, eps inside)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (..., num_k_heads, k_dim) as the conv leaves them -> float32, L2-normalised, q scaled by
    k_dim ** -0.5, each key head repeated for the num_v_heads // num_k_heads consecutive value heads it
    serves (value head j reads key head j // ratio): (..., num_v_heads, k_dim) each."""
    q, k = l2_normalize(widen(q)), l2_normalize(widen(k))
    q = q * q.shape[-1] ** -0.5
    ratio = num_v_heads // k.shape[-2]
    if ratio > 1:
        q, k = q.repeat_interleave(ratio, dim=-2), k.repeat_interleave(ratio, dim=-2)
    return q, k


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token. Returns (outputs (batch, tokens, heads, v_dim), the state after
    the last token); `state` is not modified."""
    q, k, v, g, beta = (widen(x) for x in (q, k, v, g, beta))
    s = widen(state).clone()  # (batch, heads, k_dim, v_dim)
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", s, k[:, t])
        delta = beta[:, t, :, None] * (v[:, t] - predicted)  # (batch, heads, v_dim)
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = torch.einsum("bhkv,bhk->bhv", s, q[:, t])
    return out, s


def gated_delta_step_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One token of each of n sequences, the state updated in place: q, k (n, heads, k_dim), v (n, heads,
    v_dim), g, beta (n, heads), state (n, heads, k_dim, v_dim) float32 (or float64) -> outputs (n, heads,
    v_dim).
    recurrent_gated_delta_rule's step with two passes over the state where it makes four copies: the
    decay and the rank-one update (a batched outer product added in place) write it, the two
    contractions read it. Decode's form (model/qwen35.py)."""
    n, heads, k_dim, v_dim = state.shape
    q, k, v, g, beta = (widen(x) for x in (q, k, v, g, beta))
    state.mul_(g.exp()[..., None, None])
    flat = state.view(n * heads, k_dim, v_dim)
    predicted = torch.bmm(k.reshape(n * heads, 1, k_dim), flat).view(n, heads, v_dim)
    delta = beta[..., None] * (v - predicted)  # (n, heads, v_dim)
    flat.baddbmm_(k.reshape(n * heads, k_dim, 1), delta.reshape(n * heads, 1, v_dim))
    return torch.bmm(q.reshape(n * heads, 1, k_dim), flat).view(n, heads, v_dim)


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as recurrent_gated_delta_rule, chunk by chunk (the module docstring's form): within a
    chunk everything is matmuls and one triangular solve, between chunks one state update."""
    batch, tokens, heads, k_dim = q.shape
    v_dim = v.shape[-1]
    c = min(chunk_size, tokens)
    pad = -tokens % c
    # 1. (batch, heads, chunks, c, ...), padded to whole chunks (beta 0, g 0: no write, no decay)
    q, k, v = (F.pad(x.float().transpose(1, 2), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.float().transpose(1, 2), (0, pad)) for x in (g, beta))
    n = (tokens + pad) // c
    q, k, v = (x.reshape(batch, heads, n, c, -1) for x in (q, k, v))
    g, beta = g.reshape(batch, heads, n, c), beta.reshape(batch, heads, n, c)
    # 2. within each chunk: the decays, the system (I + A) and its two solutions U, W
    cum = g.cumsum(dim=-1)  # G_t
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # D
    strictly_lower = lower.tril(-1)
    system = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay).masked_fill(~strictly_lower, 0.0)
    system = system + torch.eye(c, dtype=q.dtype, device=q.device)  # I + A
    u = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, (beta * cum.exp())[..., None] * k, upper=False, unitriangular=True
    )
    scores = (q @ k.transpose(-1, -2)) * decay  # D * Q K^T
    q_decayed = q * cum.exp()[..., None]  # diag(exp(G)) Q
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]  # diag(exp(G_C - G)) K
    chunk_decay = cum[..., -1].exp()[..., None, None]  # exp(G_C)
    # 3. chunk after chunk: the deltas' S0 term, the outputs, the state
    s = state.float().clone()  # (batch, heads, k_dim, v_dim)
    out = torch.empty(batch, heads, n, c, v_dim, dtype=torch.float32, device=q.device)
    for i in range(n):
        delta = u[:, :, i] - w[:, :, i] @ s  # (batch, heads, c, v_dim)
        out[:, :, i] = q_decayed[:, :, i] @ s + scores[:, :, i] @ delta
        s = s * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ delta
    out = out.reshape(batch, heads, n * c, v_dim)[:, :, :tokens].transpose(1, 2)
    return out, s
