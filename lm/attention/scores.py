"""The softmax over scores every softmax-based kind calls, and the options that change it.

Shapes: B batch, T queries, S keys, nh query heads, nkv K/V heads, g = nh / nkv, hs head size.

`softmax_attention` is PyTorch's fused scaled_dot_product_attention (SDPA: no T x S scores in
memory on its flash kernels) unless the layer caps its logits. **Logit softcapping** (Gemma 2,
Team Gemma 2024) turns each score s into c tanh(s / c) before the softmax, which SDPA cannot
express, so those layers take the explicit path below: the scores of one K/V group at a time are
formed, capped, masked and normalised in float32. It is chosen by the option, never detected,
and its cost shows in `scripts/bench.py attention` as the `softcap` rows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lm.util.checks import require_positive
from lm.util.errors import ConfigError


def check_softcap(softcap: float | None, learned_sink: bool = False) -> None:
    """None (no cap) or a positive number; a learned sink's logit would be capped with the scores."""
    if softcap is None:
        return
    if softcap == math.inf:  # the one way to say "no cap" that is not null
        raise ConfigError(f"softcap={softcap!r} must be finite; null turns capping off")
    require_positive("softcap", softcap)
    if learned_sink:
        raise ConfigError(f"softcap={softcap!r} with learned_sink=true: the sink's logit would be capped "
                          "with the scores; choose one")


def folds(q: torch.Tensor, nkv: int) -> bool:
    """Whether one query per head is folded onto its K/V head. On CUDA always: with a mask, SDPA's
    fused kernels cannot share a K/V head across a group (flash takes no mask, memory-efficient no
    enable_gqa). On the CPU where it is faster: SDPA's kernel splits its work over batch x heads, so
    only with enough of those to keep every thread busy (MQA at batch 1 folded is one unit of work:
    slower on 2 threads, 0.47 ms against 0.38 at 32k)."""
    return q.device.type == "cuda" or (q.device.type == "cpu" and q.shape[0] * nkv >= cpu_threads())


def cpu_threads() -> int:
    """torch.get_num_threads(), which a compiled graph cannot call. lm.generation.compiled, where
    decoding is compiled, declares it torch.compiler.assume_constant_result before it compiles
    anything, so it is read once as the step is traced (a GQA or MQA model's decoding step reaches it:
    tests/test_fast_paths.py's compiled decoding tests); not here, since that imports dynamo, 1.5-2 s at
    the start of every process that imports lm.attention."""
    return torch.get_num_threads()


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                      causal: bool = False, scale: float | None = None,
                      softcap: float | None = None) -> torch.Tensor:
    """q (B, nh, T, hs) over k, v (B, nkv, S, hs) -> (B, nh, T, hs), with SDPA's arguments: a boolean
    `mask` broadcastable to (B, 1, T, S) (True: seen), or `causal` (query t sees keys 0..t), and
    `scale` (None: 1/sqrt(hs)). With `softcap` the scores are capped first (the explicit path)."""
    if softcap is not None:
        return softcapped_attention(q, k, v, softcap, mask, causal, scale)
    B, nh, T, hs = q.shape
    nkv = k.shape[1]
    if nkv != nh and T == 1 and not causal and (mask is None or mask.shape[-2] == 1) and folds(q, nkv):
        # One query per head, as in decoding: a group's heads become query rows of their shared K/V
        # head, so each K/V head is read once per step; SDPA's enable_gqa on the CPU reads it once
        # per query head (GQA-2 at batch 16 and an 8k context: 3.28 ms -> 2.44 ms a call, docs/studies.md).
        rows = q.view(B, nkv, nh // nkv, hs)  # (B, nh, 1, hs) -> (B, nkv, g, hs): head h is row h % g of group h // g
        out = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask, scale=scale)  # (B, nkv, g, hs)
        # reshape, not view: CUDA's fused kernels return their output as a transposed view of a
        # (B, g, nkv, hs) buffer, which no view can regroup (the CPU's is contiguous)
        return out.reshape(B, nh, 1, hs)
    return grouped_sdpa(q, k, v, mask, causal, scale)


def grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                 causal: bool = False, scale: float | None = None,
                 repeat_groups: bool | None = None) -> torch.Tensor:
    """SDPA of q (B, nh, T, hs) over k, v (B, nkv, S, hs), on a fused kernel wherever there is one.
    On CUDA a masked call with fewer K/V heads than query heads has none (flash takes no mask,
    memory-efficient no enable_gqa) and would fall to the math path, so there K/V are repeated to
    one head per query head first (a copy, on the masked paths only: later prefill chunks, windows);
    everywhere else SDPA shares them with enable_gqa. `repeat_groups` (None: as the device says)."""
    if repeat_groups is None:
        repeat_groups = q.device.type == "cuda" and mask is not None
    if repeat_groups and grouped(k, q):
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # (B, nkv, S, hs) -> (B, nh, S, hs)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=grouped(k, q))


def grouped(k: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether k (B, nkv, S, hs) has fewer heads than q (B, nh, T, hs): SDPA's enable_gqa. A Python
    bool even where torch.compile has made the head count symbolic (after compiling models of
    different head counts in one process), since SDPA refuses a symbolic one; the branch makes the
    compiler decide it, with a guard."""
    return True if k.shape[1] != q.shape[1] else False  # not bool(...): that would stay symbolic


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softcap: float,
                         mask: torch.Tensor | None = None, causal: bool = False,
                         scale: float | None = None) -> torch.Tensor:
    """softmax(c tanh(q.k scale / c)) v, the query heads of each K/V group sharing its keys by
    broadcasting (no copies of K and V). Scores (B, nkv, g, T, S) are held: memory grows as T x S."""
    B, nh, T, hs = q.shape
    nkv, S = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(hs) if scale is None else scale
    grouped = q.unflatten(1, (nkv, nh // nkv))  # (B, nkv, g, T, hs)
    scores = (grouped @ k[:, :, None].transpose(-2, -1)).to(torch.promote_types(q.dtype, torch.float32))
    scores = softcap * torch.tanh(scores * (scale / softcap))  # (B, nkv, g, T, S)
    if causal:  # SDPA's rule: the top-left triangle, query t sees keys 0..t
        scores = scores.masked_fill(~torch.ones(T, S, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    if mask is not None:
        seen = mask.unsqueeze(2) if mask.dim() == 4 else mask  # (B, 1, T, S) -> (B, 1, 1, T, S): every head of a group
        scores = scores.masked_fill(~seen, float("-inf"))
    out = scores.softmax(dim=-1).to(v.dtype) @ v[:, :, None]  # (B, nkv, g, T, hs)
    return out.flatten(1, 2)  # (B, nh, T, hs)
