"""Ways of writing a model's attention, all turned into one list of specs, one per layer.

    "linear"                                  every layer of one kind, at its defaults
    SlidingSpec(window=64)                    every layer the same spec
    [LinearSpec(), SoftmaxSpec()]             one spec per layer (a hybrid)
    layer_specs("sliding", 4, {"window": [32, 64, 128, 256]}, global_every=2)
        the compact form the Hydra `attn` group uses: a kind, or a pattern of kinds repeated
        across the layers, options given once or once per layer, every k-th layer full attention
        and the last layer of a kind of its own.

The open models' stacks are written this way (conf/attn/qwen3_next.yaml, olmo3.yaml, ...): their
configs list layer types by a rule over the layer index, a pattern tiled across the stack and cut
at its depth (Gemma 3's `sliding_window_pattern`, Qwen3-Next's `full_attention_interval`, nanochat's
`window_pattern`), some with the last layer forced to full attention (OLMo-core's
`force_full_attention_on_last_layer`, nanochat's "final layer always L", Kimi Linear's MLA layer 27).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lm.attention.base import AttentionSpec, option_names, spec_class, spec_from_dict
from lm.util.checks import require_int
from lm.util.errors import ConfigError

GLOBAL_KIND = "softmax"  # what a `global_every` layer becomes


def layer_specs(kind: str | Sequence[str], n_layer: int, options: Mapping[str, Any] | None = None,
                global_every: int | None = None, strict: bool = True,
                last_kind: str | None = None) -> list[AttentionSpec]:
    """One spec per layer.

    kind: one kind for every layer, or a pattern of kinds: layer i takes entry i mod len(pattern),
      so a pattern of n_layer kinds names each layer, a shorter one repeats and a longer one is cut
      where the layers end (the open models' configs apply their rules to however many layers
      there are: Gemma 3's 6-layer period over a 4-layer model gives 4 sliding layers).
    options: name -> a value for every layer whose kind takes it, or a list of n_layer values
      (one per layer; entries for layers whose kind does not take the option are not used).
      A None value leaves the kind's default.
    global_every: k makes layers k-1, 2k-1, ... full softmax attention (Gemma's alternation).
    last_kind: the last layer's kind, whatever the pattern and global_every gave it (OLMo 3 and
      nanochat end on a full attention layer, Kimi Linear on an MLA layer).
    strict: an option that no layer's kind takes is an error (False drops it: old checkpoints
      stored such options, which were then silently ignored).
    """
    kinds = _kinds(kind, n_layer)
    if global_every is not None:
        require_int("global_every", global_every)
        kinds = [GLOBAL_KIND if (i + 1) % global_every == 0 else k for i, k in enumerate(kinds)]
    if last_kind is not None:
        if not isinstance(last_kind, str):
            raise ConfigError(f"last_kind={last_kind!r} must name one attention kind")
        try:
            spec_class(last_kind)
        except ConfigError as e:
            raise ConfigError(f"last_kind={last_kind!r}: {e}") from None
        kinds[-1] = last_kind
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
    pattern = list(kind)
    if not pattern:
        raise ConfigError("pattern=[] names no kind: give the first layers' kinds, which repeat over the layers")
    for k in pattern:
        if not isinstance(k, str):
            raise ConfigError(f"pattern={pattern} must name one kind per layer")
        spec_class(k)
    return [pattern[i % len(pattern)] for i in range(n_layer)]


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
