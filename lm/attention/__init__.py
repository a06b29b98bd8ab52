"""Pluggable attention: the contract (lm.attention.base), the kinds, and how a model's list of
per-layer specs is written (lm.attention.layout).

Importing this package defines, nothing more. Each module of this folder that holds a kind registers
it as it is imported, and the registry's lookups (available_kinds, spec_class, spec_from_dict, ...)
import every module of the folder on first use (load_builtin_kinds), so a kind registers itself by
existing: adding one is one new file (spec + layer + cache + what the shared tests and benchmarks need
to know) and one YAML in conf/attn/, nothing else. A kind can also live outside lm/, in an installed
distribution that names its module in the entry point group `lm.attention_kinds`, or for this release
in the files or folders the environment variable LM_ATTENTION_KINDS names (joined by the path
separator, ':' on Linux; deprecated, with a DeprecationWarning): those are loaded by an explicit call,
load_outside_kinds(), which every script and the server make at their start and a Python user makes
to use them (docs/adding-a-kind.md).
"""

from __future__ import annotations

from lm.attention.base import (
    ENTRY_POINT_GROUP,
    AttentionLayer,
    AttentionSpec,
    Example,
    LayerCache,
    LayerShape,
    available_kinds,
    example_rows,
    load_builtin_kinds,
    load_entry_points,
    load_kind_files,
    load_outside_kinds,
    option_names,
    register,
    spec_class,
    spec_from_dict,
)
from lm.attention.layout import as_layer_specs, layer_specs
from lm.attention.linear import LinearSpec
from lm.attention.sliding import SlidingSpec
from lm.attention.softmax import SoftmaxSpec

__all__ = [
    "ENTRY_POINT_GROUP", "AttentionLayer", "AttentionSpec", "Example", "LayerCache", "LayerShape", "LinearSpec",
    "SlidingSpec", "SoftmaxSpec", "as_layer_specs", "available_kinds", "example_rows", "layer_specs",
    "load_builtin_kinds", "load_entry_points", "load_kind_files", "load_outside_kinds", "option_names", "register",
    "spec_class", "spec_from_dict",
]
