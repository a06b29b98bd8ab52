"""Pluggable attention: the contract (lm.attention.base), the kinds, and how a model's list of
per-layer specs is written (lm.attention.layout).

Every module in this folder is imported here, so a kind registers itself by existing: adding
one is one new file (spec + layer + cache) and one YAML in conf/attn/, nothing else.
"""

from __future__ import annotations

import importlib
import pkgutil

from lm.attention.base import (
    AttentionLayer,
    AttentionSpec,
    LayerCache,
    LayerShape,
    available_kinds,
    option_names,
    register,
    spec_class,
    spec_from_dict,
)
from lm.attention.layout import as_layer_specs, layer_specs

_NOT_KINDS = {"base", "layout", "reference"}  # reference.py holds the naive twins, for tests only
for _module in pkgutil.iter_modules(__path__):
    if _module.name not in _NOT_KINDS:
        importlib.import_module(f"{__name__}.{_module.name}")

from lm.attention.linear import LinearSpec  # noqa: E402
from lm.attention.sliding import SlidingSpec  # noqa: E402
from lm.attention.softmax import SoftmaxSpec  # noqa: E402

__all__ = [
    "AttentionLayer", "AttentionSpec", "LayerCache", "LayerShape", "LinearSpec", "SlidingSpec", "SoftmaxSpec",
    "as_layer_specs", "available_kinds", "layer_specs", "option_names", "register", "spec_class", "spec_from_dict",
]
