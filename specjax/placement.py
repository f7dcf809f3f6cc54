"""Which platform a program is being built for, decided from where it will run.

Code that has a platform-specific path (``layers.dot_tn``'s CPU layout tricks, the native CPU
kernels of :mod:`specjax.kernels`) asks :func:`platform` while it is traced. The answer comes from
the devices the program is compiled for, never from ``jax.default_backend()``: a process whose
default backend is the CPU can compile a program for a TPU topology (``specjax plan``, deviceless
AOT), and that program must not pick up CPU-only paths.

Every jit boundary of the project that knows its placement says so around the traced body::

    def run(params, ids):
        with placement.building_for(mesh):      # a Mesh, a Sharding, a Device, arrays, "tpu"
            ...

:func:`platform` answers, in order: the innermost :func:`building_for`; the platform of the
abstract mesh set with ``jax.set_mesh`` (it carries the device kind); else the platform of the
default device (``jax.config.jax_default_device`` or ``jax.devices()[0]``), which is where a
program with uncommitted inputs runs.

``building_for(mesh)`` with a ``Mesh`` also records it (:func:`mesh`): the TPU attention kernels
(:mod:`specjax.kernels.tpu`) are Mosaic programs XLA cannot partition, so under a mesh they run
inside ``shard_map`` over it.

Trace caches: the answer is read at trace time and is not part of ``jax.jit``'s cache key, so a
jitted function that may be traced for two platforms takes the platform as a static argument or
is built per mesh (the mesh holds the devices), as the project's entry points do.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("specjax_platform", default=None)
_MESH: contextvars.ContextVar[Any] = contextvars.ContextVar("specjax_mesh", default=None)


def _device_platform(d) -> str:
    return str(d.platform).lower()


def platform_of(where: Any) -> str | None:
    """The platform (``"cpu"``, ``"tpu"``, ``"gpu"``/``"cuda"``/``"rocm"``) of ``where``: a platform
    name, a ``Mesh`` (concrete or abstract with a device kind), a ``Sharding``, a ``Device``, a
    ``jax.Array`` / ``ShapeDtypeStruct`` carrying a sharding, or a pytree of those (the first leaf
    that names one). None when nothing in ``where`` says where it lives (host arrays, plain
    ``ShapeDtypeStruct``)."""
    import jax

    if where is None:
        return None
    if isinstance(where, str):
        return where.lower()
    if isinstance(where, jax.sharding.Mesh):
        return _device_platform(where.devices.flat[0])
    if isinstance(where, jax.sharding.AbstractMesh):
        dev = getattr(where, "abstract_device", None)
        return None if dev is None else str(dev.platform).lower()
    if isinstance(where, jax.sharding.Sharding):
        devs = where.device_set
        return _device_platform(next(iter(devs))) if devs else None
    if hasattr(where, "platform") and hasattr(where, "device_kind"):  # a Device
        return _device_platform(where)
    sh = getattr(where, "sharding", None)
    if isinstance(sh, jax.sharding.Sharding):
        return platform_of(sh)
    leaves = jax.tree_util.tree_leaves(where, is_leaf=lambda x: isinstance(
        x, (jax.sharding.Mesh, jax.sharding.Sharding, jax.sharding.AbstractMesh)))
    if len(leaves) == 1 and leaves[0] is where:
        return None
    for leaf in leaves:
        p = platform_of(leaf)
        if p is not None:
            return p
    return None


def default_platform() -> str:
    """The platform of the device a program with uncommitted inputs runs on."""
    import jax

    dev = jax.config.jax_default_device
    if dev is not None and not isinstance(dev, str):
        return _device_platform(dev)
    return _device_platform(jax.devices(dev)[0] if isinstance(dev, str) else jax.devices()[0])


def platform() -> str:
    """The platform of the program being built (see the module docstring for the order)."""
    explicit = _PLATFORM.get()
    if explicit is not None:
        return explicit
    import jax

    am = jax.sharding.get_abstract_mesh()
    if am is not None and not am.empty:
        p = platform_of(am)
        if p is not None:
            return p
    return default_platform()


def mesh():
    """The ``Mesh`` given to the innermost :func:`building_for` (None when that was not a mesh).
    Kernels that XLA cannot partition (Pallas/Mosaic) run inside ``shard_map`` over it."""
    return _MESH.get()


def is_cpu() -> bool:
    return platform() == "cpu"


@contextlib.contextmanager
def building_for(where: Any) -> Iterator[str]:
    """Within the block, :func:`platform` answers the platform of ``where`` (see :func:`platform_of`);
    ``where`` that names no platform (None, host arrays) keeps the enclosing answer."""
    p = platform_of(where)
    if p is None:
        yield platform()
        return
    import jax

    token = _PLATFORM.set(p)
    mtoken = _MESH.set(where if isinstance(where, jax.sharding.Mesh) else None)
    try:
        yield p
    finally:
        _MESH.reset(mtoken)
        _PLATFORM.reset(token)


SCAN_SETTINGS = ("off", "on", "auto")
_SCAN_WORDS = {"0": "off", "false": "off", "no": "off", "off": "off", "1": "on", "true": "on", "yes": "on", "on": "on",
               "auto": "auto"}


def scan_env() -> str:
    """``SPECJAX_SCAN_LAYERS`` as ``"off"`` (unset), ``"on"`` or ``"auto"`` (see
    :func:`specjax.models.layer_scan.scan_layers_on`); ValueError names any other value."""
    import os

    env = os.environ.get("SPECJAX_SCAN_LAYERS", "").strip().lower()
    if env and env not in _SCAN_WORDS:
        raise ValueError(f"SPECJAX_SCAN_LAYERS={env!r}: expected one of 0, 1, auto")
    return _SCAN_WORDS.get(env, "off")
