"""The projections every attention kind shares: Q with n_head heads, K and V with n_kv_head, and
the two options that act on them whatever the kind computes between.

Shapes: B batch, T sequence length, C d_model, nh query heads, nkv K/V heads, hs head size.
A kind's layer subclasses GroupedQKV and implements `attend(q, k, v)` on q (B, nh, T, hs) and
k, v (B, nkv, T, hs) for a whole sequence, plus `naive_attend`, `build_cache` and `generation_state`
(lm.attention.base). A kind whose spec subclasses `ProjectionOptions` takes them:

- `gate`: the attention output is multiplied by sigmoid(x W_gate) before the output projection,
  one gate per head (`headwise`) or per channel (`elementwise`): Qiu et al. 2025, "Gated Attention
  for Large Language Models", their best position (G1). x is the layer's input.
- `qk_norm`: RMSNorm over the head dimension of q and of k, each with its own learned scale,
  before RoPE (OLMo 2, Qwen3, Gemma 3); the norm's epsilon is the model's `norm_eps`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lm.attention.base import AttentionLayer, AttentionSpec, LayerCache, LayerShape
from lm.attention.rope import apply_rope
from lm.util.checks import require_bool, require_choice

GATES = ("none", "headwise", "elementwise")


def qkv_rows(n_head: int, n_kv_head: int, head_dim: int) -> tuple[int, int, int]:
    """Rows of Q, K and V in the fused projection, in that order."""
    return n_head * head_dim, n_kv_head * head_dim, n_kv_head * head_dim


@dataclass(frozen=True)
class ProjectionOptions(AttentionSpec):
    """The options GroupedQKV applies around any kind's attention; a spec subclassing this takes
    them and passes `projection_options()` to its layer. A subclass's `check` calls this one."""

    gate: str = "none"  # none | headwise | elementwise: sigmoid(x W_gate) times the output (Qiu et al. 2025)
    qk_norm: bool = False  # RMSNorm with a learned scale on q and k over the head dimension, before RoPE

    def check(self) -> None:
        require_choice("gate", self.gate, GATES)
        require_bool("qk_norm", self.qk_norm)

    def projection_options(self) -> dict:
        return {"gate": self.gate, "qk_norm": self.qk_norm}


class GroupedQKV(AttentionLayer):
    def __init__(self, shape: LayerShape, gate: str = "none", qk_norm: bool = False):
        super().__init__()
        self.layer_idx = shape.layer_idx
        self.n_head, self.n_kv_head, self.head_dim = shape.n_head, shape.n_kv_head, shape.head_dim
        # One projection for Q, K and V: a single GEMM is faster than three on small models.
        # K and V get n_kv_head heads only, which is what makes GQA/MQA cheaper to cache.
        self.qkv = nn.Linear(shape.d_model, sum(qkv_rows(self.n_head, self.n_kv_head, self.head_dim)), bias=False)
        self.out = nn.Linear(self.n_head * self.head_dim, shape.d_model, bias=False)
        gate_rows = {"none": 0, "headwise": self.n_head, "elementwise": self.n_head * self.head_dim}[gate]
        self.gate = nn.Linear(shape.d_model, gate_rows, bias=False) if gate_rows else None
        # Norm gains start at one (the Transformer initialises only matrices).
        self.q_norm = nn.Parameter(torch.ones(self.head_dim)) if qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(self.head_dim)) if qk_norm else None
        self.norm_eps = shape.norm_eps

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerCache | None = None, pos: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.heads(x, cos, sin)
        if cache is None:
            y = self.attend(q, k, v)  # (B, nh, T, hs)
        elif pos is not None:
            y = cache.decode(q, k, v, pos)  # (B, nh, 1, hs): the fixed-shape step
        else:  # the next chunk of positions
            y = cache.attend(q, k, v)
        return self.merge(y, x)

    def naive_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The training path with the kind's naive twin in place of `attend`."""
        return self.merge(self.naive_attend(*self.heads(x, cos, sin)), x)

    def heads(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (B, T, C) -> q (B, nh, T, hs), k and v (B, nkv, T, hs), RoPE applied if the kind uses it."""
        B, T, _ = x.shape
        nh, nkv = self.n_head, self.n_kv_head
        # The fused rows are [Q heads | K heads | V heads] (qkv_rows above), so one view splits them.
        heads = self.qkv(x).view(B, T, nh + 2 * nkv, self.head_dim).transpose(1, 2)  # (B, nh+2nkv, T, hs)
        qk, v = heads[:, : nh + nkv], heads[:, nh + nkv :]  # (B, nh+nkv, T, hs), (B, nkv, T, hs)
        if self.q_norm is not None:
            gains = torch.cat((self.q_norm.expand(nh, -1), self.k_norm.expand(nkv, -1)))[:, None]  # (nh+nkv, 1, hs)
            qk = F.rms_norm(qk, (self.head_dim,), eps=self.norm_eps) * gains  # Q and K normalised in one pass
        if self.uses_rope:
            qk = apply_rope(qk, cos, sin)  # Q and K rotated in one pass
        return qk[:, :nh], qk[:, nh:], v  # (B, nh, T, hs), (B, nkv, T, hs), (B, nkv, T, hs)

    def merge(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Attention output y (B, nh, T, hs) of the layer input x (B, T, C) -> (B, T, C): gated if
        the layer has a gate, then through the output projection."""
        B, _, T, _ = y.shape
        y = y.transpose(1, 2)  # (B, T, nh, hs)
        if self.gate is not None:
            y = y * torch.sigmoid(self.gate(x)).view(B, T, self.n_head, -1)  # gates (B, T, nh, 1 or hs)
        return self.out(y.reshape(B, T, self.n_head * self.head_dim))  # (B, T, nh*hs) -> (B, T, C)

    def fused_rows(self) -> dict[str, tuple[int, ...]]:
        """Own weights that stack several matrices, and the rows of each: the optimizer treats Q, K and
        V as three matrices (lm.training.optim)."""
        return {"qkv.weight": qkv_rows(self.n_head, self.n_kv_head, self.head_dim)}

    def benchmark_op(self, seq_len: int, requires_grad: bool = False):
        """The attention op alone and random inputs for it at batch 1: `attend` on q (1, nh, N, hs)
        and k, v (1, nkv, N, hs)."""
        shapes = [(1, heads, seq_len, self.head_dim) for heads in (self.n_head, self.n_kv_head, self.n_kv_head)]
        return self.attend, [torch.randn(shape, requires_grad=requires_grad) for shape in shapes]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def naive_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError
