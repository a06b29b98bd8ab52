"""The naive softmax every softmax-based kind's twin builds on, written for clarity: a full T x T
score matrix under a visibility mask. Each kind's own twin lives in its file (`naive_attend`).

Shapes: B batch, T sequence length, nh query heads, nkv K/V heads, hs head size.
"""

from __future__ import annotations

import math

import torch


def masked_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                             sink_logit: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """Full masked softmax: q (B, nh, T, hs), k and v (B, nkv, T, hs), visible (T, T) -> (B, nh, T, hs).
    A `sink_logit` (nh,) joins every row's softmax as one more logit with no value attached; a
    `softcap` c turns each score s into c tanh(s / c) first (Gemma 2)."""
    group = q.shape[1] // k.shape[1]
    # Copy each K/V head out to the query heads of its group, the plain way.
    k = k.repeat_interleave(group, dim=1)  # (B, nh, T, hs)
    v = v.repeat_interleave(group, dim=1)  # (B, nh, T, hs)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, nh, T, T)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sink_logit is None:
        return scores.softmax(dim=-1) @ v
    sink = sink_logit[None, :, None, None].expand(*scores.shape[:3], 1)  # (B, nh, T, 1)
    weights = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]  # the sink's share goes nowhere
    return weights @ v


def causal_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             sink_logit: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    T = q.shape[2]
    return masked_softmax_attention(q, k, v, torch.ones(T, T, dtype=torch.bool).tril(), sink_logit, softcap)
