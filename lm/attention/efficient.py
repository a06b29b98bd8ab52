"""Efficient attention (Shen et al. 2018, "Efficient Attention: Attention with Linear Complexities"),
in a causal form.

Shapes: B batch, T sequence length, nh query heads, nkv K/V heads, g = nh / nkv, hs head size
(also the number of features f), N chunks of C positions.

The published form is sigma_row(Q) (sigma_col(K)^T V): each query is softmaxed over its features,
and each key feature is softmaxed over *all* positions, which lets a position see the future.
The causal form keeps the query side and turns the key side into a running softmax over the
positions seen so far, one per feature:

    out_i = sum_f softmax(q_i)_f * N_i[f] / D_i[f],
    N_i[f] = sum_{j<=i} exp(k_jf) v_j,   D_i[f] = sum_{j<=i} exp(k_jf)

so feature f of position i reads a weighted average of the values, weighted by how strongly
each earlier key expresses f. The state (N, D) has the size of one linear-attention state.

Computed stably and chunkwise. With b_if = softmax(q_i)_f / D_i[f] (a cumulative sum gives every
D_i inside a chunk), out_i = b_i . N_before + sum_{j<=i in chunk} (b_i . e_j) v_j with
e_j = exp(k_j - s): a masked (C, C) product like linear attention's. s is a per-feature
stabiliser, the running maximum of k up to the end of the chunk; N and D carry it (state
(N, D, m): N and D scaled by exp(-m)), and it cancels in N/D. Within a chunk the weights of
keys more than ~80 nats below that maximum underflow; D is kept at least the smallest normal
float so such a query reads zeros for that feature instead of NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lm.attention.base import AttentionSpec, Example, LayerShape, register
from lm.attention.cache import CacheContext, CacheSpec
from lm.attention.projections import GroupedQKV
from lm.attention.shared_caches import RecurrentCache, accumulation_dtype, without_autocast
from lm.util.checks import require_int

# N (B, nkv, f, hs) and D (B, nkv, f), both scaled by exp(-m); m (B, nkv, f) the running key maximum.
State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@register("efficient")
@dataclass(frozen=True)
class EfficientSpec(AttentionSpec):
    """Causal efficient attention: queries softmaxed over features, keys by a running softmax
    over positions per feature. O(N hs^2) time, a constant-size state."""

    chunk_size: int = 64  # positions per chunk of the chunkwise training path

    examples = {"": Example({"chunk_size": 8}, n_kv_head=2), "mqa": Example({"chunk_size": 4}, n_kv_head=1)}

    def check(self) -> None:
        require_int("chunk_size", self.chunk_size)

    def build(self, shape: LayerShape) -> EfficientAttention:
        return EfficientAttention(self, shape)

    def flops(self, T: int, n_head: int, n_kv_head: int, head_dim: int) -> float:
        hs, C = head_dim, self.chunk_size
        # Inside each chunk the scores b e^T and their weighted sum of v (and of 1, the normaliser);
        # across chunks each K/V head's update of (N, D) and each query head's read of it.
        inside = 2 * n_head * T * C * hs + 2 * n_head * T * C * (hs + 1)
        across = 2 * n_kv_head * T * hs * (hs + 1) + 2 * n_head * T * hs * (hs + 1)
        return inside + across


class EfficientAttention(GroupedQKV):
    # As for linear attention, position enters through causality alone: the softmaxes act on
    # features, where a rotation by position would have no meaning.
    uses_rope = False
    context_limited = False

    def __init__(self, spec: EfficientSpec, shape: LayerShape):
        super().__init__(shape)
        self.chunk_size = spec.chunk_size

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, _ = chunked_efficient_attention(q, k, v, chunk_size=self.chunk_size)
        return out.to(q.dtype)

    def generation_state(self) -> CacheSpec:
        hs = self.head_dim
        return CacheSpec("recurrent", self.n_kv_head, hs, state_numel=hs * hs + 2 * hs)

    def naive_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return naive_efficient_attention(q, k, v)

    def build_cache(self, context: CacheContext, max_len: int) -> RecurrentCache:
        """(N, D, m) per K/V head: (B, nkv, hs, hs), (B, nkv, hs), (B, nkv, hs), whatever the length."""
        empty = torch.zeros(context.batch_size, self.n_kv_head, 0, self.head_dim, dtype=context.dtype,
                            device=context.device)
        chunk = lambda q, k, v, state, real: chunked_efficient_attention(q, k, v, state, self.chunk_size, real)  # noqa: E731
        return RecurrentCache(context, dict(zip("NDm", empty_state(empty, empty), strict=True)), chunk, efficient_step)


def empty_state(k: torch.Tensor, v: torch.Tensor) -> State:
    B, nkv, _, f = k.shape
    dtype = accumulation_dtype(k.dtype)
    return (k.new_zeros(B, nkv, f, v.shape[-1], dtype=dtype), k.new_zeros(B, nkv, f, dtype=dtype),
            k.new_full((B, nkv, f), float("-inf"), dtype=dtype))


@without_autocast
def chunked_efficient_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: State | None = None,
                                chunk_size: int = 64, real: torch.Tensor | None = None
                                ) -> tuple[torch.Tensor, State]:
    """q (B, nh, T, hs), k and v (B, nkv, T, hs) -> out (B, nh, T, hs), final state.

    `real` (B, T) bool marks the positions that count; the others (left padding in a batch of
    prompts) add nothing to the state."""
    B, nh, T, hs = q.shape
    nkv, C = k.shape[1], chunk_size
    g, n_chunks = nh // nkv, -(-T // chunk_size)
    N, D, m = state if state is not None else empty_state(k, v)
    dtype = N.dtype
    pad = n_chunks * C - T
    counts = torch.ones(B, T, dtype=torch.bool, device=q.device) if real is None else real
    counts = F.pad(counts, (0, pad))  # positions past T count for nothing either
    a = F.pad(q.to(dtype).softmax(-1), (0, 0, 0, pad)).view(B, nkv, g, n_chunks, C, hs)  # softmax(q) per group
    k = F.pad(k.to(dtype), (0, 0, 0, pad)).view(B, nkv, n_chunks, C, hs)
    v = F.pad(v.to(dtype), (0, 0, 0, pad)).view(B, nkv, n_chunks, C, hs)
    counts = counts.view(B, 1, n_chunks, C, 1)
    # Per-feature stabiliser of each chunk: the running maximum of the keys that count. It
    # cancels in N/D, so it is a constant to autograd (detached): gradients stay exact.
    chunk_max = k.detach().masked_fill(~counts, float("-inf")).amax(3)  # (B, nkv, N, hs)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    tiny = torch.finfo(dtype).tiny
    outputs = []
    chunks = zip(a.unbind(3), k.unbind(2), v.unbind(2), counts.unbind(2), chunk_max.unbind(2), strict=True)
    for a_n, k_n, v_n, count_n, max_n in chunks:
        s = torch.maximum(m, max_n)  # (B, nkv, hs)
        s = torch.where(torch.isinf(s), torch.zeros_like(s), s)  # nothing counted yet: any stabiliser works
        rescale = torch.exp(m - s)  # (B, nkv, hs): the state moves to the new stabiliser
        e = torch.where(count_n, torch.exp(k_n - s[:, :, None]), torch.zeros_like(k_n))  # (B, nkv, C, hs)
        D_i = D[:, :, None] * rescale[:, :, None] + e.cumsum(2)  # (B, nkv, C, hs): D at each position
        b = a_n / D_i[:, :, None].clamp_min(tiny)  # (B, nkv, g, C, hs)
        N = N * rescale[..., None]
        scores = torch.einsum("bhgcf,bhdf->bhgcd", b, e).masked_fill(~causal, 0)  # (B, nkv, g, C, C)
        out = torch.einsum("bhgcd,bhde->bhgce", scores, v_n) + torch.einsum("bhgcf,bhfe->bhgce", b, N)
        outputs.append(out)  # (B, nkv, g, C, hs)
        N = N + torch.einsum("bhcf,bhce->bhfe", e, v_n)
        D, m = D_i[:, :, -1], s
    out = torch.stack(outputs, dim=3).reshape(B, nh, n_chunks * C, hs)[:, :, :T]  # (B, nh, T, hs)
    return out, (N, D, m)


@without_autocast
def efficient_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
    """One new position: q (B, nh, 1, hs), k and v (B, nkv, 1, hs)."""
    N, D, m = state
    B, nh, _, hs = q.shape
    nkv = k.shape[1]
    k, v = k[:, :, 0].to(N.dtype), v[:, :, 0].to(N.dtype)  # (B, nkv, hs)
    s = torch.maximum(m, k.detach())
    e, rescale = torch.exp(k - s), torch.exp(m - s)  # (B, nkv, hs) each
    N, D, m = N * rescale[..., None] + e[..., None] * v[:, :, None, :], D * rescale + e, s
    a = q[:, :, 0].to(N.dtype).softmax(-1).view(B, nkv, nh // nkv, hs)  # (B, nkv, g, hs)
    b = a / D[:, :, None].clamp_min(torch.finfo(N.dtype).tiny)
    out = torch.einsum("bhgf,bhfe->bhge", b, N).reshape(B, nh, 1, hs)  # (B, nh, 1, hs)
    return out, (N, D, m)


# ------------------------------------------------------------ naive twin (for tests)


def naive_efficient_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal efficient attention as written: softmax(q_i) over features; for each feature f, a
    softmax of k_jf over the positions j <= i weighting the values. Materialises (T, T, hs)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # (B, nh, T, hs)
    v = v.repeat_interleave(group, dim=1)  # (B, nh, T, hs)
    T = q.shape[2]
    future = torch.ones(T, T, dtype=torch.bool).triu(1)  # [i, j]: j after i
    logits = k[:, :, None, :, :].expand(-1, -1, T, -1, -1)  # (B, nh, T_i, T_j, hs)
    weights = logits.masked_fill(future[:, :, None], float("-inf")).softmax(dim=3)  # over j, per feature
    context = torch.einsum("bhijf,bhje->bhife", weights, v)  # (B, nh, T, hs_f, hs)
    return torch.einsum("bhif,bhife->bhie", q.softmax(-1), context)


def recurrent_efficient_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The same one position at a time, keeping a per-feature running maximum m of the keys:
    N = sum exp(k_j - m) v_j, D = sum exp(k_j - m)."""
    group = q.shape[1] // k.shape[1]
    B, nkv, T, hs = k.shape
    N = torch.zeros(B, nkv, hs, hs, dtype=k.dtype)
    D = torch.zeros(B, nkv, hs, dtype=k.dtype)
    m = torch.full((B, nkv, hs), float("-inf"), dtype=k.dtype)
    outputs = []
    for t in range(T):
        new_m = torch.maximum(m, k[:, :, t])
        N = N * torch.exp(m - new_m)[..., None] + torch.exp(k[:, :, t] - new_m)[..., None] * v[:, :, t, None, :]
        D = D * torch.exp(m - new_m) + torch.exp(k[:, :, t] - new_m)
        m = new_m
        context = (N / D[..., None]).repeat_interleave(group, dim=1)  # (B, nh, hs_f, hs)
        outputs.append(torch.einsum("bhf,bhfe->bhe", q[:, :, t].softmax(-1), context))
    return torch.stack(outputs, dim=2)
