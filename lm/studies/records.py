"""What makes a study's record usable as data: every field of a record read from `records/` or from a
results file has its type and range, checked when read. A digest proves a record unedited since it was
sealed, not that whoever sealed it wrote numbers; a record that fails is named and set aside
(`lm.studies.engine`), never copied into a study or shown in its tables."""

from __future__ import annotations

import math

LOSS_LIMIT = 1e4  # no model's cross-entropy in nats (or bits per byte) comes near; 1e308 in a record is not data


def bad_value(record: dict) -> str | None:
    """What makes a sealed record's figures unusable as data, in a few words naming the field and the
    value as stored; None when every field has its type and range: accuracies in [0, 1], losses and
    bits per byte finite in [0, LOSS_LIMIT], steps and counts non-negative integers, seconds and rates
    finite and non-negative, settings a mapping, and no NaN or infinity anywhere. A digest proves a
    record unedited since it was sealed, not that whoever sealed it wrote numbers."""
    if not isinstance(record.get("arm"), str) or not record["arm"]:
        return f"arm={record.get('arm')!r} is not a name"
    if not isinstance(record.get("settings"), dict):
        return f"settings={record.get('settings')!r} is not a mapping"
    if "error" in record or record.get("interrupted"):
        return None if isinstance(record.get("error", ""), str) else f"error={record['error']!r} is not text"
    for key, value in record.items():
        if key != "settings":
            problem = _bad_field(key, value)
            if problem:
                return problem
    return None


def _bad_field(key: str, value, path: str | None = None) -> str | None:
    """The first problem of one field (recursing into lists and mappings), named as `path`."""
    path = path or key
    if isinstance(value, (dict, list)) and _is_scored(key) and key != "history":
        return f"{path}={value!r} is not a number"
    if isinstance(value, dict):
        return next(filter(None, (_bad_field(str(k), v, f"{path}.{k}") for k, v in value.items())), None)
    if isinstance(value, list):
        if key == "history":  # [[step, loss, accuracy, seconds...], ...]
            return next(filter(None, (_bad_history_row(row, f"{path}[{i}]") for i, row in enumerate(value))), None)
        return next(filter(None, (_bad_field(key, v, f"{path}[{i}]") for i, v in enumerate(value))), None)
    if value is None:  # a figure a run may lack (a rate of no steps); never a score or a count of what ran
        return f"{path}=None is not a number" if _is_scored(key) else None
    if isinstance(value, str):
        return f"{path}={value!r} is not a number" if _is_figure(key) or key in COUNTS else None
    number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if isinstance(value, bool):
        return f"{path}={value!r} is not a number" if _is_figure(key) or key in COUNTS else None
    if number is None or not math.isfinite(number):
        return f"{path}={value!r} is not a finite number"
    if "accuracy" in key and not 0 <= number <= 1:
        return f"{path}={value!r} is outside [0, 1]"
    if ("loss" in key or "bits_per_byte" in key) and not 0 <= number <= LOSS_LIMIT:
        return f"{path}={value!r} is outside [0, {LOSS_LIMIT:g}]"
    if key == "fraction" and not 0 <= number <= 1:
        return f"{path}={value!r} is outside [0, 1]"
    if key == "lr" and number <= 0:
        return f"{path}={value!r} is not positive"
    if key in COUNTS and (not isinstance(number, int) or number < 0):
        return f"{path}={value!r} is not a non-negative integer"
    if (key in COUNTS or _is_figure(key)) and number < 0:
        return f"{path}={value!r} is negative"
    return None


# Fields that count (steps, tokens, parameters): non-negative integers wherever a record holds them.
COUNTS = ("steps", "params", "eval_bytes", "eval_tokens", "batch", "context", "tokens", "new_tokens", "seed",
          "pairs", "width")


def _is_scored(key: str) -> bool:
    """A score or a count of what ran: every finished record holds it as a number."""
    return any(word in key for word in ("loss", "accuracy", "bits_per_byte")) or key in ("seconds", "steps")


def _is_figure(key: str) -> bool:
    """A measured figure: a number (or null), never text."""
    return any(word in key for word in ("loss", "accuracy", "bits_per_byte", "seconds", "per_s", "bytes", "_s"))


def _bad_history_row(row, path: str) -> str | None:
    if not isinstance(row, list) or len(row) < 2:
        return f"{path}={row!r} is not [step, loss, ...]"
    # as LitLM.val_history holds them: step, loss, accuracy, training seconds so far
    names = ("steps", "val_loss", "val_accuracy", *("seconds",) * (len(row) - 3))[:len(row)]
    return next(filter(None, (_bad_field(name, v, f"{path}[{i}]")
                              for i, (name, v) in enumerate(zip(names, row, strict=True)))), None)
