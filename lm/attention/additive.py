"""Additive attention (Bahdanau et al. 2015) as causal self-attention with grouped K/V heads.

Shapes: B batch, T queries, S keys, nh query heads, nkv K/V heads, g = nh / nkv, hs head size.

Bahdanau scores a query against a key with a one-hidden-layer network instead of a dot product,
score_ij = w^T tanh(W_q q_i + W_k k_j + b). Here q and k already are learned projections of the
layer input, so W_q and W_k would be absorbed into them exactly; each query head h keeps its own
w_h and b_h (hs each):

    score_ij = w_h . tanh(q_i + k_j + b_h),   out_i = sum_{j<=i} softmax_j(score_ij) v_j

Every (query, key) pair runs its own tanh over hs numbers, so the cost is O(T^2 hs) in time
whatever the kernel. The fast path bounds memory: `block` queries at a time form their
(block, S, hs) hidden activations, and in training each block is recomputed in the backward
pass (activation checkpointing), so only one block's activations exist at once. Position enters
through causality alone: q + k has no rotation RoPE could encode a relative offset in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lm.attention.base import AttentionSpec, Example, LayerShape, register
from lm.attention.cache import CacheContext, CacheSpec
from lm.attention.projections import GroupedQKV
from lm.attention.shared_caches import KVCache
from lm.util.checks import require_int


@register("additive")
@dataclass(frozen=True)
class AdditiveSpec(AttentionSpec):
    """Causal additive (Bahdanau) attention; `block` queries at a time bound the memory."""

    block: int = 64

    examples = {"": Example({"block": 8}, n_kv_head=2), "mha-odd-block": Example({"block": 5}, n_kv_head=4)}
    # a tanh per (query, key, feature): ~40x the work of a dot product, so 16k would take minutes
    benchmarks = {"": Example(longest=4096)}

    def check(self) -> None:
        require_int("block", self.block)

    def build(self, shape: LayerShape) -> AdditiveAttention:
        return AdditiveAttention(self, shape)

    def flops(self, T: int, n_head: int, n_kv_head: int, head_dim: int) -> float:
        return 6 * n_head * head_dim * T * (T + 1) / 2  # q + k, tanh, w . hidden (1 each), then v, per pair


class AdditiveAttention(GroupedQKV):
    uses_rope = False
    adamw_parameters = ("score", "score_bias")  # (nh, hs): a vector per head, not a matrix for Muon (lm.training.optim)

    def __init__(self, spec: AdditiveSpec, shape: LayerShape):
        super().__init__(shape)
        self.block = spec.block
        self.score = nn.Parameter(torch.empty(shape.n_head, shape.head_dim))  # w_h
        self.score_bias = nn.Parameter(torch.empty(shape.n_head, shape.head_dim))  # b_h
        self.reset_own_parameters()

    def reset_own_parameters(self) -> None:
        """w_h of unit scale, so scores start with the spread of dot products (a sum of hs terms
        of size ~1/sqrt(hs)); no bias."""
        nn.init.normal_(self.score, std=self.head_dim**-0.5)
        nn.init.zeros_(self.score_bias)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return additive_attention(q, k, v, self.score, self.score_bias, self.block)

    def naive_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return naive_additive_attention(q, k, v, self.score, self.score_bias)

    def generation_state(self) -> CacheSpec:
        return CacheSpec("kv", self.n_kv_head, self.head_dim)

    def build_cache(self, context: CacheContext, max_len: int) -> AdditiveCache:
        return AdditiveCache(context, self, max_len)


def additive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, bias: torch.Tensor,
                       block: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, nh, T, hs) over k, v (B, nkv, S, hs) -> (B, nh, T, hs); w, bias (nh, hs).

    Without `mask`, T == S and query i sees keys j <= i. A `mask` (T, S) or (B, 1, T, S) says
    which keys each query sees instead (the generation cache's slots)."""
    B, nh, T, hs = q.shape
    nkv, S = k.shape[1], k.shape[2]
    g = nh // nkv
    q = (q + bias[:, None, :]).view(B, nkv, g, T, hs)  # b_h folded into the query once
    w = w.view(nkv, g, hs)
    if mask is None:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
    mask = mask.expand(B, 1, T, S).view(B, 1, 1, T, S)  # broadcast over K/V heads and groups
    outputs = []
    for start in range(0, T, block):
        end = min(T, start + block)
        # Keys past the block's last query are never seen without a mask; skip them (causal work halves).
        keys = S if T != S else end
        args = (q[:, :, :, start:end], k[:, :, :keys], v[:, :, :keys], w, mask[..., start:end, :keys])
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, w)):
            outputs.append(checkpoint(_attend_block, *args, use_reentrant=False))
        else:
            outputs.append(_attend_block(*args))
    return torch.cat(outputs, dim=3).view(B, nh, T, hs)  # (B, nkv, g, T, hs) -> (B, nh, T, hs)


def _attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
    """q (B, nkv, g, t, hs) over k, v (B, nkv, s, hs) under mask (B, 1, 1, t, s) -> (B, nkv, g, t, hs)."""
    hidden = torch.tanh(q[:, :, :, :, None, :] + k[:, :, None, None, :, :])  # (B, nkv, g, t, s, hs)
    scores = torch.einsum("bhgtsd,hgd->bhgts", hidden, w)  # (B, nkv, g, t, s)
    weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhgts,bhsd->bhgtd", weights, v)


class AdditiveCache(KVCache):
    """K and V of every position, as for softmax attention; the scores differ, not what is kept."""

    def __init__(self, context: CacheContext, layer: AdditiveAttention, max_len: int):
        super().__init__(context, layer.n_kv_head, layer.head_dim, max_len)
        self.layer = layer

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        mask = self.causal_mask(q.shape[2])
        keys, values = self.store(k, v)
        return additive_attention(q, keys, values, self.layer.score, self.layer.score_bias, self.layer.block, mask)

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.store_at(k, v, pos)
        mask = self.context.decode_mask(pos)  # (B, 1, 1, L): the slots after pos are hidden
        return additive_attention(q, self.k, self.v, self.layer.score, self.layer.score_bias, self.layer.block, mask)


# ------------------------------------------------------------ naive twin (for tests)


def naive_additive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor,
                       bias: torch.Tensor) -> torch.Tensor:
    """Causal additive attention pair by pair: score_ij = w_h . tanh(q_i + k_j + b_h) for each
    j <= i, softmax over j, weighted sum of values. w, bias (nh, hs)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # (B, nh, T, hs)
    v = v.repeat_interleave(group, dim=1)  # (B, nh, T, hs)
    outputs = []
    for i in range(q.shape[2]):
        scores = torch.stack([(w * torch.tanh(q[:, :, i] + k[:, :, j] + bias)).sum(-1) for j in range(i + 1)], -1)
        weights = scores.softmax(dim=-1)  # (B, nh, i + 1)
        outputs.append(sum(weights[:, :, j, None] * v[:, :, j] for j in range(i + 1)))
    return torch.stack(outputs, dim=2)
