"""The short causal convolution, written once: gated delta's on its fused q, k, v rows and the
model's before every attention layer (`model.short_conv`, lm.model.short_conv).

A depthwise conv1d whose last tap is the current position: each channel of each position mixes
itself with the W-1 before it. Decoding carries those W-1 rows from call to call (`window`), so a
sequence fed in pieces gives what one call over the whole would.

Shapes: B batch, T new positions, ch channels, W kernel taps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv(rows: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None) -> torch.Tensor:
    """rows (B, T, ch) convolved with weight (ch, W), after `window` (B, W-1, ch), the rows before
    them (None: zeros, a sequence's start); (B, T, ch)."""
    W = weight.shape[1]
    before = rows.new_zeros(rows.shape[0], W - 1, rows.shape[2]) if window is None else window.to(rows.dtype)
    full = torch.cat((before, rows), dim=1).transpose(1, 2)  # (B, ch, W-1+T)
    return F.conv1d(full, weight.to(rows.dtype)[:, None], groups=weight.shape[0]).transpose(1, 2)  # (B, T, ch)


def naive_causal_conv(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same from a sequence's start, written as a sum over taps: the twin tests compare with."""
    W, T = weight.shape[1], rows.shape[1]
    padded = F.pad(rows, (0, 0, W - 1, 0))  # (B, W-1+T, ch)
    return sum(padded[:, tap:tap + T] * weight[:, tap] for tap in range(W))


def window_after(window: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The last W-1 rows once `rows` (B, T, ch) follow `window` (B, W-1, ch)."""
    keep = window.shape[1]
    return torch.cat((window, rows.to(window.dtype)), dim=1)[:, -keep:] if keep else window
