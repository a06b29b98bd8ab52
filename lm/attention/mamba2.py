"""Mamba-2 (Dao and Gu, "Transformers are SSMs", ICML 2024): a selective state space model with a
scalar decay per head, computed by state space duality (SSD).

Shapes: B batch, T sequence length, nh heads, G groups (heads of a group share the SSM's input and
output vectors), g = nh / G, P head size, N the state size (d_state), K chunks of Q positions,
W the short convolution's kernel, ch the convolved channels. The paper's B_t and C_t (the SSM's
input and output vectors, each of size N per group) are called `b` and `c` here, so that the
batch keeps the letter B; in attention's vocabulary (section 5 of the paper) c is the query, b the
key and dt x the value.

Each head keeps a state h (N x P). At each position, with dt_t = softplus(x W_dt + dt_bias) > 0
and A = -exp(A_log) < 0 per head:

    h_t = exp(dt_t A) h_{t-1} + b_t (dt_t x_t)^T        y_t = h_t^T c_t + D x_t

The training path is the paper's chunkwise SSD algorithm (section 6): inside a chunk the output is
a masked, decayed attention y = (L o c b^T)(dt x) with L_ij = exp(gamma_i - gamma_j) for j <= i
(gamma the in-chunk cumulative log decay), plus what the state before the chunk gives; each
chunk's own contribution to the state is computed for all chunks at once, and only the state
crosses chunks, one scaled sum per chunk. Nothing larger than Q x Q per head per chunk is formed.
Everything accumulates in float32 (float64 stays float64).

The layer around the op is mamba_ssm's Mamba2 (rmsnorm=True, norm_before_gate=False): one input
projection to [z | x | b | c | dt], a short causal depthwise convolution and SiLU over (x, b, c),
the SSM, y times SiLU(z), RMS-normalised per group, through the output projection. No RoPE:
position enters through the decay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lm.attention.base import AttentionLayer, AttentionSpec, Example, LayerShape, register
from lm.attention.cache import CacheContext, CacheSpec
from lm.attention.convolution import causal_conv, naive_causal_conv, window_after
from lm.attention.shared_caches import RecurrentCache, accumulation_dtype, without_autocast
from lm.util.checks import require_int


@without_autocast
def ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
        state: torch.Tensor | None = None, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSM, chunkwise: x (B, nh, T, P), dt (B, nh, T), A (nh,), b and c (B, G, T, N) -> y
    (B, nh, T, P) in x's dtype (without D's skip, which the layer adds), the final state (B, nh,
    N, P) in float32 or wider. `state` is carried in.

    A position with dt = 0 neither decays nor writes the state, which is how padding is kept out."""
    Bsz, nh, T, P = x.shape
    G, N, Q = b.shape[1], b.shape[-1], chunk_size
    g, K = nh // G, -(-T // chunk_size)
    pad = K * Q - T
    in_dtype, dtype = x.dtype, accumulation_dtype(x.dtype)
    h = x.new_zeros(Bsz, nh, N, P, dtype=dtype) if state is None else state.to(dtype)

    # Padded tail positions: dt = 0 gives decay 1 and no write, so the final state is the last real one's.
    dt = F.pad(dt.to(dtype), (0, pad)).view(Bsz, G, g, K, Q)  # (B, G, g, K, Q)
    v = F.pad(x.to(dtype), (0, 0, 0, pad)).view(Bsz, G, g, K, Q, P) * dt[..., None]  # (B, G, g, K, Q, P): dt x
    b = F.pad(b.to(dtype), (0, 0, 0, pad)).view(Bsz, G, 1, K, Q, N)  # (B, G, 1, K, Q, N): one per group
    c = F.pad(c.to(dtype), (0, 0, 0, pad)).view(Bsz, G, 1, K, Q, N)
    gamma = (dt * A.to(dtype).view(G, g, 1, 1)).cumsum(-1)  # (B, G, g, K, Q): in-chunk log decay up to each position

    # Within each chunk, the quadratic (attention) form of the paper's state space duality.
    # L[i, j] = exp(gamma_i - gamma_j) for j <= i, 0 above the diagonal (masked before exp: no overflow).
    causal = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()
    L = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, -math.inf).exp()  # (B, G, g, K, Q, Q)
    y_within = ((c @ b.transpose(-1, -2)) * L) @ v  # (B, G, g, K, Q, P): c b^T once per group

    # Each chunk's own write to the state, decayed to the chunk's end, for every chunk at once.
    to_end = (gamma[..., -1:] - gamma).exp()  # (B, G, g, K, Q)
    written = b.transpose(-1, -2) @ (v * to_end[..., None])  # (B, G, g, K, N, P)
    chunk_decay = gamma[..., -1].exp()[..., None, None]  # (B, G, g, K, 1, 1)

    # Only the state crosses chunks: h before chunk k+1 = its decay times h before chunk k plus its write.
    h = h.view(Bsz, G, g, N, P)  # (B, G, g, N, P): heads of a group side by side
    before = []
    for written_k, decay_k in zip(written.unbind(3), chunk_decay.unbind(3), strict=True):
        before.append(h)
        h = decay_k * h + written_k
    before = torch.stack(before, dim=3)  # (B, G, g, K, N, P): the state each chunk starts from
    y_from_state = (c * gamma.exp()[..., None]) @ before  # (B, G, g, K, Q, P): c_i read with decay up to i

    y = (y_within + y_from_state).reshape(Bsz, nh, K * Q, P)[:, :, :T]  # (B, nh, T, P)
    return y.to(in_dtype), h.reshape(Bsz, nh, N, P)


@without_autocast
def ssd_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One position: x (B, nh, 1, P), dt (B, nh, 1), A (nh,), b and c (B, G, 1, N), h (B, nh, N, P)
    -> y (B, nh, 1, P), the new h. Fixed shapes, no host reads."""
    Bsz, nh, _, P = x.shape
    G, N = b.shape[1], b.shape[-1]
    dt = dt.to(h.dtype).view(Bsz, G, nh // G, 1, 1)  # (B, G, g, 1, 1)
    v = x.to(h.dtype).view(Bsz, G, nh // G, 1, P) * dt  # (B, G, g, 1, P): dt x
    b, c = b.to(h.dtype).view(Bsz, G, 1, 1, N), c.to(h.dtype).view(Bsz, G, 1, 1, N)
    h = h.view(Bsz, G, nh // G, N, P) * (dt * A.to(h.dtype).view(G, -1, 1, 1)).exp() + b.transpose(-1, -2) @ v
    return (c @ h).view(Bsz, nh, 1, P), h.view(Bsz, nh, N, P)  # y_t = h_t^T c_t


# ------------------------------------------------------------------------------------ the kind


@register("mamba2")
@dataclass(frozen=True)
class Mamba2Spec(AttentionSpec):
    """Mamba-2's SSD layer: a state per head with a scalar decay, written and read through b and c.

    Sizes come from the model's LayerShape as the other kinds take theirs, so that `attn=mamba2`
    swaps into any model and a hybrid's layers line up: the model's n_head heads of head_dim
    channels each (Mamba-2's nheads and headdim; its inner width expand * d_model is n_head *
    head_dim, which is d_model unless the model sets its head size otherwise), and n_kv_head
    groups (Mamba-2's n_groups): the heads of a group share b and c as the query heads of a GQA
    group share K and V, the "multi-value" pattern of the paper's section 7.2. A separate `expand`
    would give the layer a width no other kind of the same model has, and the output norm's groups
    and the cache's heads would no longer be the model's."""

    d_state: int = 64  # N: the state size per head (the paper sweeps 64 to 256; 64 keeps N x P at a head's hs x hs)
    chunk_size: int = 64  # positions per chunk of the chunkwise training path (Q x Q per head per chunk)
    conv_size: int = 4  # kernel of the short causal convolution over (x, b, c); 0 turns it off

    examples = {
        "": Example({"d_state": 8, "chunk_size": 8}, n_kv_head=2),
        "mha-odd-chunk": Example({"d_state": 4, "chunk_size": 5, "conv_size": 3}),
        "one-group-no-conv": Example({"d_state": 6, "chunk_size": 4, "conv_size": 0}, n_kv_head=1),
    }

    def check(self) -> None:
        require_int("d_state", self.d_state)
        require_int("chunk_size", self.chunk_size)
        require_int("conv_size", self.conv_size, minimum=0)

    def build(self, shape: LayerShape) -> Mamba2:
        return Mamba2(self, shape)

    def flops(self, T: int, n_head: int, n_kv_head: int, head_dim: int) -> float:
        """Per chunk of Q: c b^T once per group (Q^2 N); per head the masked scores times dt x
        (Q^2 P), the chunk's write b^T (dt x) (Q N P) and the read from the state before it (Q N P)."""
        Q, N, P = self.chunk_size, self.d_state, head_dim
        return n_kv_head * 2 * T * Q * N + n_head * (2 * T * Q * P + 4 * T * N * P)


class Mamba2(AttentionLayer):
    """Its own layer (not projections around an attention op): one input projection, the short
    convolution of lm.attention.convolution, the SSM, the gated group norm, the output projection."""

    uses_rope = False  # position enters through the decay
    context_limited = False
    # (channels, taps): convolution taps, not a matrix for Muon (lm.training.optim); A_log, dt_bias,
    # D, the convolution's bias and the norm's gain are vectors, which go to AdamW anyway.
    adamw_parameters = ("conv",)

    def __init__(self, spec: Mamba2Spec, shape: LayerShape):
        super().__init__()
        self.spec, self.layer_idx, self.norm_eps = spec, shape.layer_idx, shape.norm_eps
        self.n_head, self.n_group, self.head_dim = nh, G, P = shape.n_head, shape.n_kv_head, shape.head_dim
        self.d_inner, N = nh * P, spec.d_state
        # Rows [z | x | b | c | dt], as mamba_ssm's in_proj lays them out.
        self.rows = (self.d_inner, self.d_inner, G * N, G * N, nh)
        self.in_proj = nn.Linear(shape.d_model, sum(self.rows), bias=False)
        self.channels = self.d_inner + 2 * G * N  # (x, b, c): what the convolution runs over
        # One weight per channel and tap, tap W-1 the current position (a depthwise causal conv1d), and its bias.
        self.conv = nn.Parameter(torch.empty(self.channels, spec.conv_size)) if spec.conv_size else None
        self.conv_bias = nn.Parameter(torch.zeros(self.channels)) if spec.conv_size else None
        self.A_log = nn.Parameter(torch.empty(nh))
        self.dt_bias = nn.Parameter(torch.empty(nh))
        self.D = nn.Parameter(torch.ones(nh))  # the skip y += D x, per head
        self.norm = nn.Parameter(torch.ones(self.d_inner))  # the gated RMSNorm's gain
        self.out_proj = nn.Linear(self.d_inner, shape.d_model, bias=False)

    def reset_own_parameters(self) -> None:
        """mamba_ssm's initialisation: A ~ U(1, 16), dt ~ logU(1e-3, 0.1) (floor 1e-4) through an
        inverse softplus in dt_bias, D and the norm's gain one, the convolution as torch's Conv1d."""
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
            dt = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(0.1))).clamp(min=1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
            self.D.fill_(1.0)
            self.norm.fill_(1.0)
            if self.conv is not None:
                bound = 1 / math.sqrt(self.spec.conv_size)  # Conv1d's default for one input channel per group
                self.conv.uniform_(-bound, bound)
                self.conv_bias.uniform_(-bound, bound)

    def fused_rows(self) -> dict[str, tuple[int, ...]]:
        """The input projection stacks five matrices (lm.training.optim): z, x, b, c and dt."""
        return {"in_proj.weight": self.rows}

    # -------------------------------------------------------------- from x to the op's inputs

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, C) -> the gate z (B, T, nh*P), the rows (x, b, c) before the convolution (B, T, ch)
        and dt (B, nh, T) in float32 or wider (softplus(x W_dt + dt_bias) > 0)."""
        z, xbc, dt = self.in_proj(x).split((self.d_inner, self.channels, self.n_head), dim=-1)
        wide = accumulation_dtype(x.dtype)
        dt = F.softplus(dt.to(wide) + self.dt_bias.to(wide)).transpose(1, 2)  # (B, T, nh) -> (B, nh, T)
        return z, xbc, dt

    def _convolved(self, rows: torch.Tensor, window: torch.Tensor | None) -> torch.Tensor:
        """The short causal convolution and SiLU over rows (B, T, ch), after `window` (B, W-1, ch)."""
        if self.conv is None:
            return F.silu(rows)
        return F.silu(causal_conv(rows, self.conv, window) + self.conv_bias.to(rows.dtype))

    def _ssm_inputs(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convolved rows (B, T, ch) -> x (B, nh, T, P), b and c (B, G, T, N)."""
        B, T, _ = xbc.shape
        x, b, c = xbc.split((self.d_inner, *self.rows[2:4]), dim=-1)
        x = x.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, T, nh*P) -> (B, nh, T, P)
        b = b.view(B, T, self.n_group, self.spec.d_state).transpose(1, 2)  # (B, T, G*N) -> (B, G, T, N)
        c = c.view(B, T, self.n_group, self.spec.d_state).transpose(1, 2)
        return x, b, c

    def _A(self) -> torch.Tensor:
        return -self.A_log.to(accumulation_dtype(self.A_log.dtype)).exp()  # (nh,) < 0: each exp(dt A) in (0, 1)

    def _skip(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y (B, nh, T, P) plus D x, per head."""
        return y + self.D.to(y.dtype)[:, None, None] * x.to(y.dtype)

    def _output(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y (B, nh, T, P) times SiLU(z), RMS-normalised over each group's channels (in float32 or wider), through
        the output projection: mamba_ssm's RMSNormGated with group_size = d_inner / n_groups."""
        B, _, T, P = y.shape
        y = y.transpose(1, 2).reshape(B, T, self.d_inner)  # (B, nh, T, P) -> (B, T, nh*P)
        wide = accumulation_dtype(z.dtype)
        gated = (y.to(wide) * F.silu(z.to(wide))).view(B, T, self.n_group, -1)  # (B, T, G, g*P)
        normed = F.rms_norm(gated, (gated.shape[-1],), eps=self.norm_eps).view(B, T, self.d_inner)  # (B, T, nh*P)
        return self.out_proj((normed * self.norm.to(wide)).to(z.dtype))

    # ---------------------------------------------------------------------------- the contract

    def benchmark_op(self, seq_len: int, requires_grad: bool = False):
        """The SSM alone on what the layer would give it: dt from the layer's own projection and bias on
        random inputs, x, b and c after SiLU."""
        nh, G, P, N = self.n_head, self.n_group, self.head_dim, self.spec.d_state
        with torch.no_grad():
            _, _, dt = self._project(torch.randn(1, seq_len, self.in_proj.in_features))
            A = self._A()
        inputs = [F.silu(torch.randn(1, nh, seq_len, P)), dt, F.silu(torch.randn(1, G, seq_len, N)),
                  F.silu(torch.randn(1, G, seq_len, N))]
        for t in inputs:
            t.requires_grad_(requires_grad)

        def op(x, dt, b, c):
            return ssd(x, dt, A, b, c, chunk_size=self.spec.chunk_size)[0]

        return op, inputs

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: RecurrentCache | None = None, pos: torch.Tensor | None = None) -> torch.Tensor:
        z, rows, dt = self._project(x)
        if cache is None:
            xs, b, c = self._ssm_inputs(self._convolved(rows, None))
            y = self._skip(ssd(xs, dt, self._A(), b, c, chunk_size=self.spec.chunk_size)[0], xs)
        elif pos is not None:
            y = cache.decode(rows, dt, pos)
        else:
            y = cache.attend(rows, dt)
        return self._output(y, z)

    def naive_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The same, the convolution written as a sum over taps and the SSM token by token."""
        z, rows, dt = self._project(x)
        if self.conv is not None:
            rows = naive_causal_conv(rows, self.conv) + self.conv_bias
        xs, b, c = self._ssm_inputs(F.silu(rows))
        return self._output(self._skip(recurrent_ssd(xs, dt, self._A(), b, c)[0], xs), z)

    def generation_state(self) -> CacheSpec:
        """Per group: its g heads' states (N x P each) and its share of the convolution's last W-1 rows."""
        window = max(self.spec.conv_size - 1, 0) * self.channels
        per_group = (self.n_head * self.spec.d_state * self.head_dim + window) // self.n_group
        return CacheSpec("recurrent", self.n_group, self.head_dim, state_numel=per_group)

    def build_cache(self, context: CacheContext, max_len: int) -> RecurrentCache:
        """The state h (B, nh, N, P) in float32 and the last W-1 rows before the convolution (B, W-1, ch),
        whatever the length. It takes the layer's own per-position inputs: the rows before the
        convolution (B, T, ch) and dt (B, nh, T)."""
        B, device = context.batch_size, context.device
        state = {"h": torch.zeros(B, self.n_head, self.spec.d_state, self.head_dim,
                                  dtype=accumulation_dtype(context.dtype), device=device),
                 "conv_window": torch.zeros(B, max(self.spec.conv_size - 1, 0), self.channels, dtype=context.dtype,
                                            device=device)}
        return RecurrentCache(context, state, self._chunk_from, self._step_from, time_dim=1)  # rows (B, T, ch)

    def _chunk_from(self, rows: torch.Tensor, dt: torch.Tensor, state, real):
        h, window = state
        if real is not None:  # left padding: no input to the convolution, and dt = 0 neither decays nor writes
            rows, dt = rows * real[..., None], dt * real[:, None]
        xs, b, c = self._ssm_inputs(self._convolved(rows, window))
        y, h = ssd(xs, dt, self._A(), b, c, state=h, chunk_size=self.spec.chunk_size)
        return self._skip(y, xs), (h, window_after(window, rows))

    def _step_from(self, rows: torch.Tensor, dt: torch.Tensor, state):
        h, window = state
        xs, b, c = self._ssm_inputs(self._convolved(rows, window))
        y, h = ssd_step(xs, dt, self._A(), b, c, h)
        return self._skip(y, xs), (h, window_after(window, rows))


# ------------------------------------------------------------ naive twin (for tests)


def recurrent_ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                  state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSM one position at a time, as the paper writes the recurrence; the shapes and
    conventions of ssd."""
    Bsz, nh, T, P = x.shape
    G = b.shape[1]
    dtype = accumulation_dtype(x.dtype)
    h = x.new_zeros(Bsz, nh, b.shape[-1], P, dtype=dtype) if state is None else state.to(dtype)
    # Each head reads its group's b and c.
    b, c = b.to(dtype).repeat_interleave(nh // G, dim=1), c.to(dtype).repeat_interleave(nh // G, dim=1)
    outputs = []
    for t in range(T):
        dt_t = dt[:, :, t, None, None].to(dtype)  # (B, nh, 1, 1)
        # h_t = exp(dt_t A) h_{t-1} + b_t (dt_t x_t)^T
        h = (dt_t * A.to(dtype)[:, None, None]).exp() * h + b[:, :, t, :, None] * (dt_t * x[:, :, t, None, :].to(dtype))
        outputs.append((c[:, :, t, :, None] * h).sum(-2))  # y_t = h_t^T c_t, (B, nh, P)
    return torch.stack(outputs, dim=2).to(x.dtype), h
