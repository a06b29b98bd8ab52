"""The projections every attention kind shares: Q with n_head heads, K and V with n_kv_head.

Shapes: B batch, T sequence length, C d_model, nh query heads, nkv K/V heads, hs head size.
A kind's layer subclasses GroupedQKV and implements `attend(q, k, v)` on q (B, nh, T, hs) and
k, v (B, nkv, T, hs) for a whole sequence, plus `naive_attend`, `build_cache` and `generation_state`
(lm.attention.base).
"""

from __future__ import annotations

import torch
from torch import nn

from lm.attention.base import LayerCache, LayerShape
from lm.attention.rope import apply_rope


def qkv_rows(n_head: int, n_kv_head: int, head_dim: int) -> tuple[int, int, int]:
    """Rows of Q, K and V in the fused projection, in that order."""
    return n_head * head_dim, n_kv_head * head_dim, n_kv_head * head_dim


class GroupedQKV(nn.Module):
    uses_rope = True
    context_limited = True

    def __init__(self, shape: LayerShape):
        super().__init__()
        self.layer_idx = shape.layer_idx
        self.n_head, self.n_kv_head, self.head_dim = shape.n_head, shape.n_kv_head, shape.head_dim
        # One projection for Q, K and V: a single GEMM is faster than three on small models.
        # K and V get n_kv_head heads only, which is what makes GQA/MQA cheaper to cache.
        self.qkv = nn.Linear(shape.d_model, sum(qkv_rows(self.n_head, self.n_kv_head, self.head_dim)), bias=False)
        self.out = nn.Linear(self.n_head * self.head_dim, shape.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerCache | None = None, pos: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.heads(x, cos, sin)
        if cache is None:
            y = self.attend(q, k, v)  # (B, nh, T, hs)
        elif pos is not None:
            y = cache.decode(q, k, v, pos)  # (B, nh, 1, hs): the fixed-shape step
        else:  # the next chunk of positions
            y = cache.attend(q, k, v)
        return self.merge(y)

    def naive_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The training path with the kind's naive twin in place of `attend`."""
        return self.merge(self.naive_attend(*self.heads(x, cos, sin)))

    def heads(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (B, T, C) -> q (B, nh, T, hs), k and v (B, nkv, T, hs), RoPE applied if the kind uses it."""
        B, T, _ = x.shape
        nh, nkv = self.n_head, self.n_kv_head
        # The fused rows are [Q heads | K heads | V heads] (qkv_rows above), so one view splits them.
        heads = self.qkv(x).view(B, T, nh + 2 * nkv, self.head_dim).transpose(1, 2)  # (B, nh+2nkv, T, hs)
        qk, v = heads[:, : nh + nkv], heads[:, nh + nkv :]  # (B, nh+nkv, T, hs), (B, nkv, T, hs)
        if self.uses_rope:
            qk = apply_rope(qk, cos, sin)  # Q and K rotated in one pass
        return qk[:, :nh], qk[:, nh:], v  # (B, nh, T, hs), (B, nkv, T, hs), (B, nkv, T, hs)

    def merge(self, y: torch.Tensor) -> torch.Tensor:
        """Attention output y (B, nh, T, hs) -> (B, T, C) through the output projection."""
        B, _, T, _ = y.shape
        return self.out(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))  # (B, T, nh*hs) -> (B, T, C)

    def benchmark_op(self, seq_len: int, requires_grad: bool = False):
        """The attention op alone and random inputs for it at batch 1: `attend` on q (1, nh, N, hs)
        and k, v (1, nkv, N, hs)."""
        shapes = [(1, heads, seq_len, self.head_dim) for heads in (self.n_head, self.n_kv_head, self.n_kv_head)]
        return self.attend, [torch.randn(shape, requires_grad=requires_grad) for shape in shapes]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def naive_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def reset_own_parameters(self) -> None:
        """Initialise the kind's parameters besides the shared projections, if its parameters need
        more than the model's normal(0, init_std), which the Transformer applies first."""
