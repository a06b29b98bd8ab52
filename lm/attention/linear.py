"""Causal linear attention (Katharopoulos et al. 2020) with grouped K/V heads.

Shapes: B batch, T sequence length, nh query heads, nkv K/V heads, g = nh / nkv, F feature
size, hs head size, N chunks of C positions.

    out_i = phi(q_i) S_i / (phi(q_i) . z_i + eps),  S_i = sum_{j<=i} phi(k_j) v_j^T,  z_i = sum_{j<=i} phi(k_j)

The non-causal form phi(Q) (phi(K)^T V) lets every position see the future, so it cannot
train a decoder. The training path here is chunkwise: inside a chunk of C positions the
masked quadratic form, across chunks the running state (S, z), all accumulated in float32.
The state is passed in and returned, so generation can prefill with this function and then
update (S, z) token by token. The naive twins in reference.py share this signature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lm.attention.base import AttentionSpec, LayerShape, register
from lm.attention.feature_maps import FEATURE_MAPS, feature_dim, feature_map
from lm.attention.projections import GroupedQKV
from lm.cache import CacheSpec, GenerationCache, tensor_bytes
from lm.checks import require_choice, require_int, require_positive

State = tuple[torch.Tensor, torch.Tensor]  # S (B, nkv, F, hs), z (B, nkv, F), at least float32


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision inputs (bf16 sums over thousands of positions lose the state);
    float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def zero_state(k: torch.Tensor, v: torch.Tensor) -> State:
    B, nkv, _, Fdim = k.shape
    dtype = accumulation_dtype(k.dtype)
    return k.new_zeros(B, nkv, Fdim, v.shape[-1], dtype=dtype), k.new_zeros(B, nkv, Fdim, dtype=dtype)


def chunked_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eps: float,
                             state: State | None = None, chunk_size: int = 64) -> tuple[torch.Tensor, State]:
    """Featurised q (B, nh, T, F), k (B, nkv, T, F), v (B, nkv, T, hs) -> out (B, nh, T, hs), final state."""
    B, nh, T, Fdim = q.shape
    nkv, hs, C = k.shape[1], v.shape[-1], chunk_size
    g, N = nh // nkv, -(-T // chunk_size)
    S, z = state if state is not None else zero_state(k, v)
    q, k, v = (_padded(t, N * C - T, S.dtype) for t in (q, k, v))  # zero features add nothing to any sum
    q = q.reshape(B, nkv, g, N, C, Fdim)  # query heads of one group share their K/V head
    k = k.reshape(B, nkv, N, C, Fdim)
    v = v.reshape(B, nkv, N, C, hs)

    # Inside each chunk: the masked quadratic form.
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    scores = torch.einsum("bhgncf,bhndf->bhgncd", q, k).masked_fill_(~causal, 0)  # (B, nkv, g, N, C, C)
    num = torch.einsum("bhgncd,bhnde->bhgnce", scores, v)  # (B, nkv, g, N, C, hs)
    den = scores.sum(-1)  # (B, nkv, g, N, C)

    # Across chunks: the state accumulated before each chunk. A running sum over the N
    # chunks beats torch.cumsum along a middle dimension by 2x on CPU, and adds nothing
    # it must later subtract (which would cancel badly for small normalisers).
    kv = torch.einsum("bhncf,bhnce->bhnfe", k, v)  # (B, nkv, N, F, hs)
    k_sum = k.sum(3)  # (B, nkv, N, F)
    S_before, z_before = [], []
    # unbind, not kv[:, :, n]: the backward of N separate selects would build N full-size
    # zero gradients, quadratic in the number of chunks.
    for kv_n, k_sum_n in zip(kv.unbind(2), k_sum.unbind(2), strict=True):
        S_before.append(S)
        z_before.append(z)
        S, z = S + kv_n, z + k_sum_n
    S_before = torch.stack(S_before, dim=2)  # (B, nkv, N, F, hs)
    z_before = torch.stack(z_before, dim=2)  # (B, nkv, N, F)
    num = num + torch.einsum("bhgncf,bhnfe->bhgnce", q, S_before)
    den = den + torch.einsum("bhgncf,bhnf->bhgnc", q, z_before)

    out = num / (den.unsqueeze(-1) + eps)  # (B, nkv, g, N, C, hs)
    out = out.reshape(B, nh, N * C, hs)[:, :, :T]  # (B, nh, T, hs)
    return out, (S, z)


def _padded(x: torch.Tensor, pad: int, dtype: torch.dtype) -> torch.Tensor:
    x = x.to(dtype)
    return F.pad(x, (0, 0, 0, pad)) if pad else x


@register("linear")
@dataclass(frozen=True)
class LinearSpec(AttentionSpec):
    """Causal linear attention with feature map `feature_map` (lm.attention.feature_maps)."""

    feature_map: str = "elu"
    chunk_size: int = 64  # positions per chunk of the chunkwise training path
    eps: float = 1e-6  # added to the normaliser phi(q) . z

    def check(self) -> None:
        require_choice("feature_map", self.feature_map, FEATURE_MAPS)
        require_int("chunk_size", self.chunk_size)
        require_positive("eps", self.eps)

    def build(self, shape: LayerShape) -> LinearAttention:
        return LinearAttention(self, shape)


class LinearAttention(GroupedQKV):
    # Position enters through causality alone, as in Katharopoulos et al.; RoPE before a
    # feature map would not preserve the kernel's meaning.
    uses_rope = False
    context_limited = False

    def __init__(self, spec: LinearSpec, shape: LayerShape):
        super().__init__(shape)
        self.spec = spec
        self.phi = feature_map(spec.feature_map)
        self.feature_size = feature_dim(spec.feature_map, self.head_dim)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, _ = chunked_linear_attention(self.phi(q), self.phi(k), v, self.spec.eps, chunk_size=self.spec.chunk_size)
        return out.to(q.dtype)

    def generation_state(self) -> CacheSpec:
        features = self.feature_size
        return CacheSpec("recurrent", self.n_kv_head, self.head_dim, state_numel=features * self.head_dim + features)

    def build_cache(self, context: GenerationCache, max_len: int) -> LinearState:
        return LinearState(context, self)


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eps: float,
                   state: State) -> tuple[torch.Tensor, State]:
    """One new position: featurised q (B, nh, 1, F), k (B, nkv, 1, F), v (B, nkv, 1, hs).

    S += phi(k) v^T, z += phi(k); out = phi(q) S / (phi(q) . z + eps). O(1) in the length."""
    S, z = state
    B, nh, _, Fdim = q.shape
    nkv = k.shape[1]
    k, v = k.to(S.dtype), v.to(S.dtype)
    S = S + k.transpose(-1, -2) @ v  # (B, nkv, F, hs)
    z = z + k[:, :, 0]  # (B, nkv, F)
    q = q.to(S.dtype).reshape(B, nkv, nh // nkv, Fdim)  # (B, nkv, g, F): a group shares S and z
    num = q @ S  # (B, nkv, g, hs)
    den = (q @ z[..., None])[..., 0]  # (B, nkv, g)
    out = (num / (den[..., None] + eps)).reshape(B, nh, 1, -1)  # (B, nh, 1, hs)
    return out, (S, z)


class LinearState:
    """The recurrent state (S, z) per K/V head: (B, nkv, F, hs) and (B, nkv, F), whatever the length."""

    def __init__(self, context: GenerationCache, layer: LinearAttention):
        self.context, self.phi, self.spec = context, layer.phi, layer.spec
        dtype = accumulation_dtype(context.dtype)
        B, nkv, Fdim, hs = context.batch_size, layer.n_kv_head, layer.feature_size, layer.head_dim
        self.state: State = (torch.zeros(B, nkv, Fdim, hs, dtype=dtype, device=context.device),
                             torch.zeros(B, nkv, Fdim, dtype=dtype, device=context.device))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        fq, fk = self.phi(q), self.phi(k)
        context, T = self.context, q.shape[2]
        if context.has_padding:
            # Padding slots get zero features, so they add nothing to S or z.
            real = context.real(context.seen, T)  # (B, T)
            fk = fk * real[:, None, :, None]
        if T == 1:
            out, self.state = recurrent_step(fq, fk, v, self.spec.eps, self.state)
        else:
            out, self.state = chunked_linear_attention(fq, fk, v, self.spec.eps, self.state, self.spec.chunk_size)
        return out.to(q.dtype)

    def nbytes(self) -> int:
        return tensor_bytes(*self.state)
