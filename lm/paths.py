"""Where relative paths in configs point: the folder the command was started from, as for any
command-line tool. The scripts keep Hydra from changing folder (hydra.job.chdir=false), so that
is still the working directory, and the same `lm` works from a clone or from an installed package."""

from __future__ import annotations

import os
from pathlib import Path


def resolve_path(path: str | Path) -> Path:
    path = Path(os.path.expanduser(str(path)))
    return path if path.is_absolute() else Path.cwd() / path
