"""Small helpers shared by the CLI command modules (printing, sizes, errors)."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import typer

from bridge.errors import BridgeError, WriteError


def console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def fail(err: BaseException, code: int = 2):
    """Print an error message (never a traceback) and exit."""
    from rich.markup import escape

    console(stderr=True).print(f"[red]error:[/red] {escape(str(err))}", markup=True)
    raise typer.Exit(code)


def human_bytes(n: int) -> str:
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{n} B"


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, flags=re.I)
    if not m:
        raise typer.BadParameter(f"size {text!r}: expected e.g. 500MB, 5GB, 2GiB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def download_option():
    """``--download``: the explicit opt-in to fetch Hub repo ids that are not in the local HF cache."""
    return typer.Option(False, "--download", help="download Hub repo ids that are not in the local HF cache "
                                                  "(also SPECJAX_ALLOW_DOWNLOAD=1); without it nothing is downloaded")


def local_dir(spec, *, kind: str, download: bool):
    """``spec`` as a local path: a path as given, a bucket URL (``gs://``, ``s3://``, ...) staged
    into the local cache (:func:`specjax.storage.stage_in`: unchanged files are not fetched again),
    a Hub repo id from the local HF cache (downloaded with ``--download``; :mod:`specjax.hub`). An
    unresolvable repo id or an unreachable bucket prints its error and exits 2."""
    from specjax import hub, storage

    try:
        if storage.is_remote(spec):
            return storage.stage_in(str(spec), markers=storage.CHECKPOINT_MARKERS)
        return hub.resolve(spec, kind=kind, download=download or None)
    except hub.HubError as e:
        fail(e, code=e.exit_code)
    except BridgeError as e:
        fail(e, code=2)


@contextlib.contextmanager
def output_dir(dst: str, *, overwrite: bool):
    """Where a command writes its output directory ``dst``: ``dst`` itself, or for a bucket URL a
    local scratch directory, published to ``dst`` when the block ends without an error
    (:func:`specjax.storage.publish`: the markers last; an existing ``dst`` needs ``overwrite``,
    checked before any work)."""
    from specjax import storage

    if not storage.is_remote(dst):
        yield Path(dst)
        return
    remote = storage.path(dst)
    if remote.is_dir() and storage.files(remote) and not overwrite:
        raise WriteError("destination exists; pass --overwrite to replace it", path=dst)
    with storage.scratch_dir() as tmp:
        out = Path(tmp) / "out"
        yield out
        storage.publish(out, dst, markers=storage.CHECKPOINT_MARKERS, overwrite=overwrite)


def draft_dir(draft: str | None, *, download: bool) -> str | None:
    """A ``--draft`` value with a repo id replaced by its local snapshot ('self' / 'self:M' kept)."""
    if draft is None or draft == "self" or draft.startswith("self:"):
        return draft
    return str(local_dir(draft, kind="draft", download=download))


def fetch_target(target: str | None, *, download: bool) -> None:
    """With ``--download``: put a ``--target`` repo id into the local HF cache before the loader
    (which reads the cache) runs."""
    if download and target not in (None, "default"):
        local_dir(target, kind="target", download=True)
