"""Reading the files a checkpoint is made of without hanging or crashing on hostile input.

Every JSON document the bridge reads (``config.json``, a verifier's ``config.json``, a sharded
index, a safetensors header) goes through :func:`loads_bounded`, and every file is checked with
:func:`regular_file` before it is opened: a FIFO would block ``open()`` forever, a symlink loop
raises a bare ``OSError``, and a deeply nested array exhausts Python's recursion in ``json``.
Each becomes the caller's typed error naming the file."""

from __future__ import annotations

import json
import os
import re
import stat
from typing import Callable

import numpy as np

from bridge.errors import BridgeError, CheckpointNotFoundError

MAX_JSON_DEPTH = 64  # a speculators config nests 4 levels; safetensors headers 3
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def regular_file(path: str | os.PathLike, what: str, error: type[BridgeError]) -> int:
    """The size of ``path`` after checking it is a regular file (symlinks followed); else ``error``
    (or CheckpointNotFoundError when nothing is there). Never opens the file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{what} does not exist", path=str(path)) from None
    except OSError as e:  # ELOOP (a symlink loop), ENAMETOOLONG, EACCES on a parent...
        raise error(f"cannot stat {what}: {e.strerror or e}", path=str(path)) from None
    if not stat.S_ISREG(st.st_mode):
        kind = next((k for test, k in _KINDS if test(st.st_mode)), "not a regular file")
        raise error(f"expected {what} to be a regular file, found {kind}", path=str(path))
    return st.st_size


def json_depth(raw: bytes) -> int:
    """The deepest nesting of ``[``/``{`` in a JSON document (brackets inside strings ignored)."""
    body = np.frombuffer(_STRING.sub(b'""', raw), np.uint8)
    step = (np.isin(body, (ord("["), ord("{"))).astype(np.int32)
            - np.isin(body, (ord("]"), ord("}"))).astype(np.int32))
    return int(np.cumsum(step).max(initial=0))


def loads_bounded(raw: bytes | str, *, path: str, what: str, error: type[BridgeError],
                  hook: Callable | None = None, max_depth: int = MAX_JSON_DEPTH):
    """``json.loads`` of a document nested at most ``max_depth`` deep, every failure as ``error``
    (a hook's own BridgeError passes through)."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    depth = json_depth(data)
    if depth > max_depth:
        raise error(f"{what} nests {depth} levels deep; expected at most {max_depth}", path=path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} is not valid UTF-8 JSON ({e})", path=path) from None
    try:
        return json.loads(text, object_pairs_hook=hook)
    except BridgeError:
        raise
    except (ValueError, RecursionError) as e:
        raise error(f"{what} is not valid JSON ({type(e).__name__}: {e})", path=path) from None


def read_json(path: str | os.PathLike, *, what: str, error: type[BridgeError], hook: Callable | None = None):
    """A JSON file through :func:`regular_file` and :func:`loads_bounded`."""
    regular_file(path, what, error)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise error(f"cannot read {what}: {e.strerror or e}", path=str(path)) from None
    return loads_bounded(raw, path=str(path), what=what, error=error, hook=hook)
