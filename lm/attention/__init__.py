"""Pluggable attention: the contract (lm.attention.base), the kinds, and how a model's list of
per-layer specs is written (lm.attention.layout).

Every module in this folder is imported here, so a kind registers itself by existing: adding
one is one new file (spec + layer + cache + what the shared tests and benchmarks need to know)
and one YAML in conf/attn/, nothing else. A kind can also live outside lm/: name its file (or a
folder of such files) in the environment variable LM_ATTENTION_KINDS (several joined by the
path separator, ':' on Linux) and it registers the same way (docs/adding-a-kind.md).
"""

from __future__ import annotations

import importlib
import os
import pkgutil

from lm.attention.base import (
    AttentionLayer,
    AttentionSpec,
    Example,
    LayerCache,
    LayerShape,
    available_kinds,
    example_rows,
    load_kind_files,
    option_names,
    register,
    spec_class,
    spec_from_dict,
)
from lm.attention.layout import as_layer_specs, layer_specs

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
load_kind_files(os.environ.get("LM_ATTENTION_KINDS", ""))

from lm.attention.linear import LinearSpec  # noqa: E402
from lm.attention.sliding import SlidingSpec  # noqa: E402
from lm.attention.softmax import SoftmaxSpec  # noqa: E402

__all__ = [
    "AttentionLayer", "AttentionSpec", "Example", "LayerCache", "LayerShape", "LinearSpec", "SlidingSpec",
    "SoftmaxSpec", "as_layer_specs", "available_kinds", "example_rows", "layer_specs", "load_kind_files",
    "option_names", "register", "spec_class", "spec_from_dict",
]
