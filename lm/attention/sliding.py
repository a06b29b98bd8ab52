"""Causal sliding-window attention with dilation (Longformer-style).

Shapes: B batch, T sequence length, nh query heads, nkv K/V heads, hs head size, W window.
Query i attends keys j = i - k*d for 0 <= k < W (d the dilation), so each layer sees a
fixed span of W*d positions and the cost grows linearly with T.

The fast path never forms a T x T score matrix. Without dilation it cuts the sequence into
blocks of W queries; block b attends the keys of blocks b-1 and b (2W keys) under one fixed
(W, 2W) band mask, which SDPA's CPU/GPU kernels take directly. With dilation d, positions
sharing a residue mod d form an undilated sequence of their own (i - k*d stays in the same
residue class), so the d subsequences are folded into the batch and solved as above.
Options besides the window: an output gate and QK-norm (lm.attention.projections), logit
softcapping (lm.attention.scores, which every softmax here goes through), sinks (lm.attention.sinks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lm.attention.base import Example, LayerShape, register
from lm.attention.cache import CacheContext, CacheSpec, scatter_at, visibility_mask
from lm.attention.projections import GroupedQKV, ProjectionOptions
from lm.attention.reference import masked_softmax_attention
from lm.attention.scores import check_softcap, softmax_attention
from lm.attention.sinks import SINK_DIMS, learned_sink_logit, masked_attention, widen_for_sink
from lm.util.checks import require_bool, require_int


def band_mask(window: int, device: torch.device) -> torch.Tensor:
    """(W, 2W) bool: query a of a block may see key c of [previous block, own block]."""
    a = torch.arange(window, device=device)[:, None]
    offset = torch.arange(2 * window, device=device)[None, :] - window  # key position - block start
    return (offset <= a) & (offset > a - window)


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                             dilation: int = 1, softcap: float | None = None) -> torch.Tensor:
    """q (B, nh, T, hs), k and v (B, nkv, T, hs) -> (B, nh, T, hs); scores capped at `softcap` if given."""
    if dilation > 1:
        return _dilated(q, k, v, window, dilation, softcap)
    B, nh, T, hs = q.shape
    if window >= T:  # the window covers every earlier position: plain causal attention
        return softmax_attention(q, k, v, causal=True, softcap=softcap)
    W = window
    n_blocks = -(-T // W)
    if n_blocks * W != T:  # padded positions come after every real one, so causality hides them
        q, k, v = (F.pad(t, (0, 0, 0, n_blocks * W - T)) for t in (q, k, v))
    # Block 0 has no previous block; inside it the window reaches back to position 0.
    first = softmax_attention(q[:, :, :W], k[:, :, :W], v[:, :, :W], causal=True, softcap=softcap)
    if n_blocks == 1:
        return first[:, :, :T]
    rest = n_blocks - 1
    q_blocks = q[:, :, W:].unflatten(2, (rest, W)).transpose(1, 2).flatten(0, 1)  # (B*rest, nh, W, hs)
    k_pairs, v_pairs = _block_pairs(k, W), _block_pairs(v, W)  # (B*rest, nkv, 2W, hs) each
    out = softmax_attention(q_blocks, k_pairs, v_pairs, mask=band_mask(W, q.device), softcap=softcap)
    out = out.unflatten(0, (B, rest)).transpose(1, 2).flatten(2, 3)  # (B, nh, T - W, hs)
    return torch.cat((first, out), dim=2)[:, :, :T]


def sliding_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, dilation: int,
                       sink_tokens: int, sink_logit: torch.Tensor | None,
                       softcap: float | None = None) -> torch.Tensor:
    """The window plus sinks: the first `sink_tokens` positions stay visible to every query, and a
    learned per-head `sink_logit` (nh,) joins each softmax (lm.attention.sinks); scores capped at
    `softcap` if given (never with a learned sink: lm.attention.scores).

    Every residue class of the dilation becomes a row of the batch, cut into blocks of W queries;
    block n attends [the extra keys | block n-1 | block n] (a zero block stands before block 0)
    under a mask from absolute positions, so a sink already inside a query's window counts once.
    Costs O(T (W + sinks)), like the plain window."""
    B, nh, T, hs = q.shape
    W, d = window, dilation
    S = min(sink_tokens, T)
    extra_k, extra_v = k[:, :, :S], v[:, :, :S]  # (B, nkv, S, hs): the sink tokens' own keys
    scale = None
    if sink_logit is not None:  # values widened too, as in lm.attention.sinks: one head size for SDPA
        q, k, sink_key, scale = widen_for_sink(q, k, sink_logit)
        v = F.pad(v, (0, SINK_DIMS))
        extra_k = torch.cat((sink_key, F.pad(extra_k, (0, SINK_DIMS))), dim=2)  # (B, nkv, 1 + S, e)
        extra_v = F.pad(extra_v, (0, SINK_DIMS, 1, 0))  # the sink's value is zero
    E = extra_k.shape[2]  # extra keys per block
    n = -(-T // (d * W))  # blocks per residue class
    m = n * W  # positions per residue class
    q, k, v = (F.pad(t, (0, 0, 0, m * d - T)) for t in (q, k, v))

    def fold(x: torch.Tensor) -> torch.Tensor:  # (B, h, m*d, c) -> (B*d, h, m, c): residue r at row b*d + r
        return x.unflatten(2, (m, d)).permute(0, 3, 1, 2, 4).flatten(0, 1)

    qf, kf, vf = fold(q), fold(k), fold(v)
    q_blocks = qf.unflatten(2, (n, W)).transpose(1, 2).flatten(0, 1)  # (B*d*n, nh, W, e)
    k_pairs = _block_pairs(F.pad(kf, (0, 0, W, 0)), W)  # (B*d*n, nkv, 2W, e): a zero block before block 0
    v_pairs = _block_pairs(F.pad(vf, (0, 0, W, 0)), W)  # (B*d*n, nkv, 2W, hs)
    per_block = lambda x: x[:, None].expand(B, d * n, *x.shape[1:]).flatten(0, 1)  # noqa: E731
    keys = torch.cat((per_block(extra_k), k_pairs), dim=2)  # (B*d*n, nkv, E + 2W, e)
    values = torch.cat((per_block(extra_v), v_pairs), dim=2)  # (B*d*n, nkv, E + 2W, hs)

    # Absolute positions: query a of block b in residue r is (b W + a) d + r; key c of its pair is
    # (b W + c - W) d + r (negative: the zero block, never seen).
    r = torch.arange(d, device=q.device)[:, None, None]  # (d, 1, 1)
    b = torch.arange(n, device=q.device)[None, :, None]  # (1, n, 1)
    a = torch.arange(W, device=q.device)
    q_pos = (b * W + a) * d + r  # (d, n, W)
    k_pos = (b * W + torch.arange(2 * W, device=q.device) - W) * d + r  # (d, n, 2W)
    back = q_pos[..., :, None] - k_pos[..., None, :]  # (d, n, W, 2W)
    window_mask = (k_pos[..., None, :] >= 0) & (back >= 0) & (back < W * d)  # same residue: multiples of d
    sink_back = q_pos[..., None] - torch.arange(S, device=q.device)  # (d, n, W, S)
    sink_mask = (sink_back >= 0) & ~((sink_back < W * d) & (sink_back % d == 0))  # not already in the window
    if sink_logit is not None:
        sink_mask = F.pad(sink_mask, (1, 0), value=True)
    mask = torch.cat((sink_mask, window_mask), dim=-1).flatten(0, 1)  # (d*n, W, E + 2W)
    mask = mask[None].expand(B, d * n, W, E + 2 * W).flatten(0, 1)[:, None]  # (B*d*n, 1, W, E + 2W)
    out = softmax_attention(q_blocks, keys, values, mask=mask, scale=scale, softcap=softcap)  # (B*d*n, nh, W, e)
    out = out.unflatten(0, (B, d, n)).permute(0, 3, 2, 4, 1, 5).reshape(B, nh, m * d, -1)  # (B, nh, m*d, e)
    return out[:, :, :T, :hs]


def _block_pairs(x: torch.Tensor, W: int) -> torch.Tensor:
    """(B, h, n*W, hs) -> (B*(n-1), h, 2W, hs): blocks r and r+1 side by side for every r.

    `unfold` makes the overlapping pairs a strided view of x, so (for B = 1) nothing is copied."""
    pairs = x.unfold(2, 2 * W, W)  # (B, h, n-1, hs, 2W)
    return pairs.transpose(-1, -2).transpose(1, 2).flatten(0, 1)  # (B*(n-1), h, 2W, hs)


def _dilated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, d: int,
             softcap: float | None) -> torch.Tensor:
    B, nh, T, hs = q.shape
    pad = -T % d
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    m = (T + pad) // d

    def fold(x: torch.Tensor) -> torch.Tensor:  # (B, h, m*d, hs) -> (B*d, h, m, hs), residue r at [b*d + r]
        h = x.shape[1]
        return x.view(B, h, m, d, hs).permute(0, 3, 1, 2, 4).reshape(B * d, h, m, hs)

    out = sliding_window_attention(fold(q), fold(k), fold(v), window, 1, softcap)  # (B*d, nh, m, hs)
    out = out.view(B, d, nh, m, hs).permute(0, 2, 3, 1, 4).reshape(B, nh, m * d, hs)  # (B, nh, T + pad, hs)
    return out[:, :, :T]


@register("sliding")
@dataclass(frozen=True)
class SlidingSpec(ProjectionOptions):
    """Each query sees the last `window` positions, `dilation` apart (so a span of window*dilation),
    and the first `sink_tokens` positions of the sequence."""

    window: int = 128
    dilation: int = 1
    sink_tokens: int = 0  # the first positions stay visible to every query (StreamingLLM's sinks)
    learned_sink: bool = False  # a per-head logit in the denominator with no value (gpt-oss)
    softcap: float | None = None  # c: scores become c tanh(s / c) (Gemma 2); the explicit path

    examples = {
        "": Example({"window": 3}, n_kv_head=2),  # 3 divides none of the test lengths
        "wrapped": Example({"window": 4, "dilation": 2}, n_kv_head=2),  # a ring of 8 slots wrapped many times
        "sinks": Example({"window": 4, "sink_tokens": 3}, n_kv_head=2),
        "sinks-dilated-learned": Example({"window": 3, "dilation": 2, "sink_tokens": 2, "learned_sink": True},
                                         n_kv_head=1),
        "gated-qk-norm-softcap": Example({"window": 3, "dilation": 2, "sink_tokens": 1, "gate": "elementwise",
                                          "qk_norm": True, "softcap": 2.0}, n_kv_head=2),
    }
    benchmarks = {"": Example({"window": 512}), "sinks": Example({"window": 512, "sink_tokens": 4}),
                  "softcap": Example({"window": 512, "softcap": 30.0})}

    def check(self) -> None:
        super().check()
        require_int("window", self.window)
        require_int("dilation", self.dilation)
        require_int("sink_tokens", self.sink_tokens, minimum=0)
        require_bool("learned_sink", self.learned_sink)
        check_softcap(self.softcap, self.learned_sink)

    def build(self, shape: LayerShape) -> SlidingWindowAttention:
        return SlidingWindowAttention(self, shape)

    def flops(self, T: int, n_head: int, n_kv_head: int, head_dim: int) -> float:
        span = self.window + self.sink_tokens  # keys a query sees once the window is full
        pairs = sum(min(i + 1, span) for i in range(T))
        return 4 * n_head * head_dim * pairs


class SlidingWindowAttention(GroupedQKV):
    context_limited = False

    def __init__(self, spec: SlidingSpec, shape: LayerShape):
        super().__init__(shape, **spec.projection_options())
        self.window, self.dilation, self.sink_tokens = spec.window, spec.dilation, spec.sink_tokens
        self.sink_logit = learned_sink_logit(self.n_head, spec.learned_sink)
        self.softcap = spec.softcap

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.sink_tokens or self.sink_logit is not None:
            return sliding_with_sinks(q, k, v, self.window, self.dilation, self.sink_tokens, self.sink_logit,
                                      self.softcap)
        return sliding_window_attention(q, k, v, self.window, self.dilation, self.softcap)

    def naive_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return naive_sliding_window_attention(q, k, v, self.window, self.dilation, self.sink_tokens, self.sink_logit,
                                              self.softcap)

    def generation_state(self) -> CacheSpec:
        # Query i reaches back to i - (W-1)*d, so the last (W-1)*d + 1 <= W*d positions suffice;
        # the sink tokens are kept beside them for good.
        positions = self.window * self.dilation + self.sink_tokens
        return CacheSpec("ring", self.n_kv_head, self.head_dim, positions=positions)

    def build_cache(self, context: CacheContext, max_len: int) -> RingKVCache:
        return RingKVCache(context, self)


class RingKVCache:
    """K and V of the last window*dilation slots, (B, nkv, W*d, hs) each, written round-robin,
    and those of each row's first `sink_tokens` positions, (B, nkv, S, hs), kept for good.

    Its size never grows with the generated length. Ring index i of a row holds the latest slot s
    with s = i (mod W*d) that the row has written, so a row's slot count alone says what is where:
    no table of slots is kept. New queries attend the ring's contents plus their own keys under
    the window rule on absolute slot numbers, so a chunk longer than the ring is still exact; the
    newest W*d keys are then kept. A sink token inside a query's window is read from the ring,
    outside it from the sink buffer: it counts once either way.
    """

    def __init__(self, context: CacheContext, layer: SlidingWindowAttention):
        self.context, self.window, self.dilation = context, layer.window, layer.dilation
        self.sink_logit, self.softcap = layer.sink_logit, layer.softcap
        size = layer.window * layer.dilation
        shape = (context.batch_size, layer.n_kv_head, size, layer.head_dim)
        self.k = torch.zeros(shape, dtype=context.dtype, device=context.device)
        self.v = torch.zeros(shape, dtype=context.dtype, device=context.device)
        self.ring_index = torch.arange(size, device=context.device)  # (W*d,)
        S = layer.sink_tokens
        self.sink_k = torch.zeros(shape[:2] + (S, shape[3]), dtype=context.dtype, device=context.device)
        self.sink_v = torch.zeros_like(self.sink_k)

    def held_slots(self, last: torch.Tensor | int) -> torch.Tensor:
        """The slot each ring index holds once slot `last` (an int, or (B, 1) per row) is written:
        the latest one at or before it with its residue; negative where none has been written."""
        return last - (last - self.ring_index) % self.k.shape[2]  # (W*d,) or (B, W*d)

    def sink_slots(self) -> torch.Tensor:
        """(B, S): each row's sinks are its first S real tokens, which start after its left padding."""
        return self.context.pad[:, None] + torch.arange(self.sink_k.shape[2], device=self.k.device)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        start, T = self.context.seen, q.shape[2]
        sinks = self.sink_k.shape[2] > 0
        q_slots = torch.arange(start, start + T, device=q.device)
        keys = torch.cat((self.k, k), dim=2)  # (B, nkv, W*d + T, hs)
        values = torch.cat((self.v, v), dim=2)  # (B, nkv, W*d + T, hs)
        k_slots = torch.cat((self.held_slots(start - 1), q_slots))  # (W*d + T,)
        back = q_slots[:, None] - k_slots[None, :]  # (T, W*d + T): how far back each key lies
        in_window = (back >= 0) & (back % self.dilation == 0) & (back < self.window * self.dilation)
        visible = in_window & (k_slots[None, :] >= 0)
        mask = visibility_mask(self.context, q_slots, k_slots, visible)
        if sinks:
            self._keep_sinks(k, v, q_slots[None])
            keys, values = torch.cat((self.sink_k, keys), dim=2), torch.cat((self.sink_v, values), dim=2)
            mask = torch.cat((self._sink_mask(q_slots[None]), mask.expand(q.shape[0], 1, *visible.shape)), dim=-1)
        out = masked_attention(q, keys, values, mask, self.sink_logit, self.softcap)
        keep = min(T, self.k.shape[2])
        index = q_slots[-keep:] % self.k.shape[2]
        self.k[:, :, index] = k[:, :, -keep:]
        self.v[:, :, index] = v[:, :, -keep:]
        return out

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Each row's new key, at its slot pos (B,), replaces the one W*d slots back, which no query
        needs any more, so the ring is written first and attended as it is, without a copy."""
        scatter_at(self.k, pos % self.k.shape[2], k)
        scatter_at(self.v, pos % self.k.shape[2], v)
        # Every slot in the ring is within W*d of pos; dilation and each row's padding decide the rest.
        held = self.held_slots(pos[:, None])  # (B, W*d)
        on_stride = (pos[:, None] - held) % self.dilation == 0  # (B, W*d)
        mask = (on_stride & (held >= self.context.pad[:, None]))[:, None, None]  # (B, 1, 1, W*d)
        keys, values = self.k, self.v
        if self.sink_k.shape[2] > 0:
            self._keep_sinks(k, v, pos[:, None])
            keys, values = torch.cat((self.sink_k, keys), dim=2), torch.cat((self.sink_v, values), dim=2)
            mask = torch.cat((self._sink_mask(pos[:, None]), mask), dim=-1)  # (B, 1, 1, S + W*d)
        return masked_attention(q, keys, values, mask, self.sink_logit, self.softcap)

    def _keep_sinks(self, k: torch.Tensor, v: torch.Tensor, q_slots: torch.Tensor) -> None:
        """Copy the sink tokens among the new slots q_slots (1 or B, T), consecutive, into the sink
        buffer, in place and without asking the device whether any is there (the step must not sync)."""
        T = k.shape[2]
        offset = self.sink_slots() - q_slots[:, :1]  # (B, S): where each row's sink sits among the new slots
        here = (offset >= 0) & (offset < T)
        index = offset.clamp(0, T - 1)[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])  # (B, nkv, S, hs)
        self.sink_k.copy_(torch.where(here[:, None, :, None], k.gather(2, index), self.sink_k))
        self.sink_v.copy_(torch.where(here[:, None, :, None], v.gather(2, index), self.sink_v))

    def _sink_mask(self, q_slots: torch.Tensor) -> torch.Tensor:
        """(B, 1, T, S) for queries at q_slots (1 or B, T): a sink is seen once it exists (at or before
        the query) and is not in the window."""
        back = q_slots[:, :, None] - self.sink_slots()[:, None, :]  # (B, T, S)
        in_window = (back < self.window * self.dilation) & (back % self.dilation == 0)
        return ((back >= 0) & ~in_window)[:, None]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"k": self.k, "v": self.v, "sink_k": self.sink_k, "sink_v": self.sink_v}


# ------------------------------------------------------------ naive twin (for tests)


def naive_sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                                   dilation: int = 1, sink_tokens: int = 0, sink_logit: torch.Tensor | None = None,
                                   softcap: float | None = None) -> torch.Tensor:
    """Full masked softmax where query i sees keys j = i - m*dilation, 0 <= m < window, and the
    first `sink_tokens` positions (j <= i)."""
    T = q.shape[2]
    back = torch.arange(T)[:, None] - torch.arange(T)[None, :]  # (T, T): i - j
    visible = (back >= 0) & (back % dilation == 0) & (back // dilation < window)
    visible |= (back >= 0) & (torch.arange(T)[None, :] < sink_tokens)
    return masked_softmax_attention(q, k, v, visible, sink_logit, softcap)
