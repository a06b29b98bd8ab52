"""The projections every attention kind shares: Q with n_head heads, K and V with n_kv_head.

Shapes: B batch, T sequence length, C d_model, nh query heads, nkv K/V heads, hs head size.
Subclasses implement `attend(q, k, v)` on q (B, nh, T, hs) and k, v (B, nkv, T, hs), and
`build_cache(context, max_len)` for generation (see lm/cache.py).
"""

from __future__ import annotations

import torch
from torch import nn

from lm.config import ModelConfig
from lm.layers import apply_rope


class GroupedQKV(nn.Module):
    uses_rope = True
    context_limited = True  # whether positions past max_seq_len are out of reach

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.head_dim
        q_size, kv_size = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        # One projection for Q, K and V: a single GEMM is faster than three on small models.
        # K and V get n_kv_head heads only, which is what makes GQA/MQA cheaper to cache.
        self.qkv = nn.Linear(config.d_model, q_size + 2 * kv_size, bias=False)
        self.out = nn.Linear(q_size, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        B, T, _ = x.shape
        nh, nkv = self.n_head, self.n_kv_head
        heads = self.qkv(x).view(B, T, nh + 2 * nkv, self.head_dim).transpose(1, 2)  # (B, nh+2nkv, T, hs)
        qk, v = heads[:, : nh + nkv], heads[:, nh + nkv :]  # (B, nh+nkv, T, hs), (B, nkv, T, hs)
        if self.uses_rope:
            qk = apply_rope(qk, cos, sin)  # Q and K rotated in one pass
        q, k = qk[:, :nh], qk[:, nh:]  # (B, nh, T, hs), (B, nkv, T, hs)
        y = self.attend(q, k, v) if cache is None else self.attend_cached(q, k, v, cache)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)  # (B, T, nh*hs)
        return self.out(y)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def attend_cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache) -> torch.Tensor:
        """Attention of the new positions over everything the layer's cache holds, updating it."""
        return cache.attend(q, k, v)
