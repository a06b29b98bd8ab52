"""Kimi Delta Attention (KDA; Kimi Linear, Moonshot AI, arXiv 2510.26692, 2025) with grouped K/V heads.

Shapes: B batch, T sequence length, nh query heads, nkv K/V heads, g = nh / nkv, hs head size (of
keys and values alike), N chunks of C positions, r the rank of the decay's and the gate's projections.

Gated DeltaNet (lm.attention.gated_delta) with a decay per key channel instead of per head. Each K/V
head keeps a state S (hs_k x hs_v, key dimension first, as flash-linear-attention lays it out) whose
key rows decay each at its own rate a_t[d] = exp(g_t[d]) (g_t <= 0) before the delta rule's write:

    S_t = (I - b_t k_t k_t^T) Diag(a_t) S_{t-1} + b_t k_t v_t^T        o_t = S_t^T (scale * q_t)

the paper's recurrence and fla's `naive_recurrent_kda`: decay the state, read what the decayed state
predicts for k_t, write back b_t of the error. The query heads of a group read their K/V head's state.

The training path is gated delta's UT transform with the in-chunk decay a vector per key channel.
With gamma_i (hs,) the in-chunk cumulative log decay up to position i and S the state before the chunk:

    L[i, j] = b_i sum_d k_i[d] k_j[d] e^(gamma_i[d] - gamma_j[d])             j < i
    U       = (I + L)^-1 (diag(b) V - diag(b) (K * e^gamma) S)                 the chunk's writes
    o_i     = (q_i * e^gamma_i) S + sum_{j <= i} [sum_d q_i[d] k_j[d] e^(gamma_i[d] - gamma_j[d])] u_j
    S'      = e^gamma_C * S + (K * e^(gamma_C - gamma))^T U                    (rows of S scaled per channel)

A pair's decay does not factor into a term of i times a term of j without e^(-gamma_j), which
overflows under a strong decay, so each chunk forms e^(gamma_i - gamma_j) <= 1 for its C x C pairs
and hs channels, masked above the diagonal before the exponential; one chunk at a time, inside the
loop that carries S, so the forward pass holds one chunk's (C, hs, C) pairs, never the sequence's.
Everything accumulates in float32 (float64 stays float64).

The layer around the op (fla's KimiDeltaAttention layer): gated delta's fused Q, K, V rows through
the short causal convolution and SiLU, q and k L2-normalised; b = sigmoid(x W_b) per K/V head;
g = -exp(A) softplus(x W_down W_up + dt_bias) per K/V head and key channel, through a projection of
rank r = hs; the output RMS-normalised per head and gated by sigmoid(x W_gate_down W_gate_up + bias),
of rank hs too. No RoPE: position enters through the decay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lm.attention.base import AttentionSpec, Example, LayerShape, register
from lm.attention.gated_delta import DeltaRuleLayer, check_delta_rule_options, fla_backend, mamba2_decay_init
from lm.attention.shared_caches import accumulation_dtype, without_autocast


@without_autocast
def kda_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
             scale: float | None = None, state: torch.Tensor | None = None,
             chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The KDA rule, chunkwise: q (B, nh, T, hs), k (B, nkv, T, hs), v (B, nkv, T, hv), beta
    (B, nkv, T), g (B, nkv, T, hs) the log decay of each key channel -> out (B, nh, T, hv) in q's
    dtype, final state (B, nkv, hs, hv) in float32 or wider. `scale` multiplies q (None: hs ** -0.5,
    as fla); `state` is carried in.

    q and k are used as given (the layer L2-normalises them). A position with beta = 0 and g = 0
    leaves the state unchanged, which is how padding is kept out."""
    B, nh, T, hs = q.shape
    nkv, hv, C = k.shape[1], v.shape[-1], chunk_size
    group, N = nh // nkv, -(-T // chunk_size)
    pad = N * C - T
    in_dtype, dtype = q.dtype, accumulation_dtype(q.dtype)
    scale = hs ** -0.5 if scale is None else scale
    S = q.new_zeros(B, nkv, hs, hv, dtype=dtype) if state is None else state.to(dtype)

    # Padded tail positions: zero q, k, v, beta and g = 0 write nothing and keep the state.
    q = F.pad(q.to(dtype) * scale, (0, 0, 0, pad)).view(B, nkv, group, N, C, hs)  # (B, nkv, g, N, C, hs)
    q = q.permute(0, 1, 3, 4, 2, 5)  # (B, nkv, N, C, g, hs): a position's query heads side by side
    k = F.pad(k.to(dtype), (0, 0, 0, pad)).view(B, nkv, N, C, hs)  # (B, nkv, N, C, hs)
    v = F.pad(v.to(dtype), (0, 0, 0, pad)).view(B, nkv, N, C, hv)  # (B, nkv, N, C, hv)
    beta = F.pad(beta.to(dtype), (0, pad)).view(B, nkv, N, C, 1)  # (B, nkv, N, C, 1)
    gamma = F.pad(g.to(dtype), (0, 0, 0, pad)).view(B, nkv, N, C, hs).cumsum(-2)  # in-chunk log decay per channel

    # What needs no state, for every chunk at once: the right-hand side [diag(b) V | diag(b) K e^gamma]
    # of the UT transform, the queries decayed from the chunk's start, the keys decayed to its end.
    rhs = torch.cat((beta * v, beta * gamma.exp() * k), dim=-1)  # (B, nkv, N, C, hv+hs)
    q_decayed = (q * gamma.exp()[..., None, :]).flatten(3, 4)  # (B, nkv, N, C*g, hs)
    k_to_end = k * (gamma[..., -1:, :] - gamma).exp()  # (B, nkv, N, C, hs)
    chunk_decay = gamma[..., -1, :].exp()[..., None]  # (B, nkv, N, hs, 1): each key row of S
    keys_and_queries = torch.cat((k[..., None, :], q), dim=-2)  # (B, nkv, N, C, 1+g, hs): both meet the keys
    later = ~torch.ones(C, C, dtype=torch.bool, device=q.device).tril()[:, None, :]  # (C, 1, C): j > i

    outputs = []
    # Chunks taken apart once with unbind: indexing chunk n inside the loop would give each index
    # its own full-size gradient in the backward pass, N times the memory traffic of the whole.
    per_chunk = (t.unbind(2) for t in (keys_and_queries, k, beta, gamma, rhs, q_decayed, k_to_end, chunk_decay))
    for kq_n, k_n, b_n, gamma_n, rhs_n, q_n, k_end_n, decay_n in zip(*per_chunk, strict=True):  # only S crosses
        # seen[i, :, j] = e^(gamma_i - gamma_j) * k_j for j <= i (0 for j > i): key j as position i sees it.
        gap = gamma_n[..., :, :, None] - gamma_n.transpose(-1, -2)[..., None, :, :]  # (B, nkv, C, hs, C)
        seen = gap.masked_fill(later, -math.inf).exp() * k_n.transpose(-1, -2)[..., None, :, :]  # (B, nkv, C, hs, C)
        products = kq_n @ seen  # (B, nkv, C, 1+g, C): k_i and q_i against every key the decay leaves them
        # L is b_i k_i.seen[i] below the diagonal: the unitriangular solver takes the diagonal as ones
        # and reads nothing above it, so the product stands for I + L as it is (and its gradient is
        # zero there).
        w = torch.linalg.solve_triangular(b_n * products[..., 0, :], rhs_n, upper=False, unitriangular=True)
        w_v, w_k = w.split((hv, hs), dim=-1)  # the writes are U = W_v - W_k S for the state S before the chunk
        u = w_v - w_k @ S  # (B, nkv, C, hv)
        scores = products[..., 1:, :].flatten(2, 3)  # (B, nkv, C*g, C): rows (position, query head), as q_n
        outputs.append(q_n @ S + scores @ u)  # (B, nkv, C*g, hv)
        S = decay_n * S + k_end_n.transpose(-1, -2) @ u  # (B, nkv, hs, hv)
    out = torch.stack(outputs, dim=2).view(B, nkv, N, C, group, hv)  # (B, nkv, N, C, g, hv)
    out = out.permute(0, 1, 4, 2, 3, 5).reshape(B, nh, N * C, hv)[:, :, :T]  # (B, nh, T, hv)
    return out.to(in_dtype), S


# ------------------------------------------------------------------------------------ the kind


@register("kda")
@dataclass(frozen=True)
class KimiDeltaSpec(AttentionSpec):
    """Kimi Delta Attention: gated delta's matrix state per K/V head with a decay per key channel."""

    conv_size: int = 4  # kernel of the short causal convolution on q, k and v; 0 turns it off
    chunk_size: int = 64  # positions per chunk of the chunkwise training path
    norm_eps: float = 1e-6  # of the L2 norm of q and k and of the output's RMSNorm
    backend: str = "torch"  # torch: the chunkwise form here; fla: flash-linear-attention's CUDA kernel

    examples = {
        "": Example({"chunk_size": 5, "conv_size": 3}, n_kv_head=2),
        "mqa-no-conv": Example({"chunk_size": 4, "conv_size": 0}, n_kv_head=1),
    }

    def check(self) -> None:
        check_delta_rule_options(self)

    def build(self, shape: LayerShape) -> KimiDeltaNet:
        return KimiDeltaNet(self, shape)

    def flops(self, T: int, n_head: int, n_kv_head: int, head_dim: int) -> float:
        """Per chunk of C: the decayed keys e^(gamma_i - gamma_j) k_j (C x C x hs), k_i and the g
        query heads against them (C x C x hs each), the triangular solve for [W_v | W_k]
        (C^2 x 2hs), the writes U = W_v - W_k S (C hs^2), the outputs from S and U
        (gC hs^2 + gC^2 hs) and the state update (C hs^2)."""
        C, hs = self.chunk_size, head_dim
        per_kv_head = 2 * T * C * hs + 2 * T * C * hs + T * C * 2 * hs + 2 * T * hs * hs + 2 * T * hs * hs
        per_q_head = 2 * T * C * hs + 2 * T * hs * hs + 2 * T * C * hs
        return n_kv_head * per_kv_head + n_head * per_q_head


class KimiDeltaNet(DeltaRuleLayer):
    """KDA's layer: gated delta's pieces (lm.attention.gated_delta.DeltaRuleLayer) with a write
    strength per K/V head, a log decay per K/V head and key channel through a rank-hs projection,
    and a sigmoid output gate through another."""

    def __init__(self, spec: KimiDeltaSpec, shape: LayerShape):
        super().__init__(spec, shape)
        nh, nkv, hs = self.n_head, self.n_kv_head, self.head_dim
        self.decay_and_write = nn.Linear(shape.d_model, hs + nkv, bias=False)  # x W_down (rank hs) | x W_b
        self.decay_up = nn.Linear(hs, nkv * hs, bias=False)  # W_up: one log-decay logit per K/V head and channel
        self.A_log = nn.Parameter(torch.empty(nkv))
        self.dt_bias = nn.Parameter(torch.empty(nkv * hs))
        self.gate_down = nn.Linear(shape.d_model, hs, bias=False)  # the output gate's rank-hs projection
        self.gate_up = nn.Linear(hs, nh * hs, bias=True)
        self.out_norm = nn.Parameter(torch.ones(hs))
        self.backend = kda_rule if spec.backend == "torch" else fla_backend("kda", "fla.ops.kda", "chunk_kda")

    def reset_own_parameters(self) -> None:
        """Gated delta's (Mamba2's) decay initialisation, per channel here, the convolution as torch's
        Conv1d default, the output norm's scale one; the gate's bias zero, so it starts at sigmoid of
        its projection alone."""
        mamba2_decay_init(self.A_log, self.dt_bias)
        with torch.no_grad():
            self.gate_up.bias.zero_()
        self._reset_conv_and_norm()

    def fused_rows(self) -> dict[str, tuple[int, ...]]:
        """Q, K and V; the decay's W_down and the write strength's W_b."""
        return {**super().fused_rows(), "decay_and_write.weight": (self.head_dim, self.n_kv_head)}

    def _rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, C) -> fused Q, K, V rows before the convolution (B, T, channels), beta (B, nkv, T)
        and g (B, nkv, T, hs), in float32 or wider."""
        B, T, _ = x.shape
        nkv, hs = self.n_kv_head, self.head_dim
        dtype = accumulation_dtype(x.dtype)  # float32 from bf16; float64 stays float64, as the rule's
        down, b = self.decay_and_write(x).split((hs, nkv), dim=-1)  # (B, T, hs), (B, T, nkv)
        a = self.decay_up(down).to(dtype).view(B, T, nkv, hs) + self.dt_bias.to(dtype).view(nkv, hs)  # (B, T, nkv, hs)
        g = -self.A_log.to(dtype).exp()[:, None] * F.softplus(a)  # (B, T, nkv, hs): log decay <= 0
        return self.qkv(x), torch.sigmoid(b.to(dtype)).transpose(1, 2), g.transpose(1, 2)  # (B, nkv, T[, hs])

    def _gate(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate_up(self.gate_down(x)))
