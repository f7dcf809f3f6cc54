"""Sharded loading: checkpoint tensors go straight from memory-mapped safetensors into their
``NamedSharding`` (``jax.make_array_from_callback``): each process cuts only the slices its own
devices hold from the memory map, so no process ever builds a host copy of a large tensor.

* :func:`load_target` - an HF target directory (or cached HF repo / cached GGUF); a GGUF file is
  dequantised on the host first (that is how GGUF loads) and then placed.
* :func:`load_draft` - a speculators draft checkpoint (audit, verifier-owned weights from the
  target, vocab maps), placed by the draft rules.
* :func:`restore_orbax` - a specjax Orbax draft checkpoint restored into its shardings.

Every loader checks the whole model against the rules and the mesh before it reads a byte.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

import bridge
from bridge.device import aligned_empty
from bridge.layout import get_path
from specjax.models.config import TargetConfig
from specjax.models.drafts.verifier_weights import VerifierSource
from specjax.sharding.apply import mesh_of
from specjax.sharding.mesh import make_mesh
from specjax.sharding.rules import DRAFT_RULES, TARGET_RULES, PartitionRules, as_rules, partition_specs, path_str, spec_for


def _is_float(dt) -> bool:
    return jnp.issubdtype(np.dtype(dt), jnp.floating)


def slice_loader(mesh: Mesh, rules: "PartitionRules | Iterable", dtype=None,
                 on_slice: Callable[[str, Any, int], None] | None = None) -> Callable[[tuple, Any], jax.Array]:
    """A ``place(path, view) -> jax.Array`` for :func:`specjax.models.params.load_tree`: the leaf's
    sharding comes from ``rules``; each addressable device's slice is cut from ``view`` (a numpy
    memory-map view, transposed views included) and cast to ``dtype`` (floats only) on the way.
    A leaf that is already a jax array is resharded with ``jax.device_put``.
    ``on_slice(path, index, nbytes)`` is told about every slice read (diagnostics, tests)."""
    rules = as_rules(rules)
    tgt_dtype = None if dtype is None else jnp.dtype(dtype)

    def place(path, view):
        shape = tuple(np.shape(view))
        sh = NamedSharding(mesh, spec_for(path_str(path), shape, rules, mesh))
        src = np.dtype(view.dtype)
        out = tgt_dtype if (tgt_dtype is not None and _is_float(src)) else src
        if isinstance(view, jax.Array):
            return jax.device_put(view.astype(out), sh)

        def cb(index):
            a = copy_slice(view[index], out)
            if on_slice is not None:
                on_slice(path_str(path), index, a.nbytes)
            return a

        arr = jax.make_array_from_callback(shape, sh, cb)
        release(view)  # this tensor's file pages are no longer needed in this process
        return arr

    return place


CHUNK_BYTES = 64 << 20


def copy_slice(src: np.ndarray, dtype) -> np.ndarray:
    """``src`` (a view into a memory map) as a fresh page-aligned array of ``dtype`` (the CPU
    client adopts such a buffer without a copy), copied in row chunks; a chunk whose file
    bytes are contiguous has its pages released as soon as it is copied, so a large slice never
    holds both its file pages and its copy in full."""
    out = aligned_empty(src.shape, dtype)
    if src.ndim == 0 or src.size == 0 or src.nbytes <= CHUNK_BYTES:
        out[...] = src
        return out
    step = max(1, CHUNK_BYTES // max(1, src.nbytes // src.shape[0]))
    for r in range(0, src.shape[0], step):
        part = src[r:r + step]
        out[r:r + step] = part
        lo, hi = _span(part)
        if hi - lo <= 2 * part.nbytes + mmap.PAGESIZE:  # rows of the file, not a strided column band
            release(part)
    return out


def _span(a: np.ndarray) -> tuple[int, int]:
    """[lo, hi) byte addresses an array view touches."""
    lo = hi = a.__array_interface__["data"][0]
    for n, st in zip(a.shape, a.strides):
        if n == 0:
            return lo, lo
        ext = (n - 1) * st
        lo, hi = (lo + ext, hi) if ext < 0 else (lo, hi + ext)
    return lo, hi + a.itemsize


def release(a) -> None:
    """Drop this process's mapping of the file pages under a memory-map view (``MADV_DONTNEED``:
    they stay in the page cache, they just stop counting as this process's memory)."""
    if not isinstance(a, np.ndarray) or not hasattr(mmap, "MADV_DONTNEED"):
        return
    mm, b = None, a
    while b is not None:
        if isinstance(b, mmap.mmap):
            mm = b
            break
        b = b.obj if isinstance(b, memoryview) else getattr(b, "base", None)
    if mm is None:
        return
    try:
        start = np.frombuffer(mm, np.uint8).__array_interface__["data"][0]
        lo, hi = _span(a)
        off = ((lo - start) // mmap.PAGESIZE) * mmap.PAGESIZE
        if 0 <= off < hi - start:
            mm.madvise(mmap.MADV_DONTNEED, off, hi - start - off)
    except (ValueError, OSError, BufferError):
        pass


def sharding_fn(tree, rules: "PartitionRules | Iterable", mesh) -> Callable[[tuple], NamedSharding]:
    """``path -> NamedSharding`` over a nested tree of arrays / views (e.g. ``bridge.load_checkpoint(p).tree``),
    checked for every leaf up front: what ``Checkpoint.to_device(sharding=...)`` and
    ``bridge.restore_orbax(sharding=...)`` take."""
    mesh = _mesh(mesh)
    rules = as_rules(rules)
    partition_specs(tree, rules, mesh)

    def fn(path) -> NamedSharding:
        return NamedSharding(mesh, spec_for(path_str(path), np.shape(get_path(tree, tuple(path))), rules, mesh))

    return fn


def _mesh(mesh) -> Mesh:
    return mesh if isinstance(mesh, Mesh) else make_mesh(mesh)


def check_target(config, rules: "PartitionRules | Iterable" = TARGET_RULES, mesh=None, *, dtype=jnp.float32) -> None:
    """Raise if the target for ``config`` (a ``TargetConfig``) does not fit ``rules`` on ``mesh``
    (nothing allocated: the model is built abstractly)."""
    from specjax.models.target import build_model  # heavy: flax (specjax.sharding is imported by the CLI)

    partition_specs(build_model(config, param_dtype=dtype, abstract=True), rules, _mesh(mesh))


def load_target(target=None, mesh=None, *, rules: "PartitionRules | Iterable" = TARGET_RULES, dtype=None,
                cache_dir: str | os.PathLike | None = None, progress: bool = True,
                on_slice: Callable[[str, Any, int], None] | None = None, stacked: bool | None = None):
    """``specjax.models.loading.load_target`` with every parameter placed by ``rules`` on ``mesh``
    (a Mesh, or a preset / file / inline spec for :func:`specjax.sharding.make_mesh`).

    HF directories (and cached GGUFs) are read slice by slice from the memory map, in every
    process at once; all processes must call this with the same arguments. ``stacked``: see
    :func:`specjax.models.loading.load_target` (the stacks keep each param's sharding, the layer
    axis unsplit)."""
    from specjax.models.loading import load_target as _load, resolve_target  # heavy: flax and the model code

    mesh = _mesh(mesh)
    rules = as_rules(rules)
    kind, path = resolve_target(target)
    if kind in ("hf_dir", "hf_cache"):
        check_target(TargetConfig.from_file(Path(path) / "config.json"), rules, mesh)
    return _load(target, dtype=dtype, cache_dir=cache_dir, progress=progress and _main(),
                 place=slice_loader(mesh, rules, dtype, on_slice), stacked=stacked)


def _main() -> bool:
    return jax.process_index() == 0


def _verifier_for(target):
    """The verifier as ``specjax.models.drafts.load_draft`` should see it. A sharded LoadedTarget
    with a checkpoint directory is read back through that directory; a sharded target without
    one (a GGUF, a bare module) through its params gathered to the host one tensor at a time
    (``to_host``: a global array of a multi-process run cannot be copied with ``np.asarray``)."""
    from flax import nnx

    src = getattr(target, "source", None)
    model = target if isinstance(target, nnx.Module) else getattr(target, "model", None)  # CausalLM | LoadedTarget
    if not isinstance(model, nnx.Module) or mesh_of(model) is None:
        return target
    if src and (Path(src) / "config.json").is_file():
        return src
    return _gathering_source(model)


def _gathering_source(module):
    return VerifierSource.from_module(module)  # gathers each tensor with to_host (multi-process safe)


def load_draft(path: str | os.PathLike, target: Any = None, mesh=None, *,
               rules: "PartitionRules | Iterable" = DRAFT_RULES, dtype=None, audit: bool = True,
               verifier_heads: bool = True, opened=None, verifier_checked: bool = False):
    """``specjax.load_draft`` with every parameter placed by ``rules`` on ``mesh``: the same audit,
    vocab-map checks and verifier-owned weights (from ``target``: an HF directory, or a loaded
    target), the whole abstract model checked against the rules before a tensor is read, then
    each tensor from the checkpoint's memory map straight into its sharding (the ``place`` /
    ``check`` hooks of :func:`specjax.models.drafts.load.load_draft`)."""
    from specjax.models.drafts.load import load_draft as _load  # heavy: flax and the draft modules

    mesh = _mesh(mesh)
    rules = as_rules(rules)
    return _load(path, _verifier_for(target), dtype=dtype, audit=audit, verifier_heads=verifier_heads,
                 place=slice_loader(mesh, rules, dtype), check=lambda model: partition_specs(model, rules, mesh),
                 opened=opened, verifier_checked=verifier_checked)


def restore_orbax(path: str | os.PathLike, mesh=None, *, rules: "PartitionRules | Iterable" = DRAFT_RULES):
    """``bridge.restore_orbax`` with each leaf restored straight into its rule's sharding (Orbax
    reads only the slices of this process's devices). Returns ``(config, tree, metadata)``."""
    return bridge.restore_orbax(path, sharding=sharding_fn(_orbax_shapes(path), rules, mesh))


def _orbax_shapes(path):
    """Nested dict of ShapeDtypeStruct of the params item of a specjax Orbax checkpoint."""
    import orbax.checkpoint as ocp

    ckptr = ocp.Checkpointer(ocp.CompositeCheckpointHandler(params=ocp.StandardCheckpointHandler()))
    md = ckptr.metadata(Path(path))
    item = md.item_metadata["params"] if hasattr(md, "item_metadata") else md["params"]

    def conv(t):
        if isinstance(t, dict) or hasattr(t, "items"):
            return {(int(k) if isinstance(k, str) and k.isdigit() else k): conv(v) for k, v in t.items()}
        return jax.ShapeDtypeStruct(tuple(t.shape), t.dtype)

    return conv(item)

