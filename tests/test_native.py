"""Building C source with the machine's compiler (lm.util.native): once per source and flags, into the
cache folder, and refused in one line where it cannot be built."""

import ctypes
import os
import shutil
import stat

import pytest

from lm.util.native import NativeBuildError, build_library

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) here")

SOURCE = "int twice(int x) { return 2 * x; }\n"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("CC", raising=False)  # the default compiler, whatever the environment names
    return tmp_path / "cache" / "lm" / "native"


def test_a_source_is_built_once_and_loaded(tmp_path, cache):
    source = tmp_path / "twice.c"
    source.write_text(SOURCE)
    lib = build_library(source, ())
    lib.twice.argtypes, lib.twice.restype = [ctypes.c_int], ctypes.c_int
    assert lib.twice(21) == 42
    (built,) = cache.iterdir()  # one library, no temporary left beside it
    assert built.name.startswith("twice-") and built.suffix == ".so"
    modified = built.stat().st_mtime_ns
    build_library(source, ())
    assert built.stat().st_mtime_ns == modified and len(list(cache.iterdir())) == 1  # taken from the cache
    source.write_text(SOURCE.replace("2 * x", "3 * x"))  # a changed source is a new library
    changed = build_library(source, ())
    changed.twice.argtypes, changed.twice.restype = [ctypes.c_int], ctypes.c_int
    assert changed.twice(21) == 63 and len(list(cache.iterdir())) == 2


def test_a_source_that_does_not_compile_is_refused_in_one_line(tmp_path, cache):
    source = tmp_path / "broken.c"
    source.write_text("int broken( {\n")
    with pytest.raises(NativeBuildError, match=r"^cc could not build broken\.c: ") as refused:
        build_library(source, ())
    assert "\n" not in str(refused.value)
    assert not cache.exists() or not list(cache.iterdir())  # nothing half-written left behind


def test_no_compiler_is_refused_in_one_line(tmp_path, cache, monkeypatch):
    source = tmp_path / "twice.c"
    source.write_text(SOURCE)
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(NativeBuildError, match=r"^no C compiler found \('no-such-compiler'; set CC to one\)$"):
        build_library(source, ())


def test_a_compiler_command_with_arguments_is_taken_whole(tmp_path, cache, monkeypatch):
    source = tmp_path / "factor.c"
    source.write_text("int factor(void) { return FACTOR; }\n")
    monkeypatch.setenv("CC", "cc -DFACTOR=7")
    lib = build_library(source, ())
    lib.factor.restype = ctypes.c_int
    assert lib.factor() == 7


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_cache_folder_it_cannot_write_is_refused_in_one_line(tmp_path, cache):
    source = tmp_path / "twice.c"
    source.write_text(SOURCE)
    cache.parent.mkdir(parents=True)
    cache.parent.chmod(stat.S_IRUSR | stat.S_IXUSR)  # lm/ read-only: native/ cannot be made
    try:
        with pytest.raises(NativeBuildError, match=r"^cannot write the built library under .*: .*\(set "
                                                   r"XDG_CACHE_HOME to a writable folder\)$"):
            build_library(source, ())
    finally:
        cache.parent.chmod(stat.S_IRWXU)


def test_a_cache_path_that_is_a_file_is_refused_in_one_line(tmp_path, cache):
    """(a folder that cannot be made, as a read-only home gives, also where the tests run as root)"""
    source = tmp_path / "twice.c"
    source.write_text(SOURCE)
    cache.parent.mkdir(parents=True)
    cache.write_text("not a folder")
    with pytest.raises(NativeBuildError, match=r"^cannot write the built library under .*native: .*\(set "
                                               r"XDG_CACHE_HOME to a writable folder\)$"):
        build_library(source, ())
