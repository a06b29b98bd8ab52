"""Checks of single values, shared by every config and by the Python API: each raises ConfigError
(or the `error` given, e.g. GenerationError for lm.generate) with one line naming the field and the
value it got."""

from __future__ import annotations

import math
import numbers
import os
import struct
from collections.abc import Collection, Mapping
from typing import Any

from lm.util.errors import ConfigError

SEED_LIMIT = 2**63  # torch and numpy both take seeds below it


def is_count(value: Any, minimum: int = 1) -> bool:
    """An int (not a bool, which Python counts as one) of at least `minimum`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def require_int(name: str, value: Any, minimum: int = 1, maximum: int | None = None,
                error: type[Exception] = ConfigError) -> None:
    if maximum is None and not is_count(value, minimum):
        raise error(f"{name}={value!r} must be an integer >= {minimum}")
    if maximum is not None and not (is_count(value, minimum) and value <= maximum):
        raise error(f"{name}={value!r} must be an integer from {minimum} to {maximum}")


def require_seed(name: str, value: Any, error: type[Exception] = ConfigError) -> None:
    """null, or an int every random generator here takes."""
    if value is not None and not (is_count(value, 0) and value < SEED_LIMIT):
        raise error(f"{name}={value!r} must be null or an integer from 0 to 2**63-1")


def is_real(value: Any) -> bool:
    """A real number: an int, a float or a numpy scalar of either, never a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def require_in_interval(name: str, value: Any, low: float, high: float, open_low: bool = False,
                        open_high: bool = False, error: type[Exception] = ConfigError) -> None:
    """A real number between low and high, each end open or closed; NaN never passes, and
    high=math.inf with open_high asks for a finite number."""
    above = is_real(value) and (value > low if open_low else value >= low)
    below = is_real(value) and (value < high if open_high else value <= high)
    if above and below:
        return
    if high == math.inf:
        raise error(f"{name}={value!r} must be a finite number {'>' if open_low else '>='} {low}")
    raise error(f"{name}={value!r} must be in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}")


# float32's smallest normal number: below it a value is subnormal (precision lost) or zero.
FLOAT32_TINY = 2.0**-126


def require_float32(name: str, value: Any, error: type[Exception] = ConfigError) -> None:
    """0, or a number that is a normal number once rounded to float32, where the model computes with it:
    a value that passes its bound in Python (`softcap=1e-300`, `rope_theta=10**39`) but is zero,
    subnormal or infinite there would surface only as non-finite weights after the first step."""
    if not is_real(value) or value == 0 or (isinstance(value, float) and not math.isfinite(value)):
        return  # NaN and inf are their bounds' to refuse; 0 is exact
    try:
        rounded = struct.unpack("f", struct.pack("f", float(value)))[0]  # as float32 rounds it
    except OverflowError:  # an int past float64's range
        rounded = math.inf
    if math.isinf(rounded):  # beyond float32's largest number (3.4028235e38) even after rounding
        shown = repr(value) if len(repr(value)) <= 40 else f"<an integer of {len(str(abs(value)))} digits>"
        raise error(f"{name}={shown} overflows float32, the dtype the model computes in (its largest number is "
                    "3.4028235e+38)")
    if abs(rounded) < FLOAT32_TINY:
        raise error(f"{name}={value!r} is {'zero' if rounded == 0 else 'subnormal'} in float32, the dtype the "
                    f"model computes in (its smallest normal number is {FLOAT32_TINY:.3g})")


def require_unit(name: str, value: Any) -> None:
    """A real number from 0 to 1, both ends included (a decay rate, a ratio)."""
    if not is_real(value) or not 0 <= value <= 1:
        raise ConfigError(f"{name}={value!r} must be a number from 0 to 1")


def require_positive(name: str, value: Any) -> None:
    """A finite number above 0: an infinite learning rate or scale can only give NaN later."""
    if not is_real(value) or not 0 < value < math.inf:
        raise ConfigError(f"{name}={value!r} must be a positive number")


def require_bool(name: str, value: Any, error: type[Exception] = ConfigError) -> None:
    if not isinstance(value, bool):
        raise error(f"{name}={value!r} must be true or false")


def require_choice(name: str, value: Any, choices: Collection[str]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of {sorted(choices)}")


def as_list(name: str, value: Any, error: type[Exception] = ConfigError) -> list:
    """A setting that takes a list, as the user meant it: null is empty, and a bare value typed
    without brackets (`stop=ef`, `kinds=mha`) is a list of that one value, never its characters."""
    if value is None:
        return []
    if isinstance(value, (str, int, float, bool)):
        return [value]
    if isinstance(value, Mapping) or not hasattr(value, "__iter__"):
        raise error(f"{name}={value!r} must be a list, e.g. {name}=[a,b]")
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


def physical_memory_bytes() -> int | None:
    """This machine's RAM, or None where the OS does not say (os.sysconf is POSIX only)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def require_fits_in_memory(name: str, count: int, bytes_each: int, error: type[Exception] = ConfigError) -> None:
    """Refuse a count of items whose arrays would take more than this machine's whole RAM: such
    an allocation can only fail, after a long wait or by the OS killing the process."""
    ram = physical_memory_bytes()
    if ram is not None and count * bytes_each > ram:
        raise error(f"{name}={count} needs {count * bytes_each / 2**30:,.1f} GiB ({bytes_each:,} bytes each), more "
                    f"than this machine's {ram / 2**30:,.1f} GiB of RAM; lower {name}")
