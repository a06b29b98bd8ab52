"""Causal sliding-window attention with dilation (Longformer-style).

Shapes: B batch, T sequence length, nh query heads, nkv K/V heads, hs head size, W window.
Query i attends keys j = i - k*d for 0 <= k < W (d the dilation), so each layer sees a
fixed span of W*d positions and the cost grows linearly with T.

The fast path never forms a T x T score matrix. Without dilation it cuts the sequence into
blocks of W queries; block b attends the keys of blocks b-1 and b (2W keys) under one fixed
(W, 2W) band mask, which SDPA's CPU/GPU kernels take directly. With dilation d, positions
sharing a residue mod d form an undilated sequence of their own (i - k*d stays in the same
residue class), so the d subsequences are folded into the batch and solved as above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lm.attention.base import AttentionSpec, LayerShape, register
from lm.attention.projections import GroupedQKV
from lm.cache import CacheSpec, GenerationCache, tensor_bytes, visibility_mask
from lm.checks import require_int


def band_mask(window: int, device: torch.device) -> torch.Tensor:
    """(W, 2W) bool: query a of a block may see key c of [previous block, own block]."""
    a = torch.arange(window, device=device)[:, None]
    offset = torch.arange(2 * window, device=device)[None, :] - window  # key position - block start
    return (offset <= a) & (offset > a - window)


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                             dilation: int = 1) -> torch.Tensor:
    """q (B, nh, T, hs), k and v (B, nkv, T, hs) -> (B, nh, T, hs)."""
    if dilation > 1:
        return _dilated(q, k, v, window, dilation)
    B, nh, T, hs = q.shape
    gqa = k.shape[1] != nh
    if window >= T:  # the window covers every earlier position: plain causal attention
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    W = window
    n_blocks = -(-T // W)
    if n_blocks * W != T:  # padded positions come after every real one, so causality hides them
        q, k, v = (F.pad(t, (0, 0, 0, n_blocks * W - T)) for t in (q, k, v))
    # Block 0 has no previous block; inside it the window reaches back to position 0.
    first = F.scaled_dot_product_attention(q[:, :, :W], k[:, :, :W], v[:, :, :W], is_causal=True, enable_gqa=gqa)
    if n_blocks == 1:
        return first[:, :, :T]
    rest = n_blocks - 1
    q_blocks = q[:, :, W:].unflatten(2, (rest, W)).transpose(1, 2).flatten(0, 1)  # (B*rest, nh, W, hs)
    k_pairs, v_pairs = _block_pairs(k, W), _block_pairs(v, W)  # (B*rest, nkv, 2W, hs) each
    out = F.scaled_dot_product_attention(q_blocks, k_pairs, v_pairs, attn_mask=band_mask(W, q.device), enable_gqa=gqa)
    out = out.unflatten(0, (B, rest)).transpose(1, 2).flatten(2, 3)  # (B, nh, T - W, hs)
    return torch.cat((first, out), dim=2)[:, :, :T]


def _block_pairs(x: torch.Tensor, W: int) -> torch.Tensor:
    """(B, h, n*W, hs) -> (B*(n-1), h, 2W, hs): blocks r and r+1 side by side for every r.

    `unfold` makes the overlapping pairs a strided view of x, so (for B = 1) nothing is copied."""
    pairs = x.unfold(2, 2 * W, W)  # (B, h, n-1, hs, 2W)
    return pairs.transpose(-1, -2).transpose(1, 2).flatten(0, 1)  # (B*(n-1), h, 2W, hs)


def _dilated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, d: int) -> torch.Tensor:
    B, nh, T, hs = q.shape
    pad = -T % d
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    m = (T + pad) // d

    def fold(x: torch.Tensor) -> torch.Tensor:  # (B, h, m*d, hs) -> (B*d, h, m, hs), residue r at [b*d + r]
        h = x.shape[1]
        return x.view(B, h, m, d, hs).permute(0, 3, 1, 2, 4).reshape(B * d, h, m, hs)

    out = sliding_window_attention(fold(q), fold(k), fold(v), window, 1)  # (B*d, nh, m, hs)
    out = out.view(B, d, nh, m, hs).permute(0, 2, 3, 1, 4).reshape(B, nh, m * d, hs)  # (B, nh, T + pad, hs)
    return out[:, :, :T]


@register("sliding")
@dataclass(frozen=True)
class SlidingSpec(AttentionSpec):
    """Each query sees the last `window` positions, `dilation` apart (so a span of window*dilation)."""

    window: int = 128
    dilation: int = 1

    def check(self) -> None:
        require_int("window", self.window)
        require_int("dilation", self.dilation)

    def build(self, shape: LayerShape) -> SlidingWindowAttention:
        return SlidingWindowAttention(self, shape)


class SlidingWindowAttention(GroupedQKV):
    context_limited = False

    def __init__(self, spec: SlidingSpec, shape: LayerShape):
        super().__init__(shape)
        self.window, self.dilation = spec.window, spec.dilation

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return sliding_window_attention(q, k, v, self.window, self.dilation)

    def generation_state(self) -> CacheSpec:
        # Query i reaches back to i - (W-1)*d, so the last (W-1)*d + 1 <= W*d positions suffice.
        return CacheSpec("ring", self.n_kv_head, self.head_dim, positions=self.window * self.dilation)

    def build_cache(self, context: GenerationCache, max_len: int) -> RingKVCache:
        return RingKVCache(context, self.n_kv_head, self.head_dim, self.window, self.dilation)


class RingKVCache:
    """K and V of the last window*dilation slots, (B, nkv, W*d, hs) each, written round-robin.

    Its size never grows with the generated length. New queries attend the ring's contents
    plus their own keys under the window rule on absolute slot numbers, so a chunk longer than
    the ring is still exact; the newest W*d keys are then kept.
    """

    def __init__(self, context: GenerationCache, n_kv_head: int, head_dim: int, window: int, dilation: int):
        self.context, self.window, self.dilation = context, window, dilation
        size = window * dilation
        shape = (context.batch_size, n_kv_head, size, head_dim)
        self.k = torch.zeros(shape, dtype=context.dtype, device=context.device)
        self.v = torch.zeros(shape, dtype=context.dtype, device=context.device)
        self.slot_of = torch.full((size,), -1, dtype=torch.long, device=context.device)  # -1: empty

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        start, T = self.context.seen, q.shape[2]
        if T == 1:
            return self._attend_one(q, k, v, start)
        q_slots = torch.arange(start, start + T, device=q.device)
        keys = torch.cat((self.k, k), dim=2)  # (B, nkv, W*d + T, hs)
        values = torch.cat((self.v, v), dim=2)  # (B, nkv, W*d + T, hs)
        k_slots = torch.cat((self.slot_of, q_slots))
        back = q_slots[:, None] - k_slots[None, :]  # (T, W*d + T): how far back each key lies
        in_window = (back >= 0) & (back % self.dilation == 0) & (back < self.window * self.dilation)
        visible = in_window & (k_slots[None, :] >= 0)
        mask = visibility_mask(self.context, q_slots, k_slots, visible)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=keys.shape[1] != q.shape[1])
        keep = min(T, self.k.shape[2])
        index = q_slots[-keep:] % self.k.shape[2]
        self.k[:, :, index] = k[:, :, -keep:]
        self.v[:, :, index] = v[:, :, -keep:]
        self.slot_of[index] = q_slots[-keep:]
        return out

    def _attend_one(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int) -> torch.Tensor:
        """Decoding step: the new key replaces the one W*d slots back, which no query needs any
        more, so the ring is written first and attended as it is, without a copy."""
        index = slot % self.k.shape[2]
        self.k[:, :, index] = k[:, :, 0]
        self.v[:, :, index] = v[:, :, 0]
        self.slot_of[index] = slot
        back = slot - self.slot_of  # (W*d,)
        visible = (self.slot_of >= 0) & (back % self.dilation == 0)
        q_slot = torch.tensor([slot], device=q.device)
        mask = visibility_mask(self.context, q_slot, self.slot_of, visible[None, :])
        gqa = self.k.shape[1] != q.shape[1]
        return F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask, enable_gqa=gqa)

    def nbytes(self) -> int:
        return tensor_bytes(self.k, self.v)
