"""A token cache's meta.json is a manifest: a check over it cannot pass vacuously. An empty or partial
file list, a name outside the folder, a name the cache does not hold or an entry that is no
[size, SHA-256] is refused by scripts/verify_cache.py in one line with exit code 2, and a run that
opens such a cache rebuilds it instead of reading files nothing checked."""

import json
import runpy
from pathlib import Path

import pytest

from lm.data.corpora import text_corpus
from lm.data.token_cache import CACHE_FILES, TokenCache, build_token_cache

ROOT = Path(__file__).resolve().parents[1]
SHA = "0" * 64


def cache_of(tmp_path: Path) -> TokenCache:
    doc = tmp_path / "doc.txt"
    if not doc.exists():
        doc.write_text("def add_one(x):\n    return x + 1\n" * 400)
    return build_token_cache(text_corpus([str(doc)]), tmp_path / "c", 300, 0.05, min_val_tokens=33)


def without(files: dict, name: str) -> dict:
    return {k: v for k, v in files.items() if k != name}


HOSTILE = [  # (how meta.json's file list is rewritten, what the line says)
    (lambda files: {}, "meta.json's file list does not name tokenizer.json, train.bin, val.bin, which the cache is "
                       "read from"),
    (lambda files: without(files, "train.bin"), "meta.json's file list does not name train.bin"),
    (lambda files: {**without(files, "val.bin"), "../val.bin": files["val.bin"]},
     "meta.json names '../val.bin', which is not a file inside the cache folder"),
    (lambda files: {**files, "/etc/hostname": [1, SHA]}, "meta.json names '/etc/hostname', which is not a file"),
    (lambda files: {**files, "sub/train.bin": files["train.bin"]}, "meta.json names 'sub/train.bin', which is not"),
    (lambda files: {**files, "..": [0, SHA]}, "meta.json names '..', which is not a file inside the cache folder"),
    (lambda files: {**files, "extra.bin": [0, SHA]}, "meta.json names extra.bin, which a cache does not hold"),
    (lambda files: {**files, "train.bin": [-1, SHA]}, "meta.json's entry for train.bin is [-1, '000"),
    (lambda files: {**files, "train.bin": [True, SHA]}, "meta.json's entry for train.bin is [True, "),
    (lambda files: {**files, "train.bin": ["12", SHA]}, "meta.json's entry for train.bin is ['12', "),
    (lambda files: {**files, "train.bin": [files["train.bin"][0], "abc"]}, "meta.json's entry for train.bin is"),
    (lambda files: {**files, "val.bin": None}, "meta.json's entry for val.bin is None, not [size in bytes, SHA-256]"),
    (lambda files: [["train.bin", 1, SHA]], "meta.json has no file list"),
]


@pytest.mark.parametrize("rewrite, message", HOSTILE, ids=[m[:40] for _, m in HOSTILE])
def test_a_hostile_file_list_is_refused_in_one_line_and_a_run_rebuilds_the_cache(tmp_path, rewrite, message, capsys):
    cache = cache_of(tmp_path)
    meta = cache.meta
    with open(cache.path / "train.bin", "r+b") as f:  # 4 bytes overwritten, as a list that skips the file hides
        f.write(b"\xff\xff\xff\xff")
    (cache.path / "meta.json").write_text(json.dumps({**meta, "files": rewrite(meta["files"])}))
    main = runpy.run_path(str(ROOT / "scripts" / "verify_cache.py"))["main"]
    capsys.readouterr()  # what building the cache printed
    with pytest.raises(SystemExit) as done:
        main([str(cache.path)])
    out, err = capsys.readouterr()
    assert done.value.code == 2 and out == ""
    assert err.startswith(f"error: token cache {str(cache.path)!r} is damaged: {message}") and \
        err.count("\n") == 1, err
    again = cache_of(tmp_path)  # what a run does on opening it: rebuild, not read unchecked files
    assert again.meta["files"] == meta["files"] and list(again.meta["files"]) == list(CACHE_FILES)
    assert "rebuilding it" in capsys.readouterr().out


def test_a_whole_cache_still_verifies(tmp_path, capsys):
    cache = cache_of(tmp_path)
    main = runpy.run_path(str(ROOT / "scripts" / "verify_cache.py"))["main"]
    capsys.readouterr()
    assert main([str(cache.path)]) == 0
    assert capsys.readouterr().out.startswith(f"ok {cache.path}: tokenizer.json, train.bin, val.bin match")


def test_a_dtype_the_cache_cannot_be_read_as_is_refused(tmp_path):
    cache = cache_of(tmp_path)
    (cache.path / "meta.json").write_text(json.dumps({**cache.meta, "dtype": "object"}))
    assert cache.damage(hash_every_file=True) == "meta.json's dtype 'object' is not uint16 or uint32"
