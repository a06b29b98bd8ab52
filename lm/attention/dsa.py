"""DeepSeek Sparse Attention (DeepSeek-V3.2, 2025): MLA whose queries read only the top-k positions a
lightning indexer picks.

Shapes: B batch, T new positions, S key positions, L cached slots, C d_model, nh query heads, hs head
size, r kv_rank, dR rope_dim (as lm/attention/mla.py), HI index heads, DI index_dim, k top_k.

The indexer is a few small heads that share one key per position (MQA-like):
    I_{t,s} = sum_j w_{t,j} ReLU(q^I_{t,j} . k^I_s / sqrt(DI))          over s <= t,
with q^I = x W_IQ (HI x DI), k^I = LayerNorm(x W_IK) (DI), w = x W_w / sqrt(HI) (HI), and RoPE on the
first dR numbers of q^I and k^I (DeepSeek-V3.2-Exp's `Indexer`; its queries read the query latent,
ours read x). The main attention is MLA (lm/attention/mla.py), its heads sharing one latent K/V, over
the k positions of highest I for each query (all of them while t < k).

Training phases of the indexer (DeepSeek-V3.2's continued pre-training): the indexer reads x
detached, so its only gradient is its own loss, KL(p || softmax(I)), p the main attention's
distribution (summed over heads, renormalised, detached):
- `dense` warm-up: the main attention stays dense (it is MLA); the KL covers every earlier position;
- `sparse`: the main attention reads the top-k; the KL covers the selected positions.
Its gradient and the language model's touch disjoint parameters, so the layer leaves the KL (a mean
over queries) in `aux_loss` and the training loss adds it unweighted (lm.model.Transformer.aux_loss).

Decoding keeps MLA's [c | k_rope] rows plus k^I per position. A step scores every cached slot with
the indexer (O(L HI DI), cheap), takes the top-k with a fixed k, gathers those k latent rows and
attends over them in the latent space: the main attention costs O(k), not O(L).

Ties in I (an exact 0 whenever every head's ReLU is 0) go to the earlier position, in training,
prefill and decoding alike, so a cache reproduces the full forward's choice wherever the scores
agree to the last bit (in float64, as the tests run it; in float32 or bf16 a prefill and a decoding
step sum the scores in different orders, and a near-tie may fall the other way).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lm.attention.base import Example, LayerShape, register
from lm.attention.cache import CacheContext, CacheSpec, scatter_at, visibility_mask
from lm.attention.mla import LatentAttention, LatentCache, LatentCacheSpec, LatentSpec, float_weight
from lm.attention.rope import apply_rope
from lm.util.checks import require_int
from lm.util.errors import ConfigError

PHASES = ("dense", "sparse")


@register("dsa")
@dataclass(frozen=True)
class SparseLatentSpec(LatentSpec):
    """MLA (its options and defaults) reading the `top_k` positions a lightning indexer of
    `index_heads` heads of `index_dim` numbers scores highest."""

    top_k: int = 64  # k: positions each query reads (DeepSeek-V3.2: 2048 of 128k)
    index_heads: int = 4  # HI (DeepSeek-V3.2: 64)
    index_dim: int | None = None  # DI, the indexer's key per position; None: half the head size, at least rope_dim
    phase: str = "sparse"  # the indexer's training phase: "dense" (warm-up, MLA reads everything) or "sparse"

    examples = {"": Example({"kv_rank": 12, "rope_dim": 4, "top_k": 5, "index_heads": 3, "index_dim": 6}),
                "dense": Example({"kv_rank": 9, "rope_dim": 2, "q_rank": 10, "top_k": 3, "index_heads": 2,
                                  "phase": "dense"})}
    benchmarks = {"": Example({"top_k": 256}, longest=4096)}  # training masks N x N scores: 4096 at most

    def check(self) -> None:
        super().check()
        require_int("top_k", self.top_k)
        require_int("index_heads", self.index_heads)
        if self.index_dim is not None:
            require_int("index_dim", self.index_dim, minimum=2)
        if self.phase not in PHASES:
            raise ConfigError(f"phase={self.phase!r} must be one of {list(PHASES)}")
        if self.rope is False:  # the indexer's keys and the selection rotate as the main keys do
            raise ConfigError("rope=false (NoPE) is MLA's option; dsa's indexer rotates its keys as DeepSeek's "
                              "does, so it takes rope=true only")

    def at(self, head_dim: int) -> SparseLatentSpec:
        spec = super().at(head_dim)
        index_dim = self.index_dim if self.index_dim is not None else max(head_dim // 2, spec.rope_dim)
        return dataclasses.replace(spec, index_dim=index_dim)

    def build(self, shape: LayerShape) -> SparseLatentAttention:
        return SparseLatentAttention(self, shape)

    def flops(self, T: int, n_head: int, n_kv_head: int, head_dim: int) -> float:
        """The main attention over min(t + 1, k) keys per query, plus the indexer's causal pairs."""
        spec = self.at(head_dim)
        k = min(self.top_k, T)
        read = k * (k + 1) / 2 + (T - k) * k  # sum over t of min(t + 1, k)
        if self.phase == "dense":
            read = T * (T + 1) / 2
        return 4 * n_head * head_dim * read + 2 * spec.index_heads * (spec.index_dim + 1) * T * (T + 1) / 2


class LightningIndexer(nn.Module):
    """x (B, T, C) -> the indexer's queries (B, HI, T, DI), head weights (B, HI, T, 1) with both
    scales folded in, and keys (B, 1, T, DI)."""

    def __init__(self, d_model: int, heads: int, dim: int, rope_dim: int):
        super().__init__()
        self.heads, self.dim, self.rope_dim = heads, dim, rope_dim
        self.q_proj = nn.Linear(d_model, heads * dim, bias=False)
        self.k_proj = nn.Linear(d_model, dim, bias=False)
        self.k_norm = nn.LayerNorm(dim)  # DeepSeek-V3.2's k_norm: keys of one scale whatever x's
        self.weights = nn.Linear(d_model, heads, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """cos, sin: the angles of the dR/2 RoPE pairs, (T, dR/2) or (B, T, dR/2)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.dim).transpose(1, 2)  # (B, HI, T, DI)
        k = self.k_norm(self.k_proj(x))[:, None]  # (B, 1, T, DI)
        q, k = self.rotated(q, cos, sin), self.rotated(k, cos, sin)
        # ReLU(a z) = a ReLU(z) for a > 0: 1/sqrt(DI) and 1/sqrt(HI) both ride on the weights.
        w = self.weights(x).transpose(1, 2)[..., None] / math.sqrt(self.heads * self.dim)  # (B, HI, T, 1)
        return q, w, k

    def rotated(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the first dR numbers of t (..., T, DI), the rest as they are (DeepSeek's split)."""
        rope, rest = t.split((self.rope_dim, self.dim - self.rope_dim), dim=-1)
        return torch.cat((apply_rope(rope, cos, sin), rest), dim=-1)


def index_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """I (B, T, S) = sum_j w_j ReLU(q_j . k_s): q (B, HI, T, DI), w (B, HI, T, 1), k (B, 1, S, DI).

    The heads are folded into the query rows of one product, (HI T) x S: broadcasting the one key
    head to HI heads would copy every cached key HI times at each decoding step."""
    B, HI, T, DI = q.shape
    dots = q.reshape(B, HI * T, DI) @ k[:, 0].transpose(-1, -2)  # (B, HI*T, S)
    return (dots.view(B, HI, T, -1).relu() * w).sum(1)  # (B, HI, T, S) -> (B, T, S)


def top_k_mask(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """(..., T, S) bool: for each query the k visible positions of highest score (every visible one
    while fewer than k are), ties at the k-th score going to the earlier positions. Fixed shapes and
    no host reads: the threshold is the k-th value, and the earliest ties fill the places left."""
    k = min(k, scores.shape[-1])
    masked = scores.masked_fill(~visible, float("-inf"))  # (..., T, S)
    kth = masked.topk(k, dim=-1).values[..., -1:]  # (..., T, 1)
    above = masked > kth
    tied = (masked == kth) & visible  # empty where kth is -inf: fewer than k visible, all of them above
    places_left = k - above.sum(-1, keepdim=True)  # (..., T, 1)
    return above | (tied & (tied.cumsum(-1) <= places_left))


def at_least_float32(t: torch.Tensor) -> torch.Tensor:
    """Softmaxes in float32 under bf16 autocast, in float64 where the inputs are."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def top_k_slots(scores: torch.Tensor, visible: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions top_k_mask chooses as a list of k per query, what a decoding step gathers:
    (indices (..., T, k), valid (..., T, k)), the places past the visible positions invalid.

    Scores of 32 bits or fewer rank through one int64 key per position, the float's order in the high
    half and the earlier position's precedence in the low half, so one topk decides value and tie
    alike (the threshold's extra passes and cumsum cost a compiled step as much as the indexer's
    product at 32k slots); float64 scores, whose order fills all 64 bits, go through top_k_mask."""
    k = min(k, scores.shape[-1])
    if scores.dtype == torch.float64:
        picked = top_k_mask(scores, visible, k).to(scores.dtype).topk(k, dim=-1)
        return picked.indices, picked.values > 0
    bits = scores.float().view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)  # the float's order; -0 and +0 both 0
    slots = torch.arange(scores.shape[-1], device=scores.device)
    key = (ordered << 32) | (scores.shape[-1] - 1 - slots)  # ties: the earlier slot's key is larger
    lowest = torch.iinfo(torch.int64).min
    picked = key.masked_fill(~visible, lowest).topk(k, dim=-1)
    return picked.indices, picked.values > lowest


def indexer_kl(probs: torch.Tensor, scores: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Mean over queries of KL(p || softmax(I)) over the positions `chosen` (B, T, S): p (B, T, S) the
    main attention's distribution (a target: no gradient), scores I (B, T, S)."""
    log_q = at_least_float32(scores).masked_fill(~chosen, float("-inf")).log_softmax(-1)  # (B, T, S)
    log_q = log_q.masked_fill(~chosen, 0.0)  # p is 0 there: no 0 x -inf
    return (torch.xlogy(probs, probs) - probs * log_q).sum(-1).mean()


class SparseLatentAttention(LatentAttention):
    def __init__(self, spec: SparseLatentSpec, shape: LayerShape):
        super().__init__(spec, shape)
        spec = spec.at(shape.head_dim)
        if spec.index_dim < self.rope_dim:
            raise ConfigError(f"index_dim={spec.index_dim} must be at least rope_dim={self.rope_dim}: the indexer "
                              "rotates its first rope_dim numbers as the main keys' RoPE part")
        self.top_k, self.phase = spec.top_k, spec.phase
        self.indexer = LightningIndexer(shape.d_model, spec.index_heads, spec.index_dim, self.rope_dim)

    def index(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The indexer on x detached (its gradient is its own KL alone): q (B, HI, T, DI), w, k (B, 1, T, DI)."""
        return self.indexer(x.detach(), *self.rope_angles(cos, sin))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: SparseLatentCache | None = None, pos: torch.Tensor | None = None) -> torch.Tensor:
        q, latent, indexed = self.queries(x, cos, sin), self.latent(x, cos, sin), self.index(x, cos, sin)
        self.aux_loss = None
        if cache is None:
            y = self.attend_all(q, latent, indexed)
        elif pos is not None:
            y = cache.decode(q, latent, *indexed, pos)
        else:
            y = cache.attend(q, latent, *indexed)
        return self.merge(y)

    def sparse(self, visible_at_most: int) -> bool:
        """Whether selection can leave out a position a query sees (at most `visible_at_most` of them)."""
        return self.phase == "sparse" and self.top_k < visible_at_most

    def attend_all(self, q: torch.Tensor, latent: torch.Tensor, indexed) -> torch.Tensor:
        """Training and scoring: q (B, nh, T, hs) over the decompressed K/V of the selected positions;
        in training, the indexer's KL left in `aux_loss`."""
        training = self.training and torch.is_grad_enabled()
        if not (training or self.sparse(q.shape[2])):
            return self.attend(q, latent)  # every query reads every earlier position, no loss wanted: MLA
        scores = index_scores(*indexed)  # (B, T, T)
        y, chosen = self.attend_top_k(q, latent, scores)
        if training:
            self.aux_loss = indexer_kl(self.attention_probs(q, latent, chosen), scores, chosen)
        return y

    def attend_top_k(self, q: torch.Tensor, latent: torch.Tensor, scores: torch.Tensor):
        """(output (B, nh, T, hs), the positions read (B, T, T)): each query over the top-k of its index
        scores (B, T, T), or MLA itself where that leaves nothing out."""
        T = q.shape[2]
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        if not self.sparse(T):
            return self.attend(q, latent), causal.expand_as(scores)
        chosen = top_k_mask(scores, causal, self.top_k)  # (B, T, T)
        return self.attend_selected(q, latent, chosen), chosen

    def attend_selected(self, q: torch.Tensor, latent: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """q (B, nh, T, hs) over the decompressed K/V where chosen (B, T, T) says so."""
        k, v = self.decompress(latent)  # (B, nh, T, hs) each
        return F.scaled_dot_product_attention(q, k, v, attn_mask=chosen[:, None])  # mask (B, 1, T, T)

    @torch.no_grad()
    def attention_probs(self, q: torch.Tensor, latent: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The indexer's target (B, T, T): the main attention's probabilities over the chosen positions,
        summed over heads and renormalised (a mean over heads, each head's row summing to one)."""
        k, _ = self.decompress(latent)  # (B, nh, T, hs)
        logits = at_least_float32(q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)  # (B, nh, T, T)
        return logits.masked_fill(~chosen[:, None], float("-inf")).softmax(-1).mean(1)  # (B, T, T)

    def naive_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """From the weights: the indexer head by head, the selection by a stable sort, and MLA's
        head-by-head softmax over the selected positions."""
        B, T, _ = x.shape
        ix, dR = self.indexer, self.rope_dim
        pair_cos, pair_sin = self.rope_angles(cos, sin)  # (T, dR/2) each
        keys = F.layer_norm(x @ float_weight(ix.k_proj).T, (ix.dim,), ix.k_norm.weight, ix.k_norm.bias)  # (B, T, DI)
        keys = torch.cat((apply_rope(keys[:, None, :, :dR], pair_cos, pair_sin)[:, 0], keys[..., dR:]), dim=-1)
        w_q, w_w = float_weight(ix.q_proj), float_weight(ix.weights)  # (HI*DI, C), (HI, C)
        scores = torch.zeros(B, T, T, dtype=x.dtype, device=x.device)
        for j in range(ix.heads):
            q = x @ w_q[j * ix.dim:(j + 1) * ix.dim].T  # (B, T, DI)
            q = torch.cat((apply_rope(q[:, None, :, :dR], pair_cos, pair_sin)[:, 0], q[..., dR:]), dim=-1)
            weight = (x @ w_w[j]) / math.sqrt(ix.heads)  # (B, T)
            scores = scores + weight[..., None] * (q @ keys.transpose(-1, -2) / math.sqrt(ix.dim)).relu()
        visible = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        chosen = visible.expand(B, T, T)
        if self.phase == "sparse":
            order = torch.sort(scores.masked_fill(~visible, float("-inf")), dim=-1, descending=True,
                               stable=True).indices[..., :self.top_k]  # (B, T, min(k, T)): ties keep position order
            chosen = torch.zeros_like(chosen).scatter(-1, order, True) & visible
        return self.naive_over(x, cos, sin, chosen)

    def benchmark_op(self, seq_len: int, requires_grad: bool = False):
        """Scoring, selection and the sparse attention at batch 1 on q (1, nh, N, hs) and latent
        (1, 1, N, r + dR); the indexer's own outputs are fixed random inputs (its KL, a training
        extra, is left out)."""
        ix = self.indexer
        indexed = (torch.randn(1, ix.heads, seq_len, ix.dim), torch.randn(1, ix.heads, seq_len, 1),
                   torch.randn(1, 1, seq_len, ix.dim))  # q (1, HI, N, DI), w (1, HI, N, 1), k (1, 1, N, DI)

        def op(q, latent):
            return self.attend_top_k(q, latent, index_scores(*indexed))[0]

        inputs = [torch.randn(1, self.n_head, seq_len, self.head_dim, requires_grad=requires_grad),
                  torch.randn(1, 1, seq_len, self.kv_rank + self.rope_dim, requires_grad=requires_grad)]
        return op, inputs

    def generation_state(self) -> CacheSpec:
        return LatentCacheSpec("latent", 1, self.kv_rank + self.rope_dim + self.indexer.dim)

    def build_cache(self, context: CacheContext, max_len: int) -> SparseLatentCache:
        return SparseLatentCache(context, self, max_len)


class SparseLatentCache(LatentCache):
    """MLA's [c | k_rope] rows (B, 1, L, r + dR) plus the indexer's key of every slot (B, 1, L, DI)."""

    def __init__(self, context: CacheContext, layer: SparseLatentAttention, max_len: int):
        super().__init__(context, layer, max_len)
        self.index_keys = torch.zeros(context.batch_size, 1, max_len, layer.indexer.dim, dtype=context.dtype,
                                      device=context.device)

    def attend(self, q: torch.Tensor, latent: torch.Tensor, index_q: torch.Tensor, index_w: torch.Tensor,
               index_k: torch.Tensor) -> torch.Tensor:
        """The next T positions: every row so far is scored, each query reads its top-k."""
        start, T = self.context.seen, q.shape[2]
        end = start + T
        if end > self.rows.shape[2]:
            raise ValueError(f"the latent cache holds {self.rows.shape[2]} positions; {end} were asked for")
        self.rows[:, :, start:end] = latent
        self.index_keys[:, :, start:end] = index_k
        q_slots, k_slots = torch.arange(start, end, device=q.device), torch.arange(end, device=q.device)
        visible = visibility_mask(self.context, q_slots, k_slots, k_slots[None, :] <= q_slots[:, None])
        if self.layer.sparse(end):
            visible = visible if visible.dim() == 2 else visible[:, 0]  # (T, S) or (B, T, S)
            scores = index_scores(index_q, index_w, self.index_keys[:, :, :end])  # (B, T, S)
            visible = top_k_mask(scores, visible, self.layer.top_k)[:, None]  # (B, 1, T, S)
        return self.latent_attention(q, self.rows[:, :, :end], visible)

    def decode(self, q: torch.Tensor, latent: torch.Tensor, index_q: torch.Tensor, index_w: torch.Tensor,
               index_k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One position per row at its slot pos (B,): the indexer scores the whole buffer, later slots
        and padding masked; the k chosen rows are gathered and attended over, a fixed k of them."""
        scatter_at(self.rows, pos, latent)
        scatter_at(self.index_keys, pos, index_k)
        visible = self.context.decode_mask(pos)  # (B, 1, 1, L)
        if not self.layer.sparse(self.rows.shape[2]):
            return self.latent_attention(q, self.rows, visible)
        scores = index_scores(index_q, index_w, self.index_keys)  # (B, 1, L)
        picked, valid = top_k_slots(scores, visible[:, 0], self.layer.top_k)  # (B, 1, k) each
        slots = picked[..., None].expand(-1, -1, -1, self.rows.shape[-1])  # (B, 1, k, r + dR)
        rows = self.rows.gather(2, slots)  # (B, 1, k, r + dR)
        return self.latent_attention(q, rows, valid[:, None])  # mask (B, 1, 1, k)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"rows": self.rows, "index_keys": self.index_keys}
