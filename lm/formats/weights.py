"""Where each weight lives: the fused row layouts of our projections and the transformers key map.

Our attention keeps Q, K and V in one fused matrix, rows [Q heads | K heads | V heads], and the
MLP keeps gate and up in one, rows [gate | up]; Llama keeps them apart. The QKV row sizes are
written once, by the layer that owns them (lm.attention.projections.qkv_rows); the splits and the
name map are written here: MHA->GQA conversion and the transformers export and import all go
through this file.

Shapes: nh query heads, nkv K/V heads, hs head size, C d_model, F d_ff.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from lm.attention.projections import ProjectionOptions, qkv_rows

if TYPE_CHECKING:
    from lm.model.config import ModelConfig


def split_qkv(weight: torch.Tensor, n_head: int, n_kv_head: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(nh*hs + 2*nkv*hs, C) -> q (nh*hs, C), k (nkv*hs, C), v (nkv*hs, C): views, no copy."""
    return weight.split(qkv_rows(n_head, n_kv_head, head_dim))


def split_gate_up(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(2F, C) -> gate (F, C), up (F, C)."""
    return weight.chunk(2)


# transformers' name of each of our per-layer weights; a tuple names the separate matrices one
# of our fused weights is cut into, in row order.
LAYER_KEYS: dict[str, str | tuple[str, ...]] = {
    "attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attn.out.weight": "self_attn.o_proj.weight",
    "mlp.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
}
# Qwen3's per-head norms of q and k, for layers with QK-norm (lm.attention.projections).
QK_NORM_KEYS = {"attn.q_norm": "self_attn.q_norm.weight", "attn.k_norm": "self_attn.k_norm.weight"}
MODEL_KEYS = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "head.weight": "lm_head.weight"}


def _fused_parts(name: str, weight: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, ...]:
    if name.endswith("attn.qkv.weight"):
        return split_qkv(weight, config.n_head, config.n_kv_head, config.head_dim)
    return split_gate_up(weight)


def key_map(config: ModelConfig) -> dict[str, str | tuple[str, ...]]:
    """Our name -> transformers' name(s), for every weight of a model of this config."""
    names = dict(MODEL_KEYS)
    if config.tie_embeddings:
        del names["head.weight"]  # transformers ties lm_head to the embedding itself
    for i, spec in enumerate(config.attention):
        qk_norm = isinstance(spec, ProjectionOptions) and spec.qk_norm
        layer_keys = {**LAYER_KEYS, **QK_NORM_KEYS} if qk_norm else LAYER_KEYS
        for ours, theirs in layer_keys.items():
            prefix = f"model.layers.{i}."
            names[f"blocks.{i}.{ours}"] = (tuple(prefix + t for t in theirs) if isinstance(theirs, tuple)
                                           else prefix + theirs)
    return names


def mlp_and_norm_weights(state: dict[str, torch.Tensor], config: ModelConfig, layer: int,
                         norm: Callable[[torch.Tensor], torch.Tensor] = lambda gain: gain) -> dict[str, torch.Tensor]:
    """Layer `layer`'s MLP and its two norms under transformers' names (LAYER_KEYS), for the exports whose
    attention is their own (Qwen3-Next, Kimi Linear); `norm` rewrites a gain where the target scales
    otherwise (Qwen3-Next's zero-centred 1 + w)."""
    out = {}
    for ours, theirs in LAYER_KEYS.items():
        if ours.startswith("attn."):
            continue
        weight, prefix = state[f"blocks.{layer}.{ours}"], f"model.layers.{layer}."
        if isinstance(theirs, tuple):
            out.update((prefix + t, part) for t, part in zip(theirs, _fused_parts(ours, weight, config), strict=True))
        else:
            out[prefix + theirs] = norm(weight) if ours.endswith("norm.weight") else weight
    return out


def to_hf_state_dict(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict -> transformers' Llama/Mistral/Qwen3 state dict (fused weights cut apart)."""
    out = {}
    for ours, theirs in key_map(config).items():
        if isinstance(theirs, tuple):
            out.update(zip(theirs, _fused_parts(ours, state[ours], config), strict=True))
        else:
            out[theirs] = state[ours]
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def from_hf_state_dict(hf: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """transformers' Llama/Mistral/Qwen3 state dict -> ours (separate matrices fused in row order).
    A missing weight raises KeyError naming transformers' key."""
    state = {}
    for ours, theirs in key_map(config).items():
        state[ours] = torch.cat([hf[t] for t in theirs]) if isinstance(theirs, tuple) else hf[theirs]
    if config.tie_embeddings:
        state["head.weight"] = state["embed.weight"]
    return {k: v.float() for k, v in state.items()}
