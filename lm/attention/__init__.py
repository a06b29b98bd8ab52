"""Registry of attention kinds.

A kind is a class registered under a name; `ModelConfig.attention` holds the name, so configs
stay plain strings and a new kind needs no edit to `lm.model`. A kind declares:

- `options`: its option names and defaults (read from `ModelConfig.attention_options`);
- `validate(config)`: raise ConfigError naming the field when an option value is wrong;
- `build(config, layer_idx)`: the module for one layer (by default the class itself). A
  module is called as `module(x, cos, sin)` on x (B, T, C) and returns (B, T, C); it has
  `context_limited` (whether it may see more than max_seq_len tokens) and
  `generation_state()` (what a generation cache must keep for it, see `lm.cache`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from lm.config import ModelConfig

_KINDS: dict[str, type] = {}


def register(name: str):
    """Class decorator: make an attention kind available as `attention=<name>`."""

    def add(cls: type) -> type:
        if name in _KINDS:
            raise ValueError(f"attention kind {name!r} is registered twice")
        _KINDS[name] = cls
        return cls

    return add


def available_kinds() -> list[str]:
    return sorted(_KINDS)


def get_kind(name: str) -> type:
    from lm.config import ConfigError

    if name not in _KINDS:
        raise ConfigError(f"attention={name!r} is not a known kind; choose one of {available_kinds()}")
    return _KINDS[name]


def accepted_options(name: str, config: ModelConfig) -> set[str]:
    kind = get_kind(name)
    if hasattr(kind, "accepted_options"):
        return kind.accepted_options(config)
    return set(getattr(kind, "options", {}))


def check_kind(name: str, config: ModelConfig) -> None:
    """Raise ConfigError unless `name` is a registered kind that accepts `config`."""
    from lm.config import ConfigError

    kind = get_kind(name)
    unknown = sorted(set(config.attention_options) - accepted_options(name, config))
    if unknown:
        raise ConfigError(f"attention={name} does not take option(s) {unknown}; "
                          f"it takes {sorted(accepted_options(name, config)) or 'none'}")
    if hasattr(kind, "validate"):
        kind.validate(config)


def option(config: ModelConfig, kind: type, name: str) -> Any:
    """An option's value for `kind`, its default when the config does not set it."""
    return config.attention_options.get(name, kind.options[name])


def per_layer(value: Any, layer_idx: int) -> Any:
    """`value` itself, or its entry for `layer_idx` when the option is given one value per layer."""
    return value[layer_idx] if isinstance(value, (list, tuple)) else value


def check_per_layer_int(config: ModelConfig, name: str, value: Any, minimum: int) -> None:
    """An int >= minimum, or a list of n_layer such ints; ConfigError naming the option otherwise."""
    from lm.config import ConfigError

    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if isinstance(value, (list, tuple)) and len(values) != config.n_layer:
        raise ConfigError(f"{name}={list(values)} has {len(values)} entries but n_layer={config.n_layer}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ConfigError(f"{name}={value!r} must be an integer >= {minimum} (or one per layer)")


def build_attention(config: ModelConfig, layer_idx: int) -> nn.Module:
    kind = get_kind(config.attention)
    return kind.build(config, layer_idx) if hasattr(kind, "build") else kind(config, layer_idx)


# Importing a kind's module registers it.
from lm.attention import hybrid, linear, sliding, softmax  # noqa: E402,F401
