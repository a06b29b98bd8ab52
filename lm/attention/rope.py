"""Rotary position embedding (Su et al. 2021): the angles of positions, and the rotation of q and k.

Shapes: B batch, T sequence length, nh heads, hs head size.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al. 2021) in the rotate-half layout Llama uses.

    Angles are computed for the positions asked for rather than read from a fixed table,
    so kinds without a context limit (sliding, linear) can run past `max_seq_len`.
    """

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (hs/2,)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape (..., hs/2) for integer `positions` of shape (T,) or (B, T)."""
        angles = positions.to(torch.float32)[..., None] * self.inv_freq  # (..., T, hs/2)
        return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, nh, T, hs) by the angles cos/sin: (T, hs/2), or (B, T, hs/2) per row.

    Dimension i pairs with i + hs/2 (Llama's rotate-half layout). Working on the two
    halves directly avoids building full-width cos/sin and a rotated copy of x.
    """
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if cos.dim() == 3:  # per-row positions: broadcast over heads
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, hs/2)
    first, second = x.chunk(2, dim=-1)  # 2 x (B, nh, T, hs/2)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
