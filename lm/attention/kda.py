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
overflows under a strong decay; forming it for the C x C pairs and hs channels costs C hs
exponentials per position. fla's sub-chunk split factors it through a position between them
instead: e^(gamma_i - gamma_j) = e^(gamma_i - gamma_s) e^(gamma_s - gamma_j), both at most 1 for
j < s <= i, so the pairs across the split are a matmul. Here the chunk is halved recursively
(channel_decay_pairs): each level's pairs are one matmul of scaled rows and keys, the factors are
products of the finer level's, and no tensor larger than C x C x (1 + g) or C x hs is formed per
chunk. What the rule shares with gated delta's (the segments, the solve, the state across chunks)
is lm.attention.delta_rule. Everything accumulates in float32 (float64 stays float64).

The layer around the op (fla's KimiDeltaAttention layer): gated delta's fused Q, K, V rows through
the short causal convolution and SiLU, q and k L2-normalised; b = sigmoid(x W_b) per K/V head;
g = -exp(A) softplus(x W_down W_up + dt_bias) per K/V head and key channel, through a projection of
rank r = hs; the output RMS-normalised per head and gated by sigmoid(x W_gate_down W_gate_up + bias),
of rank hs too: fla's layer has the bias, Kimi Linear's released model (transformers' KimiLinear) has
none (`gate_bias=false`, as attn=kimi_linear sets). No RoPE: position enters through the decay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lm.attention.base import Example, LayerShape, register
from lm.attention.delta_rule import chunkwise_delta_rule, decay_factor, state_flops
from lm.attention.gated_delta import DeltaRuleLayer, DeltaRuleOptions, fla_backend, mamba2_decay_init
from lm.attention.shared_caches import accumulation_dtype, without_autocast
from lm.util.checks import require_bool


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
    return chunkwise_delta_rule(channel_decay_pairs, q, k, v, beta, g, scale, state, chunk_size)


def channel_decay_pairs(q: torch.Tensor, k: torch.Tensor, beta: torch.Tensor,
                        g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The in-chunk terms (lm.attention.delta_rule) with a decay per key channel: q (B, nkv, n, g, C,
    hs), k (B, nkv, n, C, hs), beta (B, nkv, n, C), g (B, nkv, n, C, hs) -> L (B, nkv, n, C, C),
    scores (B, nkv, n, g*C, C): k_i, and q_i for each query head, against the keys the decay leaves
    them, e^(gamma_i - gamma_j) k_j, below the diagonal and, for the queries, on it; the decay from
    the chunk's start and to its end (B, nkv, n, C, hs).

    The chunk is halved, and its halves halved, down to single positions: the pairs of each block's
    second half with its first are one matmul (add_pairs_across_halves), and a position's pair with
    itself has no decay. The decay factors of each level are products of the finer level's
    (doubled_factors), down to each position's own e^(g_i): C hs exponentials per chunk and C hs
    products per level, log2(C) levels, where forming every pair's decay per channel costs C hs C
    exponentials. A chunk that is not a power of two is padded to one with positions that meet
    nothing and do not decay."""
    *outer, group, C, hs = q.shape
    size = 1 << (C - 1).bit_length()  # the power of two at or above C
    # (B, nkv, n) as one batch dimension Z, the chunks: each elementwise pass below sets up faster over fewer dimensions
    rows = torch.cat((k[..., None, :, :], q), dim=-3).view(-1, 1 + group, C, hs)  # (Z, 1+g, C, hs): keys and queries
    k, g, beta = k.reshape(-1, C, hs), g.reshape(-1, C, hs), beta.reshape(-1, C)  # (Z, C, hs), (Z, C)
    batch = (rows.shape[0],)  # Z
    if size > C:
        rows, k, g = F.pad(rows, (0, 0, 0, size - C)), F.pad(k, (0, 0, 0, size - C)), F.pad(g, (0, 0, 0, size - C))
    products = rows.new_zeros(*batch, 1 + group, size, size)  # (Z, 1+g, size, size)
    step = decay_factor(g)  # (Z, size, hs): e^(gamma_i - gamma_(i-1))
    from_start = to_end = torch.ones_like(step)  # blocks of one position: no decay inside
    half = 1
    while half < size:
        add_pairs_across_halves(products, rows, k, step, from_start, to_end, half)
        from_start, to_end = doubled_factors(step, from_start, to_end, half)
        half *= 2
    products.diagonal(dim1=-2, dim2=-1).copy_((rows * k[..., None, :, :]).sum(-1))  # i = j: no decay
    products = products[..., :C, :C]  # (Z, 1+g, C, C)
    lower = beta[..., None] * products[..., 0, :, :]  # (Z, C, C): b_i k_i . seen_j
    scores = products[..., 1:, :, :].reshape(*outer, group * C, C)  # (B, nkv, n, g*C, C)
    decay = step[..., :1, :] * from_start  # e^gamma_i = e^(g_0) e^(gamma_i - gamma_0)
    return lower.view(*outer, C, C), scores, decay[..., :C, :].view(*outer, C, hs), to_end[..., :C, :].reshape(
        *outer, C, hs)


def add_pairs_across_halves(products: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, step: torch.Tensor,
                            from_start: torch.Tensor, to_end: torch.Tensor, half: int) -> None:
    """Writes into products (Z, R, C, C) the pairs of rows (Z, R, C, hs) in the
    second half of each block of 2 * half positions with the keys k (Z, C, hs) of its first
    half.

    For blocks of `half`, from_start (Z, C, hs) holds e^(gamma_i - gamma_b), b the first
    position of i's block, and to_end e^(gamma_e - gamma_i), e its last; step is e^(gamma_i -
    gamma_(i-1)) = e^(g_i). With s the first position of the second
    half (fla's sub-chunk split),

        e^(gamma_i - gamma_j) = from_start_i * step_s * to_end_j        j < s <= i

    every factor at most 1 (no overflow under a strong decay): the first scales the rows, the others
    the keys, and the pairs are one matmul per block."""
    *batch, R, C, hs = rows.shape
    nb = C // (2 * half)
    late = rows.view(*batch, R, nb, 2, half, hs)[..., 1, :, :]  # (Z, R, nb, half, hs): rows i >= s
    early = k.view(*batch, nb, 2, half, hs)[..., 0, :, :]  # (Z, nb, half, hs): keys j < s
    to_next = step.view(*batch, nb, 2, half, hs)[..., 1, :1, :]  # (Z, nb, 1, hs): step_s
    late = late * from_start.view(*batch, 1, nb, 2, half, hs)[..., 1, :, :]
    to_next = to_end.view(*batch, nb, 2, half, hs)[..., 0, :, :] * to_next  # (Z, nb, half, hs)
    # A block's rows, R * half of them, side by side: one matmul per block, not one per block and row kind.
    late = late.transpose(-4, -3).reshape(*batch, nb, R * half, hs)  # (Z, nb, R*half, hs)
    pairs = late @ (early * to_next).transpose(-1, -2)  # (Z, nb, R*half, half)
    # products' rows of each block's second half and columns of its first: (Z, R, half, half, nb)
    blocks = products.view(*batch, R, nb, 2, half, nb, 2, half).diagonal(dim1=-6, dim2=-3)[..., 1, :, 0, :, :]
    blocks.copy_(pairs.reshape(*batch, nb, R, half, half).movedim(-4, -1))


def doubled_factors(step: torch.Tensor, from_start: torch.Tensor, to_end: torch.Tensor,
                    half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """from_start and to_end (add_pairs_across_halves) for blocks of 2 * half from those for blocks
    of half: the second half's from_start continues from the first's start, the first half's to_end
    runs on to the second's end, each by one factor per block and channel."""
    *batch, C, hs = step.shape
    nb = C // (2 * half)
    bridge = step.view(*batch, nb, 2, half, hs)[..., 1, 0, :]  # (Z, nb, hs): step_s
    ones = torch.ones_like(bridge)
    from_start = from_start.view(*batch, nb, 2, half, hs)  # (Z, nb, 2, half, hs): the blocks' halves
    to_end = to_end.view(*batch, nb, 2, half, hs)
    across = from_start[..., 0, -1, :] * bridge  # (Z, nb, hs): e^(gamma_s - gamma_b)
    through = bridge * from_start[..., 1, -1, :]  # (Z, nb, hs): e^(gamma_E - gamma_(s-1)), E the last
    from_start = from_start * torch.stack((ones, across), dim=-2)[..., None, :]  # (Z, nb, 2, half, hs)
    to_end = to_end * torch.stack((through, ones), dim=-2)[..., None, :]
    return from_start.view(*batch, C, hs), to_end.view(*batch, C, hs)


# ------------------------------------------------------------------------------------ the kind


@register("kda")
@dataclass(frozen=True)
class KimiDeltaSpec(DeltaRuleOptions):
    """Kimi Delta Attention: gated delta's matrix state per K/V head with a decay per key channel."""

    gate_bias: bool = True  # a bias in the output gate's up-projection (fla's layer); false: Kimi Linear's

    examples = {
        "": Example({"chunk_size": 5, "conv_size": 3}, n_kv_head=2),
        "mqa-no-conv": Example({"chunk_size": 4, "conv_size": 0}, n_kv_head=1),
    }

    def check(self) -> None:
        super().check()
        require_bool("gate_bias", self.gate_bias)

    def build(self, shape: LayerShape) -> KimiDeltaNet:
        return KimiDeltaNet(self, shape)

    def flops(self, T: int, n_head: int, n_kv_head: int, head_dim: int) -> float:
        """Per chunk of C: k_i and, per query head, q_i against the earlier keys (C x C x hs / 2
        each: the pairs below the diagonal, one halving level at a time), then the state's work
        (lm.attention.delta_rule.state_flops)."""
        C, hs = self.chunk_size, head_dim
        pairs = (n_kv_head + n_head) * T * C * hs
        return pairs + state_flops(T, n_head, n_kv_head, hs, C)


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
        self.gate_up = nn.Linear(hs, nh * hs, bias=spec.gate_bias)
        self.out_norm = nn.Parameter(torch.ones(hs))
        self.backend = kda_rule if spec.backend == "torch" else fla_backend("kda", "fla.ops.kda", "chunk_kda")

    def reset_own_parameters(self) -> None:
        """Gated delta's (Mamba2's) decay initialisation, per channel here, the convolution as torch's
        Conv1d default, the output norm's scale one; the gate's bias zero, so it starts at sigmoid of
        its projection alone."""
        mamba2_decay_init(self.A_log, self.dt_bias)
        if self.gate_up.bias is not None:
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
