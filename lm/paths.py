"""Where relative paths in configs point: the folder the command was started from, as for any
command-line tool. The scripts keep Hydra from changing folder (hydra.job.chdir=false), so that
is still the working directory, and the same `lm` works from a clone or from an installed package."""

from __future__ import annotations

import fnmatch
import glob
import os
import re
from pathlib import Path


def resolve_path(path: str | Path) -> Path:
    path = Path(os.path.expanduser(str(path)))
    return path if path.is_absolute() else Path.cwd() / path


GLOB_MAGIC = re.compile(r"[*?[]")


def expand_pattern(pattern: str) -> list[Path]:
    """What a `data.paths` entry names: itself, or the paths its glob matches.

    Python's recursive glob follows symlinked folders, so a tree holding two links back up
    itself makes `**` explore exponentially many paths (it hangs). Patterns with `**` are
    therefore matched by walking the tree once without following folder links (linked files
    still count); matched folders stand for every file below them, as they do elsewhere."""
    pattern = os.path.expanduser(pattern)
    if "**" not in pattern:
        return sorted(Path(m) for m in glob.glob(pattern))
    parts = Path(pattern).parts
    first = next(i for i, part in enumerate(parts) if GLOB_MAGIC.search(part))
    root, wanted = Path(*parts[:first]) if first else Path("."), parts[first:]
    found = []
    for folder, subfolders, files in os.walk(root, followlinks=False):
        folder = Path(folder)
        relative = folder.relative_to(root).parts
        subfolders.sort()
        below_a_match = any(matches(wanted, relative[:i]) for i in range(len(relative) + 1))
        found += [folder / f for f in sorted(files) if below_a_match or matches(wanted, (*relative, f))]
    return found


def matches(pattern_parts: tuple[str, ...], path_parts: tuple[str, ...]) -> bool:
    """Glob matching by path components: `**` spans any number of names, other components
    match one name each by fnmatch; as in glob, a name starting with a dot is matched only by
    a component starting with one (never by `*` or `**`)."""
    if not pattern_parts:
        return not path_parts
    head, rest = pattern_parts[0], pattern_parts[1:]
    if head == "**":
        spans = 0  # how many names `**` may take: up to the first hidden one
        while spans < len(path_parts) and not path_parts[spans].startswith("."):
            spans += 1
        return any(matches(rest, path_parts[i:]) for i in range(spans + 1))
    if not path_parts or (path_parts[0].startswith(".") and not head.startswith(".")):
        return False
    return fnmatch.fnmatchcase(path_parts[0], head) and matches(rest, path_parts[1:])
