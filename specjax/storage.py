"""Where a path lives: a local one (``pathlib``, exactly as before) or a bucket URL (``gs://``,
``s3://``, ``az://``, ``hf://``) reached through ``etils.epath``, decided once here.

What needs random access (memory-mapped safetensors, ``.npy``, arrow) never reads a bucket
directly: a remote directory is *staged* into a local cache directory first
(:func:`stage_in`, ``$SPECJAX_CACHE/remote/<hash>-<name>``) and the local code reads that. A
directory written for a bucket is built locally with the ordinary atomic writers and then
*published* (:func:`publish`) file by file, its completion markers (a data directory's
``state.json`` and ``specjax_data.json``, an export's ``config.json``) deleted first and uploaded
last, so a reader never takes a half-written remote directory for a complete one. One object
upload is atomic on a bucket (the object appears when it is complete), so single small files
(``resume.json``, ``summary.json``) are written in place (:func:`write_text`).

Append-only files (``metrics.jsonl``, TensorBoard events) of a remote run are written to a local
:class:`Spool` and uploaded whole at each checkpoint and at the end.

The filesystem behind a scheme is an optional install (``gs://``: ``pip install 'specjax[gcs]'``,
i.e. gcsfs; ``s3://``: ``specjax[s3]``); a missing one is a :class:`StorageBackendError` naming
the path and the package, raised before any work starts."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bridge.atomic import atomic_file
from bridge.errors import BridgeError, WriteError
from specjax.paths import cache_root

# scheme -> (the fsspec package behind it, the pip extra that installs it)
BACKENDS = {"gs": ("gcsfs", "specjax[gcs]"), "s3": ("s3fs", "specjax[s3]"), "az": ("adlfs", "adlfs"),
            "hf": ("huggingface_hub", "huggingface-hub")}
# the files that mark a model or checkpoint directory complete, uploaded last (a speculators
# checkpoint's or HF model's config.json; an Orbax directory's checkpoint metadata)
CHECKPOINT_MARKERS = ("config.json", "_CHECKPOINT_METADATA")
SOURCE_NAME = ".specjax-remote.json"  # in a staged copy: the URL and the markers it was staged from
CHUNK = 16 << 20
THREADS = 8
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class StorageError(BridgeError):
    """A remote path that cannot be used (unknown scheme, nothing there)."""


class StorageBackendError(StorageError):
    """A bucket URL whose filesystem package is not installed."""


def scheme(path) -> str | None:
    """``"gs"`` for ``gs://b/x``; None for a local path (``file://`` counts as local)."""
    m = _SCHEME.match(os.fspath(path))
    return None if m is None or m.group(1).lower() == "file" else m.group(1).lower()


def is_remote(path) -> bool:
    return scheme(path) is not None


def path(p):
    """A ``pathlib.Path`` for a local path (``file://`` stripped), an ``epath.Path`` for a bucket
    URL whose filesystem is installed; raises :class:`StorageBackendError` /
    :class:`StorageError` otherwise."""
    s = os.fspath(p)
    sch = scheme(s)
    if sch is None:
        return Path(s[len("file://"):]) if s.startswith("file://") else Path(s)
    if sch not in BACKENDS:
        raise StorageError(f"unsupported URL scheme {sch}://; a remote path is one of "
                           f"{', '.join(k + '://' for k in BACKENDS)}, else a local path", path=s)
    from etils import epath

    out = epath.Path(s)
    try:
        out.exists()  # the first call builds the filesystem: a missing package fails here, not mid-run
    except ImportError as e:
        pkg, extra = BACKENDS[sch]
        raise StorageBackendError(f"{sch}:// paths need the {pkg} package, which is not installed ({e}); "
                                  f"pip install '{extra}'", path=s) from None
    return out


def absolute(p):
    """``p`` made absolute (a local path; a URL is absolute already)."""
    return p if is_remote(p) else Path(p).absolute()


def cache_dir(url) -> Path:
    """The local copy of a remote directory: ``$SPECJAX_CACHE/remote/<sha256[:16]>-<name>``."""
    s = os.fspath(url).rstrip("/")
    return cache_root() / "remote" / f"{hashlib.sha256(s.encode()).hexdigest()[:16]}-{s.rsplit('/', 1)[-1]}"


def write_text(p, text: str) -> None:
    """A small text file written whole: atomically beside it (local), one object upload (remote)."""
    if is_remote(p):
        path(p).write_text(text)
        return
    with atomic_file(p, text=True) as f:
        f.write(text)


def remove(p, *, ignore_errors: bool = False) -> None:
    """Delete a file or a directory tree, local or remote; a missing one is no error."""
    if is_remote(p):
        p = path(p)
        if p.is_dir():
            p.rmtree()
        elif p.exists():
            p.unlink()
    elif Path(p).is_dir():
        shutil.rmtree(p, ignore_errors=ignore_errors)
    elif os.path.lexists(p):
        os.unlink(p)


def files(root, *, hidden: bool = True) -> list[str]:
    """Every file under ``root`` (local or remote) as a ``/``-joined relative path, sorted;
    ``hidden=False`` leaves out paths with a part starting with ``.`` (temp files, staging)."""
    out = []
    base = os.fspath(root).rstrip("/")
    walk = root.walk() if is_remote(root) else os.walk(root)
    for d, _, names in walk:
        rel_d = os.fspath(d).rstrip("/")[len(base):].strip("/")
        out += [f"{rel_d}/{n}" if rel_d else n for n in names]
    if not hidden:
        out = [r for r in out if not any(part.startswith(".") for part in r.split("/"))]
    return sorted(out)


def _size(p) -> int:
    return int(p.stat().length) if is_remote(p) else p.stat().st_size


def _copy(src, dst) -> int:
    """Stream one file; a local destination is written atomically, a remote one is one upload."""
    if is_remote(dst):
        dst.parent.mkdir(parents=True, exist_ok=True)  # a no-op on a bucket; a directory on a mounted fake
        with open(src, "rb") as s, dst.open("wb") as d:
            shutil.copyfileobj(s, d, CHUNK)
    else:
        with src.open("rb") as s, atomic_file(dst) as d:
            shutil.copyfileobj(s, d, CHUNK)
    return _size(dst)


def _transfer(pairs: list, *, progress: bool, desc: str) -> None:
    """Copy ``(src, dst)`` pairs over a few threads, a tqdm bar counting files."""
    from tqdm.auto import tqdm

    if not pairs:
        return
    with tqdm(total=len(pairs), unit="file", desc=desc, disable=not progress, dynamic_ncols=True) as bar, \
            ThreadPoolExecutor(min(THREADS, len(pairs))) as pool:
        for _ in pool.map(lambda sd: _copy(*sd), pairs):
            bar.update(1)


def _stamp(root, markers) -> dict:
    return {m: (root / m).read_text() for m in markers if (root / m).is_file()}


def stage_in(url, *, markers=(), progress: bool = True) -> Path:
    """A local copy of the remote directory ``url`` (a local path is returned as it is).

    Files already staged with the remote size are kept when the remote's ``markers`` read the
    same as when they were staged (recorded in ``.specjax-remote.json``); a remote rewritten since
    is fetched again whole. The markers are fetched last."""
    if not is_remote(url):
        return Path(url)
    src, local = path(url), cache_dir(url)
    names = files(src)
    if not names:
        raise StorageError("nothing here: expected a directory of files", path=os.fspath(url))
    record = {"url": os.fspath(url), "markers": _stamp(src, markers)}
    rec_p = local / SOURCE_NAME
    same = rec_p.is_file() and json.loads(rec_p.read_text(encoding="utf-8")) == record
    with atomic_file(rec_p, text=True) as f:
        f.write(json.dumps(record))
    body = [n for n in names if n not in markers]
    with ThreadPoolExecutor(THREADS) as pool:
        sizes = list(pool.map(lambda n: _size(src / n), body))
    todo = [(src / n, local / n) for n, size in zip(body, sizes)
            if not (same and (local / n).is_file() and (local / n).stat().st_size == size)]
    _transfer(todo, progress=progress, desc=f"staging {os.fspath(url)}")
    for m in markers:
        if m in names:
            _copy(src / m, local / m)
    return local


def publish(local_dir, url, *, markers=(), overwrite: bool = False, progress: bool = True) -> None:
    """Upload the local directory ``local_dir`` (its hidden files left out) to ``url``: the markers
    there deleted first, every other file uploaded, files of an older version removed, the
    markers uploaded last (in the order given). An existing ``url`` needs ``overwrite``. When
    ``local_dir`` is ``url``'s cache directory it is recorded as staged (no later download)."""
    dst = path(url)
    local_dir = Path(local_dir)
    old = files(dst) if dst.is_dir() else []
    if old and not overwrite:
        raise WriteError("destination exists; pass --overwrite (overwrite=True) to replace it", path=os.fspath(url))
    new = files(local_dir, hidden=False)
    _send(local_dir, url, new, markers, drop=[m for m in markers if m in old],
          stale=sorted(set(old) - set(new) - set(markers)), progress=progress)


def _send(local_dir: Path, url, names: list, markers, *, drop, stale=(), progress: bool) -> list[str]:
    """Upload ``names`` (relative to ``local_dir``) to ``url`` so that a reader never takes a
    half-written directory for a complete one: the remote markers ``drop`` deleted first, the other
    files uploaded, ``stale`` remote files removed, the markers among ``names`` uploaded last (in
    ``markers``' order). A cache directory is then recorded as staged from ``url``. Returns the
    names in upload order."""
    dst = path(url)
    for m in drop:
        (dst / m).unlink()  # from here on a reader sees the directory as incomplete
    body = [n for n in names if n not in markers]
    _transfer([(local_dir / n, dst / n) for n in body], progress=progress, desc=f"uploading to {os.fspath(url)}")
    for n in stale:
        (dst / n).unlink()
    marks = [m for m in markers if m in names]
    for m in marks:
        _copy(local_dir / m, dst / m)
    if local_dir.resolve() == cache_dir(url).resolve():
        write_text(local_dir / SOURCE_NAME, json.dumps({"url": os.fspath(url), "markers": _stamp(local_dir, markers)}))
    return body + marks


def signatures(root) -> dict[str, tuple[int, int]]:
    """``name -> (size, mtime_ns)`` of every file under the local directory ``root`` (hidden files
    left out): taken before a command changes a staged copy, for :func:`push_changed`."""
    root = Path(root)
    out = {}
    for n in files(root, hidden=False):
        st = (root / n).stat()
        out[n] = (st.st_size, st.st_mtime_ns)
    return out


def push_changed(local_dir, url, before: dict, *, markers=(), progress: bool = True) -> list[str]:
    """Upload to ``url`` the files of ``local_dir`` (its staged copy) that are new or changed since
    ``before`` (:func:`signatures`), the changed markers deleted there first and uploaded last, so a
    reader never sees new files under old markers as complete. The copy is recorded as staged
    again (no later download). Returns the names uploaded."""
    local_dir, dst = Path(local_dir), path(url)
    now = signatures(local_dir)
    changed = [n for n, sig in now.items() if before.get(n) != sig]
    drop = [m for m in markers if m in changed and (dst / m).exists()]
    return _send(local_dir, url, changed, markers, drop=drop, progress=progress)


def scratch_dir() -> tempfile.TemporaryDirectory:
    """A temporary local directory for something built here and then published."""
    root = cache_root() / "remote"
    root.mkdir(parents=True, exist_ok=True)
    return tempfile.TemporaryDirectory(prefix=".scratch-", dir=root)


class Spool:
    """A local directory that stands for the remote directory ``url`` for files written in
    pieces (appends): ``names`` present remotely are fetched first (so appends continue them);
    :meth:`flush` uploads every file changed since the last flush."""

    def __init__(self, url, names=()):
        self.remote = path(url)
        self.dir = cache_dir(url) / "spool"
        remove(self.dir)
        self.dir.mkdir(parents=True)
        for n in names:
            if (self.remote / n).is_file():
                _copy(self.remote / n, self.dir / n)
        self.sent = {n: self._sig(n) for n in files(self.dir)}

    def _sig(self, n: str):
        st = (self.dir / n).stat()
        return st.st_size, st.st_mtime_ns

    def flush(self) -> None:
        now = {n: self._sig(n) for n in files(self.dir, hidden=False)}
        changed = [n for n, sig in now.items() if self.sent.get(n) != sig]
        _transfer([(self.dir / n, self.remote / n) for n in changed], progress=False, desc="")
        self.sent.update({n: now[n] for n in changed})
