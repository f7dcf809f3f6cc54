"""speculators checkpoint directory <-> (typed config, Flax param tree).

``load_checkpoint`` parses config.json and the safetensors headers, checks the tensor set
against the algorithm's contract, and returns a tree of zero-copy numpy views (nothing is
read until touched). ``save_checkpoint`` is its exact inverse: same names, dtypes, shapes
and bytes, and a config.json with the same keys and values.
"""

from __future__ import annotations

import json
import mmap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

from bridge import layout
from bridge.atomic import atomic_dir, atomic_file
from bridge.contract import FLOAT, FLOAT_TAGS, expected_tensors, open_prefixes
from bridge.vocab_maps import vocab_map_problems
from bridge.errors import ConfigContractError, TensorMismatchError
from bridge.progress import byte_bar
from bridge.safetensors_io import DTYPES, TensorStore, dtype_tag, open_tensors, write_tensors_into
from bridge.schema import CONFIG_NAME, DraftConfig, aux_id_problems, dumps_config, read_config

BUFFER_DTYPES = {"t2d": np.dtype(np.bool_), "d2t": np.dtype(np.int64)}


@dataclass
class Checkpoint:
    """A loaded speculators checkpoint. ``tree`` leaves are read-only numpy views."""

    path: str
    config: DraftConfig
    store: TensorStore
    tree: dict = field(repr=False)

    @property
    def algorithm(self) -> str:
        return self.config.speculators_model_type

    @property
    def metadata(self) -> dict[str, str]:
        return self.store.metadata

    def flat(self) -> dict[str, np.ndarray]:
        return {n: self.store.array(n) for n in self.store.names}

    def to_device(self, *, sharding: Any = None, dtype: Any = None, progress: bool | None = None) -> dict:
        """Materialise the tree as jax arrays, one tensor at a time.

        ``sharding``: a ``jax.sharding.Sharding`` for every leaf, or a callable
        ``path -> Sharding``; with a sharding each device reads only its slice
        (``jax.make_array_from_callback``). ``dtype`` casts floating leaves. Pages of
        the file are released after each tensor, so peak host memory stays near one
        copy of the checkpoint.
        """
        from bridge.device import tree_to_device

        return tree_to_device(self, sharding=sharding, dtype=dtype, progress=progress)


def check_tensors(cfg: DraftConfig, infos: Mapping[str, Any], *, where: str) -> None:
    """Raise TensorMismatchError on missing, unexpected or mis-shaped tensors."""
    exp = expected_tensors(cfg)
    opened = open_prefixes(cfg)
    missing = sorted(n for n, s in exp.items() if s.required and n not in infos)
    unexpected = sorted(n for n in infos if n not in exp and not n.startswith(opened))
    algo = cfg.speculators_model_type
    if missing:
        raise TensorMismatchError(
            f"{len(missing)} tensor(s) the {algo} config requires are missing: {missing[:6]}", path=where, key=missing[0])
    if unexpected:
        raise TensorMismatchError(
            f"{len(unexpected)} tensor(s) unexpected for this {algo} config (flags/layers/vocab): {unexpected[:6]}",
            path=where, key=unexpected[0])
    for n, info in infos.items():
        spec = exp.get(n)
        if spec is None:
            continue
        shape = tuple(info.shape)
        if shape != spec.shape:
            raise TensorMismatchError(f"tensor {n!r} has shape {list(shape)}; the config implies {list(spec.shape)}",
                                      path=where, key=n)
        tag = info.dtype if hasattr(info, "dtype") and isinstance(info.dtype, str) else dtype_tag(info.dtype)
        if spec.dtype == FLOAT:
            if tag not in FLOAT_TAGS:
                raise TensorMismatchError(f"tensor {n!r} has dtype {tag}; expected a floating dtype", path=where, key=n)
        elif tag != spec.dtype:
            raise TensorMismatchError(f"tensor {n!r} has dtype {tag}; expected {spec.dtype}", path=where, key=n)


class Opened(NamedTuple):
    """A checkpoint directory's typed config and tensor headers, each parsed once: what
    :func:`bridge.audit` and :func:`load_checkpoint` share within one load."""

    path: Path
    config: DraftConfig
    store: TensorStore


def open_checkpoint(path: str | Path) -> Opened:
    """Read ``config.json`` and every safetensors header of a checkpoint directory (no tensor data)."""
    path = Path(path)
    return Opened(path, read_config(path), open_tensors(path))


def load_checkpoint(path: str | Path, *, check: bool = True, check_vocab: bool = True,
                    opened: Opened | None = None) -> Checkpoint:
    """Open a speculators checkpoint directory (single or sharded safetensors). ``check_vocab``:
    also check the d2t/t2d values (a caller with its own mapping check turns it off).
    ``opened``: the directory's :func:`open_checkpoint`, when the caller has read it already."""
    path = Path(path)
    cfg, store = (opened.config, opened.store) if opened is not None else (read_config(path), open_tensors(path))
    where = store.index_path or store.files[0].path if store.files else str(path)
    if check:
        for _rule, key, msg in aux_id_problems(cfg):
            raise ConfigContractError(msg, path=str(path / CONFIG_NAME), key=key)
        check_tensors(cfg, store.infos(), where=where)
        if check_vocab and "d2t" in store and "t2d" in store:  # small buffers: their values are checked, not only their shapes
            problems = vocab_map_problems(store.array("d2t"), store.raw_bytes("t2d"), cfg.layer.vocab_size)
            if problems:
                raise TensorMismatchError(problems[0][1], path=where, key=problems[0][0])
    table = layout.TABLES[cfg.speculators_model_type]
    tree = layout.unflatten({n: _LazyView(store, n) for n in store.names}, table, where=where,
                            load=lambda n, v: v.resolve())
    return Checkpoint(str(path), cfg, store, tree)


class _LazyView:
    """Defers the numpy view until layout has chosen the transform (still zero-copy)."""

    __slots__ = ("store", "name", "_t")

    def __init__(self, store, name, t=False):
        self.store, self.name, self._t = store, name, t

    @property
    def T(self):
        return _LazyView(self.store, self.name, not self._t)

    def resolve(self):
        a = self.store.array(self.name)
        return a.T if self._t else a


def tree_to_flat(tree: Mapping, cfg: DraftConfig | None = None) -> dict[str, np.ndarray]:
    """Flax tree -> flat PyTorch-layout numpy arrays; buffers get their on-disk dtypes back
    (jax keeps d2t as int32 unless x64 is enabled)."""
    flat = {}
    for n, a in layout.flatten(tree).items():
        a = np.asarray(a)
        if n in BUFFER_DTYPES and a.dtype != BUFFER_DTYPES[n]:
            a = a.astype(BUFFER_DTYPES[n])
        flat[n] = a
    return flat


def save_checkpoint(out: str | Path, config: DraftConfig | dict, tree: Mapping | None = None, *,
                    flat: Mapping[str, np.ndarray] | None = None, overwrite: bool = False,
                    max_shard_bytes: int | None = None, metadata: Mapping[str, str] | None = None,
                    explicit_config: bool = False, check: bool = True, progress: bool | None = None) -> Path:
    """Write a speculators checkpoint directory atomically (temp dir + rename).

    Give either the Flax ``tree`` or the ``flat`` PyTorch-layout tensors.
    """
    if (tree is None) == (flat is None):
        raise ValueError("give exactly one of tree= or flat=")
    tensors = tree_to_flat(tree) if tree is not None else {k: np.asarray(v) for k, v in flat.items()}
    if check and isinstance(config, DraftConfig):
        check_tensors(config, {n: _Info(a) for n, a in tensors.items()}, where=str(out))
    meta = {"format": "pt"} if metadata is None else dict(metadata)
    total = sum(a.nbytes for a in tensors.values())
    bar = byte_bar(total, f"writing {Path(out).name}", progress)
    with atomic_dir(out, overwrite=overwrite) as tmp:
        with atomic_file(tmp / CONFIG_NAME, text=True) as f:
            f.write(dumps_config(config, explicit=explicit_config))
        write_tensors_into(tmp, tensors, meta, max_shard_bytes, progress=bar.update if bar else None)
    if bar:
        bar.close()
    return Path(out)


class _Info:
    def __init__(self, a):
        self.shape = tuple(a.shape)
        self.dtype = dtype_tag(a.dtype)
