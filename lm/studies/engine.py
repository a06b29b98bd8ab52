"""The one runner of a study's arms (the attention comparison, the uptraining ablation).

An arm is a name, every setting its figures depend on, and the function that produces them.
Each finished arm leaves <records>/<name>.json: its labels, its figures, the seconds it took and
its settings. A repeated command reuses a record whose stored settings equal the requested
ones, so an interrupted study continues where it stopped and a changed setting reruns only
the arms it touches. Each arm prints exactly one line; what it says while running (training
logs, Lightning) goes to its log file.

An arm that raises stops the study, as a failed training run stops `scripts/train.py`; its
record holds the error instead of figures, so it is never reused, and the records finished
before it are kept.
"""

from __future__ import annotations

import contextlib
import json
import logging
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lm.util.errors import one_line
from lm.util.files import make_folder, write_atomically


@dataclass
class Arm:
    name: str  # the record's file name: records/<name>.json
    settings: dict  # every setting the figures depend on; JSON data
    run: Callable[[], dict]  # produces the figures
    labels: dict = field(default_factory=dict)  # what the tables group by, known before running
    log: Path | None = None  # where the arm's own output goes; None: the terminal


def as_json_data(value):
    """`value` as it reads back from its JSON record (tuples become lists), so a fresh record and
    a reused one compare equal."""
    return json.loads(json.dumps(value))


def stored_record(path: Path, settings: dict) -> dict | None:
    """The record at `path` when it finished under exactly `settings`, else None."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):  # absent, unreadable or half a file: the arm runs again
        return None
    if not isinstance(record, dict) or "error" in record or record.get("settings") != as_json_data(settings):
        return None
    return record


def write_record(path: Path, record: dict) -> None:
    text = json.dumps(record, indent=1) + "\n"
    write_atomically(path, lambda tmp: tmp.write_text(text))


@contextlib.contextmanager
def quiet_lightning():
    """Lightning logs through handlers bound to the terminal, which redirecting an arm's output
    does not reach; below WARNING they would break the one line per arm. The levels are put
    back afterwards, so a run started later in the same process speaks as usual."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "lightning")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def run_logged(arm: Arm) -> dict:
    if arm.log is None:
        return arm.run()
    make_folder(arm.log.parent)
    with open(arm.log, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        return arm.run()


def run_arms(arms: list[Arm], records: Path, describe: Callable[[dict], str]) -> list[dict]:
    """Every arm's record, in order, reusing those whose settings match; one line per arm, from
    `describe(record)`."""
    names = [arm.name for arm in arms]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"arm names {repeated} more than once: their records would overwrite each other")
    make_folder(records)
    with quiet_lightning():
        return _run_each(arms, records, describe)


def _run_each(arms: list[Arm], records: Path, describe: Callable[[dict], str]) -> list[dict]:
    done = []
    for i, arm in enumerate(arms, 1):
        prefix = f"[{i:>{len(str(len(arms)))}}/{len(arms)}]"
        path = records / f"{arm.name}.json"
        record = stored_record(path, arm.settings)
        if record is not None:
            print(f"{prefix} {describe(record)}  (done before)", flush=True)
            done.append(record)
            continue
        started = time.perf_counter()
        try:
            figures = run_logged(arm)
        except Exception as e:
            seconds = time.perf_counter() - started
            write_record(path, {"arm": arm.name, **arm.labels, "error": f"{type(e).__name__}: {one_line(e, 400)}",
                                "seconds": seconds, "settings": as_json_data(arm.settings)})
            print(f"{prefix} {arm.name} failed after {seconds:.0f} s: {one_line(e)}"
                  + (f" (its log: {arm.log})" if arm.log else ""), flush=True)
            raise
        record = as_json_data({"arm": arm.name, **arm.labels, **figures, "seconds": time.perf_counter() - started,
                               "settings": arm.settings})
        write_record(path, record)
        print(f"{prefix} {describe(record)}  ({record['seconds']:.0f} s)", flush=True)
        done.append(record)
    return done


def machine() -> dict:
    """Where the figures were measured, for the results."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"cpu": cpu, "threads": torch.get_num_threads(), "gpu": gpu, "torch": torch.__version__}
