"""Gated DeltaNet (Yang, Kautz and Hatamizadeh, ICLR 2025) with grouped K/V heads.

Shapes: B batch, T sequence length, nh query heads, nkv K/V heads, g = nh / nkv, hs head size,
N chunks of C positions, W the short convolution's kernel.

Each K/V head keeps a matrix state S (hs_k x hs_v, key dimension first, as flash-linear-attention
lays it out). At each position, with a decay a_t = exp(g_t) (g_t <= 0) and a write strength b_t:

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T        o_t = S_t^T (scale * q_t)

that is: decay the state, read what it predicts for k_t, and write back b_t of the error
v_t - S^T k_t (the delta rule). The query heads of a group read their K/V head's state.

The training path is chunkwise (the paper's WY representation, computed as a unit lower-
triangular solve, the "UT transform"): inside a chunk every position's write u_j depends on the
earlier writes of the chunk, U = (I + L)^-1 (diag(b) V - diag(b e^gamma) K S) with L the
strictly lower b_j e^(gamma_j - gamma_l) k_j.k_l, gamma the in-chunk cumulative log decay; the
chunk's outputs and final state are then products with U. Only the state crosses chunks, one
matmul per chunk, and nothing larger than C x C is formed per chunk; what this rule shares with
KDA's (the segments, the solve, the state across chunks) is lm.attention.delta_rule, and what is
its own is the C x C matrix of pair decays (head_decay_pairs). Everything accumulates in float32
(float64 stays float64).

The layer around the op (fla's GatedDeltaNet layer): Q, K, V projections through a short causal
depthwise convolution and SiLU, q and k L2-normalised, b = sigmoid(x W_b), g = -exp(A) softplus(x W_a
+ dt_bias) per K/V head (Mamba2's decay), and the output RMS-normalised per head and gated by
SiLU(x W_gate) before the output projection. No RoPE: position enters through the decay. What the
layer shares with Kimi Delta Attention (lm.attention.kda, a decay per key channel) is DeltaRuleLayer;
the decoding step and the token-by-token twin take either decay.
"""

from __future__ import annotations

import importlib
import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lm.attention.base import AttentionLayer, AttentionSpec, Example, LayerShape, register
from lm.attention.cache import CacheContext, CacheSpec
from lm.attention.convolution import causal_conv, naive_causal_conv, window_after
from lm.attention.delta_rule import chunkwise_delta_rule, decay_factor, state_flops
from lm.attention.projections import qkv_rows
from lm.attention.shared_caches import RecurrentCache, accumulation_dtype, without_autocast
from lm.util.checks import require_choice, require_int, require_positive
from lm.util.errors import ConfigError

log = logging.getLogger(__name__)

BACKENDS = ("torch", "fla")


@without_autocast
def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                     scale: float | None = None, state: torch.Tensor | None = None,
                     chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, chunkwise: q (B, nh, T, hs), k (B, nkv, T, hs), v (B, nkv, T, hv),
    beta and g (B, nkv, T) -> out (B, nh, T, hv) in q's dtype, final state (B, nkv, hs, hv) in
    float32 or wider. `scale` multiplies q (None: hs ** -0.5, as fla); `state` is carried in.

    q and k are used as given (the layer L2-normalises them). A position with beta = 0 and g = 0
    leaves the state unchanged, which is how padding is kept out."""
    return chunkwise_delta_rule(head_decay_pairs, q, k, v, beta, g, scale, state, chunk_size)


def head_decay_pairs(q: torch.Tensor, k: torch.Tensor, beta: torch.Tensor,
                     g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The in-chunk terms (lm.attention.delta_rule) with one decay per K/V head: q (B, nkv, n, g, C,
    hs), k (B, nkv, n, C, hs), beta and g (B, nkv, n, C) -> L (B, nkv, n, C, C), scores (B, nkv, n,
    g*C, C), the decay from the chunk's start and to its end (B, nkv, n, C, 1). The pair decay
    e^(gamma_i - gamma_j) is a C x C matrix per chunk, zero above the diagonal."""
    gamma = g.cumsum(-1)  # (B, nkv, n, C): the in-chunk log decay up to each position
    decay = decay_factor(gamma[..., :, None] - gamma[..., None, :]).tril()  # (B, nkv, n, C, C), 0 for j > i
    lower = beta[..., None] * (k @ k.transpose(-1, -2)) * decay  # (B, nkv, n, C, C)
    scores = q @ k[..., None, :, :].transpose(-1, -2)  # (B, nkv, n, g, C, C)
    scores = (scores * decay[..., None, :, :]).flatten(3, 4)  # (B, nkv, n, g*C, C)
    return lower, scores, decay_factor(gamma)[..., None], decay_factor(gamma[..., -1:] - gamma)[..., None]


@without_autocast
def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                     scale: float, S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One position: q (B, nh, 1, hs), k (B, nkv, 1, hs), v (B, nkv, 1, hv), beta (B, nkv, 1), g
    (B, nkv, 1) or, a decay per key channel (lm.attention.kda), (B, nkv, 1, hs); S (B, nkv, hs, hv)
    -> out (B, nh, 1, hv), the new S. Fixed shapes, no host reads."""
    B, nh, _, hs = q.shape
    nkv = k.shape[1]
    k, v = k.to(S.dtype)[:, :, 0], v.to(S.dtype)[:, :, 0]  # (B, nkv, hs), (B, nkv, hv)
    S = S * g.to(S.dtype).exp().reshape(B, nkv, -1, 1)  # (B, nkv, hs, hv): each key row decayed (one a or hs)
    error = v - (k[..., None] * S).sum(-2)  # (B, nkv, hv): what the state mispredicts for k
    S = S + k[..., None] * (beta.to(S.dtype) * error)[:, :, None, :]  # the delta rule's write
    q = q.to(S.dtype).reshape(B, nkv, nh // nkv, hs) * scale  # (B, nkv, g, hs): a group reads one state
    return (q @ S).reshape(B, nh, 1, -1), S  # (B, nh, 1, hv)


# ------------------------------------------------------------------------------------ the kind


@dataclass(frozen=True)
class DeltaRuleOptions(AttentionSpec):
    """The options every delta-rule kind takes (gated delta here, KDA in lm.attention.kda), which
    DeltaRuleLayer reads: a kind's spec subclasses this, and its `check` calls this one."""

    conv_size: int = 4  # kernel of the short causal convolution on q, k and v; 0 turns it off
    chunk_size: int = 64  # positions per chunk of the chunkwise training path
    norm_eps: float = 1e-6  # of the L2 norm of q and k and of the output's RMSNorm
    backend: str = "torch"  # torch: the chunkwise form here; fla: flash-linear-attention's CUDA kernel

    def check(self) -> None:
        require_int("conv_size", self.conv_size, minimum=0)
        require_int("chunk_size", self.chunk_size)
        require_positive("norm_eps", self.norm_eps)
        require_choice("backend", self.backend, BACKENDS)


@register("gated_delta")
@dataclass(frozen=True)
class GatedDeltaSpec(DeltaRuleOptions):
    """Gated DeltaNet: a decaying matrix state per K/V head written by the delta rule."""

    examples = {
        "": Example({"chunk_size": 8}, n_kv_head=2),
        "mha-odd-chunk": Example({"chunk_size": 5, "conv_size": 3}),
        "mqa-no-conv": Example({"chunk_size": 4, "conv_size": 0}, n_kv_head=1),
    }

    def build(self, shape: LayerShape) -> GatedDeltaNet:
        return GatedDeltaNet(self, shape)

    def flops(self, T: int, n_head: int, n_kv_head: int, head_dim: int) -> float:
        """Per chunk of C: k k^T and, per query head, q k^T (C x C x hs), then the state's work
        (lm.attention.delta_rule.state_flops)."""
        C, hs = self.chunk_size, head_dim
        pairs = (n_kv_head + n_head) * 2 * T * C * hs
        return pairs + state_flops(T, n_head, n_kv_head, hs, C)


def l2_normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def fla_backend(kind: str, module: str, name: str):
    """flash-linear-attention's CUDA kernel `module.name` (its chunk_gated_delta_rule or chunk_kda) behind
    our rule's signature, for a layer built with backend='fla'; one ConfigError line where it cannot run."""
    if not torch.cuda.is_available():
        raise ConfigError("backend='fla' runs flash-linear-attention's CUDA kernel; this torch has no CUDA device")
    try:
        kernel = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise ConfigError("backend='fla' needs flash-linear-attention (pip install flash-linear-attention)") from e
    log.info("%s: flash-linear-attention's %s (backend=fla)", kind, name)

    def fla_rule(q, k, v, beta, g, scale=None, state=None, chunk_size=64):
        group = q.shape[1] // k.shape[1]  # fla shares no state across query heads: repeat K/V per group
        k, v, beta, g = (t.repeat_interleave(group, dim=1) for t in (k, v, beta, g))
        state = None if state is None else state.repeat_interleave(group, dim=1)
        out, final = kernel(  # fla's tensors are (B, T, H, ...): g (B, T, H) or, per key channel, (B, T, H, hs)
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g.transpose(1, 2).float(),
            beta.transpose(1, 2), scale=scale, initial_state=state, output_final_state=True)
        return out.transpose(1, 2), final[:, ::group]

    return fla_rule


def mamba2_decay_init(A_log: nn.Parameter, dt_bias: nn.Parameter) -> None:
    """Mamba2's initialisation of g = -exp(A) softplus(... + dt_bias), as fla's Gated DeltaNet:
    A ~ U(0, 16) and dt ~ logU(1e-3, 0.1) through an inverse softplus in dt_bias."""
    with torch.no_grad():
        A_log.copy_(torch.empty_like(A_log).uniform_(1e-4, 16).log())
        dt = torch.exp(torch.empty_like(dt_bias).uniform_(math.log(1e-3), math.log(0.1))).clamp(min=1e-4)
        dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))


class DeltaRuleLayer(AttentionLayer):
    """What the delta-rule layers share (this file's GatedDeltaNet, lm.attention.kda's KimiDeltaNet):
    the fused Q/K/V rows of lm.attention.projections through the short causal convolution of
    lm.attention.convolution and SiLU, q and k L2-normalised, the output RMS-normalised per head and
    gated, and decoding with the recurrent cache of lm.attention.shared_caches.

    A subclass registers its own weights (those of the write strength b, the log decay g, the output
    gate and the output norm's gain `out_norm`) and provides `_rows(x)` -> (rows, beta, g), `_gate(x)`
    and its chunkwise rule as `self.backend`. One token-by-token twin serves both: the recurrence
    with a decay per K/V head or per key channel (recurrent_gated_delta_rule)."""

    uses_rope = False  # position enters through the decay
    context_limited = False
    adamw_parameters = ("conv",)  # (channels, taps): convolution taps, not a matrix for Muon (lm.training.optim)
    out_norm: nn.Parameter  # the output RMSNorm's gain (hs,), shared by the heads; registered by the subclass

    def __init__(self, spec: DeltaRuleOptions, shape: LayerShape):
        super().__init__()
        self.spec = spec
        self.layer_idx = shape.layer_idx
        self.n_head, self.n_kv_head, self.head_dim = nh, nkv, hs = shape.n_head, shape.n_kv_head, shape.head_dim
        self.qkv = nn.Linear(shape.d_model, sum(qkv_rows(nh, nkv, hs)), bias=False)  # [Q heads | K heads | V heads]
        self.out = nn.Linear(nh * hs, shape.d_model, bias=False)
        self.channels = (nh + 2 * nkv) * hs  # the fused Q, K, V rows the convolution runs over
        # One weight per channel and tap, tap W-1 the current position (a depthwise causal conv1d).
        self.conv = nn.Parameter(torch.empty(self.channels, spec.conv_size)) if spec.conv_size else None

    def _reset_conv_and_norm(self) -> None:
        """The convolution as torch's Conv1d default, the output norm's gain one."""
        with torch.no_grad():
            if self.conv is not None:
                bound = 1 / math.sqrt(self.spec.conv_size)
                self.conv.uniform_(-bound, bound)
            self.out_norm.fill_(1.0)

    def fused_rows(self) -> dict[str, tuple[int, ...]]:
        """Own weights that stack several matrices, and the rows of each (lm.training.optim): Q, K and V."""
        return {"qkv.weight": qkv_rows(self.n_head, self.n_kv_head, self.head_dim)}

    # -------------------------------------------------------------- from x to the op's inputs

    def _rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, C) -> fused Q, K, V rows before the convolution (B, T, channels), beta (B, nkv, T), g."""
        raise NotImplementedError

    def _gate(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, C) -> the output gate (B, T, nh*hs)."""
        raise NotImplementedError

    def _heads(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convolved rows (B, T, channels) -> q (B, nh, T, hs), k, v (B, nkv, T, hs), q and k L2-normalised."""
        B, T, _ = rows.shape
        nh, nkv, eps = self.n_head, self.n_kv_head, self.spec.norm_eps
        heads = F.silu(rows).view(B, T, nh + 2 * nkv, self.head_dim).transpose(1, 2)  # (B, nh+2nkv, T, hs)
        qk = l2_normalised(heads[:, : nh + nkv], eps)
        return qk[:, :nh], qk[:, nh:], heads[:, nh + nkv:]

    def _convolved(self, rows: torch.Tensor, window: torch.Tensor | None) -> torch.Tensor:
        """The short causal convolution over rows (B, T, channels), after `window` (B, W-1, channels)."""
        return rows if self.conv is None else causal_conv(rows, self.conv, window)

    def _output(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y (B, nh, T, hs) -> RMSNorm per head (in float32 or wider), times the gate, through the output projection."""
        B, _, T, hs = y.shape
        dtype = accumulation_dtype(y.dtype)
        y = F.rms_norm(y.to(dtype), (hs,), self.out_norm.to(dtype), self.spec.norm_eps)
        y = y.to(x.dtype).transpose(1, 2).reshape(B, T, self.n_head * hs)  # (B, nh, T, hs) -> (B, T, nh*hs)
        return self.out(y * self._gate(x))

    # ---------------------------------------------------------------------------- the contract

    def benchmark_op(self, seq_len: int, requires_grad: bool = False):
        """The rule alone on what the layer would give it: L2-normalised q and k, beta in (0, 1),
        g from the layer's own decay on random inputs."""
        nh, nkv, hs = self.n_head, self.n_kv_head, self.head_dim
        with torch.no_grad():
            _, beta, g = self._rows(torch.randn(1, seq_len, self.qkv.in_features))
        q = l2_normalised(torch.randn(1, nh, seq_len, hs), self.spec.norm_eps)
        k = l2_normalised(torch.randn(1, nkv, seq_len, hs), self.spec.norm_eps)
        inputs = [q, k, torch.randn(1, nkv, seq_len, hs), beta, g]
        for t in inputs:
            t.requires_grad_(requires_grad)

        def op(q, k, v, beta, g):
            return self.backend(q, k, v, beta, g, chunk_size=self.spec.chunk_size)[0]

        return op, inputs

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: RecurrentCache | None = None, pos: torch.Tensor | None = None) -> torch.Tensor:
        rows, beta, g = self._rows(x)
        if cache is None:
            q, k, v = self._heads(self._convolved(rows, None))
            y = self.backend(q, k, v, beta, g, chunk_size=self.spec.chunk_size)[0]
        elif pos is not None:
            y = cache.decode(rows, beta, g, pos)
        else:
            y = cache.attend(rows, beta, g)
        return self._output(y, x)  # y is already in x's dtype: the rule and the cache return their inputs'

    def naive_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The same, the convolution written as a sum over taps and the rule token by token."""
        rows, beta, g = self._rows(x)
        if self.conv is not None:
            rows = naive_causal_conv(rows, self.conv)
        q, k, v = self._heads(rows)
        return self._output(recurrent_gated_delta_rule(q, k, v, beta, g)[0], x)

    def generation_state(self) -> CacheSpec:
        window = max(self.spec.conv_size - 1, 0) * self.channels // self.n_kv_head
        return CacheSpec("recurrent", self.n_kv_head, self.head_dim, state_numel=self.head_dim ** 2 + window)

    def build_cache(self, context: CacheContext, max_len: int) -> RecurrentCache:
        """The state S (B, nkv, hs, hs) in float32 and the last W-1 rows before the convolution
        (B, W-1, channels), whatever the length. It takes the layer's own per-position inputs: the
        rows before the convolution (B, T, channels), the write strengths (B, nkv, T) and decays."""
        B, nkv, hs, device = context.batch_size, self.n_kv_head, self.head_dim, context.device
        state = {"S": torch.zeros(B, nkv, hs, hs, dtype=accumulation_dtype(context.dtype), device=device),
                 "conv_window": torch.zeros(B, max(self.spec.conv_size - 1, 0), self.channels, dtype=context.dtype,
                                            device=device)}
        return RecurrentCache(context, state, self._chunk_from, self._step_from, time_dim=1)  # rows (B, T, ch)

    def _chunk_from(self, rows: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, state, real):
        S, window = state
        if real is not None:  # left padding: no input to the convolution, no write, no decay
            rows = rows * real[..., None]
            beta = beta * real[:, None]
            g = g * real.view(*real.shape[:1], 1, real.shape[1], *(1,) * (g.dim() - 3))  # g (B, nkv, T[, hs])
        q, k, v = self._heads(self._convolved(rows, window))
        y, S = self.backend(q, k, v, beta, g, state=S, chunk_size=self.spec.chunk_size)
        return y, (S, window_after(window, rows))

    def _step_from(self, rows: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, state):
        S, window = state
        q, k, v = self._heads(self._convolved(rows, window))
        y, S = gated_delta_step(q, k, v, beta, g, self.head_dim ** -0.5, S)
        return y, (S, window_after(window, rows))


class GatedDeltaNet(DeltaRuleLayer):
    """Gated DeltaNet's layer: a decay and a write strength per K/V head, the output gated by
    SiLU(x W_gate). Composed of the pieces it shares with the others, not a softmax layer's
    projections and RoPE."""

    # Weights saved while this layer subclassed GroupedQKV call its SiLU gate `gate`, the sigmoid
    # gate's name there: read under today's name (lm.attention.base.WeightDeclarations).
    former_names = {"gate.weight": "output_gate.weight"}

    def __init__(self, spec: GatedDeltaSpec, shape: LayerShape):
        # Registered in this order (qkv, out, conv, then these) so a seed draws the same initial
        # weights as before this layer stood alone.
        super().__init__(spec, shape)
        nh, nkv, hs = self.n_head, self.n_kv_head, self.head_dim
        self.decay_and_write = nn.Linear(shape.d_model, 2 * nkv, bias=False)  # x W_a | x W_b
        self.A_log = nn.Parameter(torch.empty(nkv))
        self.dt_bias = nn.Parameter(torch.empty(nkv))
        self.output_gate = nn.Linear(shape.d_model, nh * hs, bias=False)  # SiLU(x W_gate) times the output
        self.out_norm = nn.Parameter(torch.ones(hs))
        self.backend = (gated_delta_rule if spec.backend == "torch"
                        else fla_backend("gated_delta", "fla.ops.gated_delta_rule", "chunk_gated_delta_rule"))

    def reset_own_parameters(self) -> None:
        """fla's initialisation: A ~ U(0, 16), dt ~ logU(1e-3, 0.1) through an inverse softplus in
        dt_bias, the convolution as torch's Conv1d default, the output norm's scale one."""
        mamba2_decay_init(self.A_log, self.dt_bias)
        self._reset_conv_and_norm()

    def fused_rows(self) -> dict[str, tuple[int, ...]]:
        """Q, K and V; the decay's W_a and the write strength's W_b."""
        return {**super().fused_rows(), "decay_and_write.weight": (self.n_kv_head, self.n_kv_head)}

    def _rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, C) -> fused Q, K, V rows before the convolution (B, T, channels), beta and g (B, nkv, T)."""
        a, b = self.decay_and_write(x).float().transpose(1, 2).chunk(2, dim=1)  # (B, nkv, T) each
        g = -self.A_log.float().exp()[:, None] * F.softplus(a + self.dt_bias.float()[:, None])  # log decay <= 0
        return self.qkv(x), torch.sigmoid(b), g

    def _gate(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.output_gate(x))


# ------------------------------------------------------------ naive twin (for tests)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                               g: torch.Tensor, scale: float | None = None, state: torch.Tensor | None = None):
    """The gated delta rule one position at a time, as the paper writes the recurrence; the
    shapes and conventions of gated_delta_rule. g may also hold a log decay per key channel,
    (B, nkv, T, hs): Kimi Delta Attention's rule (lm.attention.kda), Diag(a_t) in place of a_t."""
    B, nh, T, hs = q.shape
    nkv, hv = k.shape[1], v.shape[-1]
    group = nh // nkv
    scale = hs ** -0.5 if scale is None else scale
    dtype = accumulation_dtype(q.dtype)
    S = q.new_zeros(B, nkv, hs, hv, dtype=dtype) if state is None else state.to(dtype)
    eye = torch.eye(hs, dtype=dtype, device=q.device)
    outputs = []
    for t in range(T):
        kt, vt, bt = k[:, :, t].to(dtype), v[:, :, t].to(dtype), beta[:, :, t, None, None].to(dtype)
        at = g[:, :, t].to(dtype).exp().reshape(B, nkv, -1, 1)  # (B, nkv, 1 or hs, 1): the decay of each key row
        # S_t = (I - b_t k_t k_t^T) Diag(a_t) S_{t-1} + b_t k_t v_t^T (a scalar a_t: the paper's a_t (I - ...) S_{t-1})
        S = (eye - bt * kt[..., :, None] * kt[..., None, :]) @ (at * S) + bt * kt[..., :, None] * vt[..., None, :]
        qt = q[:, :, t].to(dtype).view(B, nkv, group, hs) * scale  # (B, nkv, g, hs)
        outputs.append((qt @ S).reshape(B, nh, hv))  # o_t = S_t^T q_t for each query head of the group
    return torch.stack(outputs, dim=2).to(q.dtype), S
