"""Causal linear attention (Katharopoulos et al. 2020) with grouped K/V heads.

Shapes: B batch, T sequence length, nh query heads, nkv K/V heads, g = nh / nkv, F feature
size, hs head size, N chunks of C positions.

    out_i = phi(q_i) S_i / (phi(q_i) . z_i + eps),  S_i = sum_{j<=i} phi(k_j) v_j^T,  z_i = sum_{j<=i} phi(k_j)

The non-causal form phi(Q) (phi(K)^T V) lets every position see the future, so it cannot
train a decoder. The training path here is chunkwise: inside a chunk of C positions the
masked quadratic form, across chunks the running state (S, z), all accumulated in float32.
The state is passed in and returned, so generation can prefill with this function and then
update (S, z) token by token. The naive twins at the end of this file share this signature.

A feature map with a closed-form kernel (Taylor's 1 + s + s^2/2) trains short sequences without
features at all: the masked T x T form on q . k, which at Taylor's 1 + hs + hs^2 features is far
cheaper than the chunkwise form up to a length the cost model below picks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lm.attention.base import AttentionSpec, Example, LayerShape, register
from lm.attention.cache import CacheContext, CacheSpec
from lm.attention.feature_maps import FEATURE_MAPS, Kernel, feature_dim, feature_kernel, feature_map
from lm.attention.projections import GroupedQKV
from lm.attention.shared_caches import RecurrentCache, accumulation_dtype, without_autocast
from lm.util.checks import require_choice, require_int, require_positive

State = tuple[torch.Tensor, torch.Tensor]  # S (B, nkv, F, hs), z (B, nkv, F), at least float32


def zero_state(k: torch.Tensor, v: torch.Tensor) -> State:
    B, nkv, _, Fdim = k.shape
    dtype = accumulation_dtype(k.dtype)
    return k.new_zeros(B, nkv, Fdim, v.shape[-1], dtype=dtype), k.new_zeros(B, nkv, Fdim, dtype=dtype)


@without_autocast
def chunked_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eps: float,
                             state: State | None = None, chunk_size: int = 64) -> tuple[torch.Tensor, State]:
    """Featurised q (B, nh, T, F), k (B, nkv, T, F), v (B, nkv, T, hs) -> out (B, nh, T, hs), final state.

    Two choices make it fast. The values get a column of ones, v1 = [v | 1], so one matmul gives
    numerator and normaliser together (phi(q) phi(k)^T 1 is the normaliser's sum) and one state
    S1 = [S | z] carries both. Every product is a 3-D batched matmul over (B, nkv, N), the g query
    heads of a group stacked as g*C rows, so each K/V chunk is read once per group and no einsum
    permutes a copy; the big intermediates are updated in place."""
    B, nh, T, Fdim = q.shape
    nkv, hs, C = k.shape[1], v.shape[-1], chunk_size
    g, N = nh // nkv, -(-T // chunk_size)
    S0, z0 = state if state is not None else zero_state(k, v)
    dtype = S0.dtype
    q, k = (_padded(t, N * C - T, dtype) for t in (q, k))  # zero features add nothing to any sum
    v1 = _padded(F.pad(v.to(dtype), (0, 1), value=1.0), N * C - T, dtype)  # (B, nkv, N*C, hs+1)
    q = q.view(B, nkv, g, N, C, Fdim).transpose(2, 3).reshape(B * nkv * N, g * C, Fdim)  # (BnN, gC, F)
    k = k.reshape(B * nkv * N, C, Fdim)  # (BnN, C, F)
    v1 = v1.reshape(B * nkv * N, C, hs + 1)  # (BnN, C, hs+1)

    # Inside each chunk: the masked quadratic form, query row (h, c) seeing keys d <= c.
    scores = torch.bmm(q, k.transpose(1, 2))  # (BnN, gC, C)
    scores.view(-1, C, C).tril_()
    out1 = torch.bmm(scores, v1)  # (BnN, gC, hs+1): numerators | normalisers
    del scores

    # Across chunks: the state before each chunk, an exclusive prefix sum of the chunks'
    # contributions. Shifting an inclusive cumsum by one chunk subtracts nothing, so small
    # normalisers do not cancel.
    S1_0 = torch.cat((S0, z0[..., None]), dim=-1)  # (B, nkv, F, hs+1)
    S1 = torch.bmm(k.transpose(1, 2), v1).view(B, nkv, N, Fdim, hs + 1).cumsum(2)  # after each chunk, from zero
    S1 += S1_0[:, :, None]
    S1_before = torch.cat((S1_0[:, :, None], S1[:, :, :-1]), dim=2)  # (B, nkv, N, F, hs+1)
    out1 = torch.baddbmm(out1, q, S1_before.view(B * nkv * N, Fdim, hs + 1))  # (BnN, gC, hs+1)

    out = out1[..., :hs] / (out1[..., hs:] + eps)  # (BnN, gC, hs)
    out = out.view(B, nkv, N, g, C, hs).transpose(2, 3).reshape(B, nh, N * C, hs)[:, :, :T]  # (B, nh, T, hs)
    final = S1[:, :, -1]  # (B, nkv, F, hs+1)
    return out, (final[..., :hs], final[..., hs])


SEGMENT = 1024  # positions featurised and attended at a time by segmented_linear_attention


@without_autocast
def segmented_linear_attention(phi, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eps: float,
                               chunk_size: int, state: State | None = None) -> tuple[torch.Tensor, State]:
    """q (B, nh, T, hs), k and v (B, nkv, T, hs) -> out (B, nh, T, hs), final state: the chunkwise
    form over segments of about SEGMENT positions, the state carried from one to the next.

    The result is the same as one call over the whole sequence; the point is memory traffic. Every
    intermediate of a segment is a few MB, so it stays in cache and the allocator reuses its
    blocks, where whole-sequence intermediates (32 MB each at 16k x 8 heads x 64) are fresh
    mappings whose page faults alone cost more than the arithmetic on a CPU."""
    step = chunk_size * max(1, SEGMENT // chunk_size)
    outputs = []
    for start in range(0, q.shape[2], step):
        end = start + step
        out, state = chunked_linear_attention(phi(q[:, :, start:end]), phi(k[:, :, start:end]), v[:, :, start:end],
                                              eps, state, chunk_size)
        outputs.append(out)
    return torch.cat(outputs, dim=2), state


@without_autocast
def kernel_linear_attention(kernel: Kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            eps: float) -> torch.Tensor:
    """q (B, nh, T, hs), k and v (B, nkv, T, hs) -> out (B, nh, T, hs), from a fresh state: the
    quadratic form with phi(q_i) . phi(k_j) = kernel(q_i . k_j / sqrt(hs)), so no feature is formed.

    The g query heads of a group are stacked as g*T rows against their K/V head, as in the chunkwise
    form, and [v | 1] gives numerators and normalisers in one product."""
    B, nh, T, hs = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    dtype = accumulation_dtype(q.dtype)
    q, k = q.to(dtype) * hs**-0.5, k.to(dtype)  # the scale on q: one pass over T x hs, not T x T
    scores = q.reshape(B, nkv, g * T, hs) @ k.transpose(-1, -2)  # (B, nkv, gT, T)
    weights = kernel(scores).view(B, nkv, g, T, T).tril()  # (B, nkv, g, T, T): query t sees keys <= t
    v1 = F.pad(v.to(dtype), (0, 1), value=1.0)  # (B, nkv, T, hs+1)
    out1 = weights.view(B, nkv, g * T, T) @ v1  # (B, nkv, gT, hs+1): numerators | normalisers
    out = out1[..., :hs] / (out1[..., hs:] + eps)  # (B, nkv, gT, hs)
    return out.view(B, nh, T, hs)  # (B, nh, T, hs): heads of a group are adjacent, as in q


# The kernel form's cost per query and position relative to a multiply-add of the chunkwise form:
# its work is 4 hs multiply-adds per pair (scores and the weighted sum over [v | 1]) plus about
# KERNEL_PASSES memory-bound passes over the T x T weights, forward and backward. Measured on a
# 2-core AMD EPYC, one thread, forward + backward: at hs 16 the kernel form is 3.8x faster at
# T = 128, 1.7x at 256 and 2x slower at 512; at hs 32, 65x at 64, 18x at 256, 2x at 1024 and
# 1.4x slower at 2048. KERNEL_PASSES = 60 puts the switch between those points.
KERNEL_PASSES = 60


def kernel_form_is_cheaper(T: int, hs: int, features: int, chunk_size: int) -> bool:
    """Whether the kernel form costs less than the chunkwise form for a T-position sequence; never
    beyond SEGMENT positions, where its T x T weights would outgrow the caches the segments keep to."""
    kernel = T * (4 * hs + KERNEL_PASSES)  # per query: T keys
    chunkwise = 2 * chunk_size * features + 4 * features * (hs + 1)  # inside the chunk + the state
    return T <= SEGMENT and kernel < chunkwise


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

    examples = {
        "": Example({"chunk_size": 8}, n_kv_head=2),
        "relu": Example({"feature_map": "relu", "chunk_size": 4}, n_kv_head=2),
        "taylor-mqa": Example({"feature_map": "taylor", "chunk_size": 4}, n_kv_head=1),
    }

    def check(self) -> None:
        require_choice("feature_map", self.feature_map, FEATURE_MAPS)
        require_int("chunk_size", self.chunk_size)
        require_positive("eps", self.eps)

    def build(self, shape: LayerShape) -> LinearAttention:
        return LinearAttention(self, shape)

    def flops(self, T: int, n_head: int, n_kv_head: int, head_dim: int) -> float:
        if self.kernel_form(T, head_dim):
            pairs = T * (T + 1) // 2  # the (query, key) pairs causality leaves
            return 2 * n_head * pairs * (head_dim + head_dim + 1)  # scores, then the weighted sum of [v | 1]
        return chunkwise_flops(T, n_head, n_kv_head, head_dim, feature_dim(self.feature_map, head_dim), self.chunk_size)

    def kernel_form(self, T: int, head_dim: int) -> bool:
        """Whether training on T positions takes the kernel form (kernel_linear_attention)."""
        features = feature_dim(self.feature_map, head_dim)
        return (feature_kernel(self.feature_map) is not None
                and kernel_form_is_cheaper(T, head_dim, features, self.chunk_size))


def chunkwise_flops(T: int, n_head: int, n_kv_head: int, hs: int, features: int, C: int) -> float:
    """The chunkwise form's work: inside each chunk the masked scores and their weighted sum of
    [v | 1]; across chunks each K/V head's state update and each query head's read of it."""
    inside = 2 * n_head * T * C * features + 2 * n_head * T * C * (hs + 1)
    across = 2 * n_kv_head * T * features * (hs + 1) + 2 * n_head * T * features * (hs + 1)
    return inside + across


class LinearAttention(GroupedQKV):
    # Position enters through causality alone, as in Katharopoulos et al.; RoPE before a
    # feature map would not preserve the kernel's meaning.
    uses_rope = False
    context_limited = False

    def __init__(self, spec: LinearSpec, shape: LayerShape):
        super().__init__(shape)
        self.spec = spec
        self.phi = feature_map(spec.feature_map)
        self.kernel = feature_kernel(spec.feature_map)
        self.feature_size = feature_dim(spec.feature_map, self.head_dim)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.spec.kernel_form(q.shape[2], self.head_dim):
            return kernel_linear_attention(self.kernel, q, k, v, self.spec.eps).to(q.dtype)
        return segmented_linear_attention(self.phi, q, k, v, self.spec.eps, self.spec.chunk_size)[0].to(q.dtype)

    def naive_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return quadratic_linear_attention(self.phi(q), self.phi(k), v, self.spec.eps)[0]

    def generation_state(self) -> CacheSpec:
        features = self.feature_size
        return CacheSpec("recurrent", self.n_kv_head, self.head_dim, state_numel=features * self.head_dim + features)

    def build_cache(self, context: CacheContext, max_len: int) -> RecurrentCache:
        """The state (S, z) per K/V head: (B, nkv, F, hs) and (B, nkv, F), whatever the length."""
        dtype = accumulation_dtype(context.dtype)
        B, nkv, Fdim, hs = context.batch_size, self.n_kv_head, self.feature_size, self.head_dim
        state = {"S": torch.zeros(B, nkv, Fdim, hs, dtype=dtype, device=context.device),
                 "z": torch.zeros(B, nkv, Fdim, dtype=dtype, device=context.device)}
        return RecurrentCache(context, state, self.chunk_from, self.step_from)

    def chunk_from(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: State,
                   real: torch.Tensor | None) -> tuple[torch.Tensor, State]:
        fk = self.phi(k)
        if real is not None:  # padding slots get zero features, so they add nothing to S or z
            fk = fk * real[:, None, :, None]
        return chunked_linear_attention(self.phi(q), fk, v, self.spec.eps, state, self.spec.chunk_size)

    def step_from(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        return recurrent_step(self.phi(q), self.phi(k), v, self.spec.eps, state)


@without_autocast
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


# ------------------------------------------------------------ naive twin (for tests)


def _naive_initial_state(k: torch.Tensor, v: torch.Tensor, state):
    if state is not None:
        return state
    B, nkv, _, F = k.shape
    return torch.zeros(B, nkv, F, v.shape[-1], dtype=k.dtype), torch.zeros(B, nkv, F, dtype=k.dtype)


def quadratic_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eps: float, state=None):
    """Causal linear attention as a masked T x T product, the way it is written on paper.

    q (B, nh, T, F), k (B, nkv, T, F), v (B, nkv, T, hs); state (S, z) carried in from earlier tokens.
    """
    S0, z0 = _naive_initial_state(k, v, state)
    group = q.shape[1] // k.shape[1]
    kq, vq = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, nh, T, .)
    T = q.shape[2]
    weights = (q @ kq.transpose(-2, -1)).tril()  # (B, nh, T, T)
    num = weights @ vq + q @ S0.repeat_interleave(group, dim=1)  # (B, nh, T, hs)
    den = weights.sum(-1) + (q @ z0.repeat_interleave(group, dim=1)[..., None])[..., 0]  # (B, nh, T)
    out = num / (den[..., None] + eps)
    assert out.shape[2] == T
    return out, (S0 + k.transpose(-2, -1) @ v, z0 + k.sum(2))


def recurrent_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eps: float, state=None):
    """Causal linear attention one token at a time, as an RNN: S += phi(k) v^T, z += phi(k)."""
    S, z = _naive_initial_state(k, v, state)
    group = q.shape[1] // k.shape[1]
    outputs = []
    for t in range(q.shape[2]):
        S = S + k[:, :, t, :, None] * v[:, :, t, None, :]  # (B, nkv, F, hs)
        z = z + k[:, :, t]  # (B, nkv, F)
        qt = q[:, :, t]  # (B, nh, F)
        num = (qt[..., None] * S.repeat_interleave(group, dim=1)).sum(-2)  # (B, nh, hs)
        den = (qt * z.repeat_interleave(group, dim=1)).sum(-1)  # (B, nh)
        outputs.append(num / (den[..., None] + eps))
    return torch.stack(outputs, dim=2), (S, z)
