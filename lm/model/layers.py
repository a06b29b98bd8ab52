"""Building blocks shared by every attention kind: RMSNorm and the MLPs, SwiGLU and ReLU²
(rotary embeddings are lm.attention.rope).

Shapes: B batch, T sequence length, C d_model, nh heads, hs head size, F d_ff.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019): no mean subtraction, no bias."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class SwiGLU(nn.Module):
    """Gated MLP of Shazeer 2020: down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.d_ff = d_ff
        # gate and up share one matmul: one (C, 2F) GEMM runs faster than two (C, F) ones.
        self.gate_up = nn.Linear(d_model, 2 * d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.d_ff, dim=-1)  # 2 x (B, T, F)
        return self.down(F.silu(gate) * up)


class ReluSquared(nn.Module):
    """down(relu(up(x))²) (So et al. 2021, "Primer"): one matrix fewer than SwiGLU, so at equal
    parameters its hidden layer is 3/2 as wide; modded-nanogpt and nanochat train with it."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.up = nn.Linear(d_model, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)).square())


MLPS = {"swiglu": SwiGLU, "relu2": ReluSquared}  # model.mlp's choices, besides NO_MLP
NO_MLP = "none"  # model.mlp=none: blocks without an MLP
