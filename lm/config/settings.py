"""A script's settings declared once: a dataclass whose fields carry each setting's type, default,
help and, where the script owns the check, its bound. From it come

- the structured config Hydra composes (`store`): the defaults a YAML no longer restates, and a
  refusal, in one line naming it, of a key the dataclass lacks (lm.util.cli);
- the options part of `--help` (`options_help`, the `${settings_help:<name>}` resolver);
- the checks and their one-line errors (`check_settings`), each naming the key as typed.

Fields are stored typed Any: Hydra takes a value as typed and the bound says what is wrong with it,
in the same words the checks in lm.util.checks use everywhere else. A setting whose bound a library
function declares (a sampling temperature: lm.generation.decode.Sampling) has no bound here; the
script's run checks it there, so the Python API and the script share one bound.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection
from dataclasses import MISSING, dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from lm.util.checks import require_bool, require_choice, require_fraction, require_in_interval, require_int

SCHEMAS: dict[str, type] = {}  # the name a primary config's defaults list uses -> its dataclass


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


def boolean() -> Bound:
    return Bound("true or false", require_bool)


def fraction(nullable: bool = False) -> Bound:
    return Bound("a number between 0 and 1", require_fraction, nullable)


def number(low: float, high: float = math.inf, open_low: bool = False, nullable: bool = False) -> Bound:
    words = f"a finite number {'>' if open_low else '>='} {low}" if high == math.inf else f"a number in [{low}, {high}]"
    return Bound(words, lambda n, v: require_in_interval(n, v, low, high, open_low=open_low,
                                                         open_high=high == math.inf), nullable)


def choice(choices: Collection[str]) -> Bound:
    return Bound(" | ".join(choices), lambda n, v: require_choice(n, v, choices))


def setting(default: Any = MISSING, help: str = "", bound: Bound | None = None,
            factory: Callable[[], Any] | None = None) -> Any:
    """A field of a settings dataclass: its default (MISSING: required, `???`), what it means, and
    the bound the script checks it against (None: checked where a library declares it)."""
    metadata = {"help": help, "bound": bound}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def group(cls: type, help: str = "") -> Any:
    """A field holding a nested settings dataclass (`checkpoint.every_n_steps`)."""
    return field(default_factory=cls, metadata={"help": help, "bound": None})


def default_of(f: dataclasses.Field) -> Any:
    if f.default_factory is not MISSING:
        return f.default_factory()
    return f.default


def is_group(f: dataclasses.Field) -> bool:
    return dataclasses.is_dataclass(f.type) or (f.default_factory is not MISSING
                                                and dataclasses.is_dataclass(f.default_factory))


def untyped(cls: type) -> type:
    """The dataclass with every field typed Any, its groups likewise: what Hydra composes."""
    fields = []
    for f in dataclasses.fields(cls):
        if is_group(f):
            fields.append((f.name, Any, field(default_factory=untyped(f.default_factory))))
        elif f.default_factory is not MISSING:
            fields.append((f.name, Any, field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, Any, field(default=f.default)))
    return dataclasses.make_dataclass(cls.__name__, fields)


def store(name: str, cls: type) -> None:
    """Register `cls` as the structured config `name` (a primary config's first defaults entry)."""
    SCHEMAS[name] = cls
    ConfigStore.instance().store(name=name, node=untyped(cls))


def shown(value: Any) -> str:
    if value is MISSING or value == "???":
        return "required"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def options_help(cls: type, prefix: str = "", width: int = 24) -> str:
    """One line per setting: its dotted name, what it means, its bound and its default."""
    lines = []
    for f in dataclasses.fields(cls):
        name, meta = prefix + f.name, f.metadata
        if is_group(f):
            lines.append(options_help(f.default_factory, f"{name}.", width))
            continue
        words = meta.get("help", "")
        if meta.get("bound") is not None:
            words += f"{'; ' if words else ''}{meta['bound'].words}"
        lines.append(f"  {name:<{width}}{words} ({shown(default_of(f))})".rstrip())
    return "\n".join(lines)


def check_settings(cfg: DictConfig | dict, cls: type, prefix: str = "") -> None:
    """Check every setting of `cls` that has a bound, naming it as typed (`checkpoint.every_n_steps`).
    A key absent from `cfg` (a run config written before the setting existed) takes its default."""
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        value = cfg.get(f.name, default_of(f)) if cfg is not None else default_of(f)
        if is_group(f):
            check_settings(value, f.default_factory, f"{name}.")
        elif f.metadata.get("bound") is not None:
            f.metadata["bound"](name, value)


def settings_help(name: str) -> str:
    return options_help(SCHEMAS[name])


# `${settings_help:generate}` in a help template: the options part of --help, from the dataclass.
OmegaConf.register_new_resolver("settings_help", settings_help, replace=True)

__all__ = ["Bound", "boolean", "check_settings", "choice", "fraction", "group", "integer", "number",
           "options_help", "setting", "store"]
