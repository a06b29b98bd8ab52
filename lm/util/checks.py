"""Checks of single values, shared by every config: each raises ConfigError with one line
naming the field and the value it got."""

from __future__ import annotations

from collections.abc import Collection
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
