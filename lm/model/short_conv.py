"""The short causal convolution before each attention layer (`model.short_conv=W`).

Each position's normalised input h gets a learned depthwise mix of itself and the W-1 positions
before it, added to it: h + conv_W(h), so the attention layer reads every token beside its left
neighbours. Recall needs exactly that: to answer a query, a layer looks for the position whose
*previous* token is the queried key, and attention alone must first learn a previous-token head
to see it (the long plateau before induction heads form, Olsson et al. 2022). H3, Based (Arora et
al. 2024) and the gated delta rule put a short convolution beside their mixers for this reason;
here it sits in the block, the same for every attention kind, so a comparison stays fair.
0 (the default) leaves it out.

Decoding keeps the last W-1 inputs per row (ShortConvCache, a layer cache like any other); a
left-padded row's padding enters the convolution as zeros, as a sequence's start does in training.

Shapes: B batch, T new positions, C d_model, W kernel taps.
"""

from __future__ import annotations

import torch
from torch import nn

from lm.attention.cache import CacheContext, keep_in_place
from lm.attention.convolution import causal_conv, naive_causal_conv, window_after


class ShortConv(nn.Module):
    def __init__(self, d_model: int, taps: int):
        super().__init__()
        # One weight per channel and tap, tap W-1 the current position; the model's normal init
        # keeps the block near the identity at the start.
        self.weight = nn.Parameter(torch.empty(d_model, taps))  # (C, W)

    def forward(self, h: torch.Tensor, cache: ShortConvCache | None = None,
                pos: torch.Tensor | None = None) -> torch.Tensor:
        """h (B, T, C) -> h + conv(h); through `cache` when decoding (pos: one step per row)."""
        if cache is None:
            return h + causal_conv(h, self.weight, None)
        return h + (cache.decode(h) if pos is not None else cache.attend(h))

    def naive_forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + naive_causal_conv(h, self.weight)

    def build_cache(self, context: CacheContext) -> ShortConvCache:
        return ShortConvCache(context, self.weight)


class ShortConvCache:
    """The last W-1 inputs of one layer's convolution, (B, W-1, C), updated in place: a compiled
    decoding step keeps reading the same buffer. Its inputs are the block's normalised rows h."""

    def __init__(self, context: CacheContext, weight: torch.Tensor):
        C, W = weight.shape
        self.context, self.weight = context, weight
        self.window = torch.zeros(context.batch_size, W - 1, C, dtype=context.dtype, device=context.device)

    def attend(self, h: torch.Tensor) -> torch.Tensor:
        """The next T positions h (B, T, C) -> conv(h) (B, T, C)."""
        if self.context.has_padding:  # a prefill over left padding: the padding enters as zeros
            h = h * self.context.real(self.context.seen, h.shape[1])[..., None].to(h.dtype)
        return self.decode(h)

    def decode(self, h: torch.Tensor) -> torch.Tensor:
        """One position per row (or a prefill without padding): no slot enters a convolution."""
        out = causal_conv(h, self.weight, self.window)
        keep_in_place((self.window,), (window_after(self.window, h),))
        return out

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"window": self.window}
