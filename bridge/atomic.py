"""Atomic writes: a temp file (or directory) beside the destination, renamed into place
only when complete. A failure leaves no partial output and never touches inputs.

``tempfile`` creates its files 0600 and directories 0700; what is renamed into place gets the
ordinary modes of the process umask instead (0644 / 0755 under umask 022), so another user or a
container (vLLM) can read an exported checkpoint."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from bridge.errors import WriteError


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, *, text: bool = False):
    """Yield a file object; on success it is fsynced and renamed onto ``path``."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise WriteError(f"cannot create a file here: {e.strerror}", path=str(path)) from e
    try:
        with os.fdopen(fd, "w" if text else "wb", **({"encoding": "utf-8"} if text else {})) as f:
            os.fchmod(f.fileno(), file_mode())  # mkstemp's 0600 -> the umask's ordinary mode
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_dir(dest: str | os.PathLike, *, overwrite: bool = False):
    """Yield a temp directory beside ``dest``; on success it replaces ``dest``.

    Refuses an existing ``dest`` unless ``overwrite``. With ``overwrite`` the old
    directory is moved aside first and deleted only after the new one is in place.
    """
    dest = Path(dest)
    refuse_existing(dest, overwrite)
    tmp = temp_dir_beside(dest)
    try:
        yield tmp
        replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def staged_dir(dest: str | os.PathLike, *, overwrite: bool = False):
    """Yield a path that does not exist yet, inside a temp directory beside ``dest``. Whatever the
    body creates there replaces ``dest`` when the body succeeds (it can write and then verify the
    result before anything is in place); on failure nothing is left and an old ``dest`` is untouched.
    """
    dest = Path(dest)
    refuse_existing(dest, overwrite)
    parent = temp_dir_beside(dest)
    try:
        staged = parent / dest.name
        yield staged
        if not staged.exists():
            raise WriteError(f"the writer left no output at {staged} (expected a directory there)", path=str(dest))
        replace_dir(staged, dest)
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def refuse_existing(dest: Path, overwrite: bool) -> None:
    if dest.exists() and not overwrite:
        raise WriteError("destination exists; pass --overwrite (overwrite=True) to replace it", path=str(dest))


def temp_dir_beside(dest: Path) -> Path:
    """An empty hidden directory next to ``dest`` with the umask's ordinary mode (not mkdtemp's 0700)."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    except OSError as e:
        raise WriteError(f"cannot create a directory here: {e.strerror}", path=str(dest)) from e
    try:
        os.chmod(tmp, dir_mode())
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise WriteError(f"cannot set the mode of a new directory: {e.strerror}", path=str(tmp)) from e
    return tmp


def current_umask() -> int:
    """The process umask (POSIX has no read-only query: set it and put it back at once)."""
    old = os.umask(0)
    os.umask(old)
    return old


def file_mode() -> int:
    """Mode of a new regular file under the umask: 0o644 under 0o022."""
    return 0o666 & ~current_umask()


def dir_mode() -> int:
    """Mode of a new directory under the umask: 0o755 under 0o022."""
    return 0o777 & ~current_umask()


def replace_dir(complete: Path, dest: Path) -> None:
    """Move a finished directory onto ``dest``; an old ``dest`` is moved aside first and
    deleted only once the new one is in place."""
    old = None
    if dest.exists():
        old = dest.parent / f".{dest.name}.old-{os.getpid()}"
        os.replace(dest, old)
    os.replace(complete, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
