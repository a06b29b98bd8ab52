"""Causal softmax attention with grouped K/V heads: MHA, GQA and MQA in one module.

Shapes: B batch, T sequence length, nh query heads, nkv K/V heads, hs head size.
n_kv_head == n_head is multi-head attention (Vaswani et al. 2017), n_kv_head == 1 is
multi-query attention (Shazeer 2019), anything between is grouped-query attention
(Ainslie et al. 2023): query heads h*g .. h*g+g-1 share K/V head h, with g = nh / nkv.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lm.attention import register
from lm.attention.projections import GroupedQKV
from lm.cache import CacheSpec


@register("softmax")
class SoftmaxAttention(GroupedQKV):
    options: dict = {}

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of q (B, nh, T, hs) over k, v (B, nkv, T, hs).

        SDPA's `enable_gqa` lets the kernel share each K/V head across its query group
        instead of materialising n_head copies of K and V.
        """
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head)

    def generation_state(self) -> CacheSpec:
        return CacheSpec("kv", self.n_kv_head, self.head_dim)
