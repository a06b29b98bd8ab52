"""Corpora, tokenizer training, the on-disk token cache and the LightningDataModule.

A corpus is a stream of (doc_id, text) documents from one of three sources: the running
interpreter's standard library (`pystdlib`), local files and globs (`text`), or a
`datasets.load_dataset` call (`hf`). Documents are split into train/val by a hash of their
id, so the split does not depend on file order or machine. A byte-level BPE tokenizer is
trained on the train split, both splits are tokenized once into flat token arrays, and
those are memory-mapped on later runs: the cache key covers the corpus and tokenizer.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import numpy as np
import torch
from tokenizers import Tokenizer
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from lm.distributed import is_main_process, say
from lm.errors import DataError, one_line
from lm.files import remove_stale_temporaries, write_failure_reason
from lm.paths import expand_pattern, resolve_path
from lm.tokenizer import EOT, train_tokenizer

CACHE_FORMAT = 1  # bump when the cache layout or the tokenizer recipe changes
SKIPPED_STDLIB_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


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


def files_corpus(name: str, files: list[Path], root: Path | None = None) -> Corpus:
    files = sorted(files)
    ids = [str(f.relative_to(root)) if root else str(f) for f in files]
    stats = [(i, f.stat().st_size, f.stat().st_mtime_ns) for i, f in zip(ids, files, strict=True)]
    fingerprint = _digest(["files", stats])

    def documents() -> Iterator[tuple[str, str]]:
        for doc_id, f in zip(ids, files, strict=True):
            yield doc_id, read_text(f)

    return Corpus(name, fingerprint, documents)


def pystdlib_corpus() -> Corpus:
    """The `.py` files of this interpreter's standard library, without its test suites."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p for p in root.rglob("*.py")
        if not SKIPPED_STDLIB_DIRS.intersection(p.relative_to(root).parts[:-1])
    ]
    if not files:
        raise DataError(f"data=pystdlib found no .py files under {root}")
    return files_corpus("pystdlib", files, root)


def text_corpus(paths: list[str]) -> Corpus:
    """Local files; each entry of `paths` is a file, a directory (all files below) or a glob."""
    if not paths:
        raise DataError("data.paths is empty: give files, directories or globs, e.g. data.paths=[notes/*.txt]")
    files: set[Path] = set()
    for pattern in paths:
        matched = expand_pattern(str(pattern))
        if not matched:
            raise DataError(f"data.paths entry {str(pattern)!r} matches no file")
        for m in matched:
            files.update(p for p in m.rglob("*") if p.is_file()) if m.is_dir() else files.add(m)
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
        # Local datasets change in place, so their content stats join the fingerprint.
        files = sorted(p for p in (local.rglob("*") if local.is_dir() else [local]) if p.is_file())
        source = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    else:
        source = name  # a hub name: its revision is pinned by the `datasets` cache
    fingerprint = _digest(["hf", source, config_name, split, text_field, data_files, max_docs])

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


def build_corpus(data_cfg) -> Corpus:
    """The corpus a `data` config group describes."""
    source = data_cfg.get("source")
    if source == "pystdlib":
        if data_cfg.get("paths"):
            raise DataError("data.paths is set but data=pystdlib; train on your files with data=text data.paths=[...]")
        return pystdlib_corpus()
    if source == "text":
        return text_corpus(list(data_cfg.get("paths") or []))
    if source == "hf":
        return hf_corpus(data_cfg.get("name"), data_cfg.get("config_name"), data_cfg.get("split", "train"),
                         data_cfg.get("text_field", "text"), bool(data_cfg.get("streaming", False)),
                         data_cfg.get("data_files"), data_cfg.get("max_docs"))
    raise DataError(f"data.source={source!r} is not one of 'pystdlib', 'text', 'hf', 'mqar'")


# ------------------------------------------------------------------ split and tokenizer


def is_validation(doc_id: str, val_fraction: float) -> bool:
    """Deterministic split: a document is held out when its id hashes below val_fraction."""
    h = int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "big")
    return h / 2**64 < val_fraction


# ------------------------------------------------------------------------ token cache


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
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def cache_key(corpus: Corpus, vocab_size: int, val_fraction: float, tokenizer_json: str | None = None) -> str:
    return _digest([CACHE_FORMAT, corpus.fingerprint, vocab_size, val_fraction, tokenizer_json])[:16]


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


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


# ------------------------------------------------------------------ datasets and module


class TokenWindows(Dataset):
    """Non-overlapping windows of seq_len + 1 tokens: input is [:-1], target is [1:]."""

    def __init__(self, tokens: np.ndarray, seq_len: int, split: str):
        self.tokens, self.seq_len = tokens, seq_len
        self.n = (len(tokens) - 1) // seq_len
        if self.n < 1:
            raise DataError(f"the {split} split has {len(tokens)} tokens, fewer than one sequence of "
                            f"seq_len+1={seq_len + 1}; use more text or a smaller model.max_seq_len")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.seq_len
        return torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))


class EpochShuffle(torch.utils.data.Sampler):
    """This process' share of a shuffle that is a function of (seed, epoch) alone.

    Global batch g of an epoch is order[g*B*W : (g+1)*B*W] for batch size B and W processes,
    and process r takes the r-th block of B of it: together the processes see exactly the
    batches one process with batch B*W would, without overlap. It can start mid-epoch: on
    resume the data module starts it at the global batch the checkpoint had reached."""

    def __init__(self, n: int, seed: int, batch_size: int, start_batch: int = 0, rank: int = 0, world_size: int = 1):
        self.n, self.seed, self.batch_size, self.rank, self.world_size = n, seed, batch_size, rank, world_size
        self.batches_per_epoch = n // (batch_size * world_size)  # the remainder is dropped, as drop_last does
        self.start_epoch, start_in_epoch = divmod(start_batch, self.batches_per_epoch)
        self.offset = start_in_epoch * batch_size
        self.epoch = self.start_epoch

    def set_epoch(self, epoch: int) -> None:
        """Lightning calls this before every epoch (through its distributed wrapper too), so the
        order never depends on how often the sampler was iterated."""
        self.epoch = epoch

    def _skip(self) -> int:
        return self.offset if self.epoch == self.start_epoch else 0

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        B, W = self.batch_size, self.world_size
        mine = order[: self.batches_per_epoch * B * W].view(-1, W, B)[:, self.rank].flatten()  # (batches*B,)
        return iter(mine[self._skip():].tolist())

    def __len__(self) -> int:
        return self.batches_per_epoch * self.batch_size - self._skip()


class ShuffledDataModule(L.LightningDataModule):
    """Loaders over `train_set` and `val_set` (set by a subclass's setup): the training order is
    EpochShuffle's, so a resumed run continues at the batch it stopped at, and validation is
    split across ranks without overlap."""

    batch_size: int
    seed: int
    num_workers: int
    is_text = True  # False: examples are not text, and no text sample is printed after training

    def _rank_and_world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def train_dataloader(self) -> DataLoader:
        # Resuming: Lightning restores the step count before asking for the dataloader, so the
        # shuffle starts at the global batch the checkpointed run had reached.
        trainer = getattr(self, "trainer", None)
        start_batch = trainer.global_step * trainer.accumulate_grad_batches if trainer is not None else 0
        rank, world = self._rank_and_world()
        sampler = EpochShuffle(len(self.train_set), self.seed, self.batch_size, start_batch, rank, world)
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler, drop_last=True,
                          num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        rank, world = self._rank_and_world()
        shard = list(range(rank, len(self.val_set), world))  # each rank a disjoint share; losses are summed
        return DataLoader(torch.utils.data.Subset(self.val_set, shard), batch_size=self.batch_size, shuffle=False,
                          num_workers=self.num_workers)


class TokenDataModule(ShuffledDataModule):
    def __init__(self, corpus: Corpus, cache_dir: Path, seq_len: int, batch_size: int, vocab_size: int,
                 val_fraction: float = 0.05, seed: int = 0, num_workers: int = 0, tokenizer_json: str | None = None):
        super().__init__()
        if batch_size < 1:
            raise DataError(f"data.batch_size={batch_size} must be >= 1")
        if not 0 < val_fraction < 1:
            raise DataError(f"data.val_fraction={val_fraction} must be between 0 and 1")
        self.corpus, self.cache_dir = corpus, Path(cache_dir)
        self.seq_len, self.batch_size, self.vocab_size = seq_len, batch_size, vocab_size
        self.val_fraction, self.seed, self.num_workers = val_fraction, seed, num_workers
        self.tokenizer_json = tokenizer_json
        self.cache: TokenCache | None = None

    @classmethod
    def from_config(cls, data_cfg, seq_len: int, seed: int = 0, tokenizer_json: str | None = None) -> TokenDataModule:
        """The data module a `data` config group (or a run config's `data` dict) describes."""
        return cls(build_corpus(data_cfg), resolve_path(data_cfg["cache_dir"]), seq_len=seq_len,
                   batch_size=data_cfg["batch_size"], vocab_size=data_cfg["vocab_size"],
                   val_fraction=data_cfg["val_fraction"], seed=seed, num_workers=data_cfg.get("num_workers", 0),
                   tokenizer_json=tokenizer_json)

    def prepare_data(self) -> None:
        self.cache = build_token_cache(self.corpus, self.cache_dir, self.vocab_size, self.val_fraction,
                                       min_val_tokens=self.seq_len + 1, tokenizer_json=self.tokenizer_json)

    def setup(self, stage: str | None = None) -> None:
        if self.cache is None:
            self.prepare_data()
        self.tokenizer = self.cache.tokenizer()
        self.train_set = TokenWindows(self.cache.tokens("train"), self.seq_len, "train")
        self.val_set = TokenWindows(self.cache.tokens("val"), self.seq_len, "val")
        if len(self.train_set) < self.batch_size:
            raise DataError(f"data.batch_size={self.batch_size} is larger than the {len(self.train_set)} "
                            f"training sequences of the corpus")


def make_data_module(data_cfg, seq_len: int, seed: int = 0, tokenizer_json: str | None = None) -> ShuffledDataModule:
    """The data module a `data` config group names: a corpus of text, or generated recall examples."""
    if data_cfg.get("source") == "mqar":
        from lm.mqar import RecallDataModule

        return RecallDataModule.from_config(data_cfg, seq_len)
    return TokenDataModule.from_config(data_cfg, seq_len, seed, tokenizer_json)
