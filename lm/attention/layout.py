"""Ways of writing a model's attention, all turned into one list of specs, one per layer.

    "linear"                                  every layer of one kind, at its defaults
    SlidingSpec(window=64)                    every layer the same spec
    [LinearSpec(), SoftmaxSpec()]             one spec per layer (a hybrid)
    layer_specs("sliding", 4, {"window": [32, 64, 128, 256]}, global_every=2)
        the compact form the Hydra `attn` group uses: a kind or one kind per layer, options
        given once or once per layer, and every k-th layer full attention.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lm.attention.base import AttentionSpec, option_names, spec_class, spec_from_dict
from lm.util.checks import require_int
from lm.util.errors import ConfigError

GLOBAL_KIND = "softmax"  # what a `global_every` layer becomes


def layer_specs(kind: str | Sequence[str], n_layer: int, options: Mapping[str, Any] | None = None,
                global_every: int | None = None, strict: bool = True) -> list[AttentionSpec]:
    """One spec per layer.

    kind: one kind for every layer, or a list of n_layer kinds.
    options: name -> a value for every layer whose kind takes it, or a list of n_layer values
      (one per layer; entries for layers whose kind does not take the option are not used).
      A None value leaves the kind's default.
    global_every: k makes layers k-1, 2k-1, ... full softmax attention (Gemma's alternation).
    strict: an option that no layer's kind takes is an error (False drops it: old checkpoints
      stored such options, which were then silently ignored).
    """
    kinds = _kinds(kind, n_layer)
    if global_every is not None:
        require_int("global_every", global_every)
        kinds = [GLOBAL_KIND if (i + 1) % global_every == 0 else k for i, k in enumerate(kinds)]
    options = {name: value for name, value in (options or {}).items() if value is not None}
    taken = {kind_: set(option_names(kind_)) for kind_ in set(kinds)}
    unused = sorted(name for name in options if not any(name in names for names in taken.values()))
    if unused and strict:
        raise ConfigError(f"option(s) {unused} are taken by no layer's kind ({', '.join(sorted(taken))}); "
                          f"they take {sorted(set().union(*taken.values())) or 'none'}")
    for name, value in options.items():
        if isinstance(value, (list, tuple)) and len(value) != n_layer:
            raise ConfigError(f"{name}={list(value)} has {len(value)} entries but n_layer={n_layer}")
    specs = []
    for i, kind_ in enumerate(kinds):
        mine = {name: _entry(value, i) for name, value in options.items() if name in taken[kind_]}
        specs.append(spec_class(kind_)(**mine))
    return specs


def _kinds(kind: str | Sequence[str], n_layer: int) -> list[str]:
    if isinstance(kind, str):
        spec_class(kind)
        return [kind] * n_layer
    kinds = list(kind)
    if len(kinds) != n_layer:
        raise ConfigError(f"pattern={kinds} has {len(kinds)} entries but n_layer={n_layer}")
    for k in kinds:
        if not isinstance(k, str):
            raise ConfigError(f"pattern={kinds} must name one kind per layer")
        spec_class(k)
    return kinds


def _entry(value: Any, layer_idx: int) -> Any:
    return value[layer_idx] if isinstance(value, (list, tuple)) else value


def as_layer_specs(attention: Any, n_layer: int) -> list[AttentionSpec]:
    """ModelConfig.attention in any of the forms above -> n_layer specs."""
    if isinstance(attention, (str, AttentionSpec, dict)):
        return [as_spec(attention)] * n_layer
    if isinstance(attention, (list, tuple)):
        if len(attention) != n_layer:
            raise ConfigError(f"attention has {len(attention)} layers but n_layer={n_layer}")
        return [as_spec(a) for a in attention]
    raise ConfigError(f"attention={attention!r} must be a kind's name, a spec, or one per layer")


def as_spec(value: Any) -> AttentionSpec:
    if isinstance(value, AttentionSpec):
        return value
    if isinstance(value, str):
        return spec_class(value)()
    return spec_from_dict(value)
