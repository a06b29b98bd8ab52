"""C source built into a shared library with the machine's C compiler, once per source and flags, and
loaded with ctypes: how `lm` ships a kernel of its own without a wheel per platform.

Why not torch.utils.cpp_extension: it compiles against PyTorch's C++ headers and pybind11 (tens of
seconds on a 2-core CPU for every fresh install, and it wants ninja), while a kernel that takes raw
pointers needs neither; this builds one C file in under a second. The compiler is the one
`torch.compile` already needs on the CPU (`CC`, else `cc`).

The library lands in `$XDG_CACHE_HOME/lm/native` (else `~/.cache/lm/native`) under a name hashed from
the source, the flags and the compiler, written to a temporary name and renamed, so processes that build
at once (test workers) never load a half-written file."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

from lm.util.errors import one_line


class NativeBuildError(RuntimeError):
    """The C source could not be built or loaded here; the message says why, in one line."""


def cache_folder() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lm" / "native"


def compiler() -> str:
    """The C compiler's path; NativeBuildError where there is none."""
    name = os.environ.get("CC", "cc")
    path = shutil.which(name)
    if path is None:
        raise NativeBuildError(f"no C compiler found ({name!r}; set CC to one)")
    return path


def build_library(source: Path, flags: tuple[str, ...]) -> ctypes.CDLL:
    """`source` compiled with `flags` (plus -O3 -shared -fPIC) and loaded; built only where this source,
    these flags and this compiler have not been built before. OpenMP (-fopenmp) is taken where the
    compiler has it: the library then shares the OpenMP runtime PyTorch has loaded (the same libgomp.so.1),
    as the kernels torch.compile builds do."""
    cc = compiler()
    text = source.read_bytes()
    key = hashlib.sha256(b"\0".join([text, " ".join(flags).encode(), cc.encode(), platform.machine().encode()]))
    target = cache_folder() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        base = [cc, "-O3", "-shared", "-fPIC", *flags, str(source), "-o", str(partial), "-lm"]
        try:
            for command in ([*base[:1], "-fopenmp", *base[1:]], base):  # without OpenMP it runs on one thread
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode == 0:
                    break
            else:
                raise NativeBuildError(f"{Path(cc).name} could not build {source.name}: "
                                       f"{one_line(done.stderr or done.stdout, 200)}")
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    try:
        return ctypes.CDLL(str(target))
    except OSError as error:
        raise NativeBuildError(f"{target} did not load: {one_line(error)}") from error
