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
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hydra.core.config_store import ConfigStore

from lm.attention import available_kinds, option_names
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


def register_attn_schemas() -> list[str]:
    """Store every registered kind's schema (and PER_LAYER's) in Hydra's ConfigStore; returns the
    names stored. Call it again after registering a kind later in the process."""
    if PER_LAYER in available_kinds():
        raise ConfigError(f"attention kind {PER_LAYER!r} clashes with attn/kind/{PER_LAYER}, the schema of "
                          "attn.pattern: register the kind under another name")
    names = [*available_kinds(), PER_LAYER]
    store = ConfigStore.instance()
    for name in names:
        store.store(group=GROUP, name=name, node=attn_schema(name))
    return names


__all__ = ["GROUP", "PER_LAYER", "attn_schema", "register_attn_schemas"]
