"""The attention contract, written once. Every kind in lm/attention/ is one file with three parts:

- a **spec**: a frozen dataclass of the kind's options, with their defaults and their checks
  (`check`, run on construction), registered under the kind's name with `@register("name")`.
  `spec.build(shape)` makes the layer from the few sizes in `LayerShape`; nothing else is needed.
- its **layer**, a subclass of `AttentionLayer` (an nn.Module): x (B, T, C) -> (B, T, C) for
  training and scoring, and with a cache for generation. What the rest of the code reads from a
  layer besides its calls (whether it is context-limited, whether it rotates by RoPE, a loss of its
  own, how the optimizer treats its weights, former names of its weights) is declared there with
  its default, so a layer states only where it differs and nothing probes a layer for an attribute.
- its **cache** (`LayerCache`): the tensors it holds, declared (`tensors()`), and `attend(...)` of
  the next positions over what it holds, updating it, and `decode(..., pos)`, the same for one
  position per row on fixed shapes (what a compiled decoding step runs), each taking the inputs
  its kind computes. The cached path is always here, never in the layer.

A model's attention is a list of specs, one per layer (lm.model.config.ModelConfig.attention).
Shapes: B batch, T new positions, C d_model, nh query heads, nkv K/V heads, hs head size.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from lm.util.checks import require_float32
from lm.util.errors import ConfigError

if TYPE_CHECKING:
    from lm.attention.cache import CacheContext, CacheSpec


@dataclass(frozen=True)
class LayerShape:
    """The model sizes a layer is built from."""

    d_model: int
    n_head: int
    n_kv_head: int
    head_dim: int
    layer_idx: int = 0
    norm_eps: float = 1e-5  # the model's RMSNorm epsilon, for norms inside the layer (QK-norm)


@runtime_checkable
class LayerCache(Protocol):
    """What one layer keeps between decoding steps (lm.model.generation_cache.GenerationCache holds
    one per layer). Besides `tensors()`, a cache has the two calls its own layer makes, with the
    inputs that kind computes per position (lm.attention.cache):

      attend(*inputs) -> (B, nh, T, hs): the next T positions over everything held so far plus
        these, which are then held (q, k, v for the kinds built on GroupedQKV; MLA's q and latent);
      decode(*inputs, pos) -> (B, nh, 1, hs): the same for one new position per row, at its slot
        pos (B,). Fixed shapes, in-place writes, no host sync (no .item(), no Python branch on
        tensor values), so a compiled step can run it."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor it holds, by name, each with the batch row first: written in place, never
        replaced, and nothing else written by a decoding step. Byte counts, CUDA-graph marking and
        the row operations (reset a row, prefill one row while the others decode) come from it."""
        ...


def rename_former_weights(module: WeightDeclarations, state_dict: dict, prefix: str, *args) -> None:
    """A load_state_dict pre-hook: the module's weights saved under a former name take today's."""
    for old, new in module.former_names.items():
        if f"{prefix}{old}" in state_dict and f"{prefix}{new}" not in state_dict:
            state_dict[f"{prefix}{new}"] = state_dict.pop(f"{prefix}{old}")


class WeightDeclarations(nn.Module):
    """What a module declares about its own weights, for the code that treats weights by their role
    rather than by their shape: the optimizer's placement (lm.training.optim) and checkpoint loading
    (lm.formats.checked). Every attention layer is one (AttentionLayer); a submodule with weights of
    such roles subclasses it too, and the readers look at no other module. The defaults declare
    nothing: each 2-D weight an nn.Linear's single matrix, saved under today's name."""

    # Own 2-D parameters that are no matrix for Muon (convolution taps, per-head vectors), by name:
    # AdamW takes them. Declared, since a shape does not say what a weight means.
    adamw_parameters: ClassVar[tuple[str, ...]] = ()
    # Own weights renamed since checkpoints were saved, {old: new} relative to the module: checkpoint
    # loading and load_state_dict read a weight under its old name as the new one, so old files load.
    former_names: ClassVar[Mapping[str, str]] = {}

    def __init__(self) -> None:
        super().__init__()
        if self.former_names:
            self.register_load_state_dict_pre_hook(rename_former_weights)

    def fused_rows(self) -> dict[str, tuple[int, ...]]:
        """Own weights that stack several matrices (fused Q/K/V: one GEMM is faster than three on small
        models) -> the row count of each matrix, in row order: Muon orthogonalises each on its own."""
        return {}


class AttentionLayer(WeightDeclarations):
    """One layer's attention, the base every kind's layer subclasses (most through GroupedQKV,
    lm.attention.projections). It declares the calls the model and the shared tests make, and the
    hooks the rest of the code reads, each with its default."""

    # True: positions past max_seq_len are out of reach (full attention: trained on no longer
    # context), so generation stops there. The default is the cautious answer for a new kind.
    context_limited: bool = True
    # Whether q and k are rotated by the RoPE angles the layer is given; False: position enters
    # otherwise (causality, a decay) and the angles change nothing (tests/test_contract.py holds both).
    uses_rope: bool = True
    # A loss of its own that its last forward computed, weighted by the layer itself, which alone knows
    # what it trains (DSA's indexer KL, in training); None: none. lm.model.Transformer.aux_loss sums
    # the layers' and the training loss adds the sum.
    aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerCache | None = None, pos: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C); cos, sin are the RoPE angles of the T positions. With a cache,
        x holds the next T positions after those the cache has seen; with `pos` too (a 0-dim long
        tensor), x is the one position at slot pos, decoded through `cache.decode`."""
        raise NotImplementedError(f"{type(self).__name__} has no forward")

    def naive_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The same as its training path `layer(x, cos, sin)`, written plainly (its naive twin):
        the shared equivalence test compares the two, values and gradients, in float64. Layers
        built on GroupedQKV (lm.attention.projections) write only `naive_attend(q, k, v)`."""
        raise NotImplementedError(f"{type(self).__name__} has no naive twin (naive_forward)")

    def benchmark_op(self, seq_len: int, requires_grad: bool = False) -> tuple[Any, list[torch.Tensor]]:
        """Its attention op, projections excluded, and random inputs for it at batch 1 and length
        seq_len: what the attention benchmark times (GroupedQKV's: `attend` on q, k, v)."""
        raise NotImplementedError(f"{type(self).__name__} declares no benchmark_op")

    def generation_state(self) -> CacheSpec:
        """What its cache keeps, as a size anyone can compute without building it; the shared
        cache test holds it equal to the bytes of the built cache's `tensors()`, and the benchmarks
        report it."""
        raise NotImplementedError(f"{type(self).__name__} declares no generation_state")

    def build_cache(self, context: CacheContext, max_len: int) -> LayerCache:
        """An empty cache for `context.batch_size` rows of up to `max_len` positions, its tensors on
        `context.device` in `context.dtype` (or wider, for a recurrent state)."""
        raise NotImplementedError(f"{type(self).__name__} has no build_cache")

    def reset_own_parameters(self) -> None:
        """Initialise parameters of its own that the model's normal(0, init_std) does not suit
        (called by the Transformer after that); by default there are none."""


ALL_HEADS = 0  # an Example's n_kv_head meaning one K/V head per query head, whatever their number


@dataclass(frozen=True)
class Example:
    """One setting of a kind that the shared tests or the benchmarks run: its options, its number of
    K/V heads (None: the table's own choice; ALL_HEADS: as many as query heads) and, for the
    attention benchmark, the longest N it is timed at (None: every N)."""

    options: Mapping[str, Any] = field(default_factory=dict)
    n_kv_head: int | None = None
    longest: int | None = None

    def kv_heads(self, n_head: int, default: int) -> int:
        """The number of K/V heads of this setting in a table of n_head query heads."""
        if self.n_kv_head is None:
            return default
        return n_head if self.n_kv_head == ALL_HEADS else self.n_kv_head


@dataclass(frozen=True)
class AttentionSpec:
    """Base of every kind's spec: subclasses add their options as fields with defaults.

    Besides its options, a kind declares what the shared tests and benchmarks need to know about
    it; they build their tables from the registry and these, so a new kind needs no other edit.
    """

    kind: ClassVar[str] = ""  # set by @register
    # Small settings the shared tests run on a 4-head model (choose awkward sizes: a window or a
    # chunk that does not divide the length, fewer K/V heads); the row is named kind-name.
    examples: ClassVar[dict[str, Example]] = {"": Example(n_kv_head=2)}
    # Settings at the benchmarks' sizes (benchmarks.bench attention and generate).
    benchmarks: ClassVar[dict[str, Example]] = {"": Example()}
    # False: a layer that goes beside a mixer in a hybrid (Based's gated convolution), not a sequence mixer
    # of its own, so the attention comparison's default list of kinds (lm.studies.compare_arms) leaves it out.
    compared_alone: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self.check()
        for name, value in self.options().items():  # every kind's float options, where the model uses them
            require_float32(name, value)

    def check(self) -> None:
        """Raise ConfigError, one line naming the field, when an option value cannot work."""

    def at(self, head_dim: int) -> AttentionSpec:
        """This spec with the options it sizes from the head size filled in (ModelConfig calls it, so
        a checkpoint stores every size explicitly); most kinds size nothing from it."""
        return self

    def build(self, shape: LayerShape) -> AttentionLayer:
        raise NotImplementedError

    def flops(self, T: int, n_head: int, n_kv_head: int, head_dim: int) -> float:
        """Forward FLOPs of the attention op over T positions as this kind computes it (a
        multiply-add is 2), counting only the (query, key) work causality leaves: what the
        benchmark's GFLOP/s divides by."""
        raise NotImplementedError(f"attention kind {self.kind!r} declares no FLOP count (AttentionSpec.flops)")

    def options(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_dict(self) -> dict[str, Any]:
        """Plain data, every option explicit: what a checkpoint stores for this layer."""
        return {"kind": self.kind, **self.options()}

    def describe(self) -> str:
        options = ", ".join(f"{k}={v}" for k, v in self.options().items())
        return f"{self.kind}({options})" if options else self.kind


# The registry. Importing lm.attention fills it with nothing but what the modules it imports define; the
# lookups below (available_kinds, spec_class, ...) load every built-in kind on first use
# (load_builtin_kinds), and the kinds outside lm/ come with an explicit call (load_outside_kinds).
_SPECS: dict[str, type[AttentionSpec]] = {}
_LOADED: set[str] = set()  # which of "builtin" and "outside" this process has loaded


def register(name: str):
    """Class decorator: make a spec class available as the attention kind `name`."""

    def add(cls: type[AttentionSpec]) -> type[AttentionSpec]:
        if not getattr(cls, "__module__", "").startswith(f"{__package__}."):
            load_builtin_kinds()  # a kind from outside that takes a built-in's name is refused here, where it is
        if name in _SPECS:
            raise ValueError(f"attention kind {name!r} is registered twice")
        # Its own dataclass parameters: a subclass left undecorated would inherit the base's
        # and silently have no options.
        params = cls.__dict__.get("__dataclass_params__")
        if not (isinstance(cls, type) and issubclass(cls, AttentionSpec) and params is not None and params.frozen):
            raise TypeError(f"the spec of attention kind {name!r} must be a frozen dataclass subclassing AttentionSpec")
        cls.kind = name
        _SPECS[name] = cls
        return cls

    return add


def load_builtin_kinds() -> list[str]:
    """Import every module of lm/attention/, so that each built-in kind registers itself (its spec's
    @register runs as its file is imported): a new kind is a new file, listed nowhere. The registry's
    lookups call it on first use, so a Python user never needs to; importing lm.attention does not.
    Returns the kinds it added; after the first call it does nothing."""
    if "builtin" in _LOADED:
        return []
    import importlib
    import pkgutil
    from pathlib import Path

    _LOADED.add("builtin")  # first: a lookup while the modules load sees the kinds so far, not a loop
    before = set(_SPECS)
    try:
        for module in pkgutil.iter_modules([str(Path(__file__).parent)]):
            importlib.import_module(f"{__package__}.{module.name}")
    except BaseException:
        _LOADED.discard("builtin")
        raise
    return sorted(set(_SPECS) - before)


def load_outside_kinds() -> list[str]:
    """The kinds written outside lm/: those of the modules installed distributions name in the entry
    point group lm.attention_kinds (load_entry_points; a broken one is a RuntimeWarning), then those
    of the files the environment variable LM_ATTENTION_KINDS names (load_kind_files; deprecated, with
    a DeprecationWarning). Never on import: every script calls it at its start (through
    lm.config.attn.load_attention_kinds, before Hydra composes) and so does the server's
    (lm.serving.run.prepare); a Python user calls it to use them. Returns the kinds it added; after
    the first call it does nothing."""
    if "outside" in _LOADED:
        return []
    import os

    load_builtin_kinds()  # first, so an outside kind that takes a built-in's name is the one refused
    _LOADED.add("outside")
    try:
        added = load_entry_points(strict=False)
        paths = os.environ.get("LM_ATTENTION_KINDS", "")
        if paths:
            warnings.warn(f"LM_ATTENTION_KINDS is deprecated and goes in the next release: declare the module of "
                          f"your kinds in the entry point group {ENTRY_POINT_GROUP!r} of an installed "
                          "distribution (docs/adding-a-kind.md)", DeprecationWarning, stacklevel=2)
            added += load_kind_files(paths)
    except BaseException:
        _LOADED.discard("outside")  # a bad path is said once per attempt, and a corrected one loads
        raise
    return sorted(added)


def available_kinds() -> list[str]:
    """Every registered kind: the built-in ones (loaded on first use) and those registered since."""
    load_builtin_kinds()
    return sorted(_SPECS)


def example_rows(table: str = "examples") -> dict[str, tuple[AttentionSpec, Example]]:
    """Every registered kind's declared settings, `examples` (the shared tests) or `benchmarks`:
    row name -> (spec, its Example). Rows are named kind or kind-name."""
    rows = {}
    for kind in available_kinds():
        cls = spec_class(kind)
        for name, example in getattr(cls, table).items():
            rows[f"{kind}-{name}" if name else kind] = (cls(**example.options), example)
    return rows


def load_kind_files(paths: str) -> list[str]:
    """Import attention kinds written outside lm/: `paths` names .py files or folders of them,
    joined by os.pathsep. Each file registers its kinds as the built-in ones do. Returns the
    kinds it added."""
    import importlib.util
    import os
    from pathlib import Path

    before = set(_SPECS)
    for entry in filter(None, paths.split(os.pathsep)):
        path = Path(entry).expanduser()
        files = sorted(path.glob("*.py")) if path.is_dir() else [path]
        if not path.exists() or not files or any(f.suffix != ".py" for f in files):
            raise ConfigError(f"LM_ATTENTION_KINDS entry {entry!r} is not a .py file or a folder holding .py files")
        for file in files:
            name = f"lm_attention_kind_{file.stem}"
            module_spec = importlib.util.spec_from_file_location(name, file)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module  # dataclasses look their module up while the file runs
            module_spec.loader.exec_module(module)
    return sorted(set(_SPECS) - before)


ENTRY_POINT_GROUP = "lm.attention_kinds"


def load_entry_points(group: str = ENTRY_POINT_GROUP, strict: bool = True) -> list[str]:
    """Import the modules that installed distributions name in the entry point group
    `lm.attention_kinds` (a pyproject.toml's [project.entry-points."lm.attention_kinds"]); each
    registers its kinds on import, as the built-in ones do. Returns the kinds it added.

    A module that cannot be imported is one line naming the entry point: a ConfigError, or with
    strict=False (what load_outside_kinds does) a RuntimeWarning, the other kinds loading as usual, so one
    broken plug-in does not stop every command; its kinds are then unknown, one line where used."""
    from importlib.metadata import entry_points

    before = set(_SPECS)
    for point in entry_points(group=group):
        try:
            point.load()
        except Exception as error:  # whatever the module raised, said in one line naming the entry point
            dist = f" of {point.dist.name}" if getattr(point, "dist", None) is not None else ""
            said = (str(error).strip().splitlines() or [""])[0]
            message = (f"entry point {point.name} = {point.value}{dist} (group {group}) cannot be loaded: "
                       f"{type(error).__name__}: {said}")
            if strict:
                raise ConfigError(message) from error
            warnings.warn(f"{message}; its kinds are not available", RuntimeWarning, stacklevel=2)
    return sorted(set(_SPECS) - before)


def spec_class(kind: str) -> type[AttentionSpec]:
    """The spec class of `kind`. A kind not yet registered loads the built-in kinds, then the outside
    ones: a process a launcher or a spawned worker starts runs only the script's function, not its
    start, and a checkpoint of an outside kind loads in Python without a call first."""
    if kind not in _SPECS:
        load_builtin_kinds()
    if kind not in _SPECS:
        load_outside_kinds()
    if kind not in _SPECS:
        raise ConfigError(f"attention kind {kind!r} is not known; choose one of {available_kinds()}")
    return _SPECS[kind]


def option_names(kind: str) -> list[str]:
    return [f.name for f in dataclasses.fields(spec_class(kind))]


def spec_from_dict(values: dict[str, Any]) -> AttentionSpec:
    """{"kind": name, option: value, ...} -> that kind's spec; unset options take their defaults."""
    if not isinstance(values, dict) or "kind" not in values:
        raise ConfigError(f"attention layer {values!r} must be a mapping with a 'kind'")
    options = {k: v for k, v in values.items() if k != "kind"}
    kind = values["kind"]
    unknown = sorted(set(options) - set(option_names(kind)))
    if unknown:
        raise ConfigError(f"attention kind {kind!r} does not take option(s) {unknown}; "
                          f"it takes {option_names(kind) or 'none'}")
    return spec_class(kind)(**options)
