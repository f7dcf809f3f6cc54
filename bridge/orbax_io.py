"""Orbax checkpoints of a draft: the param tree plus its speculators config.

Layout of the directory (one Orbax composite checkpoint):
  params/   the tree (StandardSave; dtypes kept: bf16, bool t2d, int64 d2t)
  config/   config.json object, verbatim (unknown keys kept)
  specjax/  {"format": ..., "safetensors_metadata": {...}, "int_keys": true}

``speculators -> orbax -> speculators`` is bit-exact: same tensors, dtypes, bytes, config.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from bridge.atomic import staged_dir
from bridge.errors import OrbaxFormatError
from bridge.schema import DraftConfig, parse_config

FORMAT = "specjax-draft-v1"


def _str_keys(tree):
    if isinstance(tree, Mapping):
        return {str(k): _str_keys(v) for k, v in tree.items()}
    return tree


def _int_keys(tree):
    if isinstance(tree, Mapping):
        return {(int(k) if isinstance(k, str) and k.isdigit() else k): _int_keys(v) for k, v in tree.items()}
    return tree


def _checkpointer():
    import orbax.checkpoint as ocp

    _drop_closed_loop_callbacks()
    return ocp, ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def _drop_closed_loop_callbacks() -> None:
    """Keep a failed Orbax read from printing asyncio tracebacks.

    Orbax runs each restore on an event loop that it closes as soon as one tensorstore read fails;
    the reads still in flight then complete on tensorstore's threads and post their results to the
    closed loop, and every such ``RuntimeError('Event loop is closed')`` goes to
    ``sys.unraisablehook`` (printed as a bare traceback), after the real error was raised. Those
    results have no reader left, so the hook installed here drops exactly that error and passes
    everything else to the hook it replaced. Installed once per process."""
    if getattr(sys.unraisablehook, "_specjax_closed_loop_filter", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable):
        if not _is_closed_loop_callback(unraisable):
            previous(unraisable)

    hook._specjax_closed_loop_filter = True
    sys.unraisablehook = hook
    # the same reads' futures (or the tasks wrapping them), when collected before the loop closes,
    # log "Future exception was never retrieved" ("Task exception ...") through asyncio's logger
    # instead, with tensorstore's error: dropped too
    logging.getLogger("asyncio").addFilter(_unread_tensorstore_error)


_UNREAD = ("Future exception was never retrieved", "Task exception was never retrieved")


def _unread_tensorstore_error(record: logging.LogRecord) -> bool:
    """False (drop) for asyncio's "Future/Task exception was never retrieved" about a tensorstore
    read (which of the two depends on whether the garbage collector reaches the orphaned future or
    the task awaiting it first)."""
    if not str(record.msg).startswith(_UNREAD):
        return True
    exc = record.exc_info[1] if record.exc_info else None
    return not (exc is not None and "tensorstore_spec" in str(exc))


def _is_closed_loop_callback(unraisable) -> bool:
    """A ``RuntimeError('Event loop is closed')`` raised by asyncio's ``call_soon_threadsafe``."""
    e = unraisable.exc_value
    if not (isinstance(e, RuntimeError) and str(e) == "Event loop is closed" and unraisable.object is None):
        return False
    tb = unraisable.exc_traceback
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "call_soon_threadsafe" and "asyncio" in Path(code.co_filename).parts:
            return True
        tb = tb.tb_next
    return False


_TS_SPEC = re.compile(r"\s*\[tensorstore_spec='.*'\]\s*$", re.S)


def _reason(e: BaseException) -> str:
    """``Type: message`` of an Orbax/tensorstore error, without the kvstore spec JSON tensorstore
    appends (a kilobyte of driver settings that names nothing the user can act on)."""
    return f"{type(e).__name__}: {_TS_SPEC.sub('', str(e))}"


def save_orbax(out: str | Path, config: DraftConfig | dict, tree: Mapping, *, metadata: Mapping[str, str] | None = None,
               overwrite: bool = False) -> Path:
    """Save ``tree`` (numpy or jax leaves) and ``config`` to an Orbax checkpoint, atomically."""
    out = Path(out)
    cfg = config if isinstance(config, dict) else config.to_dict()
    extra = {"format": FORMAT, "safetensors_metadata": dict(metadata or {"format": "pt"}), "int_keys": True}
    with staged_dir(out, overwrite=overwrite) as tmp:  # orbax creates tmp itself (dirs under the umask)
        ocp, ckptr = _checkpointer()
        ckptr.save(tmp, args=ocp.args.Composite(
            params=ocp.args.StandardSave(_str_keys(tree)),
            config=ocp.args.JsonSave(cfg),
            specjax=ocp.args.JsonSave(extra),
        ))
    return out


def is_orbax(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / "params").is_dir() and (p / "config").exists()


def restore_orbax(path: str | Path, *, sharding: Any = None) -> tuple[DraftConfig, dict, dict]:
    """Restore ``(config, tree, safetensors_metadata)``. Leaves are numpy arrays, or jax
    arrays placed with ``sharding`` (a Sharding or a callable ``path -> Sharding``)."""
    p = Path(path)
    if not is_orbax(p):
        raise OrbaxFormatError("not a specjax Orbax checkpoint (expected params/ and config/ inside)", path=str(p))
    ocp, ckptr = _checkpointer()
    try:
        with _quiet_absl():  # orbax logs a warning for every item not asked for (params, here)
            meta = ckptr.restore(p, args=ocp.args.Composite(config=ocp.args.JsonRestore(),
                                                            specjax=ocp.args.JsonRestore()))
    except Exception as e:  # orbax raises many types; name the file instead
        raise OrbaxFormatError(f"cannot read config/specjax items: {_reason(e)}", path=str(p)) from e
    extra = meta.get("specjax") or {}
    if extra.get("format") != FORMAT:
        raise OrbaxFormatError(f"format marker {extra.get('format')!r}; expected {FORMAT!r}", path=str(p), key="specjax")
    cfg = parse_config(meta["config"], path=str(p / "config"))
    import jax

    try:
        with _quiet_absl():
            plain = _plain(_params_metadata(p))
    except Exception as e:  # orbax raises many types; name the file instead
        raise OrbaxFormatError(f"cannot read params metadata: {_reason(e)}", path=str(p)) from e
    if sharding is None:
        abstract = jax.tree.map(lambda m: np.empty(m.shape, m.dtype), plain)
    else:

        def abstract_leaf(path, m):
            keys = tuple(getattr(k, "key", k) for k in path)
            sh = sharding(_int_keys_path(keys)) if callable(sharding) else sharding
            return jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sh)

        abstract = jax.tree_util.tree_map_with_path(abstract_leaf, plain)
    try:
        with _quiet_absl():
            r = ckptr.restore(p, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))
    except Exception as e:
        raise OrbaxFormatError(f"cannot restore params: {_reason(e)}", path=str(p)) from e
    return cfg, _int_keys(r["params"]), dict(extra.get("safetensors_metadata") or {})


def _params_metadata(p: Path):
    """Tree metadata of the params item. The checkpointer must know the item's handler: a bare
    ``CompositeCheckpointHandler`` answers None, and restoring into None gives numpy arrays
    instead of arrays in the requested shardings."""
    import orbax.checkpoint as ocp

    md = ocp.Checkpointer(ocp.CompositeCheckpointHandler(params=ocp.StandardCheckpointHandler())).metadata(p)
    return md.item_metadata["params"] if hasattr(md, "item_metadata") else md["params"]


class _quiet_absl:
    def __enter__(self):
        from absl import logging as alog

        self._alog, self._old = alog, alog.get_verbosity()
        alog.set_verbosity(alog.ERROR)

    def __exit__(self, *exc):
        self._alog.set_verbosity(self._old)


def _int_keys_path(keys):
    return tuple(int(k) if isinstance(k, str) and k.isdigit() else k for k in keys)


def _plain(md):
    """Orbax tree metadata -> plain nested dict of leaf metadata."""
    if isinstance(md, Mapping):
        return {k: _plain(v) for k, v in md.items()}
    return md
