"""Orbax checkpoints of a draft: the param tree plus its speculators config.

Layout of the directory (one Orbax composite checkpoint):
  params/   the tree (StandardSave; dtypes kept: bf16, bool t2d, int64 d2t)
  config/   config.json object, verbatim (unknown keys kept)
  specjax/  {"format": ..., "safetensors_metadata": {...}, "int_keys": true}

``speculators -> orbax -> speculators`` is bit-exact: same tensors, dtypes, bytes, config.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from bridge.atomic import replace_dir
from bridge.errors import OrbaxFormatError, WriteError
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

    return ocp, ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def save_orbax(out: str | Path, config: DraftConfig | dict, tree: Mapping, *, metadata: Mapping[str, str] | None = None,
               overwrite: bool = False) -> Path:
    """Save ``tree`` (numpy or jax leaves) and ``config`` to an Orbax checkpoint, atomically."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise WriteError("destination exists; pass --overwrite (overwrite=True) to replace it", path=str(out))
    ocp, ckptr = _checkpointer()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_parent = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    tmp = tmp_parent / "ckpt"
    cfg = config if isinstance(config, dict) else config.to_dict()
    extra = {"format": FORMAT, "safetensors_metadata": dict(metadata or {"format": "pt"}), "int_keys": True}
    try:
        ckptr.save(tmp, args=ocp.args.Composite(
            params=ocp.args.StandardSave(_str_keys(tree)),
            config=ocp.args.JsonSave(cfg),
            specjax=ocp.args.JsonSave(extra),
        ))
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp_parent, ignore_errors=True)
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
        raise OrbaxFormatError(f"cannot read config/specjax items: {type(e).__name__}: {e}", path=str(p)) from e
    extra = meta.get("specjax") or {}
    if extra.get("format") != FORMAT:
        raise OrbaxFormatError(f"format marker {extra.get('format')!r}; expected {FORMAT!r}", path=str(p), key="specjax")
    cfg = parse_config(meta["config"], path=str(p / "config"))
    import jax

    try:
        with _quiet_absl():
            plain = _plain(_params_metadata(p))
    except Exception as e:  # orbax raises many types; name the file instead
        raise OrbaxFormatError(f"cannot read params metadata: {type(e).__name__}: {e}", path=str(p)) from e
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
        raise OrbaxFormatError(f"cannot restore params: {type(e).__name__}: {e}", path=str(p)) from e
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
