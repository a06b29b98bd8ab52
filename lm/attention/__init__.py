"""Registry of attention kinds.

A kind is an `nn.Module` class registered under a name; `ModelConfig.attention` holds the
name, so configs stay plain strings and a new kind needs no edit to `lm.model`.
Every kind is built as `cls(config, layer_idx)` and called as `module(x, cos, sin)` on
x of shape (B, T, C), returning (B, T, C).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from lm.config import ModelConfig

_KINDS: dict[str, type[nn.Module]] = {}


def register(name: str):
    """Class decorator: make an attention module available as `attention=<name>`."""

    def add(cls: type[nn.Module]) -> type[nn.Module]:
        if name in _KINDS:
            raise ValueError(f"attention kind {name!r} is registered twice")
        _KINDS[name] = cls
        return cls

    return add


def available_kinds() -> list[str]:
    return sorted(_KINDS)


def check_kind(name: str, config: ModelConfig) -> None:
    """Raise ConfigError unless `name` is a registered kind that accepts `config`."""
    from lm.config import ConfigError

    if name not in _KINDS:
        raise ConfigError(f"attention={name!r} is not a known kind; choose one of {available_kinds()}")
    _KINDS[name].check_config(config)


def build_attention(config: ModelConfig, layer_idx: int) -> nn.Module:
    return _KINDS[config.attention](config, layer_idx)


# Importing a kind's module registers it.
from lm.attention import softmax  # noqa: E402,F401
