"""Writing files so that nothing is ever half-written, and keeping runs out of each other's way.

Every file lm writes (checkpoints, exports, token caches, study records) is written under a
temporary name beside its final one and renamed into place, so a kill, a full disk or a
read-only folder leaves the previous file whole. Temporary names end in `.tmp-<pid>`; the
next run removes those whose process is gone.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path, PurePath

from lm.util.errors import CheckpointError, ConfigError, one_line

TMP_SUFFIX = re.compile(r"\.tmp-(\d+)$")


def _default_file_mode() -> int:
    """The mode a plain open() gives a new file under this process's umask (usually 0644);
    some writers (safetensors) create 0600 files instead."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


FILE_MODE = _default_file_mode()


def tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


# torch.save reports a failed write (a full disk, a vanished folder) as a RuntimeError of its
# zip writer, e.g. "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598".
TORCH_WRITER_ERRORS = ("PytorchStreamWriter", "inline_container")


def is_write_failure(error: BaseException) -> bool:
    return isinstance(error, OSError) or (isinstance(error, RuntimeError)
                                          and any(marker in str(error) for marker in TORCH_WRITER_ERRORS))


def write_failure_reason(error: BaseException, folder: Path) -> str:
    if isinstance(error, (FileExistsError, NotADirectoryError)):
        in_the_way = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
        if in_the_way is not None:
            return f"{str(in_the_way)!r} is a file, not a folder"
    if isinstance(error, OSError):
        return error.strerror or str(error)
    try:
        if shutil.disk_usage(folder).free < 1 << 20:
            return "No space left on device"
    except OSError:
        pass
    return f"the write failed ({one_line(error, 160)})"


def make_folder(folder: Path) -> Path:
    """`mkdir -p` for an output folder, one line when it cannot be made."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create the folder {str(folder)!r}: {write_failure_reason(e, folder)}") from None
    return folder


def write_atomically(path: str | Path, write) -> Path:
    """Call write(tmp) beside `path`, then rename tmp into place: a crash or a full disk during
    the write leaves the previous file whole. A write failure becomes one CheckpointError line, and
    the temporary file is removed whatever stops the write."""
    path = Path(path)
    tmp = tmp_name(path)
    try:
        make_folder(path.parent)
        write(tmp)
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        if is_write_failure(e):
            raise CheckpointError(f"could not write {str(path)!r}: {write_failure_reason(e, path.parent)}; "
                        "the previous file is untouched") from None
        raise
    return path


def write_folder_atomically(out: Path, write_into) -> Path:
    """Call write_into(tmp) to fill a temporary folder inside `out`, then move its files into
    `out` one by one: for writers that only write whole folders (transformers' save_pretrained).
    Each file is complete, with the usual mode, before it takes its name; a failure while
    writing leaves the previous files whole and no temporary folder behind. The temporary folder
    is inside `out`, not beside it, so the moves stay on one filesystem even when `out` is a
    mount point or a link to another disk."""
    make_folder(out)
    remove_stale_temporaries(out)  # a killed export's leftovers
    tmp = out / f".export.tmp-{os.getpid()}"
    moved = 0
    try:
        make_folder(tmp)
        write_into(tmp)
        for written in sorted(tmp.iterdir()):
            os.chmod(written, FILE_MODE)
            os.replace(written, out / written.name)
            moved += 1
    except BaseException as e:
        if is_write_failure(e):
            untouched = "the previous files are untouched" if not moved else \
                f"{moved} file(s) were already replaced, each whole"
            raise CheckpointError(f"could not write into {str(out)!r}: {write_failure_reason(e, out)}; "
                                  f"{untouched}") from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, owned by someone else
    return True


def remove_stale_temporaries(folder: Path) -> None:
    """Remove `*.tmp-<pid>` files and folders in `folder` whose writing process has died."""
    if not folder.is_dir():
        return
    for entry in folder.iterdir():
        found = TMP_SUFFIX.search(entry.name)
        if not found or pid_alive(int(found.group(1))):
            continue
        try:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        except OSError:
            pass  # a folder we cannot clean is no reason to stop a run


class RunLock:
    """An exclusive lock on a run folder, held while one process trains it.

    flock locks belong to the open file, so the kernel drops them when the process dies however
    it dies: a killed run never leaves a stuck lock, only a harmless `.lock` file."""

    def __init__(self, run_dir: Path, run_name: str):
        self.path = run_dir / ".lock"
        self.run_name = run_name
        self._file = None

    def __enter__(self) -> RunLock:
        import fcntl  # POSIX only, so imported here: `import lm` works anywhere

        while True:
            make_folder(self.path.parent)
            try:
                self._file = open(self.path, "a+")
            except FileNotFoundError:
                continue  # its holder removed the empty folder just now: make it again
            try:
                fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._file.seek(0)
                holder = self._file.read().strip() or "another process"
                self._file.close()
                self._file = None
                raise ConfigError(f"run {self.run_name!r} is being trained by {holder} right now; "
                                  "wait for it or choose another run_name") from None
            if self._holds_the_file_at_path():
                break
            self._file.close()  # its holder removed it on the way out: lock the one at the path now
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"process {os.getpid()}")
        self._file.flush()
        return self

    def _holds_the_file_at_path(self) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(self._file.fileno()).st_ino
        except FileNotFoundError:
            return False

    def __exit__(self, *exc) -> None:
        if self._file is None:
            return
        # A run that wrote nothing (it stopped at bad input) leaves no empty run folder behind;
        # removed while still locked, so no other process can have started in it.
        folder = self.path.parent
        try:
            if [p.name for p in folder.iterdir()] == [self.path.name]:
                self.path.unlink()
                folder.rmdir()
        except OSError:
            pass  # something else is in it now, or it is gone already: nothing to tidy
        import fcntl

        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()
        self._file = None


def run_folder_name(run_name) -> str:
    """run_name itself, when it names a folder below whichever folder holds it; a ConfigError
    otherwise. Only the text is judged (not empty, not absolute, no `..`): the `run_folder_name`
    resolver (lm.util.cli) puts the name into Hydra's outputs/<run_name>/, which Hydra creates
    before any of the script's code runs."""
    name = str(run_name) if run_name is not None else ""
    parts = PurePath(name).parts
    if not name.strip() or PurePath(name).is_absolute() or ".." in parts or not parts:
        shown = repr(name) if run_name is not None else "null"
        raise ConfigError(f"run_name={shown} must name a folder inside checkpoint_dir and outputs/ "
                          "(not empty, no '..', no leading '/')")
    return name


def run_folder(checkpoint_dir: Path, run_name) -> Path:
    """checkpoint_dir / run_name, refusing a name that would put the run anywhere else (a link
    inside checkpoint_dir that leads out of it too)."""
    name = run_folder_name(run_name)
    run_dir = (checkpoint_dir / name).resolve()
    if run_dir == checkpoint_dir.resolve() or not run_dir.is_relative_to(checkpoint_dir.resolve()):
        raise ConfigError(f"run_name={name!r} must name a folder inside checkpoint_dir ({checkpoint_dir})")
    return checkpoint_dir / name
