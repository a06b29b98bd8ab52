"""Causal softmax attention with grouped K/V heads: MHA, GQA and MQA in one module.

Shapes: B batch, T sequence length, nh query heads, nkv K/V heads, hs head size.
n_kv_head == n_head is multi-head attention (Vaswani et al. 2017), n_kv_head == 1 is
multi-query attention (Shazeer 2019), anything between is grouped-query attention
(Ainslie et al. 2023): query heads h*g .. h*g+g-1 share K/V head h, with g = nh / nkv.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lm.attention.base import AttentionSpec, LayerShape, register
from lm.attention.cache import CacheSpec, GenerationCache, tensor_bytes, visibility_mask
from lm.attention.projections import GroupedQKV
from lm.attention.sinks import causal_with_learned_sink, masked_attention
from lm.util.checks import require_bool


@register("softmax")
@dataclass(frozen=True)
class SoftmaxSpec(AttentionSpec):
    """Full causal attention; MHA, GQA or MQA by the model's n_kv_head."""

    learned_sink: bool = False  # a per-head logit in the denominator with no value (gpt-oss)

    def check(self) -> None:
        require_bool("learned_sink", self.learned_sink)

    def build(self, shape: LayerShape) -> SoftmaxAttention:
        return SoftmaxAttention(shape, self.learned_sink)


class SoftmaxAttention(GroupedQKV):
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of q (B, nh, T, hs) over k, v (B, nkv, T, hs).

        SDPA's `enable_gqa` lets the kernel share each K/V head across its query group
        instead of materialising n_head copies of K and V.
        """
        if self.sink_logit is not None:
            return causal_with_learned_sink(q, k, v, self.sink_logit)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head)

    def generation_state(self) -> CacheSpec:
        return CacheSpec("kv", self.n_kv_head, self.head_dim)

    def build_cache(self, context: GenerationCache, max_len: int) -> KVCache:
        return KVCache(context, self.n_kv_head, self.head_dim, max_len, self.sink_logit)


class KVCache:
    """Preallocated K and V of every position, n_kv_head heads only: (B, nkv, max_len, hs) each."""

    def __init__(self, context: GenerationCache, n_kv_head: int, head_dim: int, max_len: int,
                 sink_logit: torch.Tensor | None = None):
        shape = (context.batch_size, n_kv_head, max_len, head_dim)
        self.context, self.sink_logit = context, sink_logit
        self.k = torch.zeros(shape, dtype=context.dtype, device=context.device)
        self.v = torch.zeros(shape, dtype=context.dtype, device=context.device)

    def store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, nkv, T, hs) of the next T slots; K and V of every slot so far, (B, nkv, end, hs)."""
        start, end = self.context.seen, self.context.seen + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"the K/V cache holds {self.k.shape[2]} positions; {end} were asked for")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def causal_mask(self, T: int) -> torch.Tensor:
        """Which slots the next T queries see: (T, end), or (B, 1, T, end) with padded rows."""
        start = self.context.seen
        q_slots = torch.arange(start, start + T, device=self.k.device)
        k_slots = torch.arange(start + T, device=self.k.device)
        return visibility_mask(self.context, q_slots, k_slots, k_slots[None, :] <= q_slots[:, None])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, nh, T, hs) of the next T slots over every slot so far; k, v (B, nkv, T, hs) are stored."""
        start, T = self.context.seen, q.shape[2]
        keys, values = self.store(k, v)  # (B, nkv, end, hs)
        gqa = keys.shape[1] != q.shape[1]
        if self.sink_logit is None and not self.context.has_padding and (T == 1 or start == 0):
            # One new token sees every cached one; a first chunk is plain causal attention.
            return F.scaled_dot_product_attention(q, keys, values, is_causal=T > 1, enable_gqa=gqa)
        return masked_attention(q, keys, values, self.causal_mask(T), self.sink_logit)

    def store_at(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Write k, v (B, nkv, 1, hs) into slot `pos` (0-dim tensor) in place."""
        self.k.index_copy_(2, pos.view(1), k)
        self.v.index_copy_(2, pos.view(1), v)

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One query (B, nh, 1, hs) at slot `pos` over the whole buffer, slots after it masked."""
        self.store_at(k, v, pos)
        return masked_attention(q, self.k, self.v, self.context.decode_mask(pos), self.sink_logit)  # mask (B, 1, 1, L)

    def nbytes(self) -> int:
        return tensor_bytes(self.k, self.v)
