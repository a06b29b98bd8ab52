"""The on-disk token cache: a byte-level BPE tokenizer trained on the train split, both splits
tokenized once into flat token arrays, memory-mapped on later runs. The cache key covers the
corpus and the tokenizer.

meta.json records each file's size, SHA-256 and modification time. Opening a cache compares
sizes and times only, so a run starts at once however large the cache (hashing costs about a
minute per 30 GB, on every rank). A file whose time changed (touched, copied without its times,
rewritten) is hashed, and its new time recorded when the bytes still match. The checksums are
computed from the files just written when the cache is built; `python scripts/verify_cache.py
<cache folder>` hashes every file on request, which also finds bytes changed behind a restored time.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from lm.data.corpora import Corpus, digest, is_validation
from lm.data.tokenizer import EOT, train_tokenizer
from lm.util.distributed import is_main_process, say
from lm.util.errors import CheckpointError, DataError
from lm.util.files import remove_stale_temporaries, write_atomically, write_failure_reason

CACHE_FORMAT = 1  # bump when the cache layout or the tokenizer recipe changes
CACHE_FILES = ("tokenizer.json", "train.bin", "val.bin")


@dataclass
class TokenCache:
    """A finished cache folder: tokenizer.json, train.bin, val.bin and meta.json."""

    path: Path

    @property
    def meta(self) -> dict:
        return json.loads((self.path / "meta.json").read_text())

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_file(str(self.path / "tokenizer.json"))

    def tokens(self, split: str) -> np.ndarray:
        return np.memmap(self.path / f"{split}.bin", dtype=self.meta["dtype"], mode="r")

    def damage(self, hash_every_file: bool = False) -> str | None:
        """What is wrong with the folder's files (None when nothing), so a truncated or overwritten
        cache is never read. Every file must have the size meta.json recorded; a file is hashed
        when its modification time differs from the recorded one (always, with hash_every_file).

        A cache written before times were recorded has none: its files are hashed once here and
        their times recorded, so the next open is cheap."""
        try:
            meta = self.meta
            times = {str(name): int(mtime) for name, mtime in meta.get("file_mtimes_ns", {}).items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return "meta.json is unreadable or from an older cache format"
        recorded = manifest(meta)
        if isinstance(recorded, str):
            return recorded
        verified_times = {}
        for name, (size, checksum) in recorded.items():
            path = self.path / name
            if not path.is_file():
                return f"{name} is missing"
            stat = path.stat()  # before hashing: a write during the hash leaves a time that differs
            if stat.st_size != size:
                return f"{name} has {stat.st_size} bytes, not {size}"
            if hash_every_file or stat.st_mtime_ns != times.get(name):
                if file_checksum(path) != checksum:
                    return f"{name} does not match its checksum"
                verified_times[name] = stat.st_mtime_ns
        if any(times.get(name) != mtime for name, mtime in verified_times.items()):
            self._record_times(meta, {**times, **verified_times})
        return None

    def _record_times(self, meta: dict, times: dict[str, int]) -> None:
        try:
            write_atomically(self.path / "meta.json",
                             lambda tmp: tmp.write_text(json.dumps({**meta, "file_mtimes_ns": times}, indent=2)))
        except CheckpointError:  # a read-only cache still opens; its files are hashed again next time
            say(f"note: cannot record the verified file times in {self.path / 'meta.json'}; "
                "the next run hashes those files again")


def manifest(meta) -> dict[str, tuple[int, str]] | str:
    """meta.json's file list as {name: (size, SHA-256)}, or what is wrong with it. It must name every
    file a cache is read from (CACHE_FILES) and nothing else, each a plain name inside the folder
    with a non-negative integer size and a SHA-256 in hex: a check of an empty or partial list, or
    of files elsewhere, would pass while the files read went unchecked."""
    files = meta.get("files") if isinstance(meta, dict) else None
    if not isinstance(files, dict):
        return "meta.json has no file list"
    for name in files:
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            return f"meta.json names {name!r}, which is not a file inside the cache folder"
    missing = [name for name in CACHE_FILES if name not in files]
    if missing:
        return f"meta.json's file list does not name {', '.join(missing)}, which the cache is read from"
    unknown = sorted(set(files) - set(CACHE_FILES))
    if unknown:
        return f"meta.json names {', '.join(unknown)}, which a cache does not hold"
    recorded = {}
    for name, entry in files.items():
        size, checksum = entry if isinstance(entry, list) and len(entry) == 2 else (None, None)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0 or not is_sha256(checksum):
            return f"meta.json's entry for {name} is {entry!r}, not [size in bytes, SHA-256]"
        recorded[name] = (size, checksum)
    if meta.get("dtype") not in ("uint16", "uint32"):
        return f"meta.json's dtype {meta.get('dtype')!r} is not uint16 or uint32"
    return recorded


def is_sha256(text) -> bool:
    return isinstance(text, str) and len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def verify_token_cache(folder: str | Path) -> TokenCache:
    """The cache in `folder` with every file hashed against meta.json; a DataError naming the
    folder and what is wrong otherwise."""
    cache = TokenCache(Path(folder))
    if not (cache.path / "meta.json").is_file():
        raise DataError(f"{str(cache.path)!r} is not a token cache folder (it has no meta.json)")
    damage = cache.damage(hash_every_file=True)
    if damage is not None:
        raise DataError(f"token cache {str(cache.path)!r} is damaged: {damage}; the next run that uses it "
                        "rebuilds it, or delete the folder")
    return cache


def file_checksum(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return sha.hexdigest()


def cache_key(corpus: Corpus, vocab_size: int, val_fraction: float, tokenizer_json: str | None = None) -> str:
    return digest([CACHE_FORMAT, corpus.fingerprint, vocab_size, val_fraction, tokenizer_json])[:16]


def build_token_cache(corpus: Corpus, cache_dir: Path, vocab_size: int, val_fraction: float,
                      min_val_tokens: int, tokenizer_json: str | None = None) -> TokenCache:
    """Train the tokenizer and tokenize the corpus once; later calls return the cache at once.

    With `tokenizer_json` (a checkpoint's tokenizer, when uptraining) that tokenizer is used
    instead of training one. The folder is assembled under a temporary name and renamed into
    place, so an interrupted run never leaves a half-written cache behind.
    """
    safe_name = corpus.name.replace("/", "_").replace(":", "_")
    final = cache_dir / f"{safe_name}-{cache_key(corpus, vocab_size, val_fraction, tokenizer_json)}"
    remove_stale_temporaries(cache_dir)
    if (final / "meta.json").exists():
        damage = TokenCache(final).damage()
        if damage is None:
            return TokenCache(final)
        say(f"note: token cache {final} is damaged ({damage}); rebuilding it")
    tmp = final.with_name(final.name + f".tmp-{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        n_train_docs = 0

        def train_texts() -> Iterator[str]:
            nonlocal n_train_docs
            for doc_id, text in corpus.documents():
                if not is_validation(doc_id, val_fraction):
                    n_train_docs += 1
                    yield text

        if tokenizer_json is not None:
            tokenizer, n_train_docs = Tokenizer.from_str(tokenizer_json), 1
        else:
            tokenizer = train_tokenizer(train_texts(), vocab_size)
        doc_val_fraction = val_fraction
        if n_train_docs == 0:
            # Every document hashed into val (a corpus of one or two files): train on all of
            # them and hold out the tail of the token stream below instead.
            doc_val_fraction = 0.0
            tokenizer = train_tokenizer((text for _, text in corpus.documents()), vocab_size)
        tokenizer.save(str(tmp / "tokenizer.json"))
        dtype = np.uint16 if tokenizer.get_vocab_size() <= 2**16 else np.uint32
        counts = _tokenize_splits(corpus, tokenizer, tmp, dtype, doc_val_fraction)
        if counts["train"] == 0:
            raise DataError(f"corpus {corpus.name!r} is empty: no text to train on")
        if counts["val"] < min_val_tokens:
            counts = _move_tail_to_val(tmp, dtype, min_val_tokens, val_fraction)
        meta = {"corpus": corpus.name, "fingerprint": corpus.fingerprint, "vocab_size": tokenizer.get_vocab_size(),
                "val_fraction": val_fraction, "dtype": np.dtype(dtype).name,
                **{f"{split}_tokens": n for split, n in counts.items()},
                "files": {name: [(tmp / name).stat().st_size, file_checksum(tmp / name)] for name in CACHE_FILES},
                # A key of its own, so code that reads only "files" still opens the cache.
                "file_mtimes_ns": {name: (tmp / name).stat().st_mtime_ns for name in CACHE_FILES}}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        if final.exists():  # an unfinished or damaged folder from an older run
            shutil.rmtree(final)
        os.replace(tmp, final)
    except OSError as e:
        raise DataError(f"could not write the token cache in {str(cache_dir)!r}: "
                        f"{write_failure_reason(e, cache_dir)}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return TokenCache(final)


def _tokenize_splits(corpus: Corpus, tokenizer: Tokenizer, out: Path, dtype, val_fraction: float) -> dict:
    eot = tokenizer.token_to_id(EOT)
    counts = {"train": 0, "val": 0}
    files = {split: open(out / f"{split}.bin", "wb") for split in counts}
    pending: dict[str, list[str]] = {"train": [], "val": []}

    def flush(split: str) -> None:
        for enc in tokenizer.encode_batch(pending[split]):
            ids = np.asarray(enc.ids + [eot], dtype=dtype)  # EOT closes every document
            files[split].write(ids.tobytes())
            counts[split] += len(ids)
        pending[split].clear()

    try:
        for doc_id, text in tqdm(corpus.documents(), desc=f"tokenizing {corpus.name}", unit="doc",
                                 disable=not is_main_process()):
            if not text:
                continue  # an empty file adds nothing, not even a separator
            split = "val" if is_validation(doc_id, val_fraction) else "train"
            pending[split].append(text)
            if len(pending[split]) >= 256:
                flush(split)
        for split in counts:
            flush(split)
    finally:
        for f in files.values():
            f.close()
    return counts


def _move_tail_to_val(folder: Path, dtype, min_val_tokens: int, val_fraction: float) -> dict:
    """Too few documents landed in val (a one-file corpus, say): hold out the train tail instead."""
    train = np.fromfile(folder / "train.bin", dtype=dtype)
    val = np.fromfile(folder / "val.bin", dtype=dtype)
    n_val = max(min_val_tokens - len(val), int(len(train) * val_fraction))
    if n_val >= len(train):
        raise DataError(
            f"corpus has {len(train) + len(val)} tokens: too small for a train and a validation sequence "
            f"of {min_val_tokens} tokens each"
        )
    train, val = train[:-n_val], np.concatenate([val, train[-n_val:]])
    train.tofile(folder / "train.bin")
    val.tofile(folder / "val.bin")
    return {"train": len(train), "val": len(val)}
