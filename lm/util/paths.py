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
    folders_only = pattern.endswith("/")  # as in glob: `c/**/` names folders (and so the files below them)
    done = len(wanted)  # the position after the last part: the path so far matches the whole pattern
    seen: set[tuple[int, int]] = set()
    first_visit(root, seen)
    root_states = reachable(wanted, {0})
    # A folder's positions in the pattern, and whether it or a folder above it matched. As in
    # glob, a pattern that starts with `**` matches below the folder it starts in, not that folder.
    walk_state = {str(root): (root_states, first != 0 and done in root_states)}
    found = []
    for folder, subfolders, files in os.walk(root, followlinks=True):
        states, below_a_match = walk_state.pop(folder)
        kept = []
        for name in sorted(subfolders):
            child_states = step(wanted, states, name)
            child_below = below_a_match or done in child_states
            # A folder no part of the pattern can reach holds nothing to match: not entered.
            if (child_states or child_below) and first_visit(Path(folder, name), seen):
                walk_state[os.path.join(folder, name)] = (child_states, child_below)
                kept.append(name)
        subfolders[:] = kept
        for name in sorted(files):
            if below_a_match or (not folders_only and file_matches(wanted, states, name)):
                found.append(Path(folder, name))
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


def reachable(wanted: tuple[str, ...], states: set[int]) -> frozenset[int]:
    """`states` (positions in the pattern) and every position after a `**` in them: `**` may
    take no name at all."""
    out = set(states)
    for position in sorted(out):
        while position < len(wanted) and wanted[position] == "**":
            position += 1
            out.add(position)
    return frozenset(out)


def step(wanted: tuple[str, ...], states: frozenset[int], name: str) -> frozenset[int]:
    """The positions after one more name. `**` takes any number of names and stays; another part
    takes one name by fnmatch. As in glob, a name starting with a dot is taken only by a part
    starting with one (never by `*` or `**`)."""
    hidden = name.startswith(".")
    nxt = set()
    for position in states:
        if position == len(wanted):
            continue
        part = wanted[position]
        if part == "**":
            if not hidden:
                nxt.add(position)
        elif (not hidden or part.startswith(".")) and fnmatch.fnmatchcase(name, part):
            nxt.add(position + 1)
    return reachable(wanted, nxt)


def file_matches(wanted: tuple[str, ...], folder_states: frozenset[int], name: str) -> bool:
    """Whether a file named `name`, in a folder at `folder_states`, matches. In glob every part but
    the last names a folder, so a trailing `**` must take the file's own name: `c/*/**` does not
    match the file c/x.txt."""
    if wanted[-1] == "**":
        return len(wanted) - 1 in folder_states and not name.startswith(".")
    return len(wanted) in step(wanted, folder_states, name)
