import glob
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import compose_config

import lm.data.token_cache
from lm.data.corpora import DataError, files_corpus, hf_corpus, is_validation, pystdlib_corpus, text_corpus
from lm.data.modules import TokenDataModule
from lm.data.token_cache import TokenCache, build_token_cache
from lm.util.errors import CheckpointError
from lm.util.paths import expand_pattern

ROOT = Path(__file__).resolve().parents[1]


def test_split_is_deterministic_and_holds_out_about_the_asked_share():
    ids = [f"pkg/module_{i}.py" for i in range(4000)]
    first = [is_validation(i, 0.05) for i in ids]
    assert first == [is_validation(i, 0.05) for i in reversed(ids)][::-1]
    assert 0.035 < sum(first) / len(ids) < 0.065


def test_stdlib_corpus_is_real_python_without_test_suites():
    corpus = pystdlib_corpus()
    ids = [doc_id for doc_id, _ in corpus.documents()]
    assert "os.py" in ids and "json/decoder.py" in ids
    assert not [i for i in ids if i.startswith(("test/", "site-packages/"))]
    assert len(ids) > 500


def test_token_cache_is_built_once_and_reused(tmp_path, small_corpus, monkeypatch):
    corpus = text_corpus([str(small_corpus)])
    first = build_token_cache(corpus, tmp_path, vocab_size=300, val_fraction=0.1, min_val_tokens=33)
    built_at = (first.path / "meta.json").stat().st_mtime_ns

    def no_second_build(*args, **kwargs):
        raise AssertionError("the cache was rebuilt")

    monkeypatch.setattr(lm.data.token_cache, "train_tokenizer", no_second_build)
    monkeypatch.setattr(lm.data.token_cache, "_tokenize_splits", no_second_build)
    second = build_token_cache(text_corpus([str(small_corpus)]), tmp_path, 300, 0.1, 33)
    assert second.path == first.path
    assert (second.path / "meta.json").stat().st_mtime_ns == built_at
    meta = first.meta
    assert meta["vocab_size"] == 300
    assert len(first.tokens("train")) == meta["train_tokens"] > 10_000
    assert len(first.tokens("val")) == meta["val_tokens"] >= 33
    # The tokenizer encodes and decodes the corpus text losslessly (byte-level BPE).
    text = next(corpus.documents())[1][:2000]
    tok = first.tokenizer()
    assert tok.decode(tok.encode(text).ids) == text


def test_a_file_rewritten_changes_the_fingerprint_by_its_time_or_its_size(tmp_path):
    """Set times, not slept ones: a rewrite at the same size a nanosecond later, or at another size
    at the same time, changes the cache key; nothing changed changes nothing."""
    f = tmp_path / "a.txt"
    f.write_text("hello world\n" * 50)
    stat = f.stat()
    before = files_corpus("text", [f]).fingerprint
    assert files_corpus("text", [f]).fingerprint == before  # nothing changed, nothing rebuilt
    f.write_text("hello there\n" * 50)  # the same size ...
    os.utime(f, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # ... a nanosecond later
    later = files_corpus("text", [f]).fingerprint
    f.write_text("hello there\n" * 51)  # another size ...
    os.utime(f, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # ... at that same time
    assert len({before, later, files_corpus("text", [f]).fingerprint}) == 3


def test_single_file_corpus_gets_a_validation_tail_and_odd_bytes_are_read(tmp_path):
    f = tmp_path / "only.txt"
    f.write_bytes(b"caf\xe9 latin-1 bytes and ordinary text. " * 300)  # not valid UTF-8
    cache = build_token_cache(text_corpus([str(f)]), tmp_path / "c", 300, 0.05, min_val_tokens=65)
    assert cache.meta["val_tokens"] >= 65 and cache.meta["train_tokens"] > 65


def test_glob_matching_nothing_is_one_clear_error(tmp_path):
    with pytest.raises(DataError, match="matches no file"):
        text_corpus([str(tmp_path / "*.nothing")])


def test_a_folder_without_files_is_one_clear_error(tmp_path):
    """Once an IndexError from inside text_corpus, in train, eval and compare alike."""
    (tmp_path / "empty" / "nested").mkdir(parents=True)  # folders below it, still no file
    with pytest.raises(DataError) as error:
        text_corpus([str(tmp_path / "empty")])
    assert str(error.value) == f"data.paths entry '{tmp_path / 'empty'}' is a folder with no files in it"
    (tmp_path / "also_empty").mkdir()
    with pytest.raises(DataError) as error:
        text_corpus([str(tmp_path / "*empty")])
    assert str(error.value) == f"data.paths entry '{tmp_path / '*empty'}' matches only folders with no files"
    (tmp_path / "text.txt").write_text("x = 1\n")
    with pytest.raises(DataError, match="'.*empty' is a folder with no files in it"):  # each entry must give files
        text_corpus([str(tmp_path / "text.txt"), str(tmp_path / "empty")])


def test_data_mqar_is_not_a_text_corpus():
    from omegaconf import OmegaConf

    from lm.data.corpora import build_corpus

    with pytest.raises(DataError, match=r"^data=mqar is a generated recall task, not a text corpus: only training"):
        build_corpus(OmegaConf.create({"source": "mqar"}))
    with pytest.raises(DataError, match=r"^data.source='csv' is not one of 'pystdlib', 'pystdlib_tests', 'text', "
                                         r"'hf' \(or 'mqar'"):
        build_corpus(OmegaConf.create({"source": "csv"}))


def test_the_stdlib_test_suites_are_text_the_built_in_corpus_never_contains():
    from lm.data.corpora import TEST_SUITE_DIRS, build_corpus

    def ids(name: str) -> set[str]:
        corpus = build_corpus(compose_config("train", [f"data={name}"]).data)
        return {doc_id for doc_id, _ in corpus.documents()}

    train, held_out = ids("pystdlib"), ids("pystdlib_tests")
    assert train and held_out and not train & held_out
    assert all(TEST_SUITE_DIRS & set(Path(i).parts[:-1]) for i in held_out)
    assert not any(TEST_SUITE_DIRS & set(Path(i).parts[:-1]) for i in train)


def test_corpus_smaller_than_a_sequence_is_refused(tmp_path):
    f = tmp_path / "tiny.txt"
    f.write_text("x = 1\n")
    with pytest.raises(DataError):
        dm = TokenDataModule(text_corpus([str(f)]), tmp_path / "c", seq_len=64, batch_size=2, vocab_size=300)
        dm.setup()


def test_hf_source_reads_a_local_dataset_folder_through_load_dataset(tmp_path):
    folder = tmp_path / "my_dataset"
    folder.mkdir()
    with open(folder / "train.jsonl", "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"def function_{i}(x):\n    return x * {i}\n", "id": i}) + "\n")
    corpus = hf_corpus(str(folder), None, "train", "text", streaming=False, data_files=None, max_docs=None)
    docs = list(corpus.documents())
    assert len(docs) == 200 and docs[3][1].startswith("def function_3")
    streamed = hf_corpus(str(folder), None, "train", "text", streaming=True, data_files=None, max_docs=50)
    assert [t for _, t in streamed.documents()] == [t for _, t in docs[:50]]
    cache = build_token_cache(corpus, tmp_path / "c", 300, 0.1, min_val_tokens=17)
    assert cache.meta["train_tokens"] > 1000
    wrong_field = hf_corpus(str(folder), None, "train", "body", False, None, None)
    with pytest.raises(DataError, match="data.text_field='body' is not a column"):
        next(wrong_field.documents())


@pytest.mark.parametrize("value", [12, None])
def test_a_dataset_row_whose_text_is_not_a_string_is_one_line(tmp_path, value):
    folder = tmp_path / "rows"
    folder.mkdir()
    rows = [{"text": "def f(x):\n    return x\n"}, {"text": value}]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus = hf_corpus(str(folder), None, "train", "text", streaming=False, data_files=None, max_docs=None)
    with pytest.raises(DataError, match=rf"row 1 of .* has text={value!r} \(\w+\), not text"):
        list(corpus.documents())


@pytest.mark.parametrize("name, config_name, split, message", [
    ("rows", None, "validation", r"split='validation'\) could not be loaded: Unknown split \"validation\""),
    ("rows", "nope", "train", r"config_name='nope', .* BuilderConfig 'nope' not found"),
])
def test_a_dataset_that_cannot_be_loaded_is_one_line(tmp_path, name, config_name, split, message):
    (tmp_path / "rows").mkdir()
    (tmp_path / "rows" / "train.jsonl").write_text(json.dumps({"text": "x = 1"}) + "\n")
    corpus = hf_corpus(str(tmp_path / name), config_name, split, "text", streaming=False, data_files=None,
                       max_docs=None)
    with pytest.raises(DataError, match=message) as error:
        list(corpus.documents())
    assert "\n" not in str(error.value)


def test_a_streamed_dataset_that_loses_its_connection_midway_is_one_line(tmp_path, monkeypatch):
    import datasets

    def rows_then_a_dropped_connection():
        yield {"text": "x = 1"}
        raise ConnectionError("Connection reset by peer")

    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: rows_then_a_dropped_connection())
    corpus = hf_corpus("someone/big", None, "train", "text", streaming=True, data_files=None, max_docs=None)
    documents = corpus.documents()
    assert next(documents) == ("0", "x = 1")
    with pytest.raises(DataError, match=r"^reading data.name='someone/big' failed at row 1: Connection reset by peer$"):
        next(documents)


def test_symlink_loops_under_a_recursive_glob_neither_hang_nor_repeat_a_file(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "x.txt").write_text("hello")
    (tmp_path / "a" / "up").symlink_to("..")  # a/up/a/up/... reaches x.txt by ever longer paths
    # Two more loops: Python's recursive glob follows every one of them and explores a number
    # of paths exponential in the link depth (more than a minute here); the walk does not.
    (tmp_path / "a" / "b" / "up").symlink_to("../..")
    (tmp_path / "a" / "b" / "back").symlink_to("..")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "e.txt").write_text("linked folder")
    (tmp_path / "a" / "b" / "data").symlink_to(tmp_path / "elsewhere")  # a linked folder is read
    (tmp_path / "f.txt").write_text("linked file")
    (tmp_path / "a" / "b" / "link.txt").symlink_to(tmp_path / "f.txt")  # a linked file counts
    corpus = text_corpus([f"{tmp_path}/a/**/*.txt"])
    assert sorted(text for _, text in corpus.documents()) == ["hello", "linked file", "linked folder"]


PATTERNS = ["c/**/*.txt", "c/**", "c/**/b", "c/**/.hidden/*", "**/*.py", "c/*/**/*.txt", "c/a/**/x.txt", "c/*.txt",
            "c/**/nothing", "c/*/**", "*/**", "**", "**/", "c/**/data/*", "c/**/e.txt", "c/**/[xy].txt",
            "c/?/**", "c/**/[!x]*.txt", "**/.hidden/**", ".*"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_recursive_patterns_match_what_glob_matches_on_a_tree_without_loops(tmp_path, monkeypatch, pattern):
    for name in ["c/a/b/x.txt", "c/x.txt", "c/.hidden/h.txt", "c/.dot.txt", "c/d/z.py", "c/a/b/deep/y.txt",
                 "top.txt", ".top.txt", "outside/e.txt", "outside/.e.txt"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    (tmp_path / "c" / "d" / "data").symlink_to(tmp_path / "outside")  # a linked folder, no loop
    monkeypatch.chdir(tmp_path)
    expected = set()
    for match in map(Path, glob.glob(pattern, recursive=True)):  # the reference: glob, folders expanded
        expected.update(f.resolve() for f in (match.rglob("*") if match.is_dir() else [match]) if f.is_file())
    assert {f.resolve() for f in expand_pattern(pattern)} == expected


def test_datamodule_batches_are_shifted_windows(tmp_path, small_corpus):
    dm = TokenDataModule(text_corpus([str(small_corpus)]), tmp_path, seq_len=16, batch_size=4, vocab_size=300)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (4, 17)
    tokens = np.asarray(dm.cache.tokens("train"))
    first_window = dm.train_set[0].numpy()
    assert (first_window == tokens[:17]).all()
    again = next(iter(dm.train_dataloader()))
    assert (again == batch).all()  # the shuffle is seeded


def test_a_lone_document_that_hashes_into_val_still_trains(tmp_path):
    # Find a file name whose hash puts it in the validation share.
    name = next(f"doc{i}.txt" for i in range(1000) if is_validation(f"doc{i}.txt", 0.05))
    f = tmp_path / name
    f.write_text("a short sentence about nothing in particular. " * 200)
    cache = build_token_cache(text_corpus([str(f)]), tmp_path / "c", 300, 0.05, min_val_tokens=33)
    assert cache.meta["train_tokens"] > 33 and cache.meta["val_tokens"] >= 33
    assert cache.tokenizer().get_vocab_size() > 257  # merges were learned from the text


def test_paths_without_data_text_is_refused():
    from omegaconf import OmegaConf

    from lm.data.corpora import build_corpus

    with pytest.raises(DataError, match="data.paths is set but data=pystdlib"):
        build_corpus(OmegaConf.create({"source": "pystdlib", "paths": ["notes.txt"]}))


# ------------------------------------------------------------------ opening and verifying a token cache

def one_file_cache(tmp_path: Path) -> TokenCache:
    (tmp_path / "doc.txt").write_text("def add_one(x):\n    return x + 1\n" * 400)
    return build_token_cache(text_corpus([str(tmp_path / "doc.txt")]), tmp_path / "c", 300, 0.05, min_val_tokens=33)


def open_again(tmp_path: Path) -> TokenCache:
    return build_token_cache(text_corpus([str(tmp_path / "doc.txt")]), tmp_path / "c", 300, 0.05, min_val_tokens=33)


def hashed_files(monkeypatch) -> list[str]:
    """The names of the files hashed from now on, in order."""
    hashed, checksum = [], lm.data.token_cache.file_checksum
    monkeypatch.setattr(lm.data.token_cache, "file_checksum", lambda path: hashed.append(path.name) or checksum(path))
    return hashed


def recorded_times(cache: TokenCache) -> dict[str, int]:
    return {name: (cache.path / name).stat().st_mtime_ns for name in cache.meta["files"]}


def test_opening_a_cache_compares_sizes_and_times_and_hashes_nothing(tmp_path, monkeypatch):
    built = one_file_cache(tmp_path)
    assert built.meta["file_mtimes_ns"] == recorded_times(built)
    hashed = hashed_files(monkeypatch)
    assert open_again(tmp_path).path == built.path
    assert hashed == []


def test_a_file_with_a_new_time_is_hashed_once_and_its_time_recorded(tmp_path, monkeypatch, capsys):
    cache = one_file_cache(tmp_path)
    train = cache.path / "train.bin"
    os.utime(train, ns=(train.stat().st_atime_ns, train.stat().st_mtime_ns + 10**9))  # copied without its times
    hashed = hashed_files(monkeypatch)
    open_again(tmp_path)
    assert hashed == ["train.bin"]
    assert cache.meta["file_mtimes_ns"] == recorded_times(cache)
    open_again(tmp_path)
    assert hashed == ["train.bin"]  # not again
    assert "damaged" not in capsys.readouterr().out


def test_a_cache_written_without_file_times_is_hashed_once_then_opens_cheaply(tmp_path, monkeypatch):
    cache = one_file_cache(tmp_path)
    older = {key: value for key, value in cache.meta.items() if key != "file_mtimes_ns"}  # what older code wrote
    (cache.path / "meta.json").write_text(json.dumps(older, indent=2))
    hashed = hashed_files(monkeypatch)
    assert open_again(tmp_path).path == cache.path
    assert hashed == ["tokenizer.json", "train.bin", "val.bin"]
    assert cache.meta == {**older, "file_mtimes_ns": recorded_times(cache)}
    open_again(tmp_path)
    assert len(hashed) == 3


def test_a_cache_whose_times_cannot_be_recorded_still_opens_with_a_note(tmp_path, monkeypatch, capsys):
    cache = one_file_cache(tmp_path)
    older = {key: value for key, value in cache.meta.items() if key != "file_mtimes_ns"}
    (cache.path / "meta.json").write_text(json.dumps(older, indent=2))

    def read_only_folder(path, write):
        raise CheckpointError(f"could not write {str(path)!r}: Read-only file system; the previous file is untouched")

    monkeypatch.setattr(lm.data.token_cache, "write_atomically", read_only_folder)
    assert open_again(tmp_path).path == cache.path
    assert cache.meta == older
    assert capsys.readouterr().out == (f"note: cannot record the verified file times in {cache.path / 'meta.json'}; "
                                       "the next run hashes those files again\n")


def verify_cache(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "verify_cache.py"), str(folder)],
                          capture_output=True, text=True, timeout=120)


def test_verify_cache_hashes_every_file_and_finds_bytes_changed_behind_a_restored_time(tmp_path, capsys):
    """The script run as typed for the good cache, its main in this process for the damaged one."""
    cache = one_file_cache(tmp_path)
    meta = cache.meta
    done = verify_cache(cache.path)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == (f"ok {cache.path}: tokenizer.json, train.bin, val.bin match their SHA-256 "
                           f"({meta['train_tokens']} train and {meta['val_tokens']} val tokens)\n")
    val = cache.path / "val.bin"
    before = val.stat()
    with open(val, "r+b") as f:  # same size, other bytes, then the old time: opening cannot tell
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 1]))
    os.utime(val, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert cache.damage() is None
    main = runpy.run_path(str(ROOT / "scripts" / "verify_cache.py"))["main"]
    capsys.readouterr()  # the cache's build said its progress
    with pytest.raises(SystemExit) as done:
        main([str(cache.path)])
    out, err = capsys.readouterr()
    assert (done.value.code, out) == (2, "")
    assert err == (f"error: token cache {str(cache.path)!r} is damaged: val.bin does not match its checksum; "
                           "the next run that uses it rebuilds it, or delete the folder\n")


@pytest.mark.parametrize("make, message", [
    (lambda folder: None, "is not a token cache folder (it has no meta.json)"),
    (lambda folder: (folder / "meta.json").write_text("{"), "is damaged: meta.json is unreadable or from an older "
                                                           "cache format; "),
])
def test_verify_cache_of_a_folder_that_is_no_cache_is_one_line_and_exit_2(tmp_path, make, message, capsys):
    """The script's main in this process (the test above runs the script itself once)."""
    folder = tmp_path / "not-a-cache"
    folder.mkdir()
    make(folder)
    main = runpy.run_path(str(ROOT / "scripts" / "verify_cache.py"))["main"]
    with pytest.raises(SystemExit) as done:
        main([str(folder)])
    stderr = capsys.readouterr().err
    assert done.value.code == 2
    assert len(stderr.splitlines()) == 1 and message in stderr, stderr
