"""Settings declared once: a dataclass (kw_only, so a required setting may follow one with a default)
whose fields carry each setting's type, default, help and, where its owner checks it, its bound.
From it come

- the settings built from plain data (`built`: a composed or stored config, groups and all) and
  checked as they are built (`Checked`), each error one line naming the key as typed;
- the defaults as plain data (`defaults`: what lm.config stores for Hydra to compose);
- the options part of `--help` (`options_help`).

A value is judged as typed: the bound says what is wrong with it, in the same words the checks in
lm.util.checks use everywhere else. A setting whose bound a library function declares (a sampling
temperature: lm.generation.decode.Sampling) has no bound here; that function checks it, so the
Python API and the script share one bound. Nothing here knows Hydra (lm.config stores the schemas).
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import MISSING, dataclass, field
from typing import Any, ClassVar

from lm.util.checks import (
    as_list,
    require_bool,
    require_choice,
    require_float32,
    require_fraction,
    require_in_interval,
    require_int,
    require_positive,
)
from lm.util.errors import ConfigError


@dataclass(frozen=True)
class Bound:
    """What a setting's value must be: its words for --help and the check that says it in one line."""

    words: str
    check: Callable[[str, Any], None]
    nullable: bool = False

    def __call__(self, name: str, value: Any) -> None:
        if value is None and self.nullable:
            return
        self.check(name, value)


def integer(minimum: int = 1, nullable: bool = False) -> Bound:
    return Bound(f"an integer >= {minimum}", lambda n, v: require_int(n, v, minimum=minimum), nullable)


TRAINING_SEED_MAX = 2 ** 32 - 1  # the largest seed Lightning's seed_everything takes


def training_seed() -> Bound:
    """A training run's seed: null, or what Lightning's seed_everything takes."""
    return Bound(f"an integer from 0 to {TRAINING_SEED_MAX}",
                 lambda n, v: require_int(n, v, minimum=0, maximum=TRAINING_SEED_MAX), nullable=True)


def boolean(nullable: bool = False) -> Bound:
    return Bound("true or false", require_bool, nullable)


def fraction(nullable: bool = False) -> Bound:
    return Bound("a number between 0 and 1", require_fraction, nullable)


def number(low: float, high: float = math.inf, open_low: bool = False, open_high: bool = False,
           nullable: bool = False) -> Bound:
    """A real number from `low` to `high`, each end included unless open; an infinite `high` is open (a
    finite number)."""
    open_high = open_high or high == math.inf
    words = (f"a finite number {'>' if open_low else '>='} {low}" if high == math.inf
             else f"a number in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}")
    return Bound(words, lambda n, v: require_in_interval(n, v, low, high, open_low=open_low, open_high=open_high),
                 nullable)


def positive() -> Bound:
    return Bound("a positive number", require_positive)


def choice(choices: Collection[str]) -> Bound:
    return Bound(" | ".join(choices), lambda n, v: require_choice(n, v, choices))


def each(bound: Bound, at_least_one: bool = True) -> Bound:
    """A list whose every entry is within `bound`. A value typed without brackets (`tasks=mqar`,
    `lm.lr=0.002`) is a list of that one value, and its error names the setting itself; an entry of
    a list is named `<setting> entry`."""

    def check(name: str, value: Any) -> None:
        values = as_list(name, value)
        if at_least_one and not values:
            raise ConfigError(f"{name}=[] is empty: give at least one value")
        typed_bare = len(values) == 1 and values[0] is value
        for entry in values:
            bound(name if typed_bare else f"{name} entry", entry)

    return Bound(f"{'one value or a list' if at_least_one else 'a list'}, each {bound.words}", check)


def setting(default: Any = MISSING, help: str = "", bound: Bound | None = None,
            factory: Callable[[], Any] | None = None) -> Any:
    """A field of a settings dataclass: its default (MISSING: required, `???`), what it means, and
    the bound the script checks it against (None: checked where a library declares it)."""
    metadata = {"help": help, "bound": bound}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def library_setting(owner: type, name: str, help: str) -> Any:
    """A setting whose default and bound a library dataclass declares and checks (ModelConfig,
    RecallTask): `owner`'s field `name`, with its meaning for --help. Python and the command line
    then share one default and one check."""
    return setting(default_of({f.name: f for f in dataclasses.fields(owner)}[name]), help)


def redefault(parent: type, name: str, default: Any) -> Any:
    """`parent`'s setting `name`, its meaning and bound, with another default: for a subclass whose
    option states the same thing (MuonConfig's schedule is OptimConfig's, defaulting to wsd)."""
    inherited = {f.name: f for f in dataclasses.fields(parent)}[name]
    return setting(default, inherited.metadata["help"], inherited.metadata["bound"])


def group(cls: type, help: str = "", choose: Callable[[Mapping], type] | None = None) -> Any:
    """A field holding a nested settings dataclass (`checkpoint.every_n_steps`). `choose` picks the
    dataclass from the group's values where options differ in their settings (the data source's, the
    optimizer's); `cls` is the default's."""
    return field(default_factory=cls, metadata={"help": help, "bound": None, "choose": choose})


def required_group(cls: type, help: str = "", choose: Callable[[Mapping], type] | None = None) -> Any:
    """A group with no default: a run built in Python names it, as the command line's defaults list
    does (a training run's data and model shape)."""
    return field(metadata={"help": help, "bound": None, "choose": choose or (lambda values: cls)})


def optional_group(cls: type, help: str = "") -> Any:
    """A group a run may leave out (None): the uptraining a training run continues, a study's grid."""
    return field(default=None, metadata={"help": help, "bound": None, "choose": lambda values: cls})


# The dotted prefix a group being built is named by (`trainer.`), for its settings' one-line errors.
_NAMED_AS = contextvars.ContextVar("settings_prefix", default="")


class Checked:
    """Base of a settings dataclass: building one checks each of its settings against its bound, so a
    run built in Python and one from the command line are refused alike, in one line naming the
    setting as typed (`trainer.max_steps`, where `built` builds the group)."""

    # True where the settings' floats reach tensors (an optimizer's rates and decays, the gradient clip):
    # each is then also checked in float32, where 1e-300 is zero (lm.util.checks.require_float32)
    in_float32: ClassVar[bool] = False

    def __post_init__(self) -> None:
        prefix = _NAMED_AS.get()
        for f in dataclasses.fields(self):
            if is_group(f):
                continue
            if f.metadata.get("bound") is not None:
                f.metadata["bound"](prefix + f.name, getattr(self, f.name))
            if self.in_float32 and isinstance(getattr(self, f.name), float):  # its ints are counts, not factors
                require_float32(prefix + f.name, getattr(self, f.name))


def built(cls: type, values: Mapping | None, prefix: str = "") -> Any:
    """`cls` built from plain data (a resolved config section, a stored run config), each group with
    the dataclass its `choose` names; a key absent takes its default (a run config written before
    the setting existed), a key `cls` lacks is one ConfigError line naming what it takes."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = dict(values or {})
    for key in values:
        if key not in fields:
            raise ConfigError(f"{prefix}{key} is not a setting here; {prefix.rstrip('.') or 'it'} takes "
                              f"{', '.join(prefix + name for name in fields)}")
    for name, f in fields.items():
        if values.get(name, MISSING) in (MISSING, "???") and f.default is MISSING and f.default_factory is MISSING:
            raise ConfigError(f"{prefix}{name} is required: give {prefix}{name}=...")
    kwargs = {}
    for name, value in values.items():
        f = fields[name]
        if is_group(f) and (value is not None or f.default is MISSING):
            if value is None:  # a group given as null: its defaults
                value = {}
            if not isinstance(value, Mapping):
                raise ConfigError(f"{prefix}{name}={value!r} must be a mapping of its settings")
            choose = f.metadata.get("choose")
            kwargs[name] = built(choose(value) if choose else group_class(f), value, f"{prefix}{name}.")
        else:
            kwargs[name] = value
    token = _NAMED_AS.set(prefix)
    try:
        return cls(**kwargs)
    finally:
        _NAMED_AS.reset(token)


def group_class(f: dataclasses.Field) -> type:
    return f.default_factory if f.default_factory is not MISSING else f.type


def default_of(f: dataclasses.Field) -> Any:
    if f.default_factory is not MISSING:
        return f.default_factory()
    return f.default


def is_group(f: dataclasses.Field) -> bool:
    return "choose" in f.metadata or dataclasses.is_dataclass(f.type) or (
        f.default_factory is not MISSING and dataclasses.is_dataclass(f.default_factory))


def defaults(cls: type) -> dict:
    """Every setting's default as plain data, groups as nested mappings, a required one as `???`:
    what Hydra composes. Plain, not the dataclass itself, so the groups a primary config also holds
    (train's attn, model, ...) can join it, and a value is taken as typed for its bound to judge."""
    return {f.name: defaults(f.default_factory) if is_group(f) else "???" if default_of(f) is MISSING
            else default_of(f) for f in dataclasses.fields(cls)}


def shown(value: Any) -> str:
    """A default as it is typed on the command line: `[mqar, lm]`, `{name: x, qk_norm: true}`, `null`."""
    if value is MISSING or (isinstance(value, str) and value == "???"):
        return "required"
    if isinstance(value, list):
        return f"[{', '.join(shown(v) for v in value)}]"
    if isinstance(value, dict):
        return f"{{{', '.join(f'{k}: {shown(v)}' for k, v in value.items())}}}"
    if isinstance(value, str) and value != value.strip():
        return repr(value)
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def described(cls: type, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted name, what it means, its bound and its default) of every setting, groups flattened."""
    rows = []
    for f in dataclasses.fields(cls):
        name, meta = prefix + f.name, f.metadata
        if is_group(f):
            rows += described(f.default_factory, f"{name}.")
            continue
        words = meta.get("help", "")
        if meta.get("bound") is not None:
            words += f"{'; ' if words else ''}{meta['bound'].words}"
        rows.append((name, f"{words} ({shown(default_of(f))})"))
    return rows


def options_help(cls: type, prefix: str = "") -> str:
    """One line per setting: its dotted name (after `prefix`, a group's `trainer.`), what it means,
    its bound and its default."""
    rows = described(cls, prefix)
    width = max(len(name) for name, _ in rows) + 2
    return "\n".join(f"  {name:<{width}}{words}" for name, words in rows)


def check_settings(cfg: Mapping, cls: type, prefix: str = "") -> None:
    """Check every setting of `cls` that has a bound, naming it as typed (`checkpoint.every_n_steps`).
    A key absent from `cfg` (a run config written before the setting existed) takes its default."""
    for f in dataclasses.fields(cls):
        name, present = prefix + f.name, cfg is not None and f.name in cfg
        if is_group(f):
            check_settings(cfg[f.name] if present else None, f.default_factory, f"{name}.")
        elif f.metadata.get("bound") is not None:
            f.metadata["bound"](name, cfg[f.name] if present else default_of(f))


__all__ = ["Bound", "Checked", "TRAINING_SEED_MAX", "boolean", "built", "check_settings", "choice", "each", "fraction",
           "group", "integer", "library_setting", "number", "optional_group", "options_help", "positive", "redefault",
           "required_group", "setting", "training_seed"]
