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


def require_fraction(name: str, value: Any) -> None:
    """A number strictly between 0 and 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ConfigError(f"{name}={value!r} must be a number between 0 and 1")


def check_device(device: Any) -> None:
    """cpu, cuda[:n] where this torch has CUDA, or mps where it has MPS, before anything loads."""
    import torch

    name = str(device)
    kind = name.split(":")[0]
    if kind not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"device={name!r} is not cpu, cuda or mps")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r}: this torch has no CUDA device; use device=cpu")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device={name!r}: this torch has no MPS device; use device=cpu")
