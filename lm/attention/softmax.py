"""Causal softmax attention with grouped K/V heads: MHA, GQA and MQA in one module.

Shapes: B batch, T sequence length, nh query heads, nkv K/V heads, hs head size.
n_kv_head == n_head is multi-head attention (Vaswani et al. 2017), n_kv_head == 1 is
multi-query attention (Shazeer 2019), anything between is grouped-query attention
(Ainslie et al. 2023): query heads h*g .. h*g+g-1 share K/V head h, with g = nh / nkv.
Options: an output gate and QK-norm (lm.attention.projections), logit softcapping
(lm.attention.scores), a learned sink (lm.attention.sinks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lm.attention.base import ALL_HEADS, Example, LayerShape, register
from lm.attention.cache import CacheContext, CacheSpec
from lm.attention.projections import GroupedQKV, ProjectionOptions
from lm.attention.reference import causal_softmax_attention
from lm.attention.scores import check_softcap, softmax_attention
from lm.attention.shared_caches import KVCache
from lm.attention.sinks import causal_with_learned_sink, learned_sink_logit
from lm.util.checks import require_bool


@register("softmax")
@dataclass(frozen=True)
class SoftmaxSpec(ProjectionOptions):
    """Full causal attention; MHA, GQA or MQA by the model's n_kv_head."""

    learned_sink: bool = False  # a per-head logit in the denominator with no value (gpt-oss)
    softcap: float | None = None  # c: scores become c tanh(s / c) (Gemma 2); the explicit path

    examples = {"mha": Example(n_kv_head=4), "gqa": Example(n_kv_head=2), "mqa": Example(n_kv_head=1),
                "learned-sink": Example({"learned_sink": True}, n_kv_head=2),
                "gated-qk-norm": Example({"gate": "elementwise", "qk_norm": True}, n_kv_head=2),
                "headwise-softcap": Example({"gate": "headwise", "softcap": 2.0}, n_kv_head=1)}
    benchmarks = {"mha": Example(n_kv_head=ALL_HEADS), "gqa": Example(n_kv_head=2), "mqa": Example(n_kv_head=1),
                  "learned-sink": Example({"learned_sink": True}),
                  "gated-qk-norm": Example({"gate": "elementwise", "qk_norm": True}, n_kv_head=2, longest=4096),
                  "softcap": Example({"softcap": 30.0}, longest=8192)}  # scores T x T in memory

    def check(self) -> None:
        super().check()
        require_bool("learned_sink", self.learned_sink)
        check_softcap(self.softcap, self.learned_sink)

    def build(self, shape: LayerShape) -> SoftmaxAttention:
        return SoftmaxAttention(self, shape)

    def flops(self, T: int, n_head: int, n_kv_head: int, head_dim: int) -> float:
        return 4 * n_head * head_dim * T * (T + 1) / 2  # q.k and the weighted sum of v, per causal pair


class SoftmaxAttention(GroupedQKV):
    def __init__(self, spec: SoftmaxSpec, shape: LayerShape):
        super().__init__(shape, **spec.projection_options())
        self.sink_logit = learned_sink_logit(self.n_head, spec.learned_sink)
        self.softcap = spec.softcap

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of q (B, nh, T, hs) over k, v (B, nkv, T, hs).

        SDPA's `enable_gqa` lets the kernel share each K/V head across its query group
        instead of materialising n_head copies of K and V.
        """
        if self.sink_logit is not None:
            return causal_with_learned_sink(q, k, v, self.sink_logit)
        return softmax_attention(q, k, v, causal=True, softcap=self.softcap)

    def naive_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return causal_softmax_attention(q, k, v, self.sink_logit, self.softcap)

    def generation_state(self) -> CacheSpec:
        return CacheSpec("kv", self.n_kv_head, self.head_dim)

    def build_cache(self, context: CacheContext, max_len: int) -> KVCache:
        return KVCache(context, self.n_kv_head, self.head_dim, max_len, self.sink_logit, self.softcap)
