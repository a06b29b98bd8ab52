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

    Python's recursive glob follows a symlinked folder every time it meets one, so a tree
    holding links back up itself makes `**` explore exponentially many paths (it hangs).
    Patterns with `**` are therefore matched by one walk that enters every folder once, linked
    folders included: a link back up the tree leads to a folder already seen. Matched folders
    stand for every file below them, as they do elsewhere."""
    pattern = os.path.expanduser(pattern)
    if "**" not in pattern:
        return sorted(Path(m) for m in glob.glob(pattern))
    parts = Path(pattern).parts
    first = next(i for i, part in enumerate(parts) if GLOB_MAGIC.search(part))
    root, wanted = Path(*parts[:first]) if first else Path("."), parts[first:]
    names_hidden = any(part.startswith(".") for part in wanted)
    folders_only = pattern.endswith("/")  # as in glob: `c/**/` names folders (and so the files below them)
    seen: set[tuple[int, int]] = set()
    first_visit(root, seen)
    found = []
    for folder, subfolders, files in os.walk(root, followlinks=True):
        folder = Path(folder)
        relative = folder.relative_to(root).parts
        # As in glob, a pattern that starts with `**` matches below the folder it starts in, not that folder.
        below_a_match = any(matches(wanted, relative[:i]) for i in range(1 if first == 0 else 0, len(relative) + 1))
        subfolders[:] = [s for s in sorted(subfolders) if first_visit(folder / s, seen)
                         and (below_a_match or names_hidden or not s.startswith("."))]
        found += [folder / f for f in sorted(files)
                  if below_a_match or (not folders_only and file_matches(wanted, (*relative, f)))]
    return found


def first_visit(folder: Path, seen: set[tuple[int, int]]) -> bool:
    """False for a folder the walk has already entered by another path (a link to it)."""
    try:
        stat = folder.stat()
    except OSError:  # a dangling link
        return False
    key = (stat.st_dev, stat.st_ino)
    if key in seen:
        return False
    seen.add(key)
    return True


def file_matches(wanted: tuple[str, ...], path_parts: tuple[str, ...]) -> bool:
    """Whether a file's path matches. In glob every part but the last names a folder, so a
    trailing `**` must take the file's own name: `c/*/**` does not match the file c/x.txt."""
    if wanted[-1] != "**":
        return matches(wanted, path_parts)
    return any(matches(wanted[:-1], path_parts[:k]) and not any(p.startswith(".") for p in path_parts[k:])
               for k in range(len(path_parts)))


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
