"""The `attn` group's schema, derived from the attention registry.

A kind's spec (a frozen dataclass in lm/attention/<kind>.py) declares its options, their defaults
and their checks. Hydra needs every key of a config before the command line can set it, so each
registered kind gets a structured config in the ConfigStore, `attn/kind/<kind>`, made from the
spec's fields: every option at null (the spec's default), beside the keys every `attn` config has.
A conf/attn/*.yaml names its kind through its defaults list and holds only what it changes:

    defaults:
      - /attn/kind@_here_: softmax
    name: gqa
    n_kv_head: 2

`attn/kind/hybrid` (attn.pattern: kinds of the first layers, repeated) takes every registered kind's options; each
reaches the layers whose kind takes it (lm.attention.layout.layer_specs). A key the schema lacks is
refused by Hydra, one line naming it (lm.util.cli); a value is checked by the spec, one line
naming the option. Options are typed Any here because each takes one value or one per layer.

The built-in kinds' schemas are stored by register_attn_schemas (lm.config does, and the registry
loads those kinds as it is asked for them); the kinds outside lm/ (entry points, LM_ATTENTION_KINDS)
are loaded, and their schemas stored, by load_attention_kinds, which every script calls at its start
(lm.util.cli.run_script's `start`), before Hydra composes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from lm.attention import available_kinds, load_builtin_kinds, load_outside_kinds, option_names
from lm.util.errors import ConfigError

GROUP = "attn/kind"
PER_LAYER = "hybrid"  # the schema of attn.pattern, a list of kinds; no kind may take this name


def _field(name: str, kind: Any = Any, default: Any = None) -> tuple[str, Any, dataclasses.Field]:
    return name, kind, dataclasses.field(default=default)


def _option_fields(kinds: list[str]) -> list[tuple]:
    """Each option of these kinds once, in the order their specs declare them, at null."""
    names = dict.fromkeys(name for kind in kinds for name in option_names(kind))
    return [_field(name) for name in names]


def attn_schema(kind: str) -> type:
    """The `attn` config of one kind (or of PER_LAYER: any registered kinds, one per layer)."""
    if kind == PER_LAYER:
        head = [_field("name", str | None, PER_LAYER), _field("pattern")]
        options = _option_fields(available_kinds())
    else:
        head = [_field("name", str | None, kind), _field("kind", str, kind)]
        options = _option_fields([kind])
    fields = [
        *head,
        # K/V heads of every layer (ModelConfig.n_kv_head): one per query head unless a config says otherwise
        _field("n_kv_head", default="${model.n_head}"),
        *options,
        _field("global_every"),  # k: every k-th layer is full softmax attention (lm.attention.layout)
        _field("last_kind"),  # the last layer's kind, whatever the rest gave it (lm.attention.layout)
    ]
    return dataclasses.make_dataclass(f"AttnOptions_{kind}".replace("-", "_"), fields)


# The keys every `attn` config has beside its kinds' options.
HEAD_KEYS = ("name", "kind", "pattern", "n_kv_head", "global_every", "last_kind")


@dataclass(kw_only=True)
class AttnSettings:
    """A run's `attn` group, typed: which kind each layer is, and the kinds' options as given. The
    options' own types and bounds are their specs' (lm.attention), which check them as the layers'
    specs are made (lm.attention.layout.layer_specs)."""

    name: str | None = None
    kind: str | None = None  # one kind for every layer ...
    pattern: list | None = None  # ... or kinds of the first layers, repeated
    n_kv_head: int | None = None  # K/V heads of every layer; null: one per query head
    global_every: int | None = None  # k: every k-th layer is full softmax attention
    last_kind: str | None = None  # the last layer's kind, whatever the rest gave it
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.kind is None) == (self.pattern is None):
            raise ConfigError(f"give attn.kind (one kind for every layer) or attn.pattern (kinds, repeated over the "
                              f"layers), not {'both' if self.kind else 'neither'}")

    @classmethod
    def from_dict(cls, values: Mapping) -> AttnSettings:
        """The group as composed or stored: its head keys, every other key an option."""
        values = dict(values)
        return cls(**{key: values.pop(key) for key in HEAD_KEYS if key in values}, options=values)

    def to_dict(self) -> dict:
        """As composed: the head keys beside the options, so a stored run config reads as the command line."""
        return {**{key: getattr(self, key) for key in HEAD_KEYS}, **self.options}


def register_attn_schemas() -> list[str]:
    """Store every registered kind's schema (and PER_LAYER's) in Hydra's ConfigStore, the built-in
    kinds loaded first; returns the names stored. Call it again after registering a kind later in the
    process (load_attention_kinds does)."""
    load_builtin_kinds()
    if PER_LAYER in available_kinds():
        raise ConfigError(f"attention kind {PER_LAYER!r} clashes with attn/kind/{PER_LAYER}, the schema of "
                          "attn.pattern: register the kind under another name")
    names = [*available_kinds(), PER_LAYER]
    store = ConfigStore.instance()
    for name in names:
        store.store(group=GROUP, name=name, node=attn_schema(name))
    return names


def load_attention_kinds() -> list[str]:
    """Every kind this process can use, each with its schema: the kinds outside lm/ loaded
    (lm.attention.load_outside_kinds: installed distributions' entry points, LM_ATTENTION_KINDS), then
    every registered kind's schema stored. What a script passes run_script as its `start`, so that
    Hydra composes `attn=` with them; returns the kinds added."""
    added = load_outside_kinds()
    register_attn_schemas()
    return added


__all__ = ["AttnSettings", "GROUP", "HEAD_KEYS", "PER_LAYER", "attn_schema", "load_attention_kinds",
           "register_attn_schemas"]
