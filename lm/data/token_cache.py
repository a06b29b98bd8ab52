"""The on-disk token cache: a byte-level BPE tokenizer trained on the train split, both splits
tokenized once into flat token arrays, memory-mapped on later runs. The cache key covers the
corpus and the tokenizer.
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
from lm.util.errors import DataError
from lm.util.files import remove_stale_temporaries, write_failure_reason

CACHE_FORMAT = 1  # bump when the cache layout or the tokenizer recipe changes



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

    def damage(self) -> str | None:
        """What is wrong with the folder's files (None when nothing): every file must have the
        size and checksum meta.json recorded, so a truncated or overwritten cache is never read."""
        try:
            recorded = self.meta["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return "meta.json is unreadable or from an older cache format"
        for name, (size, checksum) in recorded.items():
            path = self.path / name
            if not path.is_file():
                return f"{name} is missing"
            if path.stat().st_size != size:
                return f"{name} has {path.stat().st_size} bytes, not {size}"
            if file_checksum(path) != checksum:
                return f"{name} does not match its checksum"
        return None


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
                "files": {name: [(tmp / name).stat().st_size, file_checksum(tmp / name)]
                          for name in ("tokenizer.json", "train.bin", "val.bin")}}
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
