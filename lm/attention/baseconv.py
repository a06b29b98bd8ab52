"""The gated short convolution of Based's block (`attn=baseconv`; BaseConv, Arora et al. 2024, arXiv
2402.18668, zoology/mixers/base_conv.py): a layer that attends to nothing, only mixes each position
with the few before it and gates the mix by a projection of the position itself,

    y = conv_W(h) * (h W_proj) + h,

conv_W a depthwise causal convolution of W taps (lm.attention.convolution). Based's recall models
interleave it with their mixer (zoology's Hybrid: layer 0 this, layer 1 the mixer, and no MLP), so
that the mixer reads every token beside its left neighbours: a key and its value side by side is
what a recall query looks up. As a kind of its own it goes in a hybrid pattern,
`attn=hybrid attn.pattern=[baseconv, softmax]` (lm/attention/layout.py).

Departures from zoology's layer: no biases (lm's layers have none), and the short convolution
only: zoology's Figure 2 config asks for kernel 3, which its BaseConv runs as a short convolution
(an implicit long convolution is its choice only for kernel -1, and would keep the whole context as
its decoding state). Its state is the convolution's last W-1 inputs per row, whatever the length.

Shapes: B batch, T positions, C d_model, W taps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from lm.attention.base import AttentionLayer, AttentionSpec, Example, LayerShape, register
from lm.attention.cache import CacheContext, CacheSpec
from lm.attention.convolution import causal_conv, naive_causal_conv, window_after
from lm.attention.shared_caches import RecurrentCache
from lm.util.checks import require_int


@register("baseconv")
@dataclass(frozen=True)
class BaseConvSpec(AttentionSpec):
    taps: int = 3  # W: the current position and the W-1 before it (zoology's kernel_size)

    examples = {"": Example(), "taps5": Example({"taps": 5})}
    compared_alone = False  # it recalls nothing alone: it goes beside a mixer

    def check(self) -> None:
        require_int("taps", self.taps, minimum=2)

    def build(self, shape: LayerShape) -> BaseConv:
        return BaseConv(self, shape)

    def flops(self, T: int, n_head: int, n_kv_head: int, head_dim: int) -> float:
        """The convolution's multiply-adds and the gate's product, per position and channel; the
        projection is a matmul like the other kinds' projections, which the op leaves out."""
        C = n_head * head_dim
        return T * C * (2 * self.taps + 1)


class BaseConv(AttentionLayer):
    context_limited = False  # it reads the last W-1 positions, whatever the length
    uses_rope = False  # position enters through the convolution's taps
    adamw_parameters = ("conv",)  # (C, W): convolution taps, not a matrix for Muon (lm.training.optim)

    def __init__(self, spec: BaseConvSpec, shape: LayerShape):
        super().__init__()
        self.taps, self.d_model, self.n_head = spec.taps, shape.d_model, shape.n_head
        self.projection = nn.Linear(shape.d_model, shape.d_model, bias=False)
        # One weight per channel and tap, tap W-1 the current position.
        self.conv = nn.Parameter(torch.empty(shape.d_model, spec.taps))  # (C, W)
        self.reset_own_parameters()

    def reset_own_parameters(self) -> None:
        """The taps as zoology's convolution (torch's Conv1d) starts them, U(-1/sqrt(W), 1/sqrt(W));
        the projection keeps the model's normal(0, init_std), so the gated mix starts small beside
        the skip and the layer near the identity."""
        bound = 1 / math.sqrt(self.taps)
        with torch.no_grad():
            self.conv.uniform_(-bound, bound)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: RecurrentCache | None = None, pos: torch.Tensor | None = None) -> torch.Tensor:
        if cache is None:
            mixed = causal_conv(x, self.conv, None)
        elif pos is not None:
            mixed = cache.decode(x, pos)
        else:
            mixed = cache.attend(x)
        return mixed * self.projection(x) + x  # (B, T, C)

    def naive_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return naive_causal_conv(x, self.conv) * self.projection(x) + x

    def benchmark_op(self, seq_len: int, requires_grad: bool = False):
        """The convolution and the gate on random rows (the projection is left out, as the other
        kinds' are)."""
        inputs = [torch.randn(1, seq_len, self.d_model), torch.randn(1, seq_len, self.d_model)]
        for t in inputs:
            t.requires_grad_(requires_grad)

        def op(rows, gate):
            out = causal_conv(rows, self.conv, None) * gate + rows  # (1, T, C)
            return out.view(1, seq_len, self.n_head, -1).transpose(1, 2)  # (1, T, nh*hs) -> (1, nh, T, hs), as heads'

        return op, inputs

    def generation_state(self) -> CacheSpec:
        """The convolution's last W-1 inputs, C numbers each."""
        return CacheSpec("recurrent", 1, self.d_model, state_numel=(self.taps - 1) * self.d_model)

    def build_cache(self, context: CacheContext, max_len: int) -> RecurrentCache:
        """The last W-1 inputs (B, W-1, C); it takes the layer's input rows (B, T, C)."""
        window = torch.zeros(context.batch_size, self.taps - 1, self.d_model, dtype=context.dtype,
                             device=context.device)
        return RecurrentCache(context, {"conv_window": window}, self._chunk_from, self._step_from, time_dim=1)

    def _chunk_from(self, rows: torch.Tensor, state, real):
        window, = state
        if real is not None:  # left padding enters the convolution as zeros, as a sequence's start does
            rows = rows * real[..., None].to(rows.dtype)
        return causal_conv(rows, self.conv, window), (window_after(window, rows),)

    def _step_from(self, rows: torch.Tensor, state):
        window, = state
        return causal_conv(rows, self.conv, window), (window_after(window, rows),)
