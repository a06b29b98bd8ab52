"""Naive twins of the fast attention paths, written for clarity. Imported by tests only.

Shapes: B batch, T sequence length, nh query heads, nkv K/V heads, hs head size.
"""

from __future__ import annotations

import math

import torch


def masked_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                             sink_logit: torch.Tensor | None = None) -> torch.Tensor:
    """Full masked softmax: q (B, nh, T, hs), k and v (B, nkv, T, hs), visible (T, T) -> (B, nh, T, hs).
    A `sink_logit` (nh,) joins every row's softmax as one more logit with no value attached."""
    group = q.shape[1] // k.shape[1]
    # Copy each K/V head out to the query heads of its group, the plain way.
    k = k.repeat_interleave(group, dim=1)  # (B, nh, T, hs)
    v = v.repeat_interleave(group, dim=1)  # (B, nh, T, hs)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, nh, T, T)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sink_logit is None:
        return scores.softmax(dim=-1) @ v
    sink = sink_logit[None, :, None, None].expand(*scores.shape[:3], 1)  # (B, nh, T, 1)
    weights = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]  # the sink's share goes nowhere
    return weights @ v


def causal_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             sink_logit: torch.Tensor | None = None) -> torch.Tensor:
    T = q.shape[2]
    return masked_softmax_attention(q, k, v, torch.ones(T, T, dtype=torch.bool).tril(), sink_logit)


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                             dilation: int = 1, sink_tokens: int = 0,
                             sink_logit: torch.Tensor | None = None) -> torch.Tensor:
    """Full masked softmax where query i sees keys j = i - m*dilation, 0 <= m < window, and the
    first `sink_tokens` positions (j <= i)."""
    T = q.shape[2]
    back = torch.arange(T)[:, None] - torch.arange(T)[None, :]  # (T, T): i - j
    visible = (back >= 0) & (back % dilation == 0) & (back // dilation < window)
    visible |= (back >= 0) & (torch.arange(T)[None, :] < sink_tokens)
    return masked_softmax_attention(q, k, v, visible, sink_logit)


def _initial_state(k: torch.Tensor, v: torch.Tensor, state):
    if state is not None:
        return state
    B, nkv, _, F = k.shape
    return torch.zeros(B, nkv, F, v.shape[-1], dtype=k.dtype), torch.zeros(B, nkv, F, dtype=k.dtype)


def quadratic_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eps: float, state=None):
    """Causal linear attention as a masked T x T product, the way it is written on paper.

    q (B, nh, T, F), k (B, nkv, T, F), v (B, nkv, T, hs); state (S, z) carried in from earlier tokens.
    """
    S0, z0 = _initial_state(k, v, state)
    group = q.shape[1] // k.shape[1]
    kq, vq = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, nh, T, .)
    T = q.shape[2]
    weights = (q @ kq.transpose(-2, -1)).tril()  # (B, nh, T, T)
    num = weights @ vq + q @ S0.repeat_interleave(group, dim=1)  # (B, nh, T, hs)
    den = weights.sum(-1) + (q @ z0.repeat_interleave(group, dim=1)[..., None])[..., 0]  # (B, nh, T)
    out = num / (den[..., None] + eps)
    assert out.shape[2] == T
    return out, (S0 + k.transpose(-2, -1) @ v, z0 + k.sum(2))


def recurrent_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eps: float, state=None):
    """Causal linear attention one token at a time, as an RNN: S += phi(k) v^T, z += phi(k)."""
    S, z = _initial_state(k, v, state)
    group = q.shape[1] // k.shape[1]
    outputs = []
    for t in range(q.shape[2]):
        S = S + k[:, :, t, :, None] * v[:, :, t, None, :]  # (B, nkv, F, hs)
        z = z + k[:, :, t]  # (B, nkv, F)
        qt = q[:, :, t]  # (B, nh, F)
        num = (qt[..., None] * S.repeat_interleave(group, dim=1)).sum(-2)  # (B, nh, hs)
        den = (qt * z.repeat_interleave(group, dim=1)).sum(-1)  # (B, nh)
        outputs.append(num / (den[..., None] + eps))
    return torch.stack(outputs, dim=2), (S, z)


def efficient_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal efficient attention as written: softmax(q_i) over features; for each feature f, a
    softmax of k_jf over the positions j <= i weighting the values. Materialises (T, T, hs)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # (B, nh, T, hs)
    v = v.repeat_interleave(group, dim=1)  # (B, nh, T, hs)
    T = q.shape[2]
    future = torch.ones(T, T, dtype=torch.bool).triu(1)  # [i, j]: j after i
    logits = k[:, :, None, :, :].expand(-1, -1, T, -1, -1)  # (B, nh, T_i, T_j, hs)
    weights = logits.masked_fill(future[:, :, None], float("-inf")).softmax(dim=3)  # over j, per feature
    context = torch.einsum("bhijf,bhje->bhife", weights, v)  # (B, nh, T, hs_f, hs)
    return torch.einsum("bhif,bhife->bhie", q.softmax(-1), context)


def recurrent_efficient_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The same one position at a time, keeping a per-feature running maximum m of the keys:
    N = sum exp(k_j - m) v_j, D = sum exp(k_j - m)."""
    group = q.shape[1] // k.shape[1]
    B, nkv, T, hs = k.shape
    N = torch.zeros(B, nkv, hs, hs, dtype=k.dtype)
    D = torch.zeros(B, nkv, hs, dtype=k.dtype)
    m = torch.full((B, nkv, hs), float("-inf"), dtype=k.dtype)
    outputs = []
    for t in range(T):
        new_m = torch.maximum(m, k[:, :, t])
        N = N * torch.exp(m - new_m)[..., None] + torch.exp(k[:, :, t] - new_m)[..., None] * v[:, :, t, None, :]
        D = D * torch.exp(m - new_m) + torch.exp(k[:, :, t] - new_m)
        m = new_m
        context = (N / D[..., None]).repeat_interleave(group, dim=1)  # (B, nh, hs_f, hs)
        outputs.append(torch.einsum("bhf,bhfe->bhe", q[:, :, t].softmax(-1), context))
    return torch.stack(outputs, dim=2)


def additive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor,
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


def lowrank_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, E: torch.Tensor, F: torch.Tensor,
                      block: int) -> torch.Tensor:
    """Causal low-rank attention query by query: gather the raw keys of its own block up to
    itself and E K_c, F V_c (r slots each) of every completed earlier block c, then softmax."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # (B, nh, T, hs)
    v = v.repeat_interleave(group, dim=1)  # (B, nh, T, hs)
    outputs = []
    for i in range(q.shape[2]):
        own = i // block
        keys = [E @ k[:, :, c * block:(c + 1) * block] for c in range(own)] + [k[:, :, own * block:i + 1]]
        values = [F @ v[:, :, c * block:(c + 1) * block] for c in range(own)] + [v[:, :, own * block:i + 1]]
        keys, values = torch.cat(keys, dim=2), torch.cat(values, dim=2)  # (B, nh, seen, hs)
        scores = (q[:, :, i, None] @ keys.transpose(-1, -2))[:, :, 0] / math.sqrt(q.shape[-1])  # (B, nh, seen)
        outputs.append((scores.softmax(-1)[:, :, None] @ values)[:, :, 0])
    return torch.stack(outputs, dim=2)
