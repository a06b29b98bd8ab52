"""C source built into a shared library with the machine's C compiler, once per source and flags, and
loaded with ctypes: how `lm` ships a kernel of its own without a wheel per platform.

Why not torch.utils.cpp_extension: it compiles against PyTorch's C++ headers and pybind11, 34 s for a
one-line function on a 2-core AMD EPYC (`load_inline`, measured), and wants ninja, while a kernel that
takes raw pointers needs neither; this builds one C file in under a second. The compiler is `CC` (a
command, possibly with arguments), else `cc`: where torch.compile runs on the CPU a C++ compiler is
installed, and with it, as a rule, the C one.

The library lands in `$XDG_CACHE_HOME/lm/native` (else `~/.cache/lm/native`) under a name hashed from
the source, the flags and the compiler, written to a temporary file of its own and renamed, so processes
that build at once (test workers) never load a half-written file."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from lm.util.errors import one_line


class NativeBuildError(RuntimeError):
    """The C source could not be built or loaded here; the message says why, in one line."""


def cache_folder() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lm" / "native"


def compiler() -> list[str]:
    """The C compiler's command (its path, then any arguments `CC` gives); NativeBuildError where there is none."""
    command = shlex.split(os.environ.get("CC") or "cc")
    path = shutil.which(command[0]) if command else None
    if path is None:
        raise NativeBuildError(f"no C compiler found ({os.environ.get('CC') or 'cc'!r}; set CC to one)")
    return [path, *command[1:]]


def first_error(output: str) -> str:
    """The compiler's first line that names an error (else its first line), for a one-line message."""
    lines = [line for line in output.splitlines() if line.strip()]
    return next((line for line in lines if "error" in line.lower()), lines[0] if lines else "")


def build_library(source: Path, flags: tuple[str, ...]) -> ctypes.CDLL:
    """`source` compiled with `flags` (plus -O3 -shared -fPIC) and loaded; built only where this source,
    these flags and this compiler have not been built before. OpenMP (-fopenmp) is taken where the
    compiler has it: built by gcc, the library then shares the OpenMP runtime PyTorch has loaded (the
    same libgomp.so.1), as the kernels torch.compile builds do; without it the library runs on one thread."""
    cc = compiler()
    key = hashlib.sha256(b"\0".join([source.read_bytes(), " ".join([*flags, *cc]).encode(),
                                     platform.machine().encode()]))
    target = cache_folder() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            handle, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        except OSError as error:
            raise NativeBuildError(f"cannot write the built library under {target.parent}: {one_line(error)} "
                                   f"(set XDG_CACHE_HOME to a writable folder)") from error
        os.close(handle)
        partial = Path(name)
        base = [*cc, "-O3", "-shared", "-fPIC", *flags, str(source), "-o", str(partial), "-lm"]
        try:
            for command in ([*cc, "-fopenmp", *base[len(cc):]], base):
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode == 0:
                    break
            else:
                said = first_error(done.stderr or done.stdout) or f"exit code {done.returncode}"
                raise NativeBuildError(f"{Path(cc[0]).name} could not build {source.name}: {one_line(said, 200)}")
            os.replace(partial, target)
        except OSError as error:
            raise NativeBuildError(f"could not build {source.name} into {target.parent}: {one_line(error)}") from error
        finally:
            partial.unlink(missing_ok=True)
    try:
        return ctypes.CDLL(str(target))
    except OSError as error:
        raise NativeBuildError(f"{target} did not load: {one_line(error)}") from error
