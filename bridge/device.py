"""Checkpoint tensors straight onto devices, without a second full host copy.

With a sharding, ``jax.make_array_from_callback`` asks for each device's slice; the slice
is cut from the memory map, so a process reads only the bytes its devices hold. Without
one, each tensor is copied once into a host buffer that the CPU client can adopt, then
its file pages are released (``madvise(MADV_DONTNEED)``) so resident memory does not
hold the file and the arrays at the same time.
"""

from __future__ import annotations

import mmap
from typing import Any, Callable

import numpy as np

from bridge import layout


def _release(store, name: str) -> None:
    f = store._where[name]
    mm = f._mm
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    info = f.tensors[name]
    start = f.data_start + info.begin
    page = mmap.PAGESIZE
    lo = (start // page) * page
    hi = f.data_start + info.end
    if hi > lo:
        try:
            mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        except (OSError, ValueError):
            pass


def tree_to_device(ckpt, *, sharding: Any = None, dtype: Any = None, progress: bool | None = None) -> dict:
    import jax
    import jax.numpy as jnp

    from bridge.checkpoint import _bar

    store = ckpt.store
    table = layout.TABLES[ckpt.config.speculators_model_type]
    bar = _bar(store.total_bytes, "loading", progress)

    def place(name: str, path: tuple, view: np.ndarray):
        tgt = view.dtype
        if dtype is not None and view.dtype.kind == "f" or (dtype is not None and view.dtype.name == "bfloat16"):
            tgt = np.dtype(jnp.dtype(dtype))
        sh = sharding(path) if callable(sharding) else sharding
        if sh is not None:
            def cb(index):
                return np.ascontiguousarray(view[index]).astype(tgt, copy=False)

            arr = jax.make_array_from_callback(view.shape, sh, cb)
        else:
            host = np.array(view, dtype=tgt, order="C", copy=True)
            arr = jax.device_put(host)
        arr.block_until_ready()
        _release(store, name)
        if bar:
            bar.update(store.info(name).nbytes)
        return arr

    out: dict = {}
    for name in store.names:
        rule = layout.match(name, table)
        path = layout.flat_to_path(name, rule)
        view = layout.to_flax(rule.kind, store.array(name))
        layout.set_path(out, path, place(name, path, view))
    if bar:
        bar.close()
    return out
