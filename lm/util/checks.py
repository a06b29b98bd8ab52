"""Checks of single values, shared by every config: each raises ConfigError with one line
naming the field and the value it got."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from lm.util.errors import ConfigError


def is_count(value: Any, minimum: int = 1) -> bool:
    """An int (not a bool, which Python counts as one) of at least `minimum`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def require_int(name: str, value: Any, minimum: int = 1) -> None:
    if not is_count(value, minimum):
        raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}")


def require_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{name}={value!r} must be a positive number")


def require_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be true or false")


def require_choice(name: str, value: Any, choices: Collection[str]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of {sorted(choices)}")


def as_list(name: str, value: Any) -> list:
    """A setting that takes a list, as the user meant it: null is empty, and a bare value typed
    without brackets (`stop=ef`, `kinds=mha`) is a list of that one value, never its characters."""
    if value is None:
        return []
    if isinstance(value, (str, int, float, bool)):
        return [value]
    if isinstance(value, Mapping) or not hasattr(value, "__iter__"):
        raise ConfigError(f"{name}={value!r} must be a list, e.g. {name}=[a,b]")
    return list(value)
