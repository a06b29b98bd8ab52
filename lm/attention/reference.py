"""Naive twins of the fast attention paths, written for clarity. Imported by tests only.

Shapes: B batch, T sequence length, nh query heads, nkv K/V heads, hs head size.
"""

from __future__ import annotations

import math

import torch


def causal_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full masked softmax: q (B, nh, T, hs), k and v (B, nkv, T, hs) -> (B, nh, T, hs)."""
    group = q.shape[1] // k.shape[1]
    # Copy each K/V head out to the query heads of its group, the plain way.
    k = k.repeat_interleave(group, dim=1)  # (B, nh, T, hs)
    v = v.repeat_interleave(group, dim=1)  # (B, nh, T, hs)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, nh, T, T)
    T = q.shape[2]
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    return scores.softmax(dim=-1) @ v
