"""The round-trip conversions behind ``specjax convert``: speculators <-> Orbax, with an
optional bit-exact check of the result against the source."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from bridge.atomic import staged_dir
from bridge.checkpoint import load_checkpoint, save_checkpoint, tree_to_flat
from bridge.errors import BridgeError, CheckpointNotFoundError
from bridge.layout import iter_leaves
from bridge.orbax_io import is_orbax, restore_orbax, save_orbax
from bridge.safetensors_io import dtype_tag


class RoundTripMismatch(BridgeError):
    """--check found a difference between source and output."""

    exit_code = 1


class ReadBackError(BridgeError):
    """--check could not read the output back (it was written, but not in a readable form)."""


def source_kind(src: str | Path) -> str:
    p = Path(src)
    if is_orbax(p):
        return "orbax"
    if (p / "config.json").exists():
        return "speculators"
    if not p.exists():
        raise CheckpointNotFoundError("source does not exist", path=str(p))
    raise CheckpointNotFoundError("not a speculators checkpoint (no config.json) nor a specjax Orbax checkpoint "
                                  "(no params/ + config/)", path=str(p))


def read_any(src: str | Path):
    """(config, tree, safetensors metadata) from either format."""
    if source_kind(src) == "orbax":
        return restore_orbax(src)
    ck = load_checkpoint(src)
    return ck.config, ck.tree, ck.metadata


def convert(src: str | Path, dst: str | Path, to: str, *, overwrite: bool = False, check: bool = False,
            max_shard_bytes: int | None = None, progress: bool | None = None) -> dict:
    """Convert ``src`` to format ``to`` ('orbax' or 'speculators') at ``dst``.

    With ``check`` the output is written beside ``dst``, read back and compared with ``src``
    before it is moved into place: a failed check leaves no ``dst`` (an old one, with
    ``overwrite``, is untouched) and raises :class:`RoundTripMismatch` (or :class:`ReadBackError`)
    naming ``dst`` and what differed."""
    if to not in ("orbax", "speculators"):
        raise BridgeError(f"--to must be 'orbax' or 'speculators', got {to!r}")
    cfg, tree, meta = read_any(src)
    result = {"source": str(src), "source_format": source_kind(src), "output": str(dst), "format": to,
              "tensors": sum(1 for _ in iter_leaves(tree))}
    with staged_dir(dst, overwrite=overwrite) as out:
        if to == "orbax":
            save_orbax(out, cfg, tree, metadata=meta)
        else:
            save_checkpoint(out, cfg, tree, metadata=meta, max_shard_bytes=max_shard_bytes, progress=progress)
        if check:
            result["check"] = check_output(src, out, dst)
    return result


def check_output(src: str | Path, out: Path, dst: str | Path) -> dict:
    """:func:`compare` ``src`` with the staged output ``out`` that is to become ``dst``. Errors name
    ``dst`` (the staged copy is deleted with them) and say that nothing was written."""
    try:
        return compare(src, out)
    except RoundTripMismatch as e:
        raise RoundTripMismatch(f"--check failed: {_within(e, out, dst)}; nothing was written", path=str(dst),
                                key=e.key) from None
    except BridgeError as e:
        raise ReadBackError(f"--check could not read the output back: {_within(e, out, dst)}; nothing was written",
                            path=str(dst), key=e.key) from None


def _within(e: BridgeError, out: Path, dst: str | Path) -> str:
    """``e``'s message, prefixed by its file relative to the output when that is a file inside it;
    the staged path anywhere in the text is shown as ``dst``."""
    msg = e.message.replace(str(out), str(dst))
    if e.path and Path(e.path) != out and Path(e.path).is_relative_to(out):
        msg = f"{Path(e.path).relative_to(out)}: {msg}"
    return msg


def compare(a: str | Path, b: str | Path) -> dict:
    """Bit-exact comparison of two checkpoints in any of the two formats."""
    ca, ta, _ = read_any(a)
    cb, tb, _ = read_any(b)
    fa, fb = tree_to_flat(ta), tree_to_flat(tb)
    if set(fa) != set(fb):
        only = sorted(set(fa) ^ set(fb))
        raise RoundTripMismatch(f"tensor names differ: {only[:5]}", path=str(b), key=only[0])
    nbytes = 0
    for n in sorted(fa):
        x, y = np.ascontiguousarray(fa[n]), np.ascontiguousarray(fb[n])
        if x.shape != y.shape or dtype_tag(x.dtype) != dtype_tag(y.dtype):
            raise RoundTripMismatch(f"tensor {n!r}: {dtype_tag(x.dtype)}{list(x.shape)} became "
                                    f"{dtype_tag(y.dtype)}{list(y.shape)}", path=str(b), key=n)
        if x.tobytes() != y.tobytes():
            raise RoundTripMismatch(f"tensor {n!r}: bytes differ", path=str(b), key=n)
        nbytes += x.nbytes
    da, db = ca.to_dict(), cb.to_dict()
    if json.dumps(da, sort_keys=True) != json.dumps(db, sort_keys=True):
        keys = sorted(k for k in set(da) | set(db) if da.get(k) != db.get(k))
        raise RoundTripMismatch(f"config.json differs at keys {keys[:5]}", path=str(b), key=keys[0] if keys else None)
    return {"tensors": len(fa), "bytes": nbytes, "identical": True}
