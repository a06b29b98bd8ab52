"""Attention sinks, shared by the softmax and sliding kinds.

- **Learned sink** (as in gpt-oss): a per-head logit s_h in the softmax denominator with no value
  attached, out_i = sum_j e^{score_ij} v_j / (e^{s_h} + sum_j e^{score_ij}), so a head can
  attend to nothing. It rides SDPA as one extra key: queries get SINK_DIMS more dimensions,
  the first holding s_h sqrt(hs); real keys get zeros there; the sink key is 1 there and 0
  elsewhere, with a zero value. With SDPA's scale fixed at 1/sqrt(hs), the sink key scores exactly
  s_h and every real score is unchanged. Values are widened with zeros too and the output cut back,
  because SDPA's flash kernel (no T x T scores in memory) wants one head size for q, k and v.
- **Sink tokens** (Longformer's global attention in causal form, StreamingLLM's attention sinks,
  Xiao et al. 2023): the first positions stay visible to every query; sliding.py implements them.

Shapes: B batch, T positions, nh query heads, nkv K/V heads, hs head size, e = hs + SINK_DIMS.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lm.attention.scores import grouped_sdpa, softmax_attention

SINK_DIMS = 8  # a multiple of 8 keeps the widened heads aligned for SDPA's kernels


def learned_sink_logit(n_head: int, wanted: bool) -> nn.Parameter | None:
    """One logit per query head in the softmax denominator with no value (gpt-oss), starting at 0;
    None when the kind's `learned_sink` option is off. The layer keeps it as `sink_logit`."""
    return nn.Parameter(torch.zeros(n_head)) if wanted else None


def widen_for_sink(q: torch.Tensor, k: torch.Tensor,
                   sink_logit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """q (B, nh, T, hs), k (B, nkv, S, hs), sink_logit (nh,) -> q (B, nh, T, e), k (B, nkv, S, e),
    the sink key (B, nkv, 1, e) and the scale to give SDPA."""
    B, nh, T, hs = q.shape
    logit = sink_logit.to(q.dtype) * math.sqrt(hs)  # (nh,)
    extra = F.pad(logit[None, :, None, None].expand(B, nh, T, 1), (0, SINK_DIMS - 1))  # (B, nh, T, SINK_DIMS)
    sink_key = k.new_zeros(k.shape[0], k.shape[1], 1, hs + SINK_DIMS)
    sink_key[..., hs] = 1
    return torch.cat((q, extra), dim=-1), F.pad(k, (0, SINK_DIMS)), sink_key, 1 / math.sqrt(hs)


def causal_with_learned_sink(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             sink_logit: torch.Tensor) -> torch.Tensor:
    """Causal attention of q (B, nh, T, hs) over k, v (B, nkv, T, hs) with a learned sink.

    The sink key goes first and a dummy query with it, so SDPA's plain causal rule (query t+1
    sees keys 0..t+1) gives every real query the sink plus keys 0..t, without a T x T mask."""
    hs = q.shape[-1]
    q, k, sink_key, scale = widen_for_sink(q, k, sink_logit)
    q = F.pad(q, (0, 0, 1, 0))  # (B, nh, T + 1, e): a dummy query at the front
    k = torch.cat((sink_key, k), dim=2)  # (B, nkv, T + 1, e)
    v = F.pad(v, (0, SINK_DIMS, 1, 0))  # (B, nkv, T + 1, e): the sink's value is zero
    out = grouped_sdpa(q, k, v, causal=True, scale=scale)
    return out[:, :, 1:, :hs]


def masked_with_learned_sink(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                             sink_logit: torch.Tensor) -> torch.Tensor:
    """Attention of q (B, nh, T, hs) over k, v (B, nkv, S, hs) under a boolean mask (..., T, S),
    plus a learned sink every query sees."""
    hs = q.shape[-1]
    q, k, sink_key, scale = widen_for_sink(q, k, sink_logit)
    k = torch.cat((sink_key, k), dim=2)  # (B, nkv, S + 1, e)
    v = F.pad(v, (0, SINK_DIMS, 1, 0))  # (B, nkv, S + 1, e): the sink's value is zero
    mask = torch.cat((mask.new_ones(*mask.shape[:-1], 1), mask), dim=-1)  # (..., T, S + 1): the sink is seen
    out = grouped_sdpa(q, k, v, mask, scale=scale)
    return out[..., :hs]


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     sink_logit: torch.Tensor | None, softcap: float | None = None) -> torch.Tensor:
    """Attention of q (B, nh, T, hs) over k, v (B, nkv, S, hs) under a boolean mask (..., T, S),
    with the learned sink or the softcap when the layer has one (never both: lm.attention.scores):
    what every cache's masked path calls."""
    if sink_logit is not None:
        return masked_with_learned_sink(q, k, v, mask, sink_logit)
    return softmax_attention(q, k, v, mask=mask, softcap=softcap)
