"""Corpora: a stream of (doc_id, text) documents from one of three sources, the running
interpreter's standard library (`pystdlib`), local files and globs (`text`), or a
`datasets.load_dataset` call (`hf`). Documents are split into train/val by a hash of their
id, so the split does not depend on file order or machine.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from lm.util.errors import DataError, one_line
from lm.util.paths import expand_pattern

TEST_SUITE_DIRS = {"test", "tests", "idle_test"}  # data=pystdlib_tests reads only these
NOT_STDLIB_DIRS = {"site-packages", "__pycache__"}  # installed packages, caches: never read


@dataclass
class Corpus:
    """A named stream of documents plus a fingerprint that changes when the documents do."""

    name: str
    fingerprint: str
    documents: Callable[[], Iterator[tuple[str, str]]]  # yields (doc_id, text)


# ---------------------------------------------------------------------------- sources


def read_text(path: Path) -> str:
    # Undecodable bytes become U+FFFD instead of stopping a run over one odd file.
    return path.read_bytes().decode("utf-8", errors="replace")


def files_fingerprint(ids: list[str], files: list[Path]) -> list:
    """What identifies the files' contents: each one's id, size and modification time (ns).

    Not their bytes: the language-modelling records of a study are keyed by this fingerprint, and
    the committed ones were written with it. A file rewritten at its old size within one tick of a
    coarse filesystem clock (1-2 s on some) keeps it: rebuild the token cache by hand then."""
    return [(doc_id, s.st_size, s.st_mtime_ns) for doc_id, s in zip(ids, (f.stat() for f in files), strict=True)]


def files_corpus(name: str, files: list[Path], root: Path | None = None) -> Corpus:
    files = sorted(files)
    ids = [str(f.relative_to(root)) if root else str(f) for f in files]
    fingerprint = digest(["files", files_fingerprint(ids, files)])

    def documents() -> Iterator[tuple[str, str]]:
        for doc_id, f in zip(ids, files, strict=True):
            yield doc_id, read_text(f)

    return Corpus(name, fingerprint, documents)


def pystdlib_corpus(test_suites: bool = False) -> Corpus:
    """The `.py` files of this interpreter's standard library without its test suites, or
    (`test_suites=True`, data=pystdlib_tests) only those: text no model trained on `pystdlib` saw."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for p in root.rglob("*.py"):
        folders = set(p.relative_to(root).parts[:-1])
        if folders & NOT_STDLIB_DIRS:
            continue
        if bool(folders & TEST_SUITE_DIRS) == test_suites:
            files.append(p)
    name = "pystdlib_tests" if test_suites else "pystdlib"
    if not files:
        raise DataError(f"data={name} found no .py files under {root}")
    return files_corpus(name, files, root)


def text_corpus(paths: list[str]) -> Corpus:
    """Local files; each entry of `paths` is a file, a directory (all files below) or a glob."""
    if not paths:
        raise DataError("data.paths is empty: give files, directories or globs, e.g. data.paths=[notes/*.txt]")
    files: set[Path] = set()
    for pattern in paths:
        matched = expand_pattern(str(pattern))
        if not matched:
            raise DataError(f"data.paths entry {str(pattern)!r} matches no file")
        found = [f for m in matched for f in ((p for p in m.rglob("*") if p.is_file()) if m.is_dir() else [m])]
        if not found:  # only empty folders: nothing to read, and no common folder to name documents by
            what = "is a folder with no files in it" if len(matched) == 1 else "matches only folders with no files"
            raise DataError(f"data.paths entry {str(pattern)!r} {what}")
        files.update(found)
    # Resolved and deduplicated: a symlink back up the tree makes a recursive glob reach one file
    # by many paths, which would otherwise train on it many times.
    files = sorted({f.resolve() for f in files})
    # Ids relative to the files' common folder, so the split does not depend on where the corpus lives.
    root = Path(os.path.commonpath(files)) if len(files) > 1 else files[0].parent
    return files_corpus("text", files, root)


def hf_corpus(name: str, config_name: str | None, split: str, text_field: str,
              streaming: bool, data_files: str | list[str] | None, max_docs: int | None) -> Corpus:
    """Documents of a `datasets.load_dataset` split: a hub name, or a local directory or script."""
    if not name:
        raise DataError("data.name is required for data=hf (a hub dataset name or a local directory)")
    local = Path(name).expanduser()
    if local.exists():
        # Local datasets change in place, so what identifies their files' contents joins the fingerprint.
        files = sorted(p for p in (local.rglob("*") if local.is_dir() else [local]) if p.is_file())
        source = files_fingerprint([str(p) for p in files], files)
    else:
        source = name  # a hub name: its revision is pinned by the `datasets` cache
    fingerprint = digest(["hf", source, config_name, split, text_field, data_files, max_docs])

    def documents() -> Iterator[tuple[str, str]]:
        import datasets

        try:
            ds = datasets.load_dataset(str(local) if local.exists() else name, config_name, split=split,
                                       streaming=streaming, data_files=data_files)
        except ConnectionError as e:  # before the OSError below: it is one
            raise DataError(f"data.name={name!r} is not a local folder and the Hugging Face Hub cannot be "
                            f"reached ({one_line(e, 300)}); offline, only datasets already in the datasets cache "
                            "load") from None
        except (OSError, ValueError) as e:  # no such dataset, data_files, config_name or split
            raise DataError(f"data.name={name!r} (config_name={config_name!r}, split={split!r}) could not be "
                            f"loaded: {one_line(e, 300)}") from None
        rows = iter(ds)
        for i in itertools.count():
            if max_docs is not None and i >= max_docs:
                break
            try:
                row = next(rows)
            except StopIteration:
                break
            except OSError as e:  # a streamed read that loses the network or a remote file midway
                raise DataError(f"reading data.name={name!r} failed at row {i}: {one_line(e, 300)}") from None
            if text_field not in row:
                raise DataError(f"data.text_field={text_field!r} is not a column of {name!r}; columns: {sorted(row)}")
            text = row[text_field]
            if not isinstance(text, str):
                raise DataError(f"row {i} of {name!r} has {text_field}={text!r} ({type(text).__name__}), not text")
            yield f"{i}", text

    return Corpus(f"hf:{name}", fingerprint, documents)


def build_corpus(data) -> Corpus:
    """The corpus a run's `data` settings describe (lm.config.data: a source's settings; a composed `data`
    group, which the comparison's plans and the benchmarks hold, reads the same by attribute)."""
    source = data.source
    if source in ("pystdlib", "pystdlib_tests"):
        if data.paths:
            raise DataError(f"data.paths is set but data={source}; train on your files with data=text data.paths=[...]")
        return pystdlib_corpus(test_suites=source == "pystdlib_tests")
    if source == "text":
        return text_corpus(list(data.paths or []))
    if source == "hf":
        return hf_corpus(data.name, data.config_name, data.split, data.text_field, data.streaming, data.data_files,
                         data.max_docs)
    if source == "mqar":  # training builds its recall examples before reaching here (lm.data.modules)
        raise DataError("data=mqar is a generated recall task, not a text corpus: only training reads it "
                        "(train.py data=mqar reports val/accuracy)")
    raise unknown_source(source)


def unknown_source(source) -> DataError:
    return DataError(f"data.source={source!r} is not one of 'pystdlib', 'pystdlib_tests', 'text', 'hf' "
                     "(or 'mqar' for training)")


# ------------------------------------------------------------------ split and tokenizer


def is_validation(doc_id: str, val_fraction: float) -> bool:
    """Deterministic split: a document is held out when its id hashes below val_fraction."""
    h = int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "big")
    return h / 2**64 < val_fraction

def digest(value) -> str:
    """A stable SHA-256 of plain data: the fingerprint of a corpus, a part of the cache key."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
