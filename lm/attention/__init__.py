"""Pluggable attention: the contract (lm.attention.base), the kinds, and how a model's list of
per-layer specs is written (lm.attention.layout).

Every module in this folder is imported here, so a kind registers itself by existing: adding
one is one new file (spec + layer + cache + what the shared tests and benchmarks need to know)
and one YAML in conf/attn/, nothing else. A kind can also live outside lm/, in an installed
distribution that names its module in the entry point group `lm.attention_kinds`: the module is
imported here and registers the same way (docs/adding-a-kind.md). The environment variable
LM_ATTENTION_KINDS (files or folders of them, joined by the path separator, ':' on Linux) still
loads kinds for this release, with a DeprecationWarning.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import warnings

from lm.attention.base import (
    ENTRY_POINT_GROUP,
    AttentionLayer,
    AttentionSpec,
    Example,
    LayerCache,
    LayerShape,
    available_kinds,
    example_rows,
    load_entry_points,
    load_kind_files,
    option_names,
    register,
    spec_class,
    spec_from_dict,
)
from lm.attention.layout import as_layer_specs, layer_specs

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def load_outside_kinds() -> list[str]:
    """The kinds installed distributions declare (entry point group lm.attention_kinds), then those
    of the files LM_ATTENTION_KINDS names (deprecated); returns the kinds added."""
    added = load_entry_points(strict=False)
    paths = os.environ.get("LM_ATTENTION_KINDS", "")
    if paths:
        warnings.warn(f"LM_ATTENTION_KINDS is deprecated and goes in the next release: declare the module of "
                      f"your kinds in the entry point group {ENTRY_POINT_GROUP!r} of an installed distribution "
                      "(docs/adding-a-kind.md)", DeprecationWarning, stacklevel=2)
        added += load_kind_files(paths)
    return added


load_outside_kinds()

from lm.attention.linear import LinearSpec  # noqa: E402
from lm.attention.sliding import SlidingSpec  # noqa: E402
from lm.attention.softmax import SoftmaxSpec  # noqa: E402

__all__ = [
    "ENTRY_POINT_GROUP", "AttentionLayer", "AttentionSpec", "Example", "LayerCache", "LayerShape", "LinearSpec",
    "SlidingSpec", "SoftmaxSpec", "as_layer_specs", "available_kinds", "example_rows", "layer_specs",
    "load_entry_points", "load_kind_files", "load_outside_kinds", "option_names", "register", "spec_class",
    "spec_from_dict",
]
