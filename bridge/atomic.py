"""Atomic writes: a temp file (or directory) beside the destination, renamed into place
only when complete. A failure leaves no partial output and never touches inputs."""

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
    if dest.exists() and not overwrite:
        raise WriteError("destination exists; pass --overwrite (overwrite=True) to replace it", path=str(dest))
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    except OSError as e:
        raise WriteError(f"cannot create a directory here: {e.strerror}", path=str(dest)) from e
    try:
        yield tmp
        replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
