"""State-dict conversions. `to_grouped`: multi-head (or grouped) K/V heads -> fewer K/V heads.

Ainslie et al. 2023 (GQA) build a grouped-query model from a multi-head one by mean-pooling
the key and value projection heads of each group, then continue pre-training briefly
("uptraining"). Here group g of the new model takes the current K/V heads g*r .. g*r+r-1,
r = current n_kv_head / new n_kv_head. Pooling the projection weights is exact for RoPE
models: the rotation is the same linear map for every head, so it commutes with the mean.

Shapes: nh query heads, nkv K/V heads (before), m K/V heads (after), hs head size, C d_model.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from lm.formats.weights import split_qkv
from lm.model.config import ModelConfig
from lm.util.errors import ConfigError

INITS = ("mean", "first", "random")
QKV_WEIGHT = re.compile(r"^blocks\.\d+\.attn\.qkv\.weight$")


def to_grouped(state_dict: dict[str, torch.Tensor], config: ModelConfig, n_kv_head: int, init: str = "mean",
               seed: int = 0) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """(new state dict, new config) with `n_kv_head` K/V heads; Q, O, MLP, norms and embeddings
    are copied untouched. init: "mean" of each group's heads, its "first" head, or "random"
    (normal(0, init_std), the model's own initialisation)."""
    current = config.n_kv_head
    if init not in INITS:
        raise ConfigError(f"init={init!r} is not one of {list(INITS)}")
    if isinstance(n_kv_head, bool) or not isinstance(n_kv_head, int) or n_kv_head < 1:
        raise ConfigError(f"n_kv_head={n_kv_head!r} must be a positive integer")
    if config.n_head % n_kv_head:
        raise ConfigError(f"n_head={config.n_head} is not divisible by n_kv_head={n_kv_head}")
    if n_kv_head > current:
        raise ConfigError(f"n_kv_head={n_kv_head} is more than the checkpoint's {current} K/V heads; "
                          "conversion only merges heads")
    if current % n_kv_head:
        raise ConfigError(f"the checkpoint's {current} K/V heads do not split into n_kv_head={n_kv_head} equal groups")
    new_config = dataclasses.replace(config, n_kv_head=n_kv_head)
    generator = torch.Generator().manual_seed(seed)
    converted = {}
    for name, tensor in state_dict.items():
        if QKV_WEIGHT.match(name):
            tensor = _group_qkv(tensor, config, n_kv_head, init, generator)
        converted[name] = tensor.clone()
    return converted, new_config


def _group_qkv(weight: torch.Tensor, config: ModelConfig, m: int, init: str,
               generator: torch.Generator) -> torch.Tensor:
    """The fused Q/K/V projection with K and V reduced to m heads."""
    nkv, hs = config.n_kv_head, config.head_dim
    q, k, v = split_qkv(weight, config.n_head, nkv, hs)
    return torch.cat((q, _pool(k, nkv, m, hs, init, generator, config.init_std),
                      _pool(v, nkv, m, hs, init, generator, config.init_std)))


def _pool(rows: torch.Tensor, nkv: int, m: int, hs: int, init: str, generator: torch.Generator,
          std: float) -> torch.Tensor:
    C = rows.shape[1]
    heads = rows.view(m, nkv // m, hs, C)  # (m, r, hs, C): group g holds heads g*r .. g*r+r-1
    if init == "mean":
        pooled = heads.mean(dim=1)
    elif init == "first":
        pooled = heads[:, 0]
    else:
        pooled = torch.randn(m, hs, C, generator=generator, dtype=rows.dtype) * std
    return pooled.reshape(m * hs, C)  # (m*hs, C)
