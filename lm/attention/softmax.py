"""Causal softmax attention with grouped K/V heads: MHA, GQA and MQA in one module.

Shapes: B batch, T sequence length, C d_model, nh query heads, nkv K/V heads, hs head size.
n_kv_head == n_head is multi-head attention (Vaswani et al. 2017), n_kv_head == 1 is
multi-query attention (Shazeer 2019), anything between is grouped-query attention
(Ainslie et al. 2023): query heads h*g .. h*g+g-1 share K/V head h, with g = nh / nkv.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lm.attention import register
from lm.config import ConfigError, ModelConfig
from lm.layers import apply_rope


@register("softmax")
class SoftmaxAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.head_dim
        q_size, kv_size = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        # One projection for Q, K and V: a single GEMM is faster than three on small models.
        # K and V get n_kv_head heads only, which is what makes GQA/MQA cheaper to cache.
        self.qkv = nn.Linear(config.d_model, q_size + 2 * kv_size, bias=False)
        self.out = nn.Linear(q_size, config.d_model, bias=False)

    @staticmethod
    def check_config(config: ModelConfig) -> None:
        if config.attention_options:
            raise ConfigError(
                f"attention=softmax takes no options, got {sorted(config.attention_options)}"
            )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(self.split_sizes, dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = self.attend(q, k, v)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)  # (B, T, nh*hs)
        return self.out(y)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of q (B, nh, T, hs) over k, v (B, nkv, T, hs).

        SDPA's `enable_gqa` lets the kernel share each K/V head across its query group
        instead of materialising n_head copies of K and V.
        """
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head
        )
