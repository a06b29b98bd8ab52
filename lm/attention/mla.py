"""Multi-head latent attention (DeepSeek-V2, 2024) with an absorbed latent cache.

Shapes: B batch, T new positions, L cached positions, C d_model, nh query heads, hs head size,
r kv_rank (the latent), dR rope_dim (the shared RoPE key), dn = hs - dR (the part without RoPE).

Every head's key is [k_nope; k_rope] and its query [q_nope; q_rope], each hs wide:
- the latent c = x W_DKV (r numbers per position) decompresses into each head's k_nope = W_UK,h c
  and value v = W_UV,h c (hs wide);
- k_rope = x W_KR (dR numbers per position) is one key part shared by every head, and the only
  part RoPE rotates ("decoupled RoPE": a rotation between W_UK and the query would stop W_UK from
  being absorbed, below);
- queries come from x directly, or through a low-rank bottleneck x W_DQ W_UQ (`q_rank`).
Training decompresses K and V and runs SDPA (scale 1/sqrt(hs), as MHA of the same head size).

The cache holds only (c, k_rope): (r + dR) numbers per position and layer, whatever nh. Decoding
never decompresses them; it absorbs the up-projections instead (DeepSeek-V3's `attn_impl="absorb"`):
    q_nope . (W_UK,h c) = (W_UK,h^T q_nope) . c       and       sum_t p_t W_UV,h c_t = W_UV,h sum_t p_t c_t
so each head's query moves into the latent space (r numbers plus its q_rope), attends over the
cached [c; k_rope] rows as one shared K/V head (MQA-like), and its latent output goes through W_UV,h.

RoPE frequencies: the dR/2 rotated pairs of the shared key are chosen among the hs/2 frequencies
of a head (`rope_pairs`, pair i rotating by theta^(-2i/hs)): by default evenly spaced, i * hs/dR,
which is DeepSeek's own table theta^(-2j/dR); a conversion from MHA keeps the pairs that matter
most (lm/formats/to_latent.py).

Latent norm (`latent_norm=true`, DeepSeek-V2/V3's and Kimi Linear's `kv_a_layernorm`): c is
RMS-normalised with a learned gain before it is cached, so the cache holds the normalised latent and
decoding absorbs as before. Off by default: a linear latent is what an MHA model converts into
exactly (lm/formats/to_latent.py).

NoPE (`rope=false`, Kimi Linear's `mla_use_nope`): nothing is rotated. The decoupled key part
stays, a dR-wide key shared by every head with its query part, as Kimi Linear keeps its
qk_rope_head_dim=64 unrotated (transformers' KimiLinear MLA); position then reaches the layer
only through causality and the layers before it (in Kimi Linear, the KDA layers).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lm.attention.base import AttentionLayer, AttentionSpec, Example, LayerShape, register
from lm.attention.cache import CacheContext, CacheSpec, scatter_at, visibility_mask
from lm.attention.rope import apply_rope
from lm.util.checks import require_bool, require_int
from lm.util.errors import ConfigError

# The latent norm's epsilon: DeepSeek-V3's and Kimi Linear's kv_a_layernorm use their RMSNorm's default,
# 1e-6, whatever the model's own rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@register("mla")
@dataclass(frozen=True)
class LatentSpec(AttentionSpec):
    """Keys and values from a cached latent of `kv_rank` numbers, plus one RoPE key of `rope_dim`."""

    kv_rank: int | None = None  # r: the latent per position, the cache's main part; None: 3/2 of the head size
    rope_dim: int | None = None  # dR: the RoPE key shared by every head and the RoPE part of each query; None: a
    # quarter of the head size (even). The defaults cache 7/4 of a head per position: less than MQA's K and V.
    q_rank: int = 0  # queries through a rank-q_rank bottleneck (DeepSeek's q_lora_rank); 0: a full projection
    rope_pairs: tuple[int, ...] | None = None  # the head's RoPE frequency pairs the shared key uses; None: spaced
    rope: bool = True  # false: NoPE, the shared key part and every query left unrotated (Kimi Linear)
    latent_norm: bool = False  # true: RMSNorm with a gain on the latent c before it is cached (kv_a_layernorm)

    examples = {"": Example({"kv_rank": 12, "rope_dim": 4}),
                "low-rank-queries": Example({"kv_rank": 7, "rope_dim": 2, "q_rank": 10}),
                "chosen-pairs": Example({"kv_rank": 9, "rope_dim": 4, "rope_pairs": [3, 1]}),
                "nope": Example({"kv_rank": 10, "rope_dim": 2, "q_rank": 9, "rope": False}),
                "latent-norm": Example({"kv_rank": 11, "rope_dim": 4, "rope": False, "latent_norm": True})}
    benchmarks = {"": Example()}

    def check(self) -> None:
        if self.kv_rank is not None:
            require_int("kv_rank", self.kv_rank)
        if self.rope_dim is not None:
            require_int("rope_dim", self.rope_dim, minimum=2)
            if self.rope_dim % 2:
                raise ConfigError(f"rope_dim={self.rope_dim} must be even: RoPE rotates pairs of dimensions")
        require_int("q_rank", self.q_rank, minimum=0)
        if self.rope_pairs is not None:
            pairs = self.rope_pairs
            if isinstance(pairs, (str, bytes)) or not hasattr(pairs, "__iter__") or not all(
                    isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in pairs):
                raise ConfigError(f"rope_pairs={pairs!r} must be a list of frequency pair indices (integers >= 0)")
            wanted = len(list(pairs)) if self.rope_dim is None else self.rope_dim // 2  # no rope_dim: it follows
            if len(set(pairs)) != len(list(pairs)) or len(list(pairs)) != wanted:
                count = "" if self.rope_dim is None else f"rope_dim/2 = {wanted} "
                raise ConfigError(f"rope_pairs={list(pairs)} must be {count}distinct pairs")
            object.__setattr__(self, "rope_pairs", tuple(pairs))  # hashable and comparable, from a list too
        require_bool("rope", self.rope)
        require_bool("latent_norm", self.latent_norm)
        if not self.rope and self.rope_pairs is not None:
            raise ConfigError(f"rope_pairs={list(self.rope_pairs)} with rope=false: NoPE rotates nothing, so no "
                              "frequency pairs are used; leave rope_pairs unset")

    def at(self, head_dim: int) -> LatentSpec:
        """This spec with the sizes it left to the head size filled in: kv_rank 3 hs/2, rope_dim hs/4
        (even, at least 2); 96 and 16 at head size 64."""
        rope_dim = self.rope_dim
        if rope_dim is None:
            rope_dim = len(self.rope_pairs) * 2 if self.rope_pairs is not None else max(2, head_dim // 8 * 2)
        kv_rank = self.kv_rank if self.kv_rank is not None else 3 * head_dim // 2
        return dataclasses.replace(self, kv_rank=kv_rank, rope_dim=rope_dim)

    def build(self, shape: LayerShape) -> LatentAttention:
        return LatentAttention(self, shape)

    def flops(self, T: int, n_head: int, n_kv_head: int, head_dim: int) -> float:
        return 4 * n_head * head_dim * T * (T + 1) / 2  # as MHA of the same head size, over the decompressed K/V

    def pairs(self, head_dim: int) -> tuple[int, ...]:
        """The frequency pairs (of head_dim/2) the RoPE part rotates with."""
        if self.rope_pairs is not None:
            return self.rope_pairs
        rope_dim = self.at(head_dim).rope_dim
        return tuple(j * head_dim // rope_dim for j in range(rope_dim // 2))


@dataclass(frozen=True)
class LatentCacheSpec(CacheSpec):
    """(c, k_rope) of every position: `head_dim` is their width r + dR, held once for all heads."""

    def numel(self, seq_len: int, batch: int = 1) -> int:
        return batch * seq_len * self.head_dim


def check_query_rank(q_rank: int, d_model: int) -> None:
    """A query bottleneck (MLA's q_rank) is at most the width it compresses: wider, it compresses
    nothing and only grows the model (q_rank=100000 at d_model=64 is 300 times the model's weights).
    Training and uptraining refuse it alike."""
    if q_rank > d_model:
        raise ConfigError(f"attn.q_rank={q_rank} is more than d_model={d_model}: a query bottleneck wider than "
                          "its input compresses nothing")


class LatentAttention(AttentionLayer):
    def __init__(self, spec: LatentSpec, shape: LayerShape):
        super().__init__()
        check_query_rank(spec.q_rank, shape.d_model)  # before any weight is made: a huge one is refused at once
        C, nh, hs = shape.d_model, shape.n_head, shape.head_dim
        spec = spec.at(hs)
        r, dR = spec.kv_rank, spec.rope_dim
        if dR >= hs:
            raise ConfigError(f"rope_dim={dR} must be less than the head size {hs}: the rest of each key comes "
                              "from the latent")
        widest = nh * (2 * hs - dR)  # every head's k_nope and v: a wider latent compresses nothing
        if r > widest:
            raise ConfigError(f"kv_rank={r} is more than the {widest} numbers it decompresses into "
                              f"(n_head={nh} x (k_nope {hs - dR} + v {hs})); choose at most {widest}")
        pairs = spec.pairs(hs)
        if max(pairs) >= hs // 2:
            raise ConfigError(f"rope_pairs={list(pairs)} names a pair past the head's {hs // 2} frequency pairs")
        self.layer_idx = shape.layer_idx
        self.n_head, self.head_dim, self.kv_rank, self.rope_dim = nh, hs, r, dR
        self.nope_dim = hs - dR
        self.uses_rope = spec.rope  # False: NoPE, rotate() leaves its input as it is
        # Rows of every query head: [q_nope (dn) | q_rope (dR)].
        self.q_down = nn.Linear(C, spec.q_rank, bias=False) if spec.q_rank else None
        self.q_up = nn.Linear(spec.q_rank or C, nh * hs, bias=False)
        # [c (r) | k_rope (dR)] in one GEMM, DeepSeek's wkv_a.
        self.kv_down = nn.Linear(C, r + dR, bias=False)
        # Rows of every head: [k_nope (dn) | v (hs)], DeepSeek's wkv_b.
        self.kv_up = nn.Linear(r, nh * (self.nope_dim + hs), bias=False)
        self.latent_norm = nn.Parameter(torch.ones(r)) if spec.latent_norm else None  # the gain of c's RMSNorm
        self.out = nn.Linear(nh * hs, C, bias=False)
        self.register_buffer("rope_pairs", torch.tensor(pairs), persistent=False)  # (dR/2,)

    def fused_rows(self) -> dict[str, tuple[int, ...]]:
        """Own weights that stack several matrices, and the rows of each (lm.training.optim): kv_down
        holds the latent's and the shared RoPE key's. kv_up's rows interleave k_nope and v head by
        head: it is the one map from the latent to every head, orthogonalised whole."""
        return {"kv_down.weight": (self.kv_rank, self.rope_dim)}

    # ---------------------------------------------------------------- projections

    def rope_angles(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's angles (..., T, hs/2) -> those of the chosen pairs (..., T, dR/2)."""
        return cos[..., self.rope_pairs], sin[..., self.rope_pairs]

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The RoPE part x (..., T, dR) rotated by the chosen pairs' angles; as it is under NoPE."""
        return apply_rope(x, *self.rope_angles(cos, sin)) if self.uses_rope else x

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (B, T, C) -> q (B, nh, T, hs) as [q_nope | q_rope], the RoPE part rotated."""
        B, T, _ = x.shape
        q = self.q_up(self.q_down(x) if self.q_down is not None else x)  # (B, T, nh*hs)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        q_nope, q_rope = q.split((self.nope_dim, self.rope_dim), dim=-1)
        return torch.cat((q_nope, self.rotate(q_rope, cos, sin)), dim=-1)

    def latent(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (B, T, C) -> what the cache keeps, (B, 1, T, r + dR): [c | k_rope], k_rope rotated."""
        rows = self.kv_down(x)[:, None]  # (B, 1, T, r + dR): one row shared by every head
        c, k_rope = rows.split((self.kv_rank, self.rope_dim), dim=-1)
        if self.latent_norm is not None:
            c = F.rms_norm(c, (self.kv_rank,), self.latent_norm, LATENT_NORM_EPS)
        return torch.cat((c, self.rotate(k_rope, cos, sin)), dim=-1)

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK (nh, dn, r) and W_UV (nh, hs, r), from kv_up's weight."""
        w = float_weight(self.kv_up).view(self.n_head, self.nope_dim + self.head_dim, self.kv_rank)  # (nh, dn+hs, r)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def decompress(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[c | k_rope] (B, 1, T, r + dR) -> every head's key (B, nh, T, hs) and value (B, nh, T, hs)."""
        B, _, T, _ = latent.shape
        c, k_rope = latent[:, 0].split((self.kv_rank, self.rope_dim), dim=-1)  # (B, T, r), (B, T, dR)
        kv = self.kv_up(c).view(B, T, self.n_head, self.nope_dim + self.head_dim).transpose(1, 2)  # (B, nh, T, dn+hs)
        k_nope, v = kv.split((self.nope_dim, self.head_dim), dim=-1)
        k = torch.cat((k_nope, k_rope[:, None].expand(B, self.n_head, T, self.rope_dim)), dim=-1)  # (B, nh, T, hs)
        # v as a view starts dn numbers into each row: CUDA's fused SDPA kernels read 16-byte vectors
        # and, where dn (or a row) is not a multiple of 16 bytes, read misaligned memory (a CUDA
        # fault, or wrong values from the flash kernel in bf16) instead of refusing the view.
        return k, v.contiguous()

    def absorbed_query(self, q: torch.Tensor) -> torch.Tensor:
        """q (B, nh, T, hs) -> its latent-space form (B, nh, T, r + dR): [W_UK,h^T q_nope | q_rope]."""
        w_uk, _ = self.up_projections()
        q_nope, q_rope = q.split((self.nope_dim, self.rope_dim), dim=-1)
        return torch.cat((torch.einsum("bhtd,hdr->bhtr", q_nope, w_uk), q_rope), dim=-1)

    def absorbed_output(self, y_latent: torch.Tensor) -> torch.Tensor:
        """Attention-weighted latents (B, nh, T, r) -> each head's output W_UV,h y (B, nh, T, hs)."""
        _, w_uv = self.up_projections()
        return torch.einsum("bhtr,hvr->bhtv", y_latent, w_uv)

    # ---------------------------------------------------------------- the layer

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LatentCache | None = None, pos: torch.Tensor | None = None) -> torch.Tensor:
        q, latent = self.queries(x, cos, sin), self.latent(x, cos, sin)
        if cache is None:
            y = self.attend(q, latent)  # (B, nh, T, hs)
        elif pos is not None:
            y = cache.decode(q, latent, pos)  # the fixed-shape step, in the latent space
        else:
            y = cache.attend(q, latent)
        return self.merge(y)

    def merge(self, y: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = y.shape
        return self.out(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))  # (B, T, nh*hs) -> (B, T, C)

    def attend(self, q: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        """Training: q (B, nh, T, hs) over the decompressed keys and values of latent (B, 1, T, r + dR)."""
        k, v = self.decompress(latent)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def naive_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Head by head from the weights, a full score matrix under a causal mask."""
        T = x.shape[1]
        return self.naive_over(x, cos, sin, torch.ones(T, T, dtype=torch.bool, device=x.device).tril())

    def naive_over(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """The naive twin with each query reading the positions `visible` marks, (T, T) or (B, T, T)
        (DSA's naive twin passes the positions its indexer chose)."""
        B, T, _ = x.shape
        nh, hs, dn, r = self.n_head, self.head_dim, self.nope_dim, self.kv_rank
        w_q = float_weight(self.q_up)  # (nh*hs, C or q_rank)
        w_q = w_q if self.q_down is None else w_q @ float_weight(self.q_down)  # (nh*hs, C)
        w_down, w_up = float_weight(self.kv_down), float_weight(self.kv_up)  # (r + dR, C), (nh*(dn+hs), r)
        pair_cos, pair_sin = self.rope_angles(cos, sin)  # (T, dR/2) each
        if not self.uses_rope:  # NoPE: the angles of position 0, a rotation by nothing
            pair_cos, pair_sin = torch.ones_like(pair_cos), torch.zeros_like(pair_sin)
        c = x @ w_down[:r].T  # (B, T, r)
        if self.latent_norm is not None:
            c = c / torch.sqrt((c * c).mean(-1, keepdim=True) + LATENT_NORM_EPS) * self.latent_norm
        k_rope = apply_rope((x @ w_down[r:].T)[:, None], pair_cos, pair_sin)[:, 0]  # (B, T, dR)
        heads = []
        for h in range(nh):
            q = x @ w_q[h * hs:(h + 1) * hs].T  # (B, T, hs)
            q = torch.cat((q[..., :dn], apply_rope(q[:, None, :, dn:], pair_cos, pair_sin)[:, 0]), dim=-1)
            rows = w_up[h * (dn + hs):(h + 1) * (dn + hs)]  # (dn + hs, r)
            k = torch.cat((c @ rows[:dn].T, k_rope), dim=-1)  # (B, T, hs)
            v = c @ rows[dn:].T  # (B, T, hs)
            scores = (q @ k.transpose(-1, -2) / math.sqrt(hs)).masked_fill(~visible, float("-inf"))  # (B, T, T)
            heads.append(scores.softmax(-1) @ v)  # (B, T, hs)
        return self.merge(torch.stack(heads, dim=1))  # (B, nh, T, hs)

    def benchmark_op(self, seq_len: int, requires_grad: bool = False):
        """The attention op at batch 1, decompression included: q (1, nh, N, hs), latent (1, 1, N, r + dR)."""
        inputs = [torch.randn(1, self.n_head, seq_len, self.head_dim, requires_grad=requires_grad),
                  torch.randn(1, 1, seq_len, self.kv_rank + self.rope_dim, requires_grad=requires_grad)]
        return self.attend, inputs

    def generation_state(self) -> CacheSpec:
        return LatentCacheSpec("latent", 1, self.kv_rank + self.rope_dim)

    def build_cache(self, context: CacheContext, max_len: int) -> LatentCache:
        return LatentCache(context, self, max_len)

    def reset_own_parameters(self) -> None:
        """The latent norm's gain one; the matrices take the model's normal(0, init_std)."""
        if self.latent_norm is not None:
            with torch.no_grad():
                self.latent_norm.fill_(1.0)


def float_weight(linear: nn.Module) -> torch.Tensor:
    """A projection's weight (out, in) as floats: an nn.Linear's own, or a weight-only int8 one's
    (lm.generation.quantize keeps int8 rows and one scale per row) dequantized, since absorbing
    multiplies by the matrix itself rather than calling the layer."""
    if isinstance(linear, nn.Linear):
        return linear.weight
    return linear.weight.to(linear.scales.dtype) * linear.scales[:, None]  # (out, in) int8 times (out,)


class LatentCache:
    """[c | k_rope] of every position, (B, 1, max_len, r + dR), written in place; attention runs in
    the latent space (the layer's absorbed query and output), never on decompressed K/V."""

    def __init__(self, context: CacheContext, layer: LatentAttention, max_len: int):
        self.context, self.layer = context, layer
        width = layer.kv_rank + layer.rope_dim
        self.rows = torch.zeros(context.batch_size, 1, max_len, width, dtype=context.dtype, device=context.device)

    def latent_attention(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q (B, nh, T, hs) over cached rows keys (B, 1, S, r + dR) -> (B, nh, T, hs), `mask` (T, S)
        or (B, 1, T, S) saying which rows each query sees. The values are the latents themselves (the
        first r numbers of each row); the scale stays 1/sqrt(hs), the width of the decompressed scores.

        Every head reads the same rows, so the heads are folded into the query rows of one head:
        one (nh T) x S product, where SDPA's enable_gqa would copy the rows out to each head."""
        layer = self.layer
        B, nh, T, _ = q.shape
        rows = layer.absorbed_query(q).reshape(B, 1, nh * T, -1)  # (B, 1, nh*T, r + dR): head-major rows
        mask = mask.repeat(nh, 1) if mask.dim() == 2 else mask.repeat(1, 1, nh, 1)  # (nh*T, S) or (B, 1, nh*T, S)
        # The whole rows as values, the RoPE part of the output dropped after: with values as wide as
        # the keys SDPA takes its fused (flash) CPU kernel; with the r-wide latents alone it falls back
        # to the explicit path (matmuls, mask handling, softmax: 5x the time of a decoding step at 32k).
        y_rows = F.scaled_dot_product_attention(rows, keys, keys, attn_mask=mask,
                                                scale=1 / math.sqrt(layer.head_dim))  # (B, 1, nh*T, r + dR)
        y_latent = y_rows[..., : layer.kv_rank]  # (B, 1, nh*T, r)
        return layer.absorbed_output(y_latent.reshape(B, nh, T, layer.kv_rank))  # (B, nh, T, r) -> (B, nh, T, hs)

    def attend(self, q: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        """The next T positions: latent (B, 1, T, r + dR) is stored, q (B, nh, T, hs) attends over every row so far."""
        start, T = self.context.seen, q.shape[2]
        end = start + T
        if end > self.rows.shape[2]:
            raise ValueError(f"the latent cache holds {self.rows.shape[2]} positions; {end} were asked for")
        self.rows[:, :, start:end] = latent
        q_slots = torch.arange(start, end, device=q.device)
        k_slots = torch.arange(end, device=q.device)
        mask = visibility_mask(self.context, q_slots, k_slots, k_slots[None, :] <= q_slots[:, None])
        return self.latent_attention(q, self.rows[:, :, :end], mask)

    def decode(self, q: torch.Tensor, latent: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One position per row at its slot pos (B,): latent (B, 1, 1, r + dR) is stored, q (B, nh, 1, hs)
        attends over the whole buffer, later slots masked."""
        scatter_at(self.rows, pos, latent)
        return self.latent_attention(q, self.rows, self.context.decode_mask(pos))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"rows": self.rows}
